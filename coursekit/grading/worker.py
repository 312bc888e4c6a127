"""Grade ONE submission in this process: run its code cells, then the hidden-test
probes, in a kernel.

Started by :mod:`coursekit.grading.runner` as ``python -m coursekit.grading.worker`` in
its own session (process group). It reads a JSON spec on stdin and writes one JSON
result on the stdout it was given; before starting the kernel it caps file sizes (the
kernel inherits the cap), points fds 1 and 2 at /dev/null (so the kernel cannot write to
the grader's pipe through them), starts the kernel inside the sandbox
(:mod:`coursekit.grading.sandbox`) with only the environment the spec gives, watches the
kernel's resident memory, number of processes and work-directory size (a watchdog
thread), and at the end kills the kernel's process tree. It never scores anything: probe
results are plain data that the parent checks against the reference in its own process.

Spec keys: notebook (path), workdir, cell_timeout, notebook_timeout (s), memory_mb
(resident memory of the kernel's process tree), max_output (bytes kept per student
cell), env (dict: the kernel's environment on top of the minimal one), sandbox (bool),
disk_mb (largest file, size of the private /tmp; the work dir may hold twice that),
gpu, labels (a name per code cell, for messages), probes: [{name, source, per_case,
inputs_json, timeout}]. Result keys: status (ok|timeout|kernel_died|memory_limit|
grader_error), message, cells: [{index, error, timeout}] (index: 1-based among code
cells), probes: {name: {ok, value | error, timeout}}, seconds, peak_rss_mb.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import signal
import sys
import threading
import time

from .cgroup import Cgroup
from .files import dir_bytes

# The probe cell: runs the hidden test's source in a copy of the student's namespace and
# prints its result as JSON between two nonces. A per-case probe defines CASE(x); every
# input is tried on its own, so one exception or one non-JSON value fails that case
# only.
PROBE_TEMPLATE = """\
def _grader_probe_{fid}():
    import json as _j, sys as _s, traceback as _tb
    _ns = dict(globals())
    _ns["INPUTS"] = _j.loads({inputs!r})
    try:
        exec(compile({source!r}, "<hidden test {name}>", "exec"), _ns)
        if {per_case!r}:
            _res = []
            for _x in _ns["INPUTS"]:
                try:
                    _v = _ns["CASE"](_x)
                except Exception as _e:
                    _res.append({{"e": (type(_e).__name__ + ": " + str(_e))[:300]}})
                    continue
                try:
                    _j.dumps(_v)
                    _res.append({{"v": _v}})
                except Exception:
                    _res.append({{"t": (type(_v).__name__ + ": " + repr(_v))[:200]}})
            _ns["RESULT"] = _res
        if "RESULT" not in _ns:
            raise RuntimeError("hidden test did not set RESULT")
        _out = {{"ok": True, "value": _ns["RESULT"]}}
        _text = _j.dumps(_out)
    except Exception as _e:
        _msg = "".join(
            _tb.format_exception(type(_e), _e, _e.__traceback__.tb_next, limit=-4)
        )
        _text = _j.dumps({{"ok": False, "error": _msg[-3000:]}})
    _s.stdout.write("\\n{nonce}" + _text + "{nonce}\\n")
    _s.stdout.flush()
_grader_probe_{fid}()
"""

PROBE_OUTPUT_CAP = 20_000_000  # characters kept from a probe cell (its result is JSON)
MAX_MESSAGE = 64 * 2**20  # bytes: the largest message frame the worker accepts
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
STATUS_ORDER = ["ok", "timeout", "kernel_died", "memory_limit"]
DISK_MB = 512  # default of spec["disk_mb"]: the largest file the kernel may write
# (RLIMIT_FSIZE) and the size of its private /tmp; its work directory may hold twice
# that in all (the watchdog)
MAX_PROCS = 256  # processes in the kernel's tree; the extra ones are killed
BUSY_SHARE = 0.25  # a timed-out cell that waited for a CPU this share of its limit
# or more was starved by the machine: its result is not cached
WATCH_EVERY = 0.1  # seconds between two looks of the watchdog
IOPUB_TIMEOUT = 20  # s for a cell's last output after its reply (a loaded machine)
IOPUB_AFTER_TIMEOUT = 3  # s for it after the cell hit its time limit (interrupted)


def kill_tree(pid: int | None) -> None:
    """SIGKILL a process, its process group and every descendant still alive."""
    if not pid:
        return
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        procs = []
    try:
        pgid = os.getpgid(pid)
        if pgid != os.getpgrp():  # never our own group
            os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_gone(procs, 3.0)


def _wait_gone(procs, timeout: float) -> None:
    """Until every process of ``procs`` is gone or a zombie (dead; its parent reaps it:
    inside a PID namespace that can take a while, and no one needs to wait for it),
    reaping those that are our own children."""
    import psutil

    end = time.monotonic() + timeout
    while True:
        left = []
        for p in procs:
            try:
                os.waitpid(p.pid, os.WNOHANG)
            except (ChildProcessError, OSError):
                pass
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                pass
        if not left or time.monotonic() > end:
            return
        procs = left
        time.sleep(0.02)


def _limits(disk_mb: int) -> None:
    """File size and core dumps; memory is the watchdog's job: an address-space cap
    (RLIMIT_AS) would kill CUDA builds of torch, which reserve far more virtual memory
    than they ever touch."""
    fsize = int(disk_mb) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads'), from /proc; psutil elsewhere."""
    try:
        kids: list[int] = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        return kids
    except FileNotFoundError:
        if os.path.exists(f"/proc/{pid}"):  # no children files: ask psutil
            import psutil

            try:
                return [p.pid for p in psutil.Process(pid).children()]
            except psutil.Error:
                return []
        return []
    except (OSError, ValueError):
        return []


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        import psutil

        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size: resident memory with pages shared between processes
    (forked children, libraries) divided among them; falls back to RSS."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return rss_bytes(pid)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class Watchdog(threading.Thread):
    """Every WATCH_EVERY seconds: the resident memory (sum of RSS) of the kernel's
    process tree, the number of processes in it, and (every second) the size of its
    work directory. Over the memory or disk cap the whole tree is killed (the kernel
    dies with a clear status); over the process cap the kernel's own children are
    killed and the kernel lives on."""

    def __init__(self, session: "Session", pid: int):
        super().__init__(daemon=True)
        self.session, self.pid = session, pid
        self.cap = int(session.spec["memory_mb"]) * 2**20
        self.stop = threading.Event()
        self.peak = 0
        self.kernel: int | None = None
        self._pss: tuple[int, int] | None = None  # (RSS, PSS) when PSS was last read

    def resident(self, tree: list[int]) -> int:
        """Resident memory of ``tree``. RSS is cheap but counts a page shared by
        several processes (forked children, libraries) once per process; over the cap
        the proportional count (PSS) decides. PSS is read again only when RSS has grown
        by more than the margin the last PSS left below the cap."""
        rss = sum(rss_bytes(p) for p in tree)
        if rss <= self.cap:
            self._pss = None
            return rss
        if self._pss is not None and rss - self._pss[0] + self._pss[1] <= self.cap:
            return rss - self._pss[0] + self._pss[1]
        pss = sum(pss_bytes(p) for p in tree)
        self._pss = (rss, pss)
        return pss

    def _kernel_pid(self) -> int | None:
        """The kernel: the shallowest process below the watched root that runs
        ``kernel_main`` and is not bwrap (whose argv ends the same way). Found by
        depth, never by pid order: pids wrap around (pid_max is 32768 on many
        machines), so a forked child can have a smaller pid than the kernel."""
        if self.kernel is None:
            level = [self.pid]
            while level and self.kernel is None:
                for p in level:
                    argv = _cmdline(p).split(b"\0")
                    if b"coursekit.grading.kernel_main" in argv and not argv[
                        0
                    ].endswith(b"bwrap"):
                        self.kernel = p
                        break
                level = [c for p in level for c in _children(p)]
        return self.kernel

    def run(self) -> None:
        try:
            self._watch()
        except Exception as e:  # a broken watchdog must not pass silently
            self.session.note(
                "kernel_died", f"评分器的监视线程出错（{type(e).__name__}: {e}）"
            )
            kill_tree(self.pid)

    def _watch(self) -> None:
        work, n = self.session.spec["workdir"], 0
        disk = 2 * int(self.session.spec.get("disk_mb", DISK_MB)) * 2**20
        while not self.stop.wait(WATCH_EVERY):
            n += 1
            tree = process_tree(self.pid)
            kernel = self._kernel_pid()  # known from its start, before any cell runs
            if len(tree) > MAX_PROCS:
                extra = (
                    [p for p in process_tree(kernel) if p != kernel] if kernel else []
                )
                self.session.note(
                    "ok", f"进程数超过上限 {MAX_PROCS}，kernel 的子进程已被终止"
                )
                for p in extra:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
                tree = process_tree(self.pid)
            if self.session.cg is not None:  # the cgroup counts and caps memory
                rss = 0
            else:
                rss = self.resident(tree)
                self.peak = max(self.peak, rss)
            if rss > self.cap:
                self.session.note(
                    "memory_limit",
                    f"kernel 的常驻内存超过上限 {self.cap // 2**20} MiB（约 "
                    f"{rss // 2**20} MiB），已被终止",
                )
                kill_tree(self.pid)
                return
            if n % 10 == 0:
                used, problem = dir_bytes(work, disk)
                if used > disk or problem:
                    self.session.note(
                        "kernel_died",
                        f"工作目录里的文件超过 {disk // 2**20} MiB，kernel 已被终止"
                        if used > disk
                        else f"{problem}，kernel 已被终止",
                    )
                    kill_tree(self.pid)
                    return


def _error_text(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            tb = "\n".join(out.get("traceback", [])[-6:])
            return (
                ANSI.sub("", tb)[-3000:] or f"{out.get('ename')}: {out.get('evalue')}"
            )
    return None


def _read_probe(cell, nonce: str, err: str | None) -> dict:
    """The probe's JSON record from its stdout (between the nonces), or why there is
    none."""
    text = "".join(
        o.get("text", "")
        for o in cell.outputs
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )
    found = re.findall(re.escape(nonce) + r"(.*?)" + re.escape(nonce), text, re.S)
    if not found:
        return {"ok": False, "timeout": False, "error": err or "隐藏测试没有打印结果"}
    try:
        data = json.loads(found[-1])
        ok = bool(data.get("ok")) if isinstance(data, dict) else False
        return {
            "ok": ok,
            "timeout": False,
            "value": data.get("value") if ok else None,
            "error": None if ok else str(data.get("error"))[-3000:],
        }
    except Exception as e:
        return {"ok": False, "timeout": False, "error": f"结果无法读取：{e}"}


class Session:
    """One kernel running one submission: student cells first, then one probe per
    question."""

    def __init__(self, spec: dict):
        import nbformat

        self.spec = spec
        self.t_start = time.monotonic()
        self.deadline = self.t_start + float(spec["notebook_timeout"])
        self.result = {
            "status": "ok",
            "message": "",
            "cells": [],
            "probes": {},
            "seconds": 0.0,
        }
        with open(spec["notebook"], encoding="utf-8") as f:
            sub = nbformat.read(f, as_version=4)
        code = [c for c in sub.cells if c.get("cell_type") == "code"]
        self.nb = nbformat.v4.new_notebook()
        self.nb.cells = [
            nbformat.v4.new_code_cell(str(c.get("source", ""))) for c in code
        ]
        self.n_student = len(self.nb.cells)
        self.watchdog: Watchdog | None = None
        self.cg = Cgroup.from_spec(spec.get("cgroup"))
        self.env: dict = {}
        self.client = self._client()
        self.kernel_pid: int | None = None

    def _client(self):
        from coursekit.nbclient import NotebookClient

        n_student, cap = self.n_student, int(self.spec.get("max_output", 200_000))

        class CappedClient(NotebookClient):
            """Keeps at most ``cap`` characters of output per student cell."""

            _sizes: dict = {}
            # after a time limit the kernel is interrupted: one that obeys goes idle at
            # once, one that does not is never going to; so the wait for its idle
            # message is short then (a fixed 20 s wait, twice per stuck kernel, made
            # one such submission cost 50 s)
            iopub_after_timeout = IOPUB_AFTER_TIMEOUT

            async def _async_handle_timeout(self, timeout, cell=None):
                self.iopub_timeout = self.iopub_after_timeout
                return await super()._async_handle_timeout(timeout, cell)

            def output(self, outs, msg, display_id, cell_index):
                content = msg.get("content", {})
                size = len(str(content.get("text", ""))) + sum(
                    len(str(v)) for v in content.get("data", {}).values()
                )
                used = self._sizes.get(cell_index, 0)
                limit = cap if cell_index < n_student else PROBE_OUTPUT_CAP
                self._sizes[cell_index] = used + size
                if msg["msg_type"] != "error" and used + size > limit:
                    return None
                return super().output(outs, msg, display_id, cell_index)

        timeout_error = {
            "ename": "CellTimeoutError",
            "evalue": "cell time limit exceeded",
            "traceback": ["CellTimeoutError: cell time limit exceeded"],
        }
        # output of a cell can trail its execute_reply on a loaded machine; waiting ends
        # at the kernel's idle message, so a generous iopub bound costs nothing normally
        return CappedClient(
            self.nb,
            km=self._kernel_manager(),
            timeout=int(self.spec["cell_timeout"]),
            kernel_name="python3",
            allow_errors=True,
            interrupt_on_timeout=True,
            error_on_timeout=timeout_error,
            iopub_timeout=IOPUB_TIMEOUT,
            shutdown_kernel="immediate",
            resources={"metadata": {"path": self.spec["workdir"]}},
        )

    def _kernel_manager(self):
        """A kernel manager that starts ``kernel_main`` (ipykernel) over ZMQ's ipc
        transport, the sockets and connection file in the work directory; sandboxed:
        inside bwrap."""
        from jupyter_client.manager import AsyncKernelManager

        from . import sandbox

        work, gpu = self.spec["workdir"], str(self.spec.get("gpu", "off"))
        sandboxed = bool(self.spec.get("sandbox"))
        tmp = "/tmp" if sandboxed else os.path.join(work, ".tmp")
        os.makedirs(tmp, exist_ok=True) if not sandboxed else None
        self.env = sandbox.kernel_env(self.spec.get("env", {}), work, gpu, tmp)
        launch = [sys.executable, "-m", "coursekit.grading.kernel_main"]
        owner = None
        if sandboxed:
            tmp_mb = int(self.spec.get("disk_mb", DISK_MB))
            sandbox.prepare_workdir(work)
            prefix = sandbox.command(
                work, self.env, gpu, tmp_mb, self.spec.get("cgroup_procs", [])
            )
            if sandbox.nproc_counted_per_namespace():
                launch += ["--nproc", str(sandbox.NPROC)]
            if sandbox.drops_root():
                owner = (sandbox.SANDBOX_UID, sandbox.SANDBOX_GID)
        else:
            prefix = []

        class Manager(AsyncKernelManager):
            def format_kernel_cmd(self, extra_arguments=None):
                cmd = [*launch, "-f", self.connection_file, *(extra_arguments or [])]
                return [*prefix, *cmd]

            def client(self, **kwargs):  # on the context capped below
                kwargs.setdefault("context", self.context)
                return super().client(**kwargs)

            def write_connection_file(self, **kwargs):
                super().write_connection_file(**kwargs)
                if owner:  # the kernel (uid 65534) reads it; mode stays 0600
                    os.chown(self.connection_file, *owner)

        km = Manager(
            kernel_name="python3",
            transport="ipc",
            ip=os.path.join(work, "kernel"),
            connection_file=os.path.join(work, "kernel.json"),
        )
        # no message from the kernel larger than this is ever received (decoded) by
        # the worker: ZMQ disconnects a peer that sends one
        import zmq

        km.context.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        # interrupts travel as a control message: the kernel signals itself inside
        # its namespace (a SIGINT to the sandbox's process group would reach bwrap)
        km.kernel_spec.interrupt_mode = "message"
        return km

    def note(self, status: str, message: str) -> None:
        if STATUS_ORDER.index(status) > STATUS_ORDER.index(self.result["status"]):
            self.result["status"] = status
        if message and message not in self.result["message"]:
            self.result["message"] = (self.result["message"] + " " + message).strip()

    def _execute(
        self, idx: int, limit: float, what: str
    ) -> tuple[str, str | None, bool]:
        """Run cell ``idx``; returns (outcome, error text, timed out); outcome is "ran"
        or "dead"."""
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        cell = self.nb.cells[idx]
        self.client.timeout = max(1, int(min(limit, self.deadline - time.monotonic())))
        self.client.iopub_timeout = IOPUB_TIMEOUT
        t0 = time.monotonic()
        wait0 = self.cg.cpu_wait_seconds() if self.cg else None
        try:
            self.client.execute_cell(cell, idx)
        except DeadKernelError:
            self.note("kernel_died", f"运行{what}时 kernel 死了")
            return "dead", None, False
        except CellTimeoutError:
            pass
        except (
            Exception
        ) as e:  # e.g. the submission broke the kernel's own json/zmq messages
            self.note(
                "kernel_died",
                "kernel 不再按 Jupyter 协议应答"
                f"（{type(e).__name__}: {str(e)[:200]}）；notebook 是否改动了 json 或 "
                f"builtins？",
            )
            return "dead", None, False
        err = _error_text(cell)
        timed_out = bool(err and "CellTimeoutError" in err) or (
            time.monotonic() - t0 >= self.client.timeout
        )
        if timed_out:
            self.note("timeout", "")
            wait1 = self.cg.cpu_wait_seconds() if self.cg else None
            if wait0 is not None and wait1 is not None:
                waited = wait1 - wait0
                if waited >= BUSY_SHARE * self.client.timeout:
                    self.result["machine_busy"] = True
                    self.note(
                        "timeout",
                        f"（超时的单元有 {waited:.0f} 秒在等 CPU：机器太忙，"
                        "这个结果不缓存，下次评分会重评）",
                    )
        return "ran", err, timed_out

    def kernel_stuck(self, idx: int) -> bool:
        """After a time limit: a trivial cell must answer quickly, else the kernel is
        killed."""
        import nbformat

        self.client.timeout = 5
        self.client.iopub_timeout = IOPUB_TIMEOUT
        self.client.iopub_after_timeout = 1  # no reply in 5 s: stuck, whatever follows
        t1 = time.monotonic()
        try:
            self.client.execute_cell(nbformat.v4.new_code_cell("pass"), idx)
            stuck = time.monotonic() - t1 >= 4.5
        except Exception:
            stuck = True
        finally:
            self.client.iopub_after_timeout = IOPUB_AFTER_TIMEOUT
        if stuck:
            self.note("timeout", "时间到后 kernel 不响应中断，已被终止")
            kill_tree(self.kernel_pid)
        return stuck

    def out_of_time(self) -> bool:
        if self.deadline - time.monotonic() > 1:
            return False
        self.note(
            "timeout",
            f"整份 notebook 超过时间上限（{self.spec['notebook_timeout']} 秒）",
        )
        return True

    def student_cell(self, idx: int) -> str:
        """Run one student cell; returns "ok", "stop" (kernel gone or stuck) or
        "skip"."""
        if self.out_of_time():
            return "skip"
        labels = self.spec.get("labels") or []
        what = labels[idx] if idx < len(labels) else f"第 {idx + 1} 个代码单元"
        outcome, err, timed_out = self._execute(
            idx, float(self.spec["cell_timeout"]), what
        )
        if outcome == "dead":
            return "stop"
        self.result["cells"].append(
            {"index": idx + 1, "error": err, "timeout": timed_out}
        )
        return "stop" if timed_out and self.kernel_stuck(idx) else "ok"

    def probe(self, k: int, nonce: str) -> str:
        """Run the k-th probe; records its result; returns "ok" or "stop"."""
        p, idx = self.spec["probes"][k], self.n_student + k
        name = p["name"]
        if self.out_of_time():
            self.result["probes"][name] = {
                "ok": False,
                "timeout": True,
                "error": "未运行：整份 notebook 超时",
            }
            return "ok"
        outcome, err, timed_out = self._execute(
            idx, float(p["timeout"]), f"隐藏测试 {name} "
        )
        if outcome == "dead":
            self.result["probes"][name] = {
                "ok": False,
                "timeout": False,
                "error": "kernel 死了",
            }
            return "stop"
        if timed_out:
            self.result["probes"][name] = {
                "ok": False,
                "timeout": True,
                "error": f"超过时间上限（{self.client.timeout} 秒）",
            }
            return "stop" if self.kernel_stuck(idx) else "ok"
        self.result["probes"][name] = _read_probe(self.nb.cells[idx], nonce, err)
        return "ok"

    def run(self) -> dict:
        import nbformat
        from nbclient.exceptions import DeadKernelError

        nonces = ["@@" + secrets.token_hex(16) + "@@" for _ in self.spec["probes"]]
        for p, nonce in zip(self.spec["probes"], nonces):
            src = PROBE_TEMPLATE.format(
                fid=secrets.token_hex(8),
                nonce=nonce,
                name=p["name"],
                inputs=p["inputs_json"],
                source=p["source"],
                per_case=bool(p.get("per_case")),
            )
            self.nb.cells.append(nbformat.v4.new_code_cell(src))
        try:
            with self.client.setup_kernel(env=self.env):
                self.kernel_pid = getattr(self.client.km.provisioner, "pid", None)
                if self.kernel_pid:
                    self.watchdog = Watchdog(self, self.kernel_pid)
                    self.watchdog.start()
                steps = [
                    lambda i=i: self.student_cell(i) for i in range(self.n_student)
                ]
                steps += [
                    lambda k=k: self.probe(k, nonces[k]) for k in range(len(nonces))
                ]
                for step in steps:
                    if step() == "stop":
                        break
        except DeadKernelError:
            self.note("kernel_died", "kernel 死了")
        except Exception as e:  # kernel start-up or shutdown broken by the submission
            self.note("kernel_died", f"kernel 出错：{type(e).__name__}: {str(e)[:200]}")
        finally:
            if self.watchdog is not None:
                self.watchdog.stop.set()
                self.result["peak_rss_mb"] = round(self.watchdog.peak / 2**20, 1)
            kill_tree(self.kernel_pid)
        if self.cg is not None:
            peak = self.cg.memory_peak()
            if peak is not None:
                self.result["peak_rss_mb"] = round(peak / 2**20, 1)
            if self.cg.oom_kills() > 0:
                self.note(
                    "memory_limit",
                    "kernel 的内存（常驻内存加 tmpfs、共享内存、memfd）超过上限 "
                    f"{int(self.spec['memory_mb'])} MiB，已被 cgroup 终止",
                )
        why = self.result["message"] or "kernel 死了"
        for p in self.spec["probes"]:
            self.result["probes"].setdefault(
                p["name"], {"ok": False, "timeout": False, "error": "未运行：" + why}
            )
        self.result["seconds"] = round(time.monotonic() - self.t_start, 2)
        return self.result


def run(spec: dict) -> dict:
    return Session(spec).run()


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the grader dies (Ctrl-C, kill), so no worker outlives the
    run."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def main() -> int:
    _die_with_parent()
    spec = json.loads(sys.stdin.read())
    out_fd = os.dup(1)  # private copy (not inherited: os.dup makes non-inheritable fds)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _limits(int(spec.get("disk_mb", DISK_MB)))
    try:
        result = run(spec)
    except BaseException as e:  # report instead of dying silently
        import traceback

        result = {
            "status": "grader_error",
            "message": "".join(traceback.format_exception(e))[-3000:],
            "cells": [],
            "probes": {},
            "seconds": 0.0,
        }
    data = (json.dumps(result, default=repr) + "\n").encode()
    with os.fdopen(out_fd, "wb") as f:
        f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
