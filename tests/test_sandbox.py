"""The sandbox every submission runs in (bubblewrap): an attack suite graded next to
honest submissions in ONE run, the refusal without a sandbox, --no-sandbox's warnings,
and --shard / --merge.

Every attack is a cell after the honest ``add``/``mean`` of the toy lab ``lab99``
(tests/test_grader.py) that tries its attack and then raises
``RuntimeError("ATTACK <name>: SUCCEEDED …" or "blocked …")``; the quick ones share one
submission (:data:`BATCHED`), those that push a limit or outlive the kernel have one
each. The grader reports each cell's error like any student error, so each attack's
outcome comes back through the grader's own channel, and the host side is checked as
well (files, server, signals). Each attack must fail, the honest submissions keep full
marks and their files byte for byte, and each attacker earns what its honest code
earns. A second, unsandboxed run of three of
the attacks shows they do succeed without the sandbox (so the suite can fail).

Under ``CI=true`` a missing bwrap is an error naming the fix, never a skip.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import signal
import socket
import threading
from pathlib import Path

import psutil
import pytest

from coursekit.grading import files, grade, sandbox
from coursekit.grading.core import SandboxUnavailable, merge, shard_of
from coursekit.grading.worker import MAX_PROCS
from tests.test_grader import ADD, CHECK, HIDDEN, MEAN, STUB_ADD, STUB_MEAN, nb

pytestmark = pytest.mark.slow  # end-to-end grading runs; `make unit` leaves them out
ROOT = Path(__file__).resolve().parents[1]
SECRET_NAME = "COURSEKIT_TEST_SECRET"
DISK_MB = 48
SETTINGS = dict(
    cell_timeout=20,
    notebook_timeout=60,
    probe_timeout=6,
    memory_mb=768,
    disk_mb=DISK_MB,
)
FORKS = 400  # the bounded fork bomb: this many processes that would sleep 30 s
GRADING_DIR = ROOT / "coursekit" / "grading"
SITE_PACKAGES = Path(__import__("jupyter_client").__file__).resolve().parents[1]
OUTLIVE = "coursekit-outlive-" + os.urandom(4).hex()


def require_sandbox() -> None:
    why = sandbox.unavailable()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {why} (make sandbox-deps installs it)")
    pytest.skip(why)


def attack(name: str, *tries: str) -> str:
    """A cell trying each statement of ``tries`` (success = no exception), then raising
    one RuntimeError that says which succeeded or how each was blocked."""
    lines = ["_res = []"]
    for src in tries:
        body = "\n".join("    " + ln for ln in src.strip().splitlines())
        lines += [
            "try:",
            body,
            f"    _res.append('SUCCEEDED: ' + {src.strip().splitlines()[0][:50]!r})",
            "except BaseException as _e:",
            "    _res.append(f'blocked ({type(_e).__name__}: {str(_e)[:70]})')",
        ]
    lines.append(f"raise RuntimeError('ATTACK {name}: ' + ' | '.join(_res))")
    return "\n".join(lines)


FORK_BOMB = f"""
import os, time
kids = []
for _ in range({FORKS}):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
time.sleep(1.0)
alive = sum(os.waitpid(k, os.WNOHANG) == (0, 0) for k in kids)
for k in kids:
    try:
        os.kill(k, 9)
        os.waitpid(k, 0)
    except OSError:
        pass
assert alive > {MAX_PROCS}, f"only {{alive}} of {{len(kids)}} forks alive"
"""


CPU_HOG = """
import os, time
kids = []
for _ in range(48):
    pid = os.fork()
    if pid == 0:
        end = time.time() + 8
        while time.time() < end:
            pass
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
"""


def fill(path: str) -> str:
    return f"""
try:
    with open({path!r}, "wb") as f:
        for _ in range({2 * DISK_MB}):
            f.write(bytes(2**20))
finally:
    import os
    if os.path.exists({path!r}):
        os.remove({path!r})
"""


class Server:
    """A TCP server on localhost counting the connections it accepts."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self.done.set()
        self.thread.join()
        self.sock.close()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def attacks(base: Path, subs: Path, out: Path, hidden: Path, port: int) -> dict:
    """attack name → its cell."""
    outside = base / "outside.txt"
    repo_file = ROOT / "sandbox_attack.txt"
    home = Path.home()
    home_entries = [
        home / e
        for e in sorted(os.listdir(home))
        if not any(p.startswith(str(home / e)) for p in sandbox.python_paths())
    ]
    pid = os.getpid()
    return {
        "write_outside_workdir": attack(
            "write_outside_workdir",
            f"open({str(outside)!r}, 'w').write('x')",
            f"open({str(repo_file)!r}, 'w').write('x')",
            "open('/evil.txt', 'w').write('x')",
            "open('/usr/evil.txt', 'w').write('x')",
        ),
        "read_hidden_tests": attack(
            "read_hidden_tests",
            f"open({str(hidden)!r}).read()",
            f"open({str(ROOT / 'tests' / 'grading' / 'lab01.py')!r}).read()",
        ),
        "read_home": attack(
            "read_home",
            f"os = __import__('os'); os.stat({str(home_entries[0])!r})"
            if home_entries
            else "raise FileNotFoundError('the home folder is empty here')",
        ),
        "read_other_submission": attack(
            "read_other_submission",
            f"open({str(subs / 'honest_a.ipynb')!r}, 'rb').read()",
            f"__import__('os').listdir({str(subs)!r})",
        ),
        "modify_other_submission": attack(
            "modify_other_submission",
            f"open({str(subs / 'honest_b.ipynb')!r}, 'w').write('{{}}')",
        ),
        "delete_other_submission": attack(
            "delete_other_submission",
            f"__import__('os').remove({str(subs / 'honest_c.ipynb')!r})",
        ),
        "write_output_folder": attack(
            "write_output_folder",
            f"open({str(out / 'grades.csv')!r}, 'w').write('mallory,2,3,5,ok')",
            f"open({str(out / 'feedback' / 'honest_a.html')!r}, 'w').write('hacked')",
            f"open({str(out / 'evil.txt')!r}, 'w').write('evil')",
        ),
        "write_cache": attack(
            "write_cache",
            f"open({str(out / '.grade_cache.json')!r}, 'w').write('{{}}')",
        ),
        "connect_localhost": attack(
            "connect_localhost",
            f"__import__('socket').create_connection(('127.0.0.1', {port}), 2)",
            f"__import__('socket').create_connection(('localhost', {port}), 2)",
        ),
        "read_grader_env": attack(
            "read_grader_env",
            f"__import__('os').environ[{SECRET_NAME!r}]",
            f"""
import os
found = []
for p in os.listdir('/proc'):
    try:
        if {SECRET_NAME.encode()!r} in open(f'/proc/{{p}}/environ', 'rb').read():
            found.append(p)
    except OSError:
        pass
assert found, 'no process environment holds it'
""",
        ),
        "signal_grader": attack(
            "signal_grader",
            f"__import__('os').kill({pid}, __import__('signal').SIGUSR1)",
            f"import os, signal; os.killpg(os.getpgid({pid}), signal.SIGUSR1)",
            """
import os
seen = []
for p in os.listdir('/proc'):
    try:
        cmd = open(f'/proc/{p}/cmdline', 'rb').read()
    except OSError:
        continue
    if b'pytest' in cmd or b'coursekit.grading.worker' in cmd:
        seen.append(p)
assert seen, 'no grader process in sight'
""",
        ),
        "fork_bomb": attack("fork_bomb", FORK_BOMB),
        # the reported escape: remount the read-only course code writable and append
        # to a module the grader imports; plant a .pth in the environment; read
        # root-only files; write host sysctls; act as root at all
        "escape_to_grader": attack(
            "escape_to_grader",
            f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
d = {str(GRADING_DIR)!r}.encode()
assert libc.mount(None, d, None, 0x20 | 0x1000, None) == 0, ctypes.get_errno()
""",
            f"open({str(GRADING_DIR / 'worker.py')!r}, 'a').write('# pwned')",
            f"open({str(SITE_PACKAGES / 'zz_pwn.pth')!r}, 'w').write('import os')",
            "open('/etc/shadow').read()",
            "open('/proc/sys/kernel/hostname', 'w').write('pwned')",
            "assert __import__('os').getuid() == 0, 'not root'",
            "import ctypes; assert ctypes.CDLL(None).unshare(0x10000000) == 0",
            "assert open('/proc/self/status').read().split('CapEff:')[1].split()[0]"
            " != '0000000000000000', 'no capabilities'",
        ),
        # a double-forked, setsid'd process that would outlive the kernel and
        # rewrite the grader's output afterwards
        "outlive_grading": attack(
            "outlive_grading",
            f"""
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # {OUTLIVE}"],
                 start_new_session=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
raise RuntimeError('started; the host checks whether it survives')
""",
        ),
        # folders nested past PATH_MAX, written through descriptors, to hide data
        # from the size watch and make cleanup fail
        "deep_paths": attack(
            "deep_paths",
            f"""
import os, time
fd = os.open('.', os.O_RDONLY)
for i in range(300):
    os.mkdir('d' * 200, dir_fd=fd)
    nfd = os.open('d' * 200, os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = nfd
w = os.open('big', os.O_WRONLY | os.O_CREAT, dir_fd=fd)
for _ in range({DISK_MB}):
    os.write(w, bytes(2**20))
time.sleep(3)
""",
        ),
        "fill_disk": attack(
            "fill_disk",
            fill("big.bin"),
            fill("/tmp/big.bin"),
            fill("/dev/shm/big.bin"),
            fill("/dev/big.bin"),
        ),
    }


HONEST = ("honest_a", "honest_b", "honest_c")
UNSANDBOXED = (
    "read_hidden_tests",
    "read_grader_env",
    "connect_localhost",
    "modify_other_submission",
)
# Attacks that finish in a moment and test no limit: one submission holds them all,
# a cell each (the grader runs every cell whatever the one before raised, and reports
# each cell's error: each attack's verdict still comes back on its own). A kernel start
# per attack cost more than the attacks. The attacks that push a limit (fork_bomb,
# fill_disk, deep_paths) or outlive the kernel (outlive_grading) keep a submission of
# their own, so that no limit one of them hits can decide another's verdict.
BATCHED = (
    "write_outside_workdir",
    "read_hidden_tests",
    "read_home",
    "read_other_submission",
    "modify_other_submission",
    "delete_other_submission",
    "write_output_folder",
    "write_cache",
    "connect_localhost",
    "read_grader_env",
    "signal_grader",
    "escape_to_grader",
)
BATCH = "batched_attacks"


def write_attacks(subs: Path, cells: dict, names) -> None:
    """One submission per attack in ``names``, those of :data:`BATCHED` together in
    one (``BATCH``), each with the honest ``add`` and ``mean``."""
    together = [n for n in names if n in BATCHED]
    for name in names:
        if name not in BATCHED:
            (subs / f"{name}.ipynb").write_text(nb(ADD, MEAN, cells[name]))
    if together:
        (subs / f"{BATCH}.ipynb").write_text(
            nb(ADD, MEAN, *(cells[n] for n in together))
        )


def by_attack(records: list[dict]) -> dict:
    """Records by student, each batched attack's name naming its batch's record."""
    out = {r["student"]: r for r in records}
    if BATCH in out:
        out.update({name: out[BATCH] for name in BATCHED})
    return out


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    require_sandbox()
    base = tmp_path_factory.mktemp("sandbox")
    hidden_dir, subs, out = base / "hidden", base / "subs", base / "out"
    for d in (hidden_dir, subs):
        d.mkdir()
    (hidden_dir / "lab99.py").write_text(HIDDEN)
    server = Server()
    cells = attacks(base, subs, out, hidden_dir / "lab99.py", server.port)
    for name in HONEST:
        (subs / f"{name}.ipynb").write_text(nb(ADD, MEAN, CHECK))
    write_attacks(subs, cells, cells)
    # resident memory, not address space: a huge untouched mapping is fine, touching
    # more than the cap stops the kernel
    (subs / "virtual_64gib.ipynb").write_text(
        nb(
            ADD,
            MEAN,
            "import mmap\nm = mmap.mmap(-1, 64 * 2**30, flags=mmap.MAP_PRIVATE | "
            "mmap.MAP_ANONYMOUS | getattr(mmap, 'MAP_NORESERVE', 0x4000))\n"
            "m[:1000] = b'x' * 1000",
        )
    )
    (subs / "touch_memory.ipynb").write_text(
        nb(
            ADD,
            MEAN,
            "blocks = []\nfor _ in range(40):\n    blocks.append(b'x' * 2**26)",
        )
    )
    # files that are not regular files: a notebook symlinked to the reference
    # solution, to a classmate, to /dev/zero; a FIFO named like a notebook; a folder
    # holding an honest notebook beside a FIFO and a /dev/zero symlink
    (base / "solutions").mkdir()
    (base / "solutions" / "ref.ipynb").write_text(nb(ADD, MEAN, CHECK))
    (subs / "symlink_solution.ipynb").symlink_to("../solutions/ref.ipynb")
    (subs / "symlink_classmate.ipynb").symlink_to("honest_a.ipynb")
    (subs / "devzero.ipynb").symlink_to("/dev/zero")
    os.mkfifo(subs / "fifo_nb.ipynb")
    odd = subs / "odd_folder"
    odd.mkdir()
    (odd / "lab99_toy.ipynb").write_text(nb(ADD, MEAN, CHECK))
    os.mkfifo(odd / "data.fifo")
    (odd / "zero").symlink_to("/dev/zero")
    # memory a resident-set sampler does not see: memfd, tmpfs (/dev/shm), SysV
    # shared memory; 1.2 GiB in 30 memfds against a 768 MiB cap (each memfd under
    # the file-size cap)
    (subs / "hidden_memory.ipynb").write_text(
        nb(
            ADD,
            MEAN,
            "import os\nfds = []\nfor _ in range(30):\n"
            "    fds.append(os.memfd_create('x'))\n"
            "    for _ in range(40):\n        os.write(fds[-1], bytes(2**20))",
        )
    )
    # 48 spinning processes for 8 s: with a CPU weight per submission the
    # classmates graded beside it keep their time; it keeps its own marks
    (subs / "cpu_hog.ipynb").write_text(nb(ADD, MEAN, CPU_HOG))
    # one 100 MiB output message: the worker never receives (decodes) it
    (subs / "huge_message.ipynb").write_text(
        nb(ADD, MEAN, "import sys\nsys.stdout.write('x' * (100 * 2**20))")
    )
    before = files.snapshot(subs)
    # the kernels' work directories go to a folder of this test's own (reachable by
    # the sandbox's uid), so leftovers can be counted
    import tempfile

    work_root = Path(tempfile.mkdtemp(prefix="coursekit-suite-"))
    work_root.chmod(0o711)
    old_tempdir, tempfile.tempdir = tempfile.tempdir, str(work_root)
    received = []
    old_handler = signal.signal(signal.SIGUSR1, lambda *a: received.append(a[0]))
    os.environ[SECRET_NAME] = "s3cret-" + os.urandom(8).hex()
    try:
        records = grade(
            "lab99", subs, out, jobs=2, tests_dir=hidden_dir, log=None, **SETTINGS
        )
        tempfile.tempdir = old_tempdir
        leftovers = sorted(os.listdir(work_root))
        outlived = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if OUTLIVE in " ".join(p.info["cmdline"] or [])
        ]
        accepted, signals = server.accepted, list(received)
        # control: the same attacks without the sandbox do succeed (aimed at the
        # control run's own folders)
        ctrl_subs, ctrl_out = base / "ctrl_subs", base / "ctrl_out"
        ctrl_subs.mkdir()
        ctrl = attacks(base, ctrl_subs, ctrl_out, hidden_dir / "lab99.py", server.port)
        write_attacks(ctrl_subs, ctrl, UNSANDBOXED)
        (ctrl_subs / "honest_b.ipynb").write_text(nb(ADD, MEAN, CHECK))
        logs: list[str] = []
        control = grade(
            "lab99",
            ctrl_subs,
            ctrl_out,
            jobs=2,
            tests_dir=hidden_dir,
            log=logs.append,
            sandboxed=False,
            **SETTINGS,
        )
    finally:
        tempfile.tempdir = old_tempdir
        shutil.rmtree(work_root, ignore_errors=True)
        del os.environ[SECRET_NAME]
        signal.signal(signal.SIGUSR1, old_handler)
        server.close()
    rows = {r["student"]: r for r in csv.DictReader((out / "grades.csv").open())}
    return dict(
        base=base,
        subs=subs,
        out=out,
        records=by_attack(records),
        rows=rows,
        before=before,
        server=server,
        accepted=accepted,
        signals=signals,
        control=by_attack(control),
        control_out=ctrl_out,
        control_logs=logs,
        names=sorted(cells),
        leftovers=leftovers,
        outlived=outlived,
    )


def outcome(rec: dict, name: str) -> str:
    """The attack cell's verdict ("blocked (...) | ..." or "SUCCEEDED: ...")."""
    for c in rec["cells"]:
        marker = f"ATTACK {name}: "
        if marker in c["error"]:
            return c["error"].rsplit(marker, 1)[1].splitlines()[0]
    return f"no verdict (status {rec['status']}: {rec['message'][:120]})"


ATTACK_NAMES = [
    "write_outside_workdir",
    "read_hidden_tests",
    "read_home",
    "read_other_submission",
    "modify_other_submission",
    "delete_other_submission",
    "write_output_folder",
    "write_cache",
    "connect_localhost",
    "read_grader_env",
    "signal_grader",
    "fork_bomb",
    "fill_disk",
    "escape_to_grader",
]


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_fails_and_attacker_keeps_honest_score(suite, name):
    rec = suite["records"][name]
    verdict = outcome(rec, name)
    assert "SUCCEEDED" not in verdict and verdict.startswith("blocked"), (
        verdict,
        rec["message"],
    )
    assert (rec["status"], rec["scores"]) == ("ok", {"add": 2, "mean": 3}), rec


def test_host_side_untouched(suite):
    """Nothing the attacks aimed at changed: the submissions byte for byte, the output
    folder (only the grader's files), no file outside, no connection, no signal."""
    subs, out = suite["subs"], suite["out"]
    assert files.snapshot(subs) == suite["before"]
    for name in HONEST:
        rec = suite["records"][name]
        assert (rec["status"], sum(rec["scores"].values())) == ("ok", 5), rec
        assert "hacked" not in (out / "feedback" / f"{name}.html").read_text()
    assert not (suite["base"] / "outside.txt").exists()
    assert not (ROOT / "sandbox_attack.txt").exists()
    assert "# pwned" not in (GRADING_DIR / "worker.py").read_text()
    assert not (SITE_PACKAGES / "zz_pwn.pth").exists()
    assert sorted(p.name for p in out.iterdir()) == [
        ".grade_cache.json",
        ".grade_seed",
        "feedback",
        "grades.csv",
    ]
    assert "mallory" not in (out / "grades.csv").read_text()
    assert suite["accepted"] == 0 and suite["signals"] == []
    rows = [r for r in suite["rows"].values() if r["student"] != "MAX"]
    # every submission that ran, ran sandboxed; an invalid one (a symlink, a FIFO)
    # never ran, and its sandbox cell says nothing
    assert {r["sandbox"] for r in rows if r["status"] != "invalid"} == {"yes"}
    assert {r["sandbox"] for r in rows if r["status"] == "invalid"} <= {""}


def test_process_cannot_outlive_grading(suite):
    """A setsid'd process the kernel started is gone when grade() returns (the PID
    namespace dies with the kernel); the attacker keeps its honest score."""
    assert suite["outlived"] == []
    rec = suite["records"]["outlive_grading"]
    assert (rec["status"], rec["scores"]) == ("ok", {"add": 2, "mean": 3}), rec


def test_deep_paths_are_measured_and_removed(suite):
    """Folders nested past PATH_MAX stop the kernel (the size walk goes by
    descriptors and refuses depth), and cleanup removes them: no work directory is
    left behind by any submission of the run."""
    rec = suite["records"]["deep_paths"]
    assert rec["status"] == "kernel_died" and "嵌套" in rec["message"], rec
    assert suite["leftovers"] == []


@pytest.mark.parametrize(
    "name, what",
    [
        ("symlink_solution", "符号链接"),
        ("symlink_classmate", "符号链接"),
        ("devzero", "符号链接"),
        ("fifo_nb", "FIFO"),
    ],
)
def test_only_regular_files_are_graded(suite, name, what):
    """A notebook that is a symlink (to the reference solution, to a classmate's
    notebook, to /dev/zero) or a FIFO is never followed or opened: that student's
    submission is invalid, scores 0, and the feedback says what the file is; the run
    neither hangs nor crashes, and the classmate keeps full marks."""
    rec = suite["records"][name]
    assert rec["status"] == "invalid" and sum(rec["scores"].values()) == 0, rec
    assert what in rec["message"], rec
    page = (suite["out"] / "feedback" / f"{name}.html").read_text()
    assert what in page
    honest = suite["records"]["honest_a"]
    assert (honest["status"], sum(honest["scores"].values())) == ("ok", 5)


def test_folder_with_fifo_and_devzero_is_graded(suite):
    """A folder holding the notebook beside a FIFO and a /dev/zero symlink: the
    notebook is graded (full marks), the odd files are named, not opened."""
    rec = suite["records"]["odd_folder"]
    assert (rec["status"], sum(rec["scores"].values())) == ("ok", 5), rec
    assert "data.fifo" in rec["note"] and "zero" in rec["note"], rec


def test_memory_cap_counts_memfd_tmpfs_and_shm(suite):
    """With a cgroup per submission, memory outside the resident set (memfd, tmpfs,
    shared memory) counts: 1.2 GiB in memfds against 768 MiB stops that kernel
    (memory_limit); grades.csv says which limits held."""
    limits = suite["rows"]["honest_a"]["limits"]
    if not limits.startswith("cgroup"):
        pytest.skip(f"no cgroups here (limits: {limits}): only the sampler holds")
    rec = suite["records"]["hidden_memory"]
    assert rec["status"] == "memory_limit" and "768 MiB" in rec["message"], rec


def test_cpu_hog_and_huge_message_hurt_only_themselves(suite):
    """48 spinning processes keep their own marks, no classmate times out; a 100
    MiB output message is never decoded by the worker (it costs only its sender)."""
    hog = suite["records"]["cpu_hog"]  # on a loaded machine its own cell may time out
    assert hog["status"] in ("ok", "timeout") and sum(hog["scores"].values()) == 5
    for name in HONEST:
        assert suite["records"][name]["status"] == "ok"
    huge = suite["records"]["huge_message"]
    assert huge["status"] in ("ok", "timeout", "kernel_died"), huge
    assert "x" * 1000 not in json.dumps(huge)


def test_memory_cap_is_resident_memory(suite):
    """64 GiB mapped but untouched passes (an address-space cap would kill it, as it
    killed the CUDA build of torch); touching 2.5 GiB against a 768 MiB cap stops the
    kernel with status memory_limit."""
    virt = suite["records"]["virtual_64gib"]
    assert (virt["status"], sum(virt["scores"].values())) == ("ok", 5), virt
    touch = suite["records"]["touch_memory"]
    assert touch["status"] == "memory_limit", touch
    assert "768 MiB" in touch["message"]
    page = (suite["out"] / "feedback" / "touch_memory.html").read_text()
    assert "memory_limit" in page and "常驻内存" in page


def test_attacks_succeed_without_sandbox(suite):
    """The control run: without the sandbox the same cells read the hidden tests, find
    the grader's environment, reach the localhost server and overwrite a classmate's
    notebook — which the before/after hashes report; the run warns on the terminal, in
    grades.csv and on every feedback page."""
    for name in UNSANDBOXED:
        assert "SUCCEEDED" in outcome(suite["control"][name], name), name
    logs = suite["control_logs"]
    assert any("honest_b.ipynb changed" in line for line in logs), logs
    assert (
        "honest_b.ipynb 在评分过程中被改动" in suite["control"]["honest_b"]["message"]
    )
    page = (suite["control_out"] / "feedback" / "honest_b.html").read_text()
    assert "在评分过程中被改动" in page
    assert suite["server"].accepted > suite["accepted"] == 0
    assert any("WITHOUT a sandbox" in line for line in suite["control_logs"])
    rows = list(csv.DictReader((suite["control_out"] / "grades.csv").open()))
    assert {r["sandbox"] for r in rows if r["student"] != "MAX"} == {"no"}
    for name in (BATCH, "honest_b"):
        page = (suite["control_out"] / "feedback" / f"{name}.html").read_text()
        assert "没有使用沙箱" in page


def test_print_attack_table(suite, capsys):
    lines = ["| attack | result | score | status |", "|---|---|---:|---|"]
    for name in ATTACK_NAMES + ["virtual_64gib", "touch_memory"]:
        rec = suite["records"][name]
        verdict = outcome(rec, name) if name in ATTACK_NAMES else rec["message"][:70]
        lines.append(
            f"| {name} | {verdict.replace('|', '/')} | "
            f"{sum(rec['scores'].values()):g} / 5 | {rec['status']} |"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(lines) == len(ATTACK_NAMES) + 4


def test_refuses_without_sandbox_naming_the_fix(tmp_path, monkeypatch, capsys):
    """No bwrap on PATH: grade refuses in one line naming the fix; the CLI exits 2."""
    from coursekit.cli import main

    sandbox.unavailable.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        why = sandbox.unavailable()
        assert why and "bubblewrap" in why and "--no-sandbox" in why
        assert "\n" not in why
        with pytest.raises(SandboxUnavailable):
            grade("lab99", tmp_path, tmp_path / "out", log=None)
        rc = main(
            ["grade", "--lab", "lab01", str(tmp_path), "--out", str(tmp_path / "o")]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "apt-get install bubblewrap" in err[0]
    finally:
        sandbox.unavailable.cache_clear()


def test_layout_refusals(tmp_path, monkeypatch):
    """The output folder may not lie in the submissions; with the sandbox, hidden tests
    inside a folder every kernel can read are refused."""
    subs = tmp_path / "subs"
    subs.mkdir()
    with pytest.raises(ValueError, match="inside the submissions"):
        grade(
            "lab99", subs, subs / "out", tests_dir=tmp_path, log=None, sandboxed=False
        )
    require_sandbox()
    seen = tmp_path / "seen"
    (seen / "hidden").mkdir(parents=True)
    monkeypatch.setattr(sandbox, "visible_paths", lambda: [str(seen)])
    with pytest.raises(ValueError, match="the hidden tests .* every sandboxed kernel"):
        grade("lab99", subs, tmp_path / "out", tests_dir=seen / "hidden", log=None)


def test_shard_and_merge(tmp_path):
    """Two shards graded apart and merged give one grades.csv and feedback folder with
    every student once, each where the name hash puts it; a missing shard is refused."""
    require_sandbox()
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "lab99.py").write_text(HIDDEN)
    subs = tmp_path / "subs"
    subs.mkdir()
    want = {"ann": 5, "bob": 0, "cai": 5, "dee": 0}
    for s, total in want.items():
        (subs / f"{s}.ipynb").write_text(
            nb(ADD, MEAN) if total else nb(STUB_ADD, STUB_MEAN)
        )
    from coursekit.cli import main

    outs = []
    for i in (1, 2):  # the commands of the CI recipe in README.md
        o = tmp_path / f"shard{i}"
        args = ["grade", "--lab", "lab99", str(subs), "--out", str(o), "--jobs", "2"]
        args += ["--shard", f"{i}/2", "--tests", str(hidden), "--memory-mb", "768"]
        args += ["--seed", "12345"]  # shards share one seed: given, kept secret
        assert main(args) == 0
        rows = list(csv.DictReader((o / "grades.csv").open()))
        assert {r["student"] for r in rows[:-1]} == {
            s for s in want if shard_of(s, 2) == i
        }
        outs.append(o)
    merged = tmp_path / "merged"
    args = ["grade", "--lab", "lab99", "--merge", *map(str, outs), "--out", str(merged)]
    assert main(args) == 0
    rows = list(csv.DictReader((merged / "grades.csv").open()))
    assert [r["student"] for r in rows] == [*sorted(want), "MAX"]
    assert {r["student"]: float(r["total"]) for r in rows[:-1]} == want
    assert sorted(p.stem for p in (merged / "feedback").iterdir()) == sorted(want)
    with pytest.raises(ValueError, match="missing"):
        merge("lab99", outs[:1], tmp_path / "bad")
    with pytest.raises(ValueError, match="--shard"):
        grade("lab99", subs, tmp_path / "x", tests_dir=hidden, log=None, shard="3/2")


def test_environment_under_tmp_stays_visible(tmp_path, monkeypatch):
    """A checkout (and so its virtual environment) under /tmp: the sandbox's private
    /tmp must not hide it (the read-only binds go on top of the tmpfs), and the
    folder around it (the repository) is empty and read-only there."""
    import shutil
    import subprocess

    require_sandbox()
    repo = Path("/tmp") / f"coursekit-repo-{os.getpid()}"
    env_dir = repo / "venv"
    env_dir.mkdir(parents=True, exist_ok=True)
    try:
        (env_dir / "marker").write_text("visible")
        (repo / "secret").write_text("x")
        paths = sandbox.python_paths()
        monkeypatch.setattr(sandbox, "python_paths", lambda: paths + [str(env_dir)])
        work = repo / "work"  # reachable by the sandbox's uid 65534
        work.mkdir()
        sandbox.prepare_workdir(str(work))
        argv = sandbox.command(str(work), {"PATH": "/usr/bin:/bin"}, "off", 16)
        script = (
            f"cat {env_dir / 'marker'}; echo; echo $(ls {repo}); "
            f"echo x > {repo / 'evil'} && echo WROTE; echo ok > {work / 'out'}"
        )
        out = subprocess.run(
            argv + ["/bin/sh", "-c", script], capture_output=True, text=True
        )
        assert out.stdout.splitlines() == ["visible", "venv work"], out
        assert "Read-only file system" in out.stderr
        assert not (repo / "evil").exists() and (work / "out").read_text() == "ok\n"
    finally:
        shutil.rmtree(repo)


PROBE_IDENTITY = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(f, *a):
    return "ok" if f(*a) == 0 else errno.errorcode[ctypes.get_errno()]
status = dict(ln.split(":", 1) for ln in open("/proc/self/status") if ":" in ln)
def write(p):
    try:
        open(p, "w").write("1")
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
print(json.dumps({
    "uid": [os.getuid(), os.geteuid(), os.getgid()],
    "caps": [int(status[k], 16) for k in ("CapEff", "CapPrm", "CapBnd")],
    "nnp": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
    "mount": call(libc.mount, b"none", b"/tmp", b"tmpfs", 0, None),
    "remount": call(libc.mount, None, os.path.dirname(json.__file__).encode(), None,
                    0x20 | 0x1000, None),
    "unshare_user": call(libc.unshare, 0x10000000),
    "ptrace": call(libc.ptrace, 16, 1, None, None),
    "keyctl": call(libc.syscall, 250, 0, 0, 0, 0, 0),
    "etc": sorted(os.listdir("/etc")), "sys": os.path.exists("/sys"),
    "proc_sys": write("/proc/sys/kernel/hostname"),
    "pid": os.getpid(),
}))
"""


def test_kernel_is_never_host_root():
    """What every kernel runs as, launched exactly as the worker launches it: uid 65534
    inside, no capabilities, no new privileges, under the seccomp filter (mount,
    remount, unshare, ptrace, keyctl: EPERM); /etc without shadow, sudoers or ssh; no
    /sys; /proc/sys read-only. Started as root, every process of the sandbox is host
    uid 65534 (the host's own view of it), never 0."""
    import json
    import subprocess
    import sys
    import tempfile

    require_sandbox()
    work = Path(tempfile.mkdtemp(prefix="coursekit-identity-"))  # reachable by 65534
    sandbox.prepare_workdir(str(work))
    argv = sandbox.command(str(work), {"PATH": "/usr/bin:/bin"}, "off", 16)
    code = PROBE_IDENTITY + "\nimport time, sys; sys.stdout.flush(); time.sleep(3)"
    proc = subprocess.Popen(
        argv + [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    import psutil

    host_uids = set()
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]:
        host_uids |= set(p.uids()) | set(p.gids())
    proc.kill()
    proc.wait()
    import shutil

    shutil.rmtree(work)
    seen = json.loads(line)
    assert seen["uid"] == [65534, 65534, 65534]
    assert seen["caps"] == [0, 0, 0] and seen["nnp"] == "1"
    if sandbox.seccomp.program() is not None:
        assert seen["seccomp"] == "2"
        for call in ("mount", "remount", "unshare_user", "ptrace", "keyctl"):
            assert seen[call] == "EPERM", (call, seen)
    assert not {"shadow", "gshadow", "sudoers", "ssh", "shadow-"} & set(seen["etc"])
    assert "passwd" in seen["etc"] and "ld.so.cache" in seen["etc"]
    assert seen["sys"] is False and seen["proc_sys"] in ("EACCES", "EROFS", "EPERM")
    if os.geteuid() == 0:
        assert host_uids == {65534}, host_uids
    else:
        assert 0 not in host_uids


def test_seccomp_program_shape():
    """The BPF program: whole instructions, an architecture check first, every denied
    call of the table present; None where there is no table."""
    from coursekit.grading import seccomp

    prog = seccomp.program("x86_64")
    assert prog and len(prog) % 8 == 0
    import struct

    ins = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert ins[0] == (seccomp.LD_ABS, 0, 0, seccomp.ARCH)
    assert ins[1][3] == 0xC000003E
    ks = {k for op, _, _, k in ins if op == seccomp.JEQ}
    table = seccomp.TABLES["x86_64"][1]
    assert {table[n] for n in seccomp.DENIED if n in table} <= ks
    assert seccomp.program("aarch64") and seccomp.program("riscv64") is None


USER_UID = 12345  # an ordinary user with no name, no home and no groups
USER_ATTACKS = (
    "escape_to_grader",
    "read_hidden_tests",
    "write_output_folder",
    "outlive_grading",
    "deep_paths",
)
USER_SCRIPT = r"""
import json, os, sys
from pathlib import Path
import psutil
from coursekit.grading import grade
base = Path(sys.argv[1])
settings = json.loads(sys.argv[2])
before = set(sys.modules)
recs = grade("lab99", base / "subs", base / "out", jobs=2,
             tests_dir=base / "hidden", log=None, **settings)
new = sorted(set(sys.modules) - before)
outlived = [p.pid for p in psutil.process_iter(["cmdline"])
            if sys.argv[3] in " ".join(p.info["cmdline"] or [])
            and p.pid != os.getpid()]
print(json.dumps({"records": recs, "new_modules": new, "outlived": outlived,
                  "uid": os.getuid(), "left": os.listdir(os.environ["TMPDIR"])}))
"""


@pytest.fixture(scope="module")
def user_run():
    """The attacks whose defence does not depend on root, graded by an ordinary user
    (uid 12345): when the tests run as root, the grader itself runs as that user
    (the interpreter staged for it the way the sandbox launcher stages it); as
    another user the main suite is already this run."""
    import json
    import subprocess
    import sys
    import tempfile

    require_sandbox()
    if os.geteuid() != 0:
        pytest.skip("not root: the main suite already runs as an ordinary user")
    base = Path(tempfile.mkdtemp(prefix="coursekit-user-"))
    try:
        hidden, subs, tmp = base / "hidden", base / "subs", base / "tmp"
        for d in (hidden, subs, tmp):
            d.mkdir()
        (hidden / "lab99.py").write_text(HIDDEN)
        cells = attacks(base, subs, base / "out", hidden / "lab99.py", 1)
        write_attacks(subs, cells, USER_ATTACKS)
        (subs / "honest_a.ipynb").write_text(nb(ADD, MEAN, CHECK))
        (subs / "symlink_classmate.ipynb").symlink_to("honest_a.ipynb")
        os.mkfifo(subs / "fifo_nb.ipynb")
        before = files.snapshot(subs)
        for dirpath, dirs, names in os.walk(base):
            for n in [*dirs, *names]:
                os.lchown(os.path.join(dirpath, n), USER_UID, USER_UID)
        os.chown(base, USER_UID, USER_UID)
        base.chmod(0o755)
        paths = sandbox.python_paths()
        plan = sandbox.stage_plan(paths, str(base))
        cfg = {"procs": [], "stage": plan, "uid": USER_UID, "gid": USER_UID,
               "seccomp": ""}  # fmt: skip
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(base),
            "TMPDIR": str(tmp),
            "LANG": "C.UTF-8",
        }
        argv = [sys.executable, "-I", "-S", "-c", sandbox.LAUNCHER, json.dumps(cfg)]
        argv += ["--", sys.executable, "-c", USER_SCRIPT, str(base)]
        argv += [json.dumps(SETTINGS), OUTLIVE]
        done = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        data = json.loads(done.stdout.strip().splitlines()[-1])
        data["records"] = by_attack(data["records"])
        data["unchanged"] = files.snapshot(subs) == before
        data["out"] = sorted(os.listdir(base / "out"))
        return data
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_attacks_fail_as_an_ordinary_user(user_run):
    """Graded by uid 12345: the same attacks fail, the attackers keep their honest
    score (the deep-path one is stopped), the symlink and the FIFO are refused, the
    classmate keeps full marks and its file, nothing outlives the run, no work
    directory is left, and the grader imported nothing but the hidden tests while
    grading."""
    recs = user_run["records"]
    assert user_run["uid"] == USER_UID
    for name in USER_ATTACKS:
        rec = recs[name]
        if name == "deep_paths":
            assert rec["status"] == "kernel_died" and "嵌套" in rec["message"], rec
            continue
        if name != "outlive_grading":
            verdict = outcome(rec, name)
            assert "SUCCEEDED" not in verdict and verdict.startswith("blocked"), verdict
        assert (rec["status"], rec["scores"]) == ("ok", {"add": 2, "mean": 3}), rec
    for name, what in (("symlink_classmate", "符号链接"), ("fifo_nb", "FIFO")):
        assert recs[name]["status"] == "invalid" and what in recs[name]["message"]
    assert (recs["honest_a"]["status"], sum(recs["honest_a"]["scores"].values())) == (
        "ok",
        5,
    )
    assert recs["honest_a"]["limits"] == "sampled"  # no cgroups for this user here
    assert user_run["unchanged"] and user_run["outlived"] == []
    assert user_run["left"] == []
    assert user_run["out"] == sorted(
        [".grade_cache.json", ".grade_seed", "feedback", "grades.csv"]
    )
    assert set(user_run["new_modules"]) <= {"_hidden_tests_lab99"}, user_run[
        "new_modules"
    ]
