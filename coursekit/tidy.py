"""``python -m coursekit tidy [paths]`` — keep authoring plumbing off the book's pages.

The book renders every code cell, so the machinery a chapter needs (``glue`` calls that
feed the prose, nbval markers, the setup cell) would otherwise be read as if it were
part of the lesson. This tool rewrites notebooks so that plumbing lives where the HTML
does not show it:

* **glue calls.** A top-level ``glue(...)`` statement at the start or the end of a code
  cell is moved, with its stored output, into a cell of its own tagged ``remove-cell``
  (placed before or after, so it runs at the very same moment). A cell made only of glue
  calls gets the tag itself. myst-nb still reads glued values from removed cells. When
  the statement left last in the cell is an expression, a ``;`` keeps it from being
  displayed (before the move it was not the last line, so it was not displayed either).
  Glue calls in the middle of a cell, inside loops or functions, and ``glue(...,
  display=True)`` (meant to be seen) are left where they are.
* **nbval markers.** A ``# nbval-ignore-output: reason`` comment line becomes the
  ``nbval-ignore-output`` cell tag; the reason is kept in
  ``metadata.nbval_ignore_reason``.
* **the setup cell** (tag ``setup``: imports, seeds, warning filters, version banner) is
  tagged ``hide-cell`` (collapsed in Jupyter; the book leaves setup cells off the page
  altogether, ``_ext/course_ui.py``), still there, first, in Jupyter and Colab.

:func:`visible_source` is what the book shows of a cell's code (used at build time by
``_ext/course_ui.py``; the notebook is not changed): without the glue calls that stand
on their own lines, nbval comments, ``with measured(...):`` wrappers and tolerance
arguments (:func:`strip_measurement`).

The tool is idempotent: a second run changes nothing. ``--check`` only reports (exit 1
when a notebook would change), for CI. Outputs are moved, never recomputed: re-execute
(``make nb``) afterwards to refresh execution counts.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

GLUE_MIME = "application/papermill.record/"
REMOVE = "remove-cell"
HIDE_SETUP = "hide-cell"
NBVAL_IGNORE = "nbval-ignore-output"
# the toggle of the collapsed setup cell says what is behind it (myst-nb cell-level
# config)
SETUP_PROMPTS = {
    "code_prompt_show": "显示准备代码（导入、随机种子、版本与 GPU 信息）",
    "code_prompt_hide": "隐藏准备代码",
}
_NBVAL_COMMENT = re.compile(r"^\s*#\s*nbval-ignore-output\b[\s:：,，;；.。-]*(.*?)\s*$")
# the source material's cell-type line ("# 类型：【Skeleton】需要 GPU"): the page says
# what a GPU cell is in its badge (_static/course.css), the notebook keeps the line
_CELL_TYPE = re.compile(r"^#\s*类型：【\w+】.*$")


@dataclass
class Report:
    """What tidy did (or would do) to one notebook."""

    path: Path
    changes: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # glue calls left visible, and why

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def _tags(cell) -> list[str]:
    return cell.setdefault("metadata", {}).setdefault("tags", [])


def _add_tag(cell, tag: str) -> bool:
    tags = _tags(cell)
    if tag in tags:
        return False
    tags.append(tag)
    return True


def _call_name(call: ast.Call) -> str:
    """``f`` for ``f(...)`` and ``x.f(...)``; "" for anything else called."""
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    return f.attr if isinstance(f, ast.Attribute) else ""


def _is_glue_call(node: ast.AST) -> bool:
    """``glue(...)`` / ``x.glue(...)`` as a statement, not asking to be displayed."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    if _call_name(node.value) != "glue":
        return False
    for kw in node.value.keywords:
        if kw.arg == "display" and not (
            isinstance(kw.value, ast.Constant) and not kw.value.value
        ):
            return False
    return True


# calls whose value Jupyter never shows
_NONE_CALLS = {
    "print",
    "display",
    "show",
    "glue",
}


def _returns_none(node: ast.Expr) -> bool:
    v = node.value
    if not isinstance(v, ast.Call):
        return False
    return _call_name(v) in _NONE_CALLS


def _glue_name(node: ast.Expr) -> str | None:
    args = node.value.args
    if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
        return args[0].value
    return None


def _calls_glue(nodes) -> bool:
    for n in nodes:
        for sub in ast.walk(n):
            if isinstance(sub, ast.Call):
                f = sub.func
                if (isinstance(f, ast.Name) and f.id == "glue") or (
                    isinstance(f, ast.Attribute) and f.attr == "glue"
                ):
                    return True
    return False


def _is_glue_output(out) -> bool:
    return (
        out.get("output_type") in ("display_data", "execute_result")
        and any(k.startswith(GLUE_MIME) for k in out.get("data", {}))
        or (
            out.get("metadata", {}).get("scrapbook", {}).get("mime_prefix") == GLUE_MIME
        )
    )


def _new_code_cell(source: str, outputs: list, tags: list[str], count):
    cell = nbformat.v4.new_code_cell(source=source)
    cell.metadata["tags"] = list(tags)
    cell.outputs = outputs
    # it ran as part of the original cell: nbval refuses stored outputs of an "unrun"
    # cell
    cell.execution_count = count
    return cell


def _copy_reason(src, new) -> None:
    reason = src.metadata.get("nbval_ignore_reason")
    if reason and NBVAL_IGNORE in new.metadata.get("tags", []):
        new.metadata["nbval_ignore_reason"] = reason


def _split_glue(cell, where: str, report: Report) -> list:
    """Return the cells that replace ``cell`` (itself, possibly split into glue +
    rest)."""
    src = cell.source
    if REMOVE in _tags(cell) or src.lstrip().startswith("%%"):
        return [cell]
    try:
        tree = ast.parse(src)
    except SyntaxError:  # IPython magics or shell escapes: leave the cell alone
        if "glue(" in src:
            report.left.append(
                f"{where}: not plain Python, glue calls left as they are"
            )
        return [cell]
    body = tree.body
    if not body:
        return [cell]
    glue = [_is_glue_call(s) for s in body]
    # a source line belongs to the glue part only if every statement on it is a glue
    # call
    owner: dict[int, set[bool]] = {}
    for s, g in zip(body, glue):
        for ln in range(s.lineno, s.end_lineno + 1):
            owner.setdefault(ln, set()).add(g)
    if all(glue):
        if _add_tag(cell, REMOVE):
            report.changes.append(f"{where}: glue-only cell tagged {REMOVE}")
        return [cell]
    # leading and trailing runs of glue statements (whole lines only)
    lead = 0
    while lead < len(body) and glue[lead] and owner[body[lead].end_lineno] == {True}:
        lead += 1
    trail = len(body)
    while trail > lead and glue[trail - 1] and owner[body[trail - 1].lineno] == {True}:
        trail -= 1
    if lead == 0 and trail == len(body):
        if _calls_glue(body):
            report.left.append(
                f"{where}: glue call(s) inside the cell's code stay visible"
            )
        return [cell]
    rest = body[lead:trail]
    head_names = {_glue_name(s) for s in body[:lead]}
    tail_names = {_glue_name(s) for s in body[trail:]}
    outputs = cell.get("outputs", [])
    glue_out = [o for o in outputs if _is_glue_output(o)]
    if _calls_glue(rest) or (head_names and tail_names):
        # outputs are told apart by their key: a computed key makes that impossible
        if None in head_names | tail_names:
            report.left.append(
                f"{where}: glue with a computed key next to other glue: left"
            )
            return [cell]
    if _calls_glue(rest):
        report.left.append(f"{where}: glue call(s) inside the cell's code stay visible")
    if (
        None in head_names | tail_names
    ):  # only one side moves, and no glue stays: all of them
        head_out = glue_out if lead else []
        tail_out = glue_out if not lead else []
    else:
        head_out = [o for o in glue_out if _glue_name_of_out(o) in head_names]
        tail_out = [o for o in glue_out if _glue_name_of_out(o) in tail_names]
    L = src.split("\n")
    # the statement now last in the cell: keep it from being displayed, as it was before
    if (
        trail < len(body)
        and isinstance(rest[-1], ast.Expr)
        and not _returns_none(rest[-1])
    ):
        end = rest[-1]
        i = end.end_lineno - 1
        after = L[i][end.end_col_offset :]
        if not after.lstrip().startswith(";"):
            L[i] = L[i][: end.end_col_offset] + ";" + after
    # comments above the first statement stay with the code
    pre = L[: body[0].lineno - 1]
    if lead:
        head = L[body[0].lineno - 1 : body[lead - 1].end_lineno]
        mid_start = body[lead - 1].end_lineno
    else:
        head, mid_start = [], 0
    tail_start = body[trail].lineno - 1 if trail < len(body) else len(L)
    tail = L[tail_start:]
    main = (pre if lead else []) + L[mid_start:tail_start]
    moved = [id(o) for o in head_out + tail_out]
    cell.outputs = [o for o in outputs if id(o) not in moved]
    cell.source = "\n".join(main).strip("\n")
    out, count = [], cell.get("execution_count")
    # outputs that nbval does not compare in the original cell stay uncompared in the
    # new ones
    new_tags = [REMOVE] + [t for t in (NBVAL_IGNORE, "nbval-skip") if t in _tags(cell)]
    if head:
        out.append(
            _new_code_cell("\n".join(head).strip("\n"), head_out, new_tags, count)
        )
        _copy_reason(cell, out[-1])
        report.changes.append(
            f"{where}: {lead} leading glue statement(s) moved to a {REMOVE} cell"
        )
    out.append(cell)
    if tail:
        out.append(
            _new_code_cell("\n".join(tail).strip("\n"), tail_out, new_tags, count)
        )
        _copy_reason(cell, out[-1])
        n = len(body) - trail
        report.changes.append(
            f"{where}: {n} trailing glue statement(s) moved to a {REMOVE} cell"
        )
    return out


def _glue_name_of_out(o) -> str | None:
    return o.get("metadata", {}).get("scrapbook", {}).get("name")


def _nbval_comments(cell, where: str, report: Report) -> None:
    lines = cell.source.split("\n")
    keep, reasons = [], []
    for line in lines:
        m = _NBVAL_COMMENT.match(line)
        if m:
            reasons.append(m.group(1))
        else:
            keep.append(line)
    if not reasons:
        return
    cell.source = "\n".join(keep).strip("\n")
    _add_tag(cell, NBVAL_IGNORE)
    reason = "; ".join(r for r in reasons if r)
    if reason:
        cell.metadata["nbval_ignore_reason"] = reason
    report.changes.append(f"{where}: nbval comment turned into the {NBVAL_IGNORE} tag")


def tidy_notebook(nb, path: Path | str = "<notebook>") -> Report:
    """Tidy ``nb`` in place; return what changed."""
    report = Report(Path(path))
    cells = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            cells.append(cell)
            continue
        where = f"{path} cell {i}"
        _nbval_comments(cell, where, report)
        if "setup" in _tags(cell):
            if _add_tag(cell, HIDE_SETUP):
                report.changes.append(f"{where}: setup cell tagged {HIDE_SETUP}")
            prompts = cell.metadata.setdefault("mystnb", {})
            if "code_prompt_show" not in prompts:
                prompts.update(SETUP_PROMPTS)
                report.changes.append(f"{where}: setup cell's toggle labelled")
        if "gpu" in _tags(
            cell
        ):  # GPU cells run alone in tests (setup + gpu): never split
            cells.append(cell)
            continue
        cells.extend(_split_glue(cell, where, report))
    nb.cells = cells
    for cell in nb.cells:  # no empty tag lists left behind
        if cell.metadata.get("tags") == []:
            del cell.metadata["tags"]
    return report


def notebooks_in(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(
                q for q in p.glob("*.ipynb") if ".ipynb_checkpoints" not in q.parts
            )
        elif p.suffix == ".ipynb" and p.exists():
            out.append(p)
        else:
            raise FileNotFoundError(f"not a notebook or a folder: {p}")
    return out


def tidy_paths(paths, check: bool = False) -> list[Report]:
    """Tidy every notebook under ``paths`` (files or folders); write unless
    ``check``."""
    reports = []
    for path in notebooks_in(paths):
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception as e:
            raise ValueError(f"{path} is not a readable notebook: {e}") from e
        before = copy.deepcopy(nb)
        report = tidy_notebook(nb, path)
        if nb != before and not check:
            nbformat.write(nb, path)
        reports.append(report)
    return reports


def _pure_glue(stmt: ast.stmt) -> bool:
    """A glue call, or a loop/if/with whose every branch is made only of glue calls."""
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, ast.Call) and _is_glue_name(stmt)
    if isinstance(
        stmt, (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith)
    ):
        blocks = [stmt.body] + ([stmt.orelse] if getattr(stmt, "orelse", None) else [])
        return all(b and all(_pure_glue(s) for s in b) for b in blocks)
    return False


def _is_glue_name(stmt: ast.Expr) -> bool:
    f = stmt.value.func
    return (isinstance(f, ast.Name) and f.id == "glue") or (
        isinstance(f, ast.Attribute) and f.attr == "glue"
    )


def visible_source(src: str, tol_names: frozenset[str] = frozenset()) -> str:
    """The code of a cell as the book shows it: without ``# nbval-ignore-output``
    comment lines and the ``# 类型：【…】`` cell-type line, without statements that
    only feed the prose (glue calls, and loops
    or ifs made only of them) when they stand on lines of their own, and without the
    measurement plumbing :func:`strip_measurement` removes (``tol_names``: see
    :func:`tolerance_names`). The rest is kept verbatim."""
    return strip_measurement(_without_glue(src), tol_names)


def _without_glue(src: str) -> str:
    lines = src.split("\n")
    drop = {i for i, line in enumerate(lines) if _NBVAL_COMMENT.match(line)}
    drop |= {i for i, line in enumerate(lines) if _CELL_TYPE.match(line)}
    try:
        tree = ast.parse(src)
    except SyntaxError:
        tree = None
    if tree is not None:

        def visit(block: list[ast.stmt], parent: ast.stmt | None) -> None:
            pure = [
                _pure_glue(s) and (parent is None or s.lineno > parent.lineno)
                for s in block
            ]
            removable = []
            for k, stmt in enumerate(block):
                # every statement sharing a line with this one must go too
                shares = [
                    j
                    for j, o in enumerate(block)
                    if j != k
                    and o.lineno <= stmt.end_lineno
                    and o.end_lineno >= stmt.lineno
                ]
                if pure[k] and all(pure[j] for j in shares):
                    removable.append(stmt)
                else:
                    for name in ("body", "orelse", "finalbody"):
                        sub = getattr(stmt, name, None)
                        if (
                            isinstance(sub, list)
                            and sub
                            and isinstance(sub[0], ast.stmt)
                        ):
                            visit(sub, stmt)
                    for h in getattr(stmt, "handlers", []):
                        visit(h.body, h)
            if parent is not None and len(removable) == len(block):
                return  # the block would be left empty: keep it
            for stmt in removable:
                drop.update(range(stmt.lineno - 1, stmt.end_lineno))

        visit(tree.body, None)
    if not drop:
        return src
    kept = [line for i, line in enumerate(lines) if i not in drop]
    text = "\n".join(kept).strip("\n")
    return re.sub(r"\n(\s*\n){2,}", "\n\n", text)


# ---------------------------------------------------------------- measurement wrappers
#
# The page shows the lesson, not how nbval compares it: ``with measured(rtol=...):``
# wrappers (the body is shown dedented), ``rtol=``/``atol=`` arguments of ``md_table``
# and ``glue``, ``tol = dict(rtol=..., atol=...)`` dictionaries used only as ``**tol``
# in those calls, and comments that talk about nbval are left out of the displayed
# code.
# The notebook is unchanged: in Jupyter and on Colab the code runs as written.

TOLERANCE_KEYWORDS = ("rtol", "atol")
# calls whose rtol=/atol= only declare how nbval compares the output (coursekit.nb)
TOLERANCE_CALLS = ("md_table", "glue", "measured")


def _func_name(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    return f.attr if isinstance(f, ast.Attribute) else ""


def _is_tolerance_dict(value: ast.AST) -> bool:
    """``dict(rtol=..., atol=...)`` or ``{"rtol": ..., "atol": ...}`` and nothing
    else."""
    if isinstance(value, ast.Call) and _func_name(value) == "dict" and not value.args:
        keys = [k.arg for k in value.keywords]
    elif isinstance(value, ast.Dict) and all(
        isinstance(k, ast.Constant) for k in value.keys
    ):
        keys = [k.value for k in value.keys]
    else:
        return False
    return bool(keys) and all(k in TOLERANCE_KEYWORDS for k in keys)


def tolerance_names(sources) -> frozenset[str]:
    """Names bound to a tolerance dict (``tol = dict(rtol=0.05)``) in any of
    ``sources`` (the code cells of one notebook) and used only as ``**name`` in
    :data:`TOLERANCE_CALLS`: their assignments and ``**name`` arguments are plumbing."""
    bound, other_use, star_use = set(), set(), set()
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        stars = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                t = node.targets[0]
                if isinstance(t, ast.Name) and _is_tolerance_dict(node.value):
                    bound.add(t.id)
            if isinstance(node, ast.Call) and _func_name(node) in TOLERANCE_CALLS:
                for k in node.keywords:
                    if k.arg is None and isinstance(k.value, ast.Name):
                        stars.add(id(k.value))
                        star_use.add(k.value.id)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Name)
                and isinstance(node.ctx, ast.Load)
                and id(node) not in stars
            ):
                other_use.add(node.id)
    return frozenset(bound - other_use)


def _offsets(src: str):
    """(line, byte column) of ``ast`` -> index into ``src``."""
    starts, pos = [], 0
    lines = src.split("\n")
    for line in lines:
        starts.append(pos)
        pos += len(line) + 1

    def at(lineno: int, col: int) -> int:
        line = lines[lineno - 1]
        return starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8"))

    return at


def _drop_span(src: str, a: int, b: int) -> str:
    return src[:a] + src[b:]


def _strip_once(src: str, tol_names: frozenset[str]) -> str | None:
    """One plumbing construct removed from ``src``, or None when none is left."""
    tree = ast.parse(src)
    at = _offsets(src)
    lines = src.split("\n")
    for node in ast.walk(tree):
        # ``with measured(...):`` (its only item) -> the body, dedented
        if (
            isinstance(node, ast.With)
            and len(node.items) == 1
            and isinstance(node.items[0].context_expr, ast.Call)
            and _func_name(node.items[0].context_expr) == "measured"
            and node.items[0].optional_vars is None
        ):
            header_end = node.body[0].lineno - 1  # 1-based line before the body
            # the header ends on the line of its colon: the last line before the body
            # that is not a comment or blank
            while header_end > node.lineno and (
                not lines[header_end - 1].strip()
                or lines[header_end - 1].lstrip().startswith("#")
            ):
                header_end -= 1
            body = lines[header_end : node.end_lineno]
            indent = node.body[0].col_offset - node.col_offset
            out = []
            for line in body:
                lead = len(line) - len(line.lstrip(" "))
                out.append(line[min(lead, indent) :])
            new = lines[: node.lineno - 1] + out + lines[node.end_lineno :]
            return "\n".join(new)
        # ``tol = dict(rtol=..., atol=...)`` used only as **tol in tolerance calls
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in tol_names
            and _is_tolerance_dict(node.value)
            and node.col_offset == 0
        ):
            new = lines[: node.lineno - 1] + lines[node.end_lineno :]
            return "\n".join(new)
        # rtol=/atol=/**tol arguments of md_table, glue, measured
        if isinstance(node, ast.Call) and _func_name(node) in TOLERANCE_CALLS:
            if _func_name(node) == "measured":
                continue  # a measured(...) that is not a with-item: left as written
            parts = sorted(
                [*node.args, *node.keywords], key=lambda n: (n.lineno, n.col_offset)
            )
            for j, k in enumerate(parts):
                if not isinstance(k, ast.keyword):
                    continue
                plumbing = k.arg in TOLERANCE_KEYWORDS or (
                    k.arg is None
                    and isinstance(k.value, ast.Name)
                    and k.value.id in tol_names
                )
                if not plumbing:
                    continue
                start = at(k.lineno, k.col_offset)
                end = at(k.end_lineno, k.end_col_offset)
                if j + 1 < len(parts):
                    nxt = parts[j + 1]
                    return _drop_span(src, start, at(nxt.lineno, nxt.col_offset))
                if j > 0:
                    prev = parts[j - 1]
                    return _drop_span(
                        src, at(prev.end_lineno, prev.end_col_offset), end
                    )
                return _drop_span(src, start, end)
    return None


def _drop_nbval_comments(src: str) -> str:
    """Comments that talk about nbval: a whole comment block (consecutive comment lines)
    mentioning it goes; a trailing comment mentioning it is cut off its line."""
    import io
    import tokenize

    lines = src.split("\n")
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, SyntaxError):
        return src
    trailing, whole = {}, set()
    for t in toks:
        if t.type != tokenize.COMMENT:
            continue
        row, col = t.start
        if lines[row - 1][:col].strip():
            trailing[row - 1] = col
        else:
            whole.add(row - 1)
    drop = set()
    for i in sorted(whole):
        if i in drop or "nbval" not in lines[i].lower():
            continue
        a = i
        while a - 1 in whole:
            a -= 1
        b = i
        while b + 1 in whole:
            b += 1
        drop.update(range(a, b + 1))
    out = []
    for i, line in enumerate(lines):
        if i in drop:
            continue
        if i in trailing and "nbval" in line[trailing[i] :].lower():
            line = line[: trailing[i]].rstrip()
        out.append(line)
    return "\n".join(out)


def strip_measurement(src: str, tol_names: frozenset[str] = frozenset()) -> str:
    """``src`` as the page shows it: measurement wrappers and tolerance arguments left
    out (see the section comment above). Code that does not parse, or whose stripped
    form would not parse, is returned unchanged."""
    try:
        ast.parse(src)
    except SyntaxError:
        return src
    text = src
    for _ in range(200):  # each pass removes one construct
        try:
            new = _strip_once(text, tol_names)
        except SyntaxError:
            return src
        if new is None:
            break
        text = new
    text = _drop_unused_measured_import(_drop_nbval_comments(text))
    try:
        ast.parse(text)
    except SyntaxError:
        return src
    return re.sub(r"\n(\s*\n){2,}", "\n\n", text).strip("\n")


def _drop_unused_measured_import(src: str) -> str:
    """``from coursekit(.nb) import measured`` once no shown code uses ``measured``:
    the line goes, or just the name when the import brings others too."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return src
    used = any(isinstance(n, ast.Name) and n.id == "measured" for n in ast.walk(tree))
    if used:
        return src
    lines = src.split("\n")
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.ImportFrom)
            and node.module in ("coursekit", "coursekit.nb")
            and any(a.name == "measured" and a.asname is None for a in node.names)
        ):
            continue
        rest = [a for a in node.names if a.name != "measured"]
        indent = lines[node.lineno - 1][: node.col_offset]
        if rest:
            names = ", ".join(
                a.name + (f" as {a.asname}" if a.asname else "") for a in rest
            )
            new = [f"{indent}from {node.module} import {names}"]
        else:
            new = []
        lines[node.lineno - 1 : node.end_lineno] = new
        return _drop_unused_measured_import("\n".join(lines))
    return src
