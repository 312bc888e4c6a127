"""COURSE_GPU flag and device choice; CUDA presence is faked."""

import subprocess
import sys

import pytest

from coursekit import gpu


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(gpu, "cuda_available", lambda: False)


@pytest.fixture
def with_cuda(monkeypatch):
    monkeypatch.setattr(gpu, "cuda_available", lambda: True)


@pytest.mark.parametrize(
    "raw,mode",
    [
        (None, "auto"),
        ("", "auto"),
        ("auto", "auto"),
        ("AUTO", "auto"),
        ("cpu", "cpu"),
        ("on", "on"),
        ("1", "on"),
        ("off", "off"),
        ("0", "off"),
    ],
)
def test_gpu_mode_values(monkeypatch, raw, mode):
    if raw is None:
        monkeypatch.delenv("COURSE_GPU", raising=False)
    else:
        monkeypatch.setenv("COURSE_GPU", raw)
    assert gpu.gpu_mode() == mode


def test_unknown_value_names_allowed_values(monkeypatch):
    monkeypatch.setenv("COURSE_GPU", "gpu")
    with pytest.raises(
        gpu.GPUFlagError, match=r"COURSE_GPU must be one of auto\|cpu\|on\|off.*'gpu'"
    ):
        gpu.gpu_mode()


def test_auto_without_cuda_skips_with_fixed_line(no_cuda, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_GPU", "auto")
    ran = []
    assert gpu.gpu_cell(lambda device, small: ran.append(device)) is None
    assert ran == []
    assert capsys.readouterr().out.strip() == gpu.SKIP_LINE


def test_auto_with_cuda_runs_full_size(with_cuda, monkeypatch):
    monkeypatch.setenv("COURSE_GPU", "auto")
    c = gpu.choose_device()
    assert (c.run, c.device, c.small) == (True, "cuda", False)


def test_cpu_mode_runs_small_on_cpu(with_cuda, monkeypatch):
    monkeypatch.setenv("COURSE_GPU", "cpu")
    out = gpu.gpu_cell(lambda device, small: (device.type, small))
    assert out == ("cpu", True)


def test_off_skips_even_with_cuda(with_cuda, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_GPU", "off")
    assert gpu.gpu_cell(lambda d, s: 1) is None
    assert capsys.readouterr().out.strip() == gpu.OFF_LINE


def test_on_without_cuda_fails_clearly(no_cuda, monkeypatch):
    monkeypatch.setenv("COURSE_GPU", "on")
    with pytest.raises(
        gpu.GPUUnavailableError, match="COURSE_GPU=on but no CUDA device"
    ):
        gpu.gpu_cell(lambda d, s: 1)


def test_on_with_cuda_runs(with_cuda, monkeypatch):
    monkeypatch.setenv("COURSE_GPU", "1")
    assert gpu.choose_device().device == "cuda"


def test_on_without_cuda_in_a_real_process_is_one_clear_error():
    """No traceback from deep inside torch: the error is ours and names the fix."""
    code = (
        "from coursekit import gpu_cell\n@gpu_cell\ndef f(device, small):\n    pass\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"COURSE_GPU": "on", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "coursekit.gpu.GPUUnavailableError: COURSE_GPU=on but no CUDA device"
    )
    assert "torch/cuda" not in r.stderr


@pytest.mark.parametrize(
    "cap,expected",
    [((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True), ((6, 1), False)],
)
def test_bf16_needs_sm80(cap, expected):
    # A T4 is sm_75: torch.cuda.is_bf16_supported() may say True (emulation); we say
    # False.
    assert gpu.bf16_supported("cuda", capability=cap) is expected


def test_bf16_on_cpu_and_without_gpu(no_cuda):
    assert gpu.bf16_supported("cpu") is True
    assert gpu.bf16_supported("cuda") is False


def test_amp_dtype_falls_back_to_fp16_on_t4():
    import torch

    assert gpu.amp_dtype("cuda", capability=(7, 5)) is torch.float16
    assert gpu.amp_dtype("cuda", capability=(8, 0)) is torch.bfloat16
