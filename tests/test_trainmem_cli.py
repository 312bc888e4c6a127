"""python -m trainmem estimate|measure: JSON contract, table, one-line errors."""

import json
import subprocess
import sys

import pytest

from trainmem.cli import main

KEYS = {
    "weights",
    "gradients",
    "optimizer_states",
    "master_weights",
    "activations",
    "temporaries",
}


def test_estimate_json(capsys):
    assert (
        main(
            [
                "estimate",
                "--model",
                "llama-7b",
                "--method",
                "lora",
                "--batch",
                "2",
                "--seq",
                "256",
                "--lora-targets",
                "q_proj,k_proj,v_proj,o_proj",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out["breakdown"]) == KEYS
    assert all(isinstance(v, int) for v in out["breakdown"].values())
    assert out["total_bytes"] == sum(out["breakdown"].values())
    assert out["n_trainable"] == 8_388_608


def test_estimate_table(capsys):
    assert (
        main(["estimate", "--model", "tiny", "--checkpointing", "--attn", "eager"]) == 0
    )
    out = capsys.readouterr().out
    assert "GiB" in out and "GB" in out and "total (peak)" in out


def test_measure_fake_json(capsys):
    assert (
        main(
            [
                "measure",
                "--model",
                "tiny",
                "--device",
                "fake",
                "--batch",
                "1",
                "--seq",
                "8",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out["breakdown"]) == KEYS
    # independent oracles: torch counts the parameters (fp32 params and grads: 4 B
    # each), and the analytic estimator replays the same step (equal up to AdamW's
    # per-tensor step scalars)
    from trainmem.estimate import estimate
    from trainmem.measuring.models import build_model, get_config

    n = sum(
        p.numel() for p in build_model(get_config("tiny"), device="meta").parameters()
    )
    assert out["breakdown"]["master_weights"] == out["breakdown"]["gradients"] == 4 * n
    assert abs(out["total_bytes"] - estimate("tiny", batch=1, seq=8).total_bytes) <= 64


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "nope"], "--model must be one of"),
        (
            ["--model", "tiny", "--method", "lora", "--lora-rank", "0"],
            "--lora-rank must be ≥ 1",
        ),
        (
            ["--model", "tiny", "--method", "lora", "--lora-rank", "65"],
            "≤ min(d_in, d_out)=64",
        ),
        (
            ["--model", "tiny", "--method", "lora", "--lora-targets", "q_proj,foo"],
            "unknown target module 'foo'",
        ),
        (["--batch", "0"], "--batch"),
        (["--precision", "fp8"], "choose from"),
        (["--optimizer-impl", "fast"], "--optimizer-impl: invalid choice: 'fast'"),
    ],
)
def test_bad_input_one_line(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        rc = main(["estimate", *args])
        raise SystemExit(rc)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_malformed_config_one_line(tmp_path, capsys):
    bad = tmp_path / "c.json"
    bad.write_text("[1, 2")
    assert main(["estimate", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err and "not valid JSON" in err


def test_module_entry_point_help():
    out = subprocess.run(
        [sys.executable, "-m", "trainmem", "estimate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--model",
        "--method",
        "--precision",
        "--optimizer",
        "--batch",
        "--seq",
        "--lora-rank",
        "--lora-alpha",
        "--lora-targets",
        "--checkpointing",
        "--attn",
        "--zero",
        "--gpus",
        "--json",
        "master_weights",
    ):
        assert flag in out


def test_estimate_optimizer_impl_json(capsys):
    peaks = {}
    for impl in ("foreach", "fused", "for-loop"):
        assert (
            main(
                [
                    "estimate",
                    "--model",
                    "llama-7b",
                    "--optimizer-impl",
                    impl,
                    "--seq",
                    "64",
                    "--json",
                ]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)
        assert out["options"]["optimizer_impl"] == impl
        peaks[impl] = out["total_bytes"]
    assert peaks["fused"] < peaks["for-loop"] < peaks["foreach"]


def test_hf_subcommand(tmp_path, capsys):
    args = tmp_path / "training_args.json"
    args.write_text(
        json.dumps(
            {
                "optim": "adamw_torch_fused",
                "bf16": True,
                "gradient_checkpointing": True,
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 4,
                "max_length": 256,
            }
        )
    )
    peft = tmp_path / "adapter_config.json"
    peft.write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 16,
                "lora_alpha": 32,
                "target_modules": ["q_proj", "v_proj"],
            }
        )
    )
    assert (
        main(
            [
                "hf",
                "--model",
                "mistral-7b",
                "--training-args",
                str(args),
                "--peft-config",
                str(peft),
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    o = out["options"]
    assert (
        o["method"],
        o["precision"],
        o["optimizer_impl"],
        o["batch"],
        o["seq"],
        o["grad_accum"],
        o["checkpointing"],
        o["lora_rank"],
    ) == ("lora", "bf16-amp", "fused", 2, 256, 4, True, 16)
    assert out["total_bytes"] == sum(out["breakdown"].values())


@pytest.mark.parametrize(
    "setup,needle",
    [
        (
            lambda d: ["--training-args", str(d / "missing.json")],
            "--training-args: file",
        ),
        (
            lambda d: ["--training-args", str(_write(d / "a.json", "{"))],
            "is not valid JSON",
        ),
        (
            lambda d: [
                "--training-args",
                str(_write(d / "a.json", '{"optim": "galore_adamw"}')),
                "--seq",
                "8",
            ],
            "optim must be one of",
        ),
        (
            lambda d: [
                "--peft-config",
                str(_write(d / "p.json", '{"r": 0}')),
                "--seq",
                "8",
            ],
            "--peft-config r must be ≥ 1",
        ),
        (lambda d: [], "--seq must be given"),
    ],
)
def test_hf_bad_input_one_line(setup, needle, tmp_path, capsys):
    assert main(["hf", "--model", "tiny", *setup(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def _write(path, text):
    path.write_text(text)
    return path


def test_one_line_names_the_flag_from_the_option():
    from trainmem.cli import _one_line
    from trainmem.config import OptionError

    assert (
        _one_line(OptionError("lora_rank", "lora_rank must be ≥ 1, got 0"))
        == "--lora-rank must be ≥ 1, got 0"
    )
    # the flag comes from .option, not from the text
    assert (
        _one_line(OptionError("training_args", "optim must be one of a, b"))
        == "--training-args: optim must be one of a, b"
    )
    assert _one_line(ValueError("two\n  lines")) == "two lines"


def test_lora_default_is_the_recipe_users_run_and_fits_a_24_gib_card(capsys):
    """The calculator's and the CLI's LoRA default under bf16-amp: a 16-bit base (a
    16-bit checkpoint as transformers 5 loads it), peft's fp32 adapters, autocast;
    a 7B model then fits an RTX 4090 and an A100-40GB. ``--load-dtype fp32``
    (autocast over fp32 weights, their bf16 copies kept) fits neither."""
    out = {}
    for load in ("", "fp32"):
        for gpu in ("RTX4090", "A100-40GB"):
            argv = ["estimate", "--model", "llama-7b", "--method", "lora"]
            argv += ["--gpu", gpu, "--json"] + (["--load-dtype", load] if load else [])
            assert main(argv) == 0
            out[load, gpu] = json.loads(capsys.readouterr().out)
    for gpu in ("RTX4090", "A100-40GB"):
        assert out["", gpu]["fits"] and not out["fp32", gpu]["fits"]
        assert out["", gpu]["options"]["recipe"] == (
            "bf16 base + fp32 adapters, autocast bf16"
        )
        assert out["fp32", gpu]["options"]["recipe"] == (
            "fp32 base + fp32 adapters, autocast bf16"
        )
    assert main(["estimate", "--model", "tiny", "--method", "lora"]) == 0
    assert "recipe: bf16 base + fp32 adapters, autocast bf16" in capsys.readouterr().out


def test_hf_on_a_bf16_config_answers_per_transformers_version(tmp_path, capsys):
    """``trainmem hf`` on a bf16 config.json: transformers 4.57 loads fp32 unless
    torch_dtype is passed, 5.24 loads the stored bf16 (dtype="auto"); each table
    names the recipe and why. A preset names no stored dtype: fp32 is assumed, and
    said."""
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "args.json").write_text('{"bf16": true}')
    (tmp_path / "lora.json").write_text('{"r": 16}')
    base = ["hf", "--model", str(tmp_path / "config.json"), "--seq", "128"]
    base += ["--training-args", str(tmp_path / "args.json")]
    base += ["--peft-config", str(tmp_path / "lora.json")]
    text, total = {}, {}
    for t in ("4.57.1", "5.24.0"):
        assert main(base + ["--versions", f"transformers={t}"]) == 0
        text[t] = capsys.readouterr().out
        assert main(base + ["--versions", f"transformers={t}", "--json"]) == 0
        total[t] = json.loads(capsys.readouterr().out)["total_bytes"]
    assert "recipe: fp32 base + fp32 adapters, autocast bf16" in text["4.57.1"]
    assert "loads fp32 unless dtype/torch_dtype is passed" in text["4.57.1"]
    assert "recipe: bf16 base + fp32 adapters, autocast bf16" in text["5.24.0"]
    assert "loads the stored dtype (dtype='auto', from 5.0)" in text["5.24.0"]
    assert total["5.24.0"] < total["4.57.1"]
    assert main(["hf", "--model", "tiny", "--seq", "64"]) == 0
    assert "preset 'tiny' is a shape that names no stored dtype" in " ".join(
        capsys.readouterr().out.split()
    )
