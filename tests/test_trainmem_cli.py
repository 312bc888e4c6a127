"""python -m trainmem estimate|measure: JSON contract, table, one-line errors."""
import json
import subprocess
import sys

import pytest

from trainmem.cli import main

KEYS = {"weights", "gradients", "optimizer_states", "master_weights", "activations", "temporaries"}


def test_estimate_json(capsys):
    assert main(["estimate", "--model", "llama-7b", "--method", "lora", "--batch", "2",
                 "--seq", "256", "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["breakdown"]) == KEYS
    assert all(isinstance(v, int) for v in out["breakdown"].values())
    assert out["total_bytes"] == sum(out["breakdown"].values())
    assert out["n_trainable"] == 8_388_608


def test_estimate_table(capsys):
    assert main(["estimate", "--model", "tiny", "--checkpointing", "--attn", "eager"]) == 0
    out = capsys.readouterr().out
    assert "GiB" in out and "GB" in out and "total (peak)" in out


def test_measure_fake_json(capsys):
    assert main(["measure", "--model", "tiny", "--device", "fake", "--batch", "1", "--seq", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["breakdown"]) == KEYS and out["total_bytes"] > 0


@pytest.mark.parametrize("args,needle", [
    (["--model", "nope"], "--model must be one of"),
    (["--model", "tiny", "--method", "lora", "--lora-rank", "0"], "--lora-rank must be ≥ 1"),
    (["--model", "tiny", "--method", "lora", "--lora-rank", "65"], "≤ min(d_in, d_out)=64"),
    (["--model", "tiny", "--method", "lora", "--lora-targets", "q_proj,foo"], "unknown target module 'foo'"),
    (["--batch", "0"], "--batch"),
    (["--precision", "fp8"], "choose from"),
])
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
    out = subprocess.run([sys.executable, "-m", "trainmem", "estimate", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--model", "--method", "--precision", "--optimizer", "--batch", "--seq",
                 "--lora-rank", "--lora-alpha", "--lora-targets", "--checkpointing", "--attn",
                 "--zero", "--gpus", "--json", "master_weights"):
        assert flag in out
