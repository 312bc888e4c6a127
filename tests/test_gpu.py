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


def test_auto_without_cuda_runs_small_on_cpu_under_a_label(
    no_cuda, monkeypatch, capsys
):
    monkeypatch.setenv("COURSE_GPU", "auto")
    ran = []

    def cell(device, small):
        ran.append((device.type, small))
        print("the cell's own output")
        return 7

    assert gpu.gpu_cell(cell) == 7
    assert ran == [("cpu", True)]
    out = capsys.readouterr().out.splitlines()
    assert out == [
        gpu.CPU_LABEL.format(on_gpu=gpu.ON_GPU_DEFAULT),
        "the cell's own output",
    ]
    assert out[0].startswith("以下为 CPU 小规模运行的输出；在 GPU 上运行会")
    assert gpu.SKIP_PREFIX not in "\n".join(out)


def test_auto_with_cuda_runs_full_size(with_cuda, monkeypatch):
    monkeypatch.setenv("COURSE_GPU", "auto")
    c = gpu.choose_device()
    assert (c.run, c.device, c.small) == (True, "cuda", False)


def test_cpu_mode_runs_small_on_cpu(with_cuda, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_GPU", "cpu")
    out = gpu.gpu_cell(lambda device, small: (device.type, small))
    assert out == ("cpu", True)
    assert capsys.readouterr().out.startswith("以下为 CPU 小规模运行的输出；")


def test_on_gpu_says_what_the_gpu_run_adds(no_cuda, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_GPU", "auto")

    @gpu.gpu_cell(on_gpu="用 0.5B 模型测出真实的峰值显存")
    def result(device, small):
        return small

    assert result is True
    line = capsys.readouterr().out.splitlines()[0]
    assert line == (
        "以下为 CPU 小规模运行的输出；在 GPU 上运行会用 0.5B 模型测出真实的峰值显存。"
    )


def test_gpu_run_is_labelled_with_the_device(with_cuda, monkeypatch, capsys):
    import torch

    monkeypatch.setenv("COURSE_GPU", "auto")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch, "device", lambda name: name)  # no CUDA to build one on
    assert gpu.gpu_cell(lambda device, small: (device, small)) == ("cuda", False)
    assert capsys.readouterr().out.splitlines() == [
        "以下为在 GPU（NVIDIA H200）上运行的输出。"
    ]


@pytest.mark.parametrize("bad", ["", "  ", 3])
def test_on_gpu_must_be_text(bad):
    with pytest.raises(TypeError, match="on_gpu"):
        gpu.gpu_cell(on_gpu=bad)


def test_gpu_cell_needs_a_function():
    with pytest.raises(TypeError, match="decorates a function"):
        gpu.gpu_cell("not a function")


def test_off_skips_even_with_cuda(with_cuda, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_GPU", "off")
    assert gpu.gpu_cell(lambda d, s: 1) is None
    out = capsys.readouterr().out.strip()
    assert out == gpu.OFF_LINE and out.startswith(gpu.SKIP_PREFIX)


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
