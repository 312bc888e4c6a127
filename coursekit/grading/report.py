"""What the grader writes: ``grades.csv`` and one Chinese feedback page per student
(Jinja2)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

from .api import STUB_LIMIT, LabTests
from .cache import GRADER_VERSION, SEED_NAME

STATUS_TEXT = {
    "ok": "notebook 已运行完，隐藏测试已运行",
    "timeout": "触到了时间上限；还能评的题照常评分",
    "kernel_died": (
        "kernel 退出或崩溃（exit、段错误、写满磁盘上限）；尚未测试的题记 0 分"
    ),
    "memory_limit": "kernel 的常驻内存超过上限，被评分器终止；尚未测试的题记 0 分",
    "invalid": "不是可读的 notebook",
    "grader_error": "评分器自身对这份提交出错——请告诉老师",
}


SHARD_NAME = "shard.json"
SANDBOX_TEXT = {
    True: (
        "这份提交在沙箱（bubblewrap）里运行：看不到网络、隐藏测试、别人的提交和评分器。"
    ),
    False: ("注意：这次评分没有使用沙箱（--no-sandbox），提交以评分者的用户权限运行。"),
}


def seed_id(seed) -> str:
    """What a student may see of a seed: 12 hex digits of its sha256."""
    return hashlib.sha256(str(seed).encode()).hexdigest()[:12]


NOT_RUN_TEXT = "这份提交没有运行（文件读不出来），所以也没有进沙箱。"


def unreadable_text(e: BaseException) -> str:
    """Why a submission file is not a notebook, in Chinese (no raw exception name)."""
    name = type(e).__name__
    if isinstance(e, UnicodeDecodeError):
        why = "文件不是 UTF-8 文本（可能是图片、压缩包或别的二进制文件，而不是 .ipynb）"
    elif name in ("NotJSONError", "JSONDecodeError"):
        why = "文件不是完整的 JSON（下载或复制时被截断了，或者用别的程序改坏了）"
    elif name == "ValidationError" or "nbformat" in str(e):
        why = "JSON 的结构不是 Jupyter notebook 第 4 版（nbformat 4）"
    else:
        why = "文件里没有 notebook 的单元列表"
    return (
        f"不是可读的 notebook：{why}。请在 Colab 里用 文件 → 下载 → 下载 .ipynb "
        "重新下载后再交。"
    )


def ran(rec: dict) -> bool:
    """Whether the submission's code ran at all (an unreadable file never does)."""
    return rec.get("status") != "invalid"


def total(rec: dict) -> float:
    return round(sum(rec["scores"].values()), 2)


def _env():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).resolve().parent / "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )


def feedback_html(
    rec: dict, tests: LabTests, submissions_root: Path | None = None
) -> str:
    """One self-contained HTML page: per question points, per case type the first
    failing input with what was expected and what to fix; cell errors; status; seed;
    graded file."""
    graded = rec.get("file") or ""
    if graded and submissions_root is not None:
        try:
            graded = str(Path(graded).relative_to(submissions_root))
        except ValueError:
            pass
    questions = []
    for q in tests.questions:
        d = rec.get("details", {}).get(q.name) or {"summary": "未评分", "types": []}
        questions.append(
            {
                "name": q.name,
                "description": q.description,
                "max": q.points,
                "points": rec["scores"].get(q.name, 0.0),
                "detail": d,
            }
        )
    return (
        _env()
        .get_template("feedback.html")
        .render(
            lab=tests.lab,
            # the seed is the class's secret (it fixes every hidden input): the page
            # shows a digest of it, which tells runs apart and gives nothing away
            rec=dict(rec, seed=seed_id(rec.get("seed"))),
            total=total(rec),
            max_points=tests.max_points,
            status_text=STATUS_TEXT.get(rec["status"], rec["status"]),
            questions=questions,
            graded=graded,
            stub_limit=STUB_LIMIT,
            version=GRADER_VERSION,
            sandbox_text=(
                SANDBOX_TEXT[bool(rec.get("sandbox", True))]
                if ran(rec)
                else NOT_RUN_TEXT
            ),
            type_examples=type_examples(tests),
        )
    )


FORMULA_LEAD = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value) -> str:
    """A text cell a spreadsheet will not run: one starting like a formula (= + - @,
    tab, carriage return) gets a leading apostrophe."""
    text = str(value)
    return "'" + text if text.startswith(FORMULA_LEAD) else text


def type_examples(tests: LabTests, n: int = 4) -> str:
    """A few of this lab's own case-type labels, for the scoring policy's example."""
    labels: list[str] = []
    for q in tests.questions:
        for ct in q.cases or ():
            if ct.label not in labels:
                labels.append(ct.label)
    # one per question first, so the example spans the lab
    firsts = [q.cases[0].label for q in tests.questions if q.cases]
    picked = list(dict.fromkeys(firsts + labels))[:n]
    return "“" + "”、“".join(picked) + "”" if picked else "按输入的特征分的几类"


def grades_csv(records: list[dict], tests: LabTests) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            "student",
            *[q.name for q in tests.questions],
            "total",
            "status",
            "seed",
            "file",
            "sandbox",
            "limits",
        ]
    )
    for rec in records:
        w.writerow(
            [
                csv_cell(rec["student"]),
                *[f"{rec['scores'].get(q.name, 0.0):g}" for q in tests.questions],
                f"{total(rec):g}",
                csv_cell(rec["status"]),
                rec.get("seed", ""),
                csv_cell(Path(rec["file"]).name) if rec.get("file") else "",
                ("yes" if rec.get("sandbox", True) else "no") if ran(rec) else "",
                csv_cell(rec.get("limits", "")),
            ]
        )
    w.writerow(
        [
            "MAX",
            *[f"{q.points:g}" for q in tests.questions],
            f"{tests.max_points:g}",
            "",
            "",
            "",
            "",
            "",
        ]
    )
    return buf.getvalue()


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if (
        path.is_dir() and not path.is_symlink()
    ):  # a submission put a folder where a file goes
        shutil.rmtree(path, ignore_errors=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_outputs(
    out: Path,
    ordered: list[dict],
    tests: LabTests,
    cache_text: str,
    cache_name: str,
    submissions_root: Path,
    shard_info: dict | None = None,
) -> None:
    """Rewrite everything in ``out`` from memory; remove whatever else is there (a
    previous run's leftovers; with --no-sandbox, whatever a submission wrote)."""
    atomic_write(out / cache_name, cache_text)
    if shard_info is not None:
        atomic_write(out / SHARD_NAME, json.dumps(shard_info, indent=1))
    atomic_write(out / "grades.csv", grades_csv(ordered, tests))
    fb = out / "feedback"
    fb.mkdir(exist_ok=True)
    wanted = {f"{rec['student']}.html" for rec in ordered}
    for p in fb.iterdir():
        if p.name not in wanted:
            p.unlink() if not p.is_dir() or p.is_symlink() else shutil.rmtree(
                p, ignore_errors=True
            )
    for rec in ordered:
        atomic_write(
            fb / f"{rec['student']}.html", feedback_html(rec, tests, submissions_root)
        )
    for (
        p
    ) in out.iterdir():  # stray files a submission may have dropped next to grades.csv
        keep = ("grades.csv", "feedback", cache_name, SEED_NAME)
        if shard_info is not None:
            keep += (SHARD_NAME,)
        if p.name not in keep and p.is_file():
            p.unlink()
