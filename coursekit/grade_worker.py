"""Grade ONE submission in this process: run its code cells, then the hidden-test probes, in a kernel.

Started by :mod:`coursekit.grading` as ``python -m coursekit.grade_worker`` in its own session
(process group). It reads a JSON spec on stdin and writes one JSON result on the stdout it was given;
before starting the kernel it caps its own address space / file sizes (the kernel inherits the caps),
points fds 1 and 2 at /dev/null (so the kernel cannot write to the grader's pipe through them), and
at the end kills the kernel's process group. It never scores anything: probe results are plain data
that the parent checks against the reference in its own process.

Spec keys: notebook (path), workdir, cell_timeout, notebook_timeout (s), memory_mb, max_output
(bytes kept per student cell), env (dict), probes: [{name, source, inputs_json, timeout}].
Result keys: status (ok|timeout|kernel_died|grader_error), message, cells: [{index, error, timeout}],
probes: {name: {ok, value | error, timeout}}, seconds.
"""
from __future__ import annotations

import json
import os
import re
import resource
import secrets
import signal
import sys
import time

PROBE_TEMPLATE = '''\
def _grader_probe_{fid}():
    import json as _j, sys as _s, traceback as _tb
    _ns = dict(globals())
    _ns["INPUTS"] = _j.loads({inputs!r})
    try:
        exec(compile({source!r}, "<hidden test {name}>", "exec"), _ns)
        if "RESULT" not in _ns:
            raise RuntimeError("hidden test did not set RESULT")
        _out = {{"ok": True, "value": _ns["RESULT"]}}
        _text = _j.dumps(_out)
    except Exception as _e:
        _msg = "".join(_tb.format_exception(type(_e), _e, _e.__traceback__.tb_next, limit=-4))
        _text = _j.dumps({{"ok": False, "error": _msg[-3000:]}})
    _s.stdout.write("\\n{nonce}" + _text + "{nonce}\\n")
    _s.stdout.flush()
_grader_probe_{fid}()
'''

PROBE_OUTPUT_CAP = 20_000_000  # characters kept from a probe cell (its result is JSON)

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _kill_group(pgid: int | None) -> None:
    """SIGKILL the kernel's process group, if it has one and it still exists."""
    if pgid:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _limits(memory_mb: int) -> None:
    cap = int(memory_mb) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    fsize = 512 * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _error_text(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            tb = "\n".join(out.get("traceback", [])[-6:])
            return ANSI.sub("", tb)[-3000:] or f"{out.get('ename')}: {out.get('evalue')}"
    return None


def run(spec: dict) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    t_start = time.monotonic()
    deadline = t_start + float(spec["notebook_timeout"])
    max_output = int(spec.get("max_output", 200_000))

    class CappedClient(NotebookClient):
        """Keeps at most ``cap`` characters of output per cell (a 50 MB print costs nothing)."""

        cap = max_output
        _sizes: dict = {}

        def output(self, outs, msg, display_id, cell_index):
            content = msg.get("content", {})
            size = len(str(content.get("text", ""))) + sum(len(str(v)) for v in content.get("data", {}).values())
            used = self._sizes.get(cell_index, 0)
            # a hidden test's JSON result (fresh random shapes) can exceed the student-cell cap
            cap = self.cap if cell_index < n_student else PROBE_OUTPUT_CAP
            if msg["msg_type"] != "error" and used + size > cap:
                self._sizes[cell_index] = used + size
                return None
            self._sizes[cell_index] = used + size
            return super().output(outs, msg, display_id, cell_index)

    with open(spec["notebook"], encoding="utf-8") as f:
        sub = nbformat.read(f, as_version=4)
    code = [c for c in sub.cells if c.get("cell_type") == "code"]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(str(c.get("source", ""))) for c in code]
    n_student = len(nb.cells)
    nonces = {}
    for p in spec["probes"]:
        nonce = "@@" + secrets.token_hex(16) + "@@"
        nonces[p["name"]] = nonce
        src = PROBE_TEMPLATE.format(fid=secrets.token_hex(8), nonce=nonce, inputs=p["inputs_json"], source=p["source"], name=p["name"])
        nb.cells.append(nbformat.v4.new_code_cell(src))

    result = {"status": "ok", "message": "", "cells": [], "probes": {}, "seconds": 0.0}
    client = CappedClient(nb, timeout=int(spec["cell_timeout"]), kernel_name="python3",
                          allow_errors=True, interrupt_on_timeout=True,
                          error_on_timeout={"ename": "CellTimeoutError", "evalue": "cell time limit exceeded",
                                            "traceback": ["CellTimeoutError: cell time limit exceeded"]},
                          # output of a cell can trail its execute_reply on a loaded machine; waiting
                          # ends at the kernel's idle message, so a generous bound costs nothing normally
                          iopub_timeout=20, shutdown_kernel="immediate",
                          resources={"metadata": {"path": spec["workdir"]}})
    kernel_pgid = None

    def note(status: str, message: str) -> None:
        order = ["ok", "timeout", "kernel_died"]
        if order.index(status) > order.index(result["status"]):
            result["status"] = status
        if message and message not in result["message"]:
            result["message"] = (result["message"] + " " + message).strip()

    try:
        with client.setup_kernel():
            try:
                kernel_pgid = os.getpgid(client.km.provisioner.pid)
            except Exception:  # pragma: no cover - provisioner API differences
                kernel_pgid = None
            for idx, cell in enumerate(nb.cells):
                is_probe = idx >= n_student
                pname = spec["probes"][idx - n_student]["name"] if is_probe else None
                limit = float(spec["probes"][idx - n_student]["timeout"]) if is_probe else float(spec["cell_timeout"])
                remaining = deadline - time.monotonic()
                if remaining <= 1:
                    note("timeout", f"notebook time limit ({spec['notebook_timeout']} s) exceeded")
                    if is_probe:
                        result["probes"][pname] = {"ok": False, "timeout": True,
                                                   "error": "not run: notebook time limit exceeded"}
                    continue
                client.timeout = max(1, int(min(limit, remaining)))
                t0 = time.monotonic()
                try:
                    client.execute_cell(cell, idx)
                except DeadKernelError:
                    note("kernel_died", f"kernel died while running {'hidden test ' + pname if is_probe else 'cell ' + str(idx + 1)}")
                    if is_probe:
                        result["probes"][pname] = {"ok": False, "timeout": False, "error": "kernel died"}
                    break
                except CellTimeoutError:
                    pass
                except Exception as e:  # e.g. the submission broke the kernel's own json/zmq messages
                    note("kernel_died", "the kernel stopped answering in the Jupyter protocol "
                         f"({type(e).__name__}: {str(e)[:200]}); did the notebook patch json or builtins?")
                    break
                err = _error_text(cell)
                timed_out = bool(err and "CellTimeoutError" in err) or (time.monotonic() - t0 >= client.timeout)
                if timed_out:
                    note("timeout", "")
                if not is_probe:
                    result["cells"].append({"index": idx + 1, "error": err, "timeout": timed_out})
                else:
                    text = "".join(o.get("text", "") for o in cell.outputs
                                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
                    nonce = nonces[pname]
                    m = re.findall(re.escape(nonce) + r"(.*?)" + re.escape(nonce), text, re.S)
                    if timed_out:
                        result["probes"][pname] = {"ok": False, "timeout": True,
                                                   "error": f"time limit exceeded ({client.timeout} s)"}
                    elif m:
                        try:
                            data = json.loads(m[-1])
                            ok = bool(data.get("ok")) if isinstance(data, dict) else False
                            result["probes"][pname] = {"ok": ok, "timeout": False,
                                                       "value": data.get("value") if ok else None,
                                                       "error": None if ok else str(data.get("error"))[-3000:]}
                        except Exception as e:
                            result["probes"][pname] = {"ok": False, "timeout": False, "error": f"unreadable result: {e}"}
                    else:
                        result["probes"][pname] = {"ok": False, "timeout": False,
                                                   "error": err or "the hidden test printed no result"}
                if timed_out:
                    # interrupt worked? a trivial cell must finish quickly, else the kernel is stuck
                    probe_alive = nbformat.v4.new_code_cell("pass")
                    client.timeout = 5
                    t1 = time.monotonic()
                    try:
                        client.execute_cell(probe_alive, idx)
                        stuck = time.monotonic() - t1 >= 4.5
                    except Exception:
                        stuck = True
                    if stuck:
                        note("timeout", "the kernel ignored the interrupt after a time limit; it was killed")
                        _kill_group(kernel_pgid)
                        for p in spec["probes"]:
                            result["probes"].setdefault(p["name"], {"ok": False, "timeout": True,
                                                                    "error": "not run: kernel stuck after a time limit"})
                        break
    except DeadKernelError:
        note("kernel_died", "kernel died")
    except Exception as e:  # kernel start-up or shutdown broken by the submission
        note("kernel_died", f"kernel failed: {type(e).__name__}: {str(e)[:200]}")
    finally:
        _kill_group(kernel_pgid)
    for p in spec["probes"]:
        result["probes"].setdefault(p["name"], {"ok": False, "timeout": False,
                                                "error": "not run: " + (result["message"] or "kernel died")})
    result["seconds"] = round(time.monotonic() - t_start, 2)
    return result


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the grader dies (Ctrl-C, kill), so no worker outlives the run."""
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
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    _limits(int(spec["memory_mb"]))
    try:
        result = run(spec)
    except BaseException as e:  # report instead of dying silently
        import traceback

        result = {"status": "grader_error", "message": "".join(traceback.format_exception(e))[-3000:],
                  "cells": [], "probes": {}, "seconds": 0.0}
    data = (json.dumps(result, default=repr) + "\n").encode()
    with os.fdopen(out_fd, "wb") as f:
        f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
