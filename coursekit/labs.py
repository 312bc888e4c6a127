"""Lab generation: ``solutions/labNN_*.ipynb`` → ``labs/labNN_*.ipynb`` (format:
tests/grading/README.md).

* code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` → ``# TODO: <hint>`` +
  ``raise NotImplementedError`` at the marker's indentation (hint from optional ``#
  HINT:`` lines, joined: a long hint is wrapped over several);
* markdown between ``<!-- BEGIN SOLUTION -->`` / ``<!-- END SOLUTION -->`` → a
  placeholder;
* markdown cells tagged ``hints`` (collapsed ``<details>`` hints below an exercise) are
  kept as they are; :mod:`coursekit.hints` checks they do not give the code away;
* cells tagged ``solution-only`` dropped; outputs and execution counts cleared;
* ``{glue:}`key``` roles in markdown replaced by the solution's stored value (a lab has
  no outputs);
* Open-in-Colab badge after the title and the Colab setup cell before the first code
  cell (:mod:`coursekit.colab`); notebook metadata asks Colab for a GPU runtime.

``check_labs`` compares without writing (``python -m coursekit labs --check``).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

from .colab import (
    COLAB_METADATA,
    Repository,
    badge_markdown,
    read_repository,
    setup_cell_source,
)

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
HINT = "# HINT:"
MD_BEGIN = "<!-- BEGIN SOLUTION -->"
MD_END = "<!-- END SOLUTION -->"
MD_PLACEHOLDER = "*（在此写下你的答案）*"
DEFAULT_HINT = "在这里实现"
SOLUTION_ONLY = "solution-only"
BADGE_TAG = "colab-badge"
SETUP_TAG = "colab-setup"
LAB_RE = re.compile(r"^(lab\d\d)_[a-z0-9_]+\.ipynb$")


class LabFormatError(ValueError):
    """A solution notebook breaks the lab format (unclosed/nested markers, bad file
    name)."""


def find_root(start: str | Path | None = None) -> Path:
    """The repository root: the nearest folder (from ``start`` or cwd) with
    ``_config.yml`` and ``solutions/``."""
    here = Path(start or Path.cwd()).resolve()
    for p in (here, *here.parents):
        if (p / "_config.yml").exists() and (p / "solutions").is_dir():
            return p
    pkg_root = Path(__file__).resolve().parents[1]
    if (pkg_root / "_config.yml").exists():
        return pkg_root
    raise FileNotFoundError(
        f"no repository root (with _config.yml and solutions/) above {here}"
    )


def lab_id(path: str | Path) -> str:
    """``labNN`` from ``.../labNN_slug.ipynb``; raises LabFormatError for other
    names."""
    m = LAB_RE.match(Path(path).name)
    if not m:
        raise LabFormatError(
            f"lab notebooks must be named labNN_slug.ipynb (lower case), got "
            f"{Path(path).name!r}"
        )
    return m.group(1)


def _join_hint(pieces: list[str]) -> str:
    """One hint from consecutive ``# HINT:`` lines (a long hint is wrapped to fit 88
    columns): no space where either side is a CJK character or punctuation, one space
    otherwise."""
    out = ""
    for piece in filter(None, pieces):
        if out and not (_is_cjk(out[-1]) or _is_cjk(piece[0])):
            out += " "
        out += piece
    return out


def _is_cjk(ch: str) -> bool:
    return (
        "\u2e80" <= ch <= "\u9fff"
        or "\u3000" <= ch <= "\u303f"
        or "\uff00" <= ch <= "\uffef"
    )


def strip_code(source: str, where: str = "") -> str:
    """Replace every solution block in a code cell's source by a TODO stub (see module
    doc)."""
    out: list[str] = []
    lines = source.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == END:
            raise LabFormatError(f"{where}: '{END}' without '{BEGIN}' (line {i + 1})")
        if line.strip() != BEGIN:
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        j = i + 1
        hint = DEFAULT_HINT
        pieces = []
        while j < len(lines) and lines[j].strip().startswith(HINT):
            pieces.append(lines[j].strip()[len(HINT) :].strip())
            j += 1
        hint = _join_hint(pieces) or DEFAULT_HINT
        while j < len(lines) and lines[j].strip() != END:
            if lines[j].strip() == BEGIN:
                raise LabFormatError(f"{where}: nested '{BEGIN}' (line {j + 1})")
            j += 1
        if j == len(lines):
            raise LabFormatError(
                f"{where}: '{BEGIN}' at line {i + 1} is never closed by '{END}'"
            )
        out.append(f"{indent}# TODO: {hint}")
        out.append(f"{indent}raise NotImplementedError")
        i = j + 1
    return "\n".join(out)


def strip_markdown(source: str, where: str = "") -> str:
    """Replace ``<!-- BEGIN SOLUTION -->`` … ``<!-- END SOLUTION -->`` by a
    placeholder."""
    pattern = re.compile(re.escape(MD_BEGIN) + r".*?" + re.escape(MD_END), re.S)
    result = pattern.sub(MD_PLACEHOLDER, source)
    if MD_BEGIN in result or MD_END in result:
        raise LabFormatError(f"{where}: unbalanced solution markers in a markdown cell")
    return result


GLUE_ROLE = re.compile(r"\{glue(?::text|:)?\}`([^`]+)`")


def glued_values(nb: nbformat.NotebookNode) -> dict[str, str]:
    """``{key: text}`` of every text value glued in ``nb``'s stored outputs."""
    values: dict[str, str] = {}
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            name = out.get("metadata", {}).get("scrapbook", {}).get("name")
            text = out.get("data", {}).get("application/papermill.record/text/plain")
            if name and text is not None:
                values[name] = str(text)
    return values


def inline_glue(source: str, values: dict[str, str], where: str = "") -> str:
    """Replace ``{glue:}`key``` roles by the solution's stored value (labs have no
    outputs to glue from)."""

    def sub(m: re.Match) -> str:
        key = m.group(1).split(":")[0].strip()
        if key not in values:
            raise LabFormatError(
                f"{where}: glue key {key!r} has no stored value in the executed "
                f"solution"
            )
        return values[key]

    return GLUE_ROLE.sub(sub, source)


def make_lab(
    solution: nbformat.NotebookNode, name: str, repo: Repository
) -> nbformat.NotebookNode:
    """The student version of ``solution`` (not modified); ``name`` is the file name,
    e.g. lab01_x.ipynb."""
    lid = lab_id(name)
    nb = copy.deepcopy(solution)
    glued = glued_values(solution)
    cells = []
    for k, cell in enumerate(nb.cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if SOLUTION_ONLY in tags or BADGE_TAG in tags or SETUP_TAG in tags:
            continue
        where = f"solutions/{name} cell {k}"
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.source = strip_code(cell.source, where)
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            cell.source = inline_glue(strip_markdown(cell.source, where), glued, where)
        cells.append(cell)

    badge = nbformat.v4.new_markdown_cell(badge_markdown(repo, f"labs/{name}"))
    badge.id = BADGE_TAG
    badge.metadata = {"tags": [BADGE_TAG]}
    setup = nbformat.v4.new_code_cell(setup_cell_source(repo))
    setup.id = SETUP_TAG
    setup.metadata = {"tags": [SETUP_TAG]}
    first_md = next((i for i, c in enumerate(cells) if c.cell_type == "markdown"), None)
    cells.insert(0 if first_md is None else first_md + 1, badge)
    first_code = next(
        (i for i, c in enumerate(cells) if c.cell_type == "code"), len(cells)
    )
    cells.insert(first_code, setup)
    nb.cells = cells

    meta = {
        k: v
        for k, v in nb.metadata.items()
        if k not in ("widgets", "colab", "accelerator", "lab")
    }
    meta.update(copy.deepcopy(COLAB_METADATA))
    meta["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    meta["lab"] = {"id": lid, "source": f"solutions/{name}"}
    nb.metadata = nbformat.from_dict(meta)
    nb.nbformat, nb.nbformat_minor = 4, max(5, nb.get("nbformat_minor", 5))
    nbformat.validate(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    """The exact text written to disk (stable: sorted keys, indent 1, trailing
    newline)."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def generate(root: str | Path | None = None, check: bool = False) -> list[str]:
    """Generate every lab from ``solutions/``; with ``check`` write nothing.

    Returns the lab paths (relative to root) that were written (or, with ``check``, that
    differ: missing, stale, or without a solution).
    """
    root = find_root(root)
    repo = read_repository(root / "_config.yml")
    sol_dir, lab_dir = root / "solutions", root / "labs"
    changed: list[str] = []
    names = []
    for sol in sorted(sol_dir.glob("lab*.ipynb")):
        names.append(sol.name)
        nb = nbformat.read(sol, as_version=4)
        text = render(make_lab(nb, sol.name, repo))
        target = lab_dir / sol.name
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current != text:
            changed.append(f"labs/{sol.name}")
            if not check:
                lab_dir.mkdir(exist_ok=True)
                target.write_text(text, encoding="utf-8")
    for lab in sorted(lab_dir.glob("lab*.ipynb")) if lab_dir.is_dir() else []:
        if lab.name not in names:
            changed.append(f"labs/{lab.name} (no solutions/{lab.name})")
    return changed
