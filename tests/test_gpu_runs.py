"""The recorded real-GPU outputs the book shows beside the CPU runs."""

import json
import re

import pytest

from coursekit import gpu_runs


def test_every_recorded_cell_is_a_gpu_cell_of_the_book():
    cells = gpu_runs.load_run()["cells"]
    assert cells
    for key in cells:
        stem, cell_id = key.split("/")
        nb = json.loads(
            (gpu_runs.DATA.parents[2] / "book" / f"{stem}.ipynb").read_text()
        )
        tags = {c["id"]: c.get("metadata", {}).get("tags", []) for c in nb["cells"]}
        assert "gpu" in tags.get(cell_id, []), key


def test_label_names_the_gpu_and_versions_and_drops_the_cells_own_label(capsys):
    gpu_runs.show_recorded("01_number_formats/ddc4fd40")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("以下为同一单元在 NVIDIA H200（计算能力 9.0）")
    assert "torch 2.11.0+cu130" in out[0]
    assert not any(line.startswith("以下为在 GPU（") for line in out[1:])
    assert "TFLOP/s" in "\n".join(out)


def test_unknown_key_and_run_name_the_allowed_values():
    with pytest.raises(ValueError, match="key must be one of"):
        gpu_runs.recorded_output("01_number_formats/nope")
    with pytest.raises(ValueError, match="run must be one of"):
        gpu_runs.load_run("a100-1999")


def test_recorded_match_returns_the_printed_numbers_or_names_the_pattern():
    assert gpu_runs.recorded_match(
        "09_beyond_one_gpu/fde0c96b", r"dropped by ([\d,]+) MiB"
    ) == ("618",)
    with pytest.raises(ValueError, match="not found in the recorded output"):
        gpu_runs.recorded_match("09_beyond_one_gpu/fde0c96b", r"no such (line)")


def _shown_keys(stem: str) -> set[str]:
    nb = json.loads((gpu_runs.DATA.parents[2] / "book" / f"{stem}.ipynb").read_text())
    src = "\n".join(
        "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
    )
    return set(re.findall(r'show_recorded\("([^"]+)"\)', src))


def test_chapters_8_and_9_show_every_recorded_gpu_run():
    """Each GPU section of chapters 8 and 9 shows the real GPU's output beside the CPU
    run; chapter 7 shows its bitsandbytes run and the QLoRA one, beside the estimate
    of the recipe as that run ran it (trainmem.kbit; checkpointing off in eval
    mode)."""
    cells = gpu_runs.load_run()["cells"]
    for stem in ("08_attention_inference_troubleshooting", "09_beyond_one_gpu"):
        recorded = {k for k in cells if k.startswith(stem + "/")}
        assert recorded and recorded <= _shown_keys(stem), stem
    shown7 = _shown_keys("07_quantization")
    assert "07_quantization/f89c5aed" in shown7
    assert "07_quantization/qlora-run" in shown7


def test_trainer_lora_row_on_a_bf16_checkpoint_is_estimated_within_2_percent():
    """The recorded H200 step: Trainer(bf16=True) + LoRA q,v r16 on TinyLlama (4 x
    1024), the checkpoint saved in bf16 and loaded with from_pretrained's defaults
    under transformers 5.24: ``trainmem hf`` loads the stored bf16 (a 16-bit base,
    fp32 adapters, autocast) and lands within 2 % of max_memory_allocated. The same
    inputs under transformers 4.57 load fp32 (autocast over fp32 weights, their bf16
    copies kept): the estimate the run was first given, 40 % too high for 5.24."""
    from trainmem.estimate import estimate_from_hf

    row = gpu_runs.recorded_step("tr-tl-lora-bf16ckpt")
    assert row["loaded_dtype"] == "torch.bfloat16"  # what the run's model held
    kw = gpu_runs.trainer_step_inputs("tr-tl-lora-bf16ckpt")
    est = estimate_from_hf(**kw)
    assert est.options["recipe"] == "bf16 base + fp32 adapters, autocast bf16"
    assert abs(est.total_bytes / row["step_peak"] - 1) < 0.02
    old = estimate_from_hf(**dict(kw, versions=kw["versions"] + ",transformers=4.57.1"))
    assert old.options["recipe"] == "fp32 base + fp32 adapters, autocast bf16"
    assert old.total_bytes / row["step_peak"] - 1 > 0.4
    with pytest.raises(ValueError, match="not Trainer"):
        gpu_runs.trainer_step_inputs("tl-lora-bf16")
    with pytest.raises(ValueError, match="step_id must be one of"):
        gpu_runs.recorded_step("nope")
