"""trainmem.demos.monitor: tensor-level live/peak bytes on CPU, per-step peak
records."""

import pytest
import torch

from trainmem.demos.monitor import PeakMemoryMonitor, TensorMemoryTracker, storage_bytes


def test_tracker_counts_new_storages_and_frees():
    with TensorMemoryTracker() as tr:
        x = torch.zeros(1024)  # 4096 B
        y = x * 2  # +4096 B
        x.add_(1)  # in place: nothing new
        v = y.view(32, 32)  # view: nothing new
        del x, y, v
        z = torch.ones(256)  # x and y freed; +1024 B
    assert tr.peak_bytes == 8192
    assert tr.current_bytes == 1024
    del z


def test_storage_bytes_counts_views_once():
    x = torch.zeros(10, 10)
    assert storage_bytes([x, x[0], x.T]) == 400


def test_monitor_peak_per_step_adam():
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    n = sum(p.numel() for p in m.parameters())  # 4160
    opt = torch.optim.AdamW(m.parameters())
    with PeakMemoryMonitor("cpu", baseline=m.parameters(), warn_bytes=10**9) as mon:
        for i in range(3):
            x = torch.randn(32, 64)
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x
            mon.step(i)
    recs = mon.records
    assert [r.step for r in recs] == [0, 1, 2]
    # after each step: weights + Adam m and v (fp32), gradients freed
    assert recs[-1].live_bytes == 3 * 4 * n
    # the peak includes the gradients and the batch on top of that
    assert recs[-1].peak_bytes >= 4 * 4 * n + 32 * 64 * 4
    assert recs[1].peak_bytes == recs[2].peak_bytes  # steady state
    assert mon.warnings == []


def test_monitor_bad_device():
    with pytest.raises(ValueError, match="device"):
        PeakMemoryMonitor("mps")
