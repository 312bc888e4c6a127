"""The sandbox every student kernel runs in: bubblewrap (``bwrap``, the tool Flatpak
uses), started by the worker in place of the plain kernel command.

Inside, the kernel sees the system directories and the course's Python (interpreter,
virtual environment, the ``trainmem``/``coursekit`` package folders) read-only; its own
work directory (a copy of its notebook, the kernel's connection file and sockets)
read-write; a private size-capped ``/tmp``; nothing else of the machine: not the
repository's ``tests/`` (hidden tests), the submissions, the output folder, the home
folder or any other student's file. It has its own user, PID, network, IPC and UTS
namespaces (no network at all, and it cannot see or signal the grader) and the
environment the grader gives it, not the instructor's. The kernel talks to the grader
over ZMQ's ``ipc`` transport (Unix sockets in the work directory): with its own network
namespace the host's TCP loopback is out of reach.

:func:`unavailable` says why no sandbox can be had here (``bwrap`` missing, not Linux,
user namespaces disabled) in one line naming the fix; ``grade`` refuses to run then
unless told ``--no-sandbox``.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

FIX = (
    "install bubblewrap (`sudo apt-get install bubblewrap`, or `make sandbox-deps`) "
    "or pass --no-sandbox to grade without one"
)
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
NPROC = 1024  # tasks (processes + threads) the sandbox may hold, where the OS counts
# them per user namespace (Linux ≥ 5.14, not root); the worker's watchdog caps the
# number of processes everywhere


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def unavailable() -> str | None:
    """None when a bubblewrap sandbox works on this machine, else one line: why not and
    the fix."""
    if platform.system() != "Linux":
        return (
            f"no sandbox on {platform.system()}: bubblewrap needs Linux; grade in a "
            "Linux VM or container, or pass --no-sandbox to grade without one"
        )
    exe = bwrap_path()
    if exe is None:
        return f"no sandbox: bwrap (bubblewrap) is not installed; {FIX}"
    try:
        probe = subprocess.run(
            [
                exe,
                "--unshare-all",
                "--die-with-parent",
                *_system_binds(),
                "--",
                "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no sandbox: bwrap failed to start ({e}); {FIX}"
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["exit %d" % probe.returncode])[-1]
        return (
            f"no sandbox: bwrap cannot create namespaces here ({why}); enable "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 "
            "or, on Ubuntu, an AppArmor profile for bwrap) or pass --no-sandbox"
        )
    return None


def _system_binds() -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


def python_paths() -> list[str]:
    """Read-only folders the kernel needs: the interpreter, the virtual environment and
    the course packages (their own folders only: never the repository around them)."""
    import importlib.util

    paths = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        str(Path(sys.executable).resolve().parent.parent),
    }
    for package in ("coursekit", "trainmem"):  # found, not imported
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.origin:
            raise RuntimeError(f"the course package {package} is not installed")
        paths.add(str(Path(spec.origin).resolve().parent))
    out = []
    for p in sorted(paths, key=len):
        rp = os.path.realpath(p)
        if any(rp == q or rp.startswith(q + os.sep) for q in out):
            continue  # already inside a bound folder
        if any(rp == s or rp.startswith(s + os.sep) for s in SYSTEM_DIRS):
            continue
        out.append(rp)
    return out


def visible_paths() -> list[str]:
    """Every host folder the sandbox binds (system and Python); the grader checks that
    the hidden tests, the submissions and the output folder lie outside all of them."""
    return [d for d in SYSTEM_DIRS if os.path.isdir(d)] + python_paths()


def inside(path: str | Path, folders: list[str]) -> str | None:
    """The folder of ``folders`` that contains ``path`` (or is it), if any."""
    p = os.path.realpath(path)
    for f in folders:
        f = os.path.realpath(f)
        if p == f or p.startswith(f + os.sep):
            return f
    return None


def _top_below_tmp(path: str) -> str | None:
    """``/tmp/a`` for ``/tmp/a/b/c`` (``None`` outside /tmp)."""
    parts = Path(path).parts
    if len(parts) > 2 and parts[:2] == ("/", "tmp"):
        return "/tmp/" + parts[2]
    return None


def command(workdir: str, env: dict[str, str], gpu: str, tmp_mb: int) -> list[str]:
    """The bwrap argv that runs a command (appended by the caller) sandboxed, with
    ``workdir`` writable at the same path, a private /tmp of ``tmp_mb`` MiB (a tmpfs,
    never the host's /tmp) and exactly the environment ``env``."""
    exe = bwrap_path()
    if exe is None:
        raise RuntimeError(unavailable() or "bwrap not found")
    args = [
        exe,
        "--unshare-all",  # user, pid, net, ipc, uts, cgroup namespaces
        "--die-with-parent",
        "--hostname",
        "sandbox",
        *_system_binds(),
    ]
    args += ["--ro-bind-try", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev"]
    if gpu != "off":  # the GPU device nodes, where there are any
        for name in sorted(os.listdir("/dev")):
            if name.startswith(("nvidia", "dri")):
                args += ["--dev-bind-try", f"/dev/{name}", f"/dev/{name}"]
    size = str(int(tmp_mb) * 2**20)
    # /tmp and /dev/shm: private tmpfs of a fixed size; /dev itself read-only (bwrap
    # makes it a writable tmpfs of unbounded size)
    args += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm"]
    # after the private /tmp: a checkout under /tmp keeps its environment visible,
    # inside a read-only tmpfs (the folders around it, e.g. the repository's, are
    # empty there and cannot be written)
    paths = python_paths()
    tops = sorted({t for t in map(_top_below_tmp, paths) if t and t not in paths})
    for top in tops:
        args += ["--tmpfs", top]
    for p in paths:
        args += ["--ro-bind", p, p]
    args += ["--bind", workdir, workdir]
    for top in tops:
        args += ["--remount-ro", top]
    args += ["--remount-ro", "/", "--remount-ro", "/dev"]
    args += ["--chdir", workdir]
    args += ["--clearenv"]
    for k, v in sorted(env.items()):
        args += ["--setenv", k, str(v)]
    return args + ["--"]


def kernel_env(
    base: dict[str, str], workdir: str, gpu: str, tmp: str = "/tmp"
) -> dict[str, str]:
    """The kernel's whole environment: what Python and the course need, and ``base``
    (COURSE_GPU, PYTHONHASHSEED, …); none of the instructor's variables. ``tmp``: its
    temporary folder (the private /tmp in the sandbox)."""
    env = {
        "PATH": os.pathsep.join(
            [str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
        ),
        "HOME": workdir,
        "TMPDIR": tmp,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLCONFIGDIR": f"{tmp}/matplotlib",
        "IPYTHONDIR": f"{tmp}/ipython",
    }
    if gpu != "off":
        for k in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH"):
            if k in os.environ:
                env[k] = os.environ[k]
    env.update({k: str(v) for k, v in base.items()})
    return env


def nproc_counted_per_namespace() -> bool:
    """RLIMIT_NPROC counts the tasks of the sandbox's own user namespace (Linux ≥ 5.14)
    and applies at all (not root): then the kernel gets it, else only the watchdog's
    process cap holds."""
    if os.geteuid() == 0:
        return False
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)
