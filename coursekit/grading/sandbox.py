"""The sandbox every student kernel runs in: bubblewrap (``bwrap``, the tool Flatpak
uses), started by the worker in place of the plain kernel command.

Inside, the kernel sees the system directories and the course's Python (interpreter,
virtual environment, the ``trainmem``/``coursekit`` package folders) read-only; of
``/etc`` only what Python and its libraries read (:data:`ETC`: never ``shadow``,
``sudoers`` or ssh keys); no ``/sys``; a fresh ``/proc`` whose ``/proc/sys`` is
read-only; its own work directory (a copy of its notebook, the kernel's connection file
and sockets) read-write; a private size-capped ``/tmp``; nothing else of the machine:
not the repository's ``tests/`` (hidden tests), the submissions, the output folder, the
home folder or any other student's file. It has its own user, PID, network, IPC, UTS
and cgroup namespaces (no network at all, and it cannot see or signal the grader) and
the environment the grader gives it, not the instructor's. The kernel talks to the
grader over ZMQ's ``ipc`` transport (Unix sockets in the work directory).

It never runs as the host's root. bwrap itself runs unprivileged: a grader started as
root first drops the launch to :data:`SANDBOX_UID` (the overflow user ``nobody``), so
the kernel's user namespace maps uid 65534 to host uid 65534 and nothing to host uid 0;
started by another user, the kernel is uid 65534 inside and that user outside. Either
way it has no capabilities, cannot create user namespaces (``--disable-userns``, and
the seccomp filter of :mod:`coursekit.grading.seccomp` refuses ``mount``, ``unshare``,
``ptrace``, the keyring, ``bpf`` and the like with ``EPERM``). :data:`LAUNCHER` is the
small program that does this between the worker and bwrap: it joins the submission's
cgroup (:mod:`coursekit.grading.cgroup`), as root mounts (in a private mount namespace)
the course's Python folders that ``nobody`` could not reach (a pyenv under a 0700
``/root``), drops to ``nobody``, hands bwrap the seccomp program through a pipe and
becomes bwrap.

:func:`unavailable` says why no sandbox can be had here (``bwrap`` missing, not Linux,
user namespaces disabled) in one line naming the fix; ``grade`` refuses to run then
unless told ``--no-sandbox``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from . import seccomp

FIX = (
    "install bubblewrap (`sudo apt-get install bubblewrap`, or `make sandbox-deps`) "
    "or pass --no-sandbox to grade without one"
)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
# What of /etc the kernel sees: the dynamic loader's cache, users and groups (names
# only: passwd holds no password hashes), name-service and locale files, TLS
# certificates, time zone, MIME types, fonts, Debian's alternatives symlinks
ETC = (
    "passwd group nsswitch.conf host.conf hosts gai.conf protocols services networks "
    "ld.so.cache ld.so.conf ld.so.conf.d ssl/certs ssl/openssl.cnf ca-certificates "
    "ca-certificates.conf pki crypto-policies localtime timezone locale.alias "
    "locale.conf default/locale mime.types alternatives fonts os-release lsb-release "
    "debian_version python3 python3.11 python3.12 python3.13 matplotlibrc"
).split()
SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup: the kernel's uid inside, and
# outside when the grader is root
NPROC = 1024  # tasks (processes + threads) the sandbox may hold, where the OS counts
# them per user namespace (Linux ≥ 5.14, not root); the cgroup's pids.max or the
# worker's watchdog caps the number of processes everywhere

# Run as ``python -I -S -c LAUNCHER CONFIG -- bwrap ARGS…`` (no site, no user code: it
# imports nothing from the course or the virtual environment). CONFIG (JSON): procs
# (cgroup.procs files to join), stage ([[top, [folder, …]], …]: as root, a tmpfs on
# top holding only these folders, in a private mount namespace), uid/gid (drop to
# them; null: stay), seccomp (hex of the BPF program; "" for none).
LAUNCHER = r"""
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
argv = sys.argv[3:]
def die(what):
    os.write(2, ("coursekit sandbox launcher: " + what + "\n").encode())
    os._exit(97)
try:
    for f in cfg["procs"]:
        with open(f, "w") as fh:
            fh.write(str(os.getpid()))
except OSError as e:
    die("cannot join the cgroup: %s" % e)
if cfg["stage"]:
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(src, dst, fstype, flags, data):
        if libc.mount(src, dst.encode(), fstype, flags, data) != 0:
            die("mount %s: %s" % (dst, os.strerror(ctypes.get_errno())))
    if libc.unshare(0x00020000) != 0:
        die("unshare(CLONE_NEWNS): " + os.strerror(ctypes.get_errno()))
    mount(None, "/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE
    for top, folders in cfg["stage"]:
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in folders]
        mount(b"tmpfs", top, b"tmpfs", 2 | 4 | 8, b"mode=0755,size=1m")
        for p, fd in zip(folders, fds):
            os.makedirs(p, exist_ok=True)
            mount(("/proc/self/fd/%d" % fd).encode(), p, None, 0x1000 | 0x4000, None)
            os.close(fd)
if cfg["uid"] is not None:
    try:
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    except OSError as e:
        die("cannot drop to uid %s: %s" % (cfg["uid"], e))
    if os.getuid() == 0 or os.geteuid() == 0:
        die("still root")
if cfg["seccomp"]:
    r, w = os.pipe()
    os.write(w, bytes.fromhex(cfg["seccomp"]))
    os.close(w)
    os.set_inheritable(r, True)
    argv = [argv[0], "--seccomp", str(r)] + argv[1:]
try:
    os.execv(argv[0], argv)
except OSError as e:
    die("cannot start %s: %s" % (argv[0], e))
"""


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def drops_root() -> bool:
    """Started as root: the launch drops to :data:`SANDBOX_UID` before bwrap."""
    return os.geteuid() == 0


@functools.cache
def bwrap_supports(option: str) -> bool:
    exe = bwrap_path()
    if exe is None:
        return False
    try:
        text = subprocess.run(
            [exe, "--help"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return f"{option} " in text


@functools.cache
def unavailable() -> str | None:
    """None when a bubblewrap sandbox works on this machine, else one line: why not and
    the fix. The probe runs the whole launch a kernel gets (the drop from root, the
    seccomp filter, every bind) around ``true``."""
    if platform.system() != "Linux":
        return (
            f"no sandbox on {platform.system()}: bubblewrap needs Linux; grade in a "
            "Linux VM or container, or pass --no-sandbox to grade without one"
        )
    exe = bwrap_path()
    if exe is None:
        return f"no sandbox: bwrap (bubblewrap) is not installed; {FIX}"
    true = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"
    work = tempfile.mkdtemp(prefix="coursekit-probe-")
    try:
        prepare_workdir(work)
        probe = subprocess.run(
            [*command(work, {}, "off", 1), true],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired, RuntimeError) as e:
        return f"no sandbox: bwrap failed to start ({e}); {FIX}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
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
    args += ["--dir", "/etc"]
    for name in ETC:
        p = "/etc/" + name
        if os.path.lexists(p):
            args += ["--ro-bind-try", p, p]
    return args


def python_paths() -> list[str]:
    """Read-only folders the kernel needs: the interpreter, the virtual environment and
    the course packages (their own folders only: never the repository around them)."""
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


def _others_can(path: str, bits: int) -> bool:
    """Whether uid/gid 65534 (not the owner, not in the group) has ``bits`` (an
    ``S_IXOTH``-style mask of the "other" class) on ``path``."""
    st = os.stat(path)
    if st.st_uid == SANDBOX_UID:
        return bool(st.st_mode & (bits << 6))
    if st.st_gid == SANDBOX_GID:
        return bool(st.st_mode & (bits << 3))
    return bool(st.st_mode & bits)


def _unreachable_top(path: str) -> str | None:
    """The topmost ancestor of ``path`` that uid 65534 cannot enter, if any."""
    parts = Path(path).parts
    for i in range(1, len(parts)):
        anc = str(Path(*parts[:i]))
        if not _others_can(anc, stat.S_IXOTH):
            return anc
    return None


def stage_plan(paths: list[str], workdir: str) -> list[list]:
    """As root: [[top, [folder, …]], …] for the launcher, so that ``nobody`` can reach
    every folder bwrap binds. A folder it could reach but not read, or a work directory
    it could not reach, is an error naming the folder."""
    plan: dict[str, list[str]] = {}
    for p in paths:
        if not _others_can(p, stat.S_IROTH | stat.S_IXOTH):
            raise RuntimeError(
                f"{p} is not readable by uid {SANDBOX_UID}, whom the sandbox runs "
                "as under root: make it world-readable (chmod o+rX) or grade as "
                "another user"
            )
        top = _unreachable_top(p)
        if top:
            plan.setdefault(top, []).append(p)
    top = _unreachable_top(workdir)
    if top:
        raise RuntimeError(
            f"the work directory {workdir} lies in {top}, which uid "
            f"{SANDBOX_UID} cannot enter; set TMPDIR to a folder such as /tmp"
        )
    return [[t, fs] for t, fs in sorted(plan.items())]


def prepare_workdir(workdir: str) -> None:
    """Make ``workdir`` (and what is in it) the sandbox user's, where the launch drops
    from root; elsewhere it is the grader's user's already."""
    if not drops_root():
        return
    for dirpath, dirnames, filenames in os.walk(workdir):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), SANDBOX_UID, SANDBOX_GID)
    os.lchown(workdir, SANDBOX_UID, SANDBOX_GID)


def launcher(procs: list[str], stage: list[list], drop: bool) -> list[str]:
    """The argv head that runs :data:`LAUNCHER`; bwrap's argv follows after ``--``."""
    prog = seccomp.program()
    cfg = {
        "procs": list(procs),
        "stage": stage,
        "uid": SANDBOX_UID if drop else None,
        "gid": SANDBOX_GID if drop else None,
        "seccomp": prog.hex() if prog else "",
    }
    return [sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(cfg), "--"]


def command(
    workdir: str,
    env: dict[str, str],
    gpu: str,
    tmp_mb: int,
    procs: list[str] = (),  # type: ignore[assignment]
) -> list[str]:
    """The argv that runs a command (appended by the caller) sandboxed, with
    ``workdir`` writable at the same path, a private /tmp of ``tmp_mb`` MiB (a tmpfs,
    never the host's /tmp) and exactly the environment ``env``; ``procs``: the
    cgroup.procs files the launch joins first."""
    exe = bwrap_path()
    if exe is None:
        raise RuntimeError(unavailable() or "bwrap not found")
    drop = drops_root()
    paths = python_paths()
    stage = stage_plan(paths, workdir) if drop else []
    args = [
        exe,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_GID),
    ]
    if bwrap_supports("--disable-userns"):
        args += ["--disable-userns"]
    args += ["--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    args += ["--hostname", "sandbox", *_system_binds()]
    args += ["--proc", "/proc", "--dev", "/dev"]
    if gpu != "off":  # the GPU device nodes, where there are any, and what CUDA reads
        args += ["--ro-bind-try", "/sys", "/sys"]
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
    return [*launcher(list(procs), stage, drop), *args, "--"]


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
    (the kernel is never root: it applies): then the kernel gets it, else only the
    cgroup's pids.max or the watchdog's process cap holds."""
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)
