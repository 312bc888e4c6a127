"""The grader's watchdog finds the kernel in its process tree by depth, so the process
cap kills the kernel's children, not a child taken for the kernel."""

from __future__ import annotations

from types import SimpleNamespace

from coursekit.grading import worker

KERNEL = b"/venv/bin/python\0-m\0coursekit.grading.kernel_main\0-f\0k.json\0"
BWRAP = b"/usr/bin/bwrap\0--unshare-all\0--\0" + KERNEL


def test_kernel_found_by_depth_when_pids_wrapped(monkeypatch):
    # bwrap (900) -> bwrap, the namespace's init (901) -> kernel (30000) -> children
    # forked after pid_max wrapped around: smaller pids, the kernel's own argv
    children = {900: [901], 901: [30000], 30000: [12, 13], 12: [], 13: []}
    argv = {900: BWRAP, 901: BWRAP, 30000: KERNEL, 12: KERNEL, 13: KERNEL}
    monkeypatch.setattr(worker, "_children", lambda p: children.get(p, []))
    monkeypatch.setattr(worker, "_cmdline", lambda p: argv.get(p, b""))
    session = SimpleNamespace(spec={"memory_mb": 100})
    dog = worker.Watchdog(session, 900)
    assert worker.process_tree(900) and dog._kernel_pid() == 30000
