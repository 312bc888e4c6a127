"""pytest plugin loaded with ``-p tests.nbval_plugin`` for the nbval run.

* Output types that only exist on Colab or in a live widget front end are never
  compared.
* Glued figures/HTML (``application/papermill.record/image/png`` …) follow nbval's own
  rule for images: not compared. Glued text — the worked numbers — always is.
* **Exact by default, tolerant where declared.** Every output is compared as text,
  except an output whose metadata carries a declared tolerance (``glue(..., rtol=...)``,
  ``with measured(rtol=...)``, ``md_table(..., rtol=...)``; see ``coursekit.nb``): such
  an output is compared numerically — the glued raw value, or the printed numbers token
  by token (words and integers still exact). The tolerance is read from the freshly
  executed output (the code declares it) and the stored output must carry one too, else
  the comparison stays textual.
* **GPU cells (tag ``gpu``): run at their CPU size, checked, not compared.** The kernel
  runs with ``COURSE_GPU=cpu``, as ``make nb`` on a machine without CUDA does: every
  GPU cell executes its real code at its smallest size, in its place in the notebook.
  Its stored output is such a run (timings and measured numbers vary with the
  machine) or a run on a GPU, so it is not compared (:data:`GPU_IGNORE_REASON`);
  instead :func:`gpu_run_problem` checks what the fresh run printed: the CPU label
  first, never the skip line, and what a few cells must show (the fp16 loss scaler
  backs off and grows; QLoRA's CPU part builds, estimates and steps).
* Each notebook's kernel gets its environment from :func:`coursekit.execute.kernel_env`
  (the same one ``make nb`` uses: GPUs hidden, one thread, fixed hash seed; here
  ``COURSE_GPU=cpu``, see above) plus ``--kernel-env KEY=VALUE`` options; the test
  process's own ``os.environ`` is not changed. ``make test`` passes
  ``ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE`` this way, so the stored outputs
  (made on the native kernel path) are checked on another one.
"""

from __future__ import annotations

import copy
import math
import re

IGNORED_MIME = (
    "application/vnd.jupyter.widget-view+json",
    "application/vnd.jupyter.widget-state+json",
    "application/vnd.colab-display-data+json",
    "application/vnd.google.colaboratory.intrinsic+json",
    "application/papermill.record/image/png",
    "application/papermill.record/image/jpeg",
    "application/papermill.record/image/svg+xml",
    "application/papermill.record/text/html",
    "image/svg+xml",
    "text/html",
)
GPU_TAG = "gpu"
# the user property that carries why a cell's output is not compared
IGNORE_REASON = "nbval_ignore_reason"
GPU_IGNORE_REASON = (
    "GPU cell: its stored output is a labelled CPU small-size run (machine-dependent "
    "timings) or a GPU run; the fresh CPU run is checked instead (gpu_run_problem)"
)


def _backs_off_and_grows(text: str) -> bool:
    m = re.search(r"(\d+) back-offs .*?(\d+) growths", text)
    return bool(m) and int(m.group(1)) > 0 and int(m.group(2)) > 0


# a GPU cell (found by a marker in its source) -> what its CPU run must print
GPU_RUN_MUST_SHOW = {
    "def fp16_scaler_loop(": (
        "the loss scaler backs off and grows (N back-offs ... M growths, N, M > 0)",
        _backs_off_and_grows,
    ),
    "def qlora_finetune(": (
        "nf4, the trainmem estimate and two timed steps (ms/step twice)",
        lambda t: "nf4" in t and "trainmem estimate" in t and t.count("ms/step") == 2,
    ),
}


def gpu_run_problem(source: str, outputs: list) -> str | None:
    """What is wrong with a GPU cell's fresh run under ``COURSE_GPU=cpu`` (None: it
    ran at CPU size and printed what it must)."""
    from coursekit.gpu import CPU_LABEL, SKIP_PREFIX

    text = "".join(
        o.get("text", "") for o in outputs if o.get("output_type") == "stream"
    )
    errors = [o for o in outputs if o.get("output_type") == "error"]
    if errors:
        return f"the GPU cell raised {errors[0].get('ename')}"
    if SKIP_PREFIX in text:
        return "the GPU cell was skipped, not run at CPU size (COURSE_GPU=cpu?)"
    if not text.startswith(CPU_LABEL.split("{")[0]):
        return f"a GPU cell's CPU run must start with its label: {text[:80]!r}"
    for marker, (what, ok) in GPU_RUN_MUST_SHOW.items():
        if marker in source and not ok(text):
            return f"its CPU run must show {what}; it printed {text[-400:]!r}"
    return None


# same as coursekit.nb.TOL_KEY (kept literal: no import of the package here)
TOL_KEY = "coursekit"
TEXT_MIME = ("text/plain", "text/markdown")

NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
    r"|[-+]?\b(?:nan|inf)\b"
)


def pytest_addoption(parser):
    parser.addoption(
        "--kernel-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for every notebook kernel (repeatable)",
    )


def is_gpu_cell(cell) -> bool:
    return GPU_TAG in ((cell.get("metadata") or {}).get("tags") or [])


def pytest_collection_modifyitems(session, config, items):
    """GPU cells: checked by :func:`gpu_run_problem`, not compared (see
    :data:`GPU_IGNORE_REASON`)."""
    for item in items:
        cell = getattr(item, "cell", None)
        options = getattr(item, "options", None)
        if cell is None or options is None:
            continue
        if is_gpu_cell(cell):
            options["check"] = True  # reaches compare_outputs, which checks the run
            item.user_properties.append((IGNORE_REASON, GPU_IGNORE_REASON))


def pytest_collectstart(collector):
    skip = getattr(collector, "skip_compare", None)
    if skip is not None:
        collector.skip_compare = tuple(skip) + tuple(
            m for m in IGNORED_MIME if m not in skip
        )


# ---------------------------------------------------------------- tolerant comparison


def tolerance_of(output) -> dict | None:
    """The declared tolerance of a display/execute_result output, or None."""
    tol = (output.get("metadata") or {}).get(TOL_KEY) or {}
    if "rtol" in tol or "atol" in tol:
        return tol
    return None


def _split(text: str):
    """Text -> (literal parts with runs of spaces collapsed, number tokens)."""
    nums = NUMBER.findall(text)
    lits = [re.sub(r"\s+", " ", part).strip() for part in NUMBER.split(text)]
    return lits, nums


def _value(token: str) -> float:
    return float(token.replace(",", ""))


def _last_digit(token: str) -> float:
    """One unit in the last printed digit of ``token`` (``"0.027"`` -> 0.001,
    ``"2.9e-07"`` -> 1e-08)."""
    t = token.replace(",", "").lstrip("+-").lower()
    mant, _, exp = t.partition("e")
    decimals = len(mant.partition(".")[2])
    return 10.0 ** (-decimals + (int(exp) if exp else 0))


def _is_int(token: str) -> bool:
    return not re.search(r"[.eEna]", token)


def numbers_close(
    new: float, old: float, rtol: float, atol: float, slack: float = 0.0
) -> bool:
    if math.isnan(new) or math.isnan(old):
        return math.isnan(new) and math.isnan(old)
    if math.isinf(new) or math.isinf(old):
        return new == old
    return abs(new - old) <= atol + rtol * max(abs(new), abs(old)) + slack


def text_close(new: str, old: str, rtol: float, atol: float) -> str | None:
    """None when ``new`` matches ``old`` within the tolerance, else why not (one
    line)."""
    (lit_n, num_n), (lit_o, num_o) = _split(new), _split(old)
    if lit_n != lit_o or len(num_n) != len(num_o):
        return "the text around the numbers differs"
    for a, b in zip(num_n, num_o):
        if _is_int(a) and _is_int(b):
            if a != b:
                return f"integer {a} != {b} (integers are exact)"
            continue
        slack = max(_last_digit(a), _last_digit(b))
        if not numbers_close(_value(a), _value(b), rtol, atol, slack):
            return f"{a} vs stored {b}: outside rtol={rtol:g}, atol={atol:g}"
    return None


def output_close(new, old) -> str | None:
    """Compare two tolerant outputs; None when they agree within the new output's
    tolerance."""
    tol = tolerance_of(new)
    rtol, atol = float(tol.get("rtol", 0.0)), float(tol.get("atol", 0.0))
    stored = (old.get("metadata") or {}).get(TOL_KEY) or {}
    if "value" in tol and "value" in stored:
        a, b = float(tol["value"]), float(stored["value"])
        if not numbers_close(a, b, rtol, atol):
            return f"value {a!r} vs stored {b!r}: outside rtol={rtol:g}, atol={atol:g}"
        return None
    new_data, old_data = new.get("data", {}), old.get("data", {})
    if set(new_data) != set(old_data):
        return "different output types"
    for mime, text in new_data.items():
        if not mime.endswith(TEXT_MIME):
            continue
        why = text_close(str(text), str(old_data[mime]), rtol, atol)
        if why:
            return why
    return None


def reconcile(test: list, ref: list) -> tuple[list, list[str]]:
    """``test`` with each tolerant output that agrees with its stored twin replaced by
    that twin.

    Tolerant outputs are paired in order of appearance; the rest of the comparison
    (everything not tolerant, and tolerant outputs that disagree) is left to nbval's
    strict text comparison. Returns the new list and the reasons for each disagreement.
    """
    new_tol = [i for i, o in enumerate(test) if tolerance_of(o) is not None]
    old_tol = [i for i, o in enumerate(ref) if tolerance_of(o) is not None]
    if not new_tol or len(new_tol) != len(old_tol):
        return test, []
    out, reasons = list(test), []
    for i, j in zip(new_tol, old_tol):
        why = output_close(test[i], ref[j])
        if why is None:
            twin = copy.deepcopy(test[i])
            twin["data"] = copy.deepcopy(ref[j]["data"])
            out[i] = twin
        else:
            name = ((test[i].get("metadata") or {}).get("scrapbook") or {}).get("name")
            reasons.append(f"tolerant output{f' {name!r}' if name else ''}: {why}")
    return out, reasons


def _compare_outputs(original):
    def compare_outputs(self, test, ref, skip_compare=None):
        if is_gpu_cell(self.cell):
            why = gpu_run_problem(self.cell.get("source", ""), list(test))
            self.comparison_traceback = [why] if why else []
            return why is None
        test, reasons = reconcile(list(test), list(ref))
        ok = original(self, test, ref, skip_compare)
        if not ok and reasons:
            self.comparison_traceback.extend(reasons)
        return ok

    return compare_outputs


# ---------------------------------------------------------------- kernel environment


def _kernel_env(config) -> dict:
    from coursekit.execute import kernel_env

    extra = {"COURSE_GPU": "cpu"}  # GPU cells: see the module docstring
    for item in config.getoption("--kernel-env") or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--kernel-env expects KEY=VALUE, got {item!r}")
        extra[key] = value
    return kernel_env(extra)


def _execute_like_jupyter(self, cell_input, allow_stdin=None):
    """nbval runs cells with ``store_history=False``, and then IPython decides whether a
    trailing ``;`` silences a cell by looking at the *previous* cell in its history.
    Jupyter, nbclient and ``make nb`` store history, so run cells the same way here: a
    ``;`` means what it means there."""
    return self.kc.execute(
        cell_input, store_history=True, allow_stdin=allow_stdin, stop_on_error=False
    )


def pytest_configure(config):
    try:
        import nbval.kernel
        from nbval.plugin import IPyNbCell
    except ImportError:  # pragma: no cover
        return
    nbval.kernel.RunningKernel.execute_cell_input = _execute_like_jupyter
    if not getattr(IPyNbCell.compare_outputs, "_coursekit", False):
        patched = _compare_outputs(IPyNbCell.compare_outputs)
        patched._coursekit = True
        IPyNbCell.compare_outputs = patched
    env = _kernel_env(config)
    start = nbval.kernel.start_new_kernel
    if not getattr(start, "_coursekit", False):

        def start_new_kernel(*args, **kwargs):
            kwargs.setdefault("env", dict(env))
            return start(*args, **kwargs)

        start_new_kernel._coursekit = True
        nbval.kernel.start_new_kernel = start_new_kernel
