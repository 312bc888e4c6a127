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
