"""One cgroup per submission: the kernel's memory (all of it: anonymous, page cache,
shmem, tmpfs, memfd, SysV shared memory), its tasks and its share of the CPU are
counted and capped by the Linux kernel, not sampled; its CPU time and its wait for a
CPU are read from it, so a time limit hit while the machine was busy is told apart.

Where the grader can create cgroups:

* **cgroup v2** (``/sys/fs/cgroup`` a cgroup2 mount with the memory, pids and cpu
  controllers): a ``coursekit-grade-<pid>`` folder in the hierarchy's root (root) or,
  in a delegated cgroup (``systemd-run --user --scope -p Delegate=yes …``), in the
  grader's own one, after moving the grader into a leaf of it; per submission
  ``memory.max`` (and ``memory.swap.max`` 0), ``pids.max``, ``cpu.weight``.
* **cgroup v1 / hybrid** (root): a folder in each of the memory, pids and cpu
  hierarchies (``memory.limit_in_bytes`` and ``memsw``, ``pids.max``, ``cpu.shares``),
  plus one in the unified hierarchy where there is one (CPU time, CPU pressure,
  ``cgroup.kill``).

Elsewhere :func:`available` says why not, once, and the worker's sampling watchdog is
what limits the kernel (grades.csv's ``limits`` column says which held).
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
WEIGHT = 100  # cpu.weight of every submission (v2's default); v1: cpu.shares 1024


def _read(path: Path) -> str:
    return path.read_text()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _own(hierarchy: str) -> str | None:
    """This process's cgroup path in ``hierarchy`` ("" for v2's unified line)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if names.split(",") == [hierarchy] or (hierarchy == "" and names == ""):
            return path
    return None


class Parent:
    """Where per-submission cgroups are made: a folder per hierarchy."""

    def __init__(self, kind: str, dirs: dict[str, Path], unified: Path | None):
        self.kind, self.dirs, self.unified = kind, dirs, unified

    def describe(self) -> str:
        where = ", ".join(str(d) for d in {*self.dirs.values(), self.unified} if d)
        return f"cgroup {self.kind} ({where})"


def _v2_parent() -> Parent | None:
    if not (ROOT / "cgroup.controllers").exists():
        return None
    if not set(CONTROLLERS) <= set(_read(ROOT / "cgroup.controllers").split()):
        raise OSError("the memory, pids or cpu controller is not available")
    name = f"coursekit-grade-{os.getpid()}"
    enable = " ".join("+" + c for c in CONTROLLERS)
    if os.access(ROOT / "cgroup.subtree_control", os.W_OK):  # root of the hierarchy
        _write(ROOT / "cgroup.subtree_control", enable)
        parent = ROOT / name
        parent.mkdir()
    else:  # a delegated cgroup of our own: move into a leaf, then enable below
        own = ROOT / (_own("") or "/").lstrip("/")
        if not os.access(own / "cgroup.procs", os.W_OK):
            raise OSError(f"{own} is not writable (not root, no delegated cgroup)")
        leaf = own / "coursekit-grader"
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", str(os.getpid()))
        _write(own / "cgroup.subtree_control", enable)
        parent = own / name
        parent.mkdir()
    _write(parent / "cgroup.subtree_control", enable)
    _write(parent / "cpu.weight", str(min(10000, WEIGHT * _cpus())))
    return Parent("v2", {c: parent for c in CONTROLLERS}, parent)


def _v1_parent() -> Parent | None:
    dirs = {}
    name = f"coursekit-grade-{os.getpid()}"
    for c in ("memory", "pids", "cpu"):
        base = ROOT / c
        if not (base / "cgroup.procs").exists():
            return None
        own = _own(c)
        if own is None:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                if c in line.split(":")[1].split(","):
                    own = line.split(":", 2)[2]
        d = base / (own or "/").lstrip("/") / name
        d.mkdir(exist_ok=True)
        dirs[c] = d
        if c == "cpu":
            _write(d / "cpu.shares", str(1024 * _cpus()))
    unified = None
    for u in (ROOT / "unified",):
        if (u / "cgroup.procs").exists():
            try:
                d = u / (_own("") or "/").lstrip("/") / name
                d.mkdir(exist_ok=True)
                unified = d
            except OSError:
                pass
    return Parent("v1", dirs, unified)


def _cpus() -> int:
    """The run's CPU weight, in tasks: its parent cgroup competes with the machine's
    other processes as this many busy ones would (one cgroup weighs like one task)."""
    return max(
        1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    )


_parent: Parent | None = None


@functools.cache
def available() -> str | None:
    """None when per-submission cgroups can be made here, else one line saying why
    not (the grader then samples memory and processes instead)."""
    global _parent
    errors = []
    for make in (_v2_parent, _v1_parent):
        try:
            p = make()
        except OSError as e:
            errors.append(f"{make.__name__[1:3]}: {e}")
            continue
        if p is not None:
            _parent = p
            return None
    return "no cgroups: " + ("; ".join(errors) or "no cgroup filesystem")


def parent() -> Parent | None:
    return _parent if available() is None else None


class Cgroup:
    """One submission's cgroup (the folder in each hierarchy); :meth:`spec` and
    :meth:`from_spec` carry it from the grader to its worker."""

    def __init__(self, kind: str, dirs: dict[str, str], unified: str | None):
        self.kind = kind
        self.dirs = {c: Path(d) for c, d in dirs.items()}
        self.unified = Path(unified) if unified else None

    def spec(self) -> dict:
        return {
            "kind": self.kind,
            "dirs": {c: str(d) for c, d in self.dirs.items()},
            "unified": str(self.unified) if self.unified else None,
        }

    @classmethod
    def from_spec(cls, spec: dict | None) -> "Cgroup | None":
        return cls(spec["kind"], spec["dirs"], spec["unified"]) if spec else None

    @classmethod
    def create(cls, p: Parent, memory_bytes: int, tasks: int) -> "Cgroup":
        name = "sub-" + secrets.token_hex(6)
        cg = cls(
            p.kind,
            {c: str(d / name) for c, d in p.dirs.items()},
            str(p.unified / name) if p.unified else None,
        )
        made = []
        try:
            for d in cg._all():
                d.mkdir()
                made.append(d)
            mem, pids, cpu = (cg.dirs[c] for c in CONTROLLERS)
            if cg.kind == "v2":
                _write(mem / "memory.max", str(memory_bytes))
                if (mem / "memory.swap.max").exists():
                    _write(mem / "memory.swap.max", "0")
                _write(pids / "pids.max", str(tasks))
                _write(cpu / "cpu.weight", str(WEIGHT))
            else:
                _write(mem / "memory.limit_in_bytes", str(memory_bytes))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    _write(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
                _write(pids / "pids.max", str(tasks))
                _write(cpu / "cpu.shares", "1024")
        except OSError:
            for d in made:
                try:
                    d.rmdir()
                except OSError:
                    pass
            raise
        return cg

    def _all(self) -> list[Path]:
        return sorted({*self.dirs.values(), *([self.unified] if self.unified else [])})

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files the launcher writes its pid to."""
        return [str(d / "cgroup.procs") for d in self._all()]

    def _stat(self, d: Path | None, name: str) -> dict[str, int]:
        try:
            text = _read(d / name) if d else ""
        except OSError:
            return {}
        return {
            m.group(1): int(m.group(2))
            for m in re.finditer(r"^(\w+) (\d+)$", text, re.M)
        }

    def cpu_seconds(self) -> float | None:
        """CPU time used by the submission's tasks so far."""
        u = self._stat(self.unified, "cpu.stat").get("usage_usec")
        if u is not None:
            return u / 1e6
        try:  # v1 with cpu and cpuacct mounted together
            return int(_read(self.dirs["cpu"] / "cpuacct.usage")) / 1e9
        except (OSError, ValueError):
            return None

    def cpu_wait_seconds(self) -> float | None:
        """Time some task of the submission was runnable but waited for a CPU (PSI):
        the machine's doing, not the submission's."""
        d = self.unified
        try:
            text = _read(d / "cpu.pressure") if d else ""
        except OSError:
            return None
        m = re.search(r"^some .*total=(\d+)", text, re.M)
        return int(m.group(1)) / 1e6 if m else None

    def oom_kills(self) -> int:
        mem = self.dirs["memory"]
        name = "memory.events" if self.kind == "v2" else "memory.oom_control"
        return self._stat(mem, name).get("oom_kill", 0)

    def memory_peak(self) -> int | None:
        mem = self.dirs["memory"]
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                return int(_read(mem / name))
            except (OSError, ValueError):
                continue
        return None

    def pids(self) -> list[int]:
        out: set[int] = set()
        for f in self.procs:
            try:
                out |= {int(x) for x in _read(Path(f)).split()}
            except (OSError, ValueError):
                pass
        return sorted(out)

    def kill(self) -> None:
        """SIGKILL every task of the submission (cgroup.kill where there is one)."""
        for d in (self.unified, self.dirs["memory"]):
            if d and (d / "cgroup.kill").exists():
                try:
                    _write(d / "cgroup.kill", "1")
                except OSError:
                    pass
        for _ in range(50):
            left = self.pids()
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)

    def remove(self) -> None:
        self.kill()
        for d in self._all():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


def cleanup_parent() -> None:
    """Remove this run's parent folders (empty once every submission is done); the
    next run makes them again."""
    global _parent
    p, _parent = _parent, None
    available.cache_clear()
    if p is None:
        return
    for d in {*p.dirs.values(), *([p.unified] if p.unified else [])}:
        try:
            d.rmdir()
        except OSError:
            pass
