"""Scoring: inputs drawn once per run, per-type credit, and the correction for constant
answers.

Policy (also in tests/grading/README.md and on every feedback page):

1. One seed per grading run; every submission gets the same inputs, so the same code
   gets the same score, and a re-run with the same seed reproduces every grade.
2. A question's cases come in types, each with a fixed quota and a weight set by the lab
   author. A type earns ``weight × passed / drawn``; the raw share is the weighted mean
   over types.
3. ``c`` is the best raw share any *constant* answer would get (the answer returned for
   every input: ``0``, ``False``, ``None``, …, and every reference answer shared by
   several inputs). The share awarded is ``max(0, (raw − c) / (1 − c))``: a constant
   answer earns 0, a right answer 1.
4. Points = ``round(points × share, 2)``. An exception, a timeout or a result that is
   not plain data fails that case (typed questions) or the question (whole-result
   questions).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .api import LabTests, Question

CONSTANTS: list[Any] = [0, 0.0, 1, 1.0, -1, False, True, None, "", [], {}]
TOP_WANTS = 8  # most frequent reference answers tried as constants


@dataclass
class Prepared:
    """One question's inputs for this run and what does not depend on the submission."""

    question: Question
    drawn: list[tuple[str, Any]]
    wants: list[Any]
    baseline: float

    @property
    def inputs(self) -> list[Any]:
        return [x for _, x in self.drawn]


def _verdict(q: Question, got: Any, want: Any) -> tuple[bool, str]:
    try:
        v = q.compare(got, want)
    except (
        Exception
    ) as e:  # a comparison must cope with garbage; if it does not, it is a miss
        return False, f"{type(e).__name__}: {e}"
    ok, why = v if isinstance(v, tuple) else (v, "")
    return bool(ok), str(why or "")


def _raw_share(q: Question, drawn, passed: list[bool]) -> float:
    weights = {c.name: c.weight for c in q.cases}
    per_type: dict[str, list[bool]] = {}
    for (t, _), ok in zip(drawn, passed):
        per_type.setdefault(t, []).append(ok)
    total = sum(weights.values())
    return sum(weights[t] * sum(v) / len(v) for t, v in per_type.items()) / total


def constant_baseline(q: Question, drawn, wants) -> float:
    """The best raw share a constant answer gets on these inputs (policy point 3)."""
    counts = Counter(json.dumps(w, sort_keys=True, default=repr) for w in wants)
    candidates = list(CONSTANTS)
    for key, n in counts.most_common(TOP_WANTS):
        if n > 1:  # an answer shared by several inputs is one a constant can hit
            candidates.append(json.loads(key))
    best = 0.0
    for const in candidates:
        passed = [_verdict(q, const, w)[0] for w in wants]
        best = max(best, _raw_share(q, drawn, passed))
    return best


def prepare(tests: LabTests, seed: int) -> list[Prepared]:
    """Draw every question's inputs for this run and compute the references (grader
    process)."""
    out = []
    for q in tests.questions:
        drawn = q.draw(seed)
        if q.typed:
            wants = [q.expect(x) for _, x in drawn]
            baseline = constant_baseline(q, drawn, wants)
        else:
            wants, baseline = [], 0.0
        out.append(Prepared(q, drawn, wants, baseline))
    return out


def probe_spec(p: Prepared, default_timeout: float) -> dict:
    """What the worker needs to run one question's probe in the kernel."""
    data = p.inputs if p.question.typed else p.drawn[0][1]
    return {
        "name": p.question.name,
        "source": p.question.probe,
        "per_case": p.question.typed,
        "inputs_json": json.dumps(data),
        "timeout": p.question.timeout or default_timeout,
    }


def _kind(v: Any) -> str:
    """A value's category, in Chinese, without the value itself."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "+inf" if v > 0 else "−inf"
        if v == 0:
            return "+0.0" if math.copysign(1.0, v) > 0 else "−0.0"
        return "有限的 float"
    return {
        int: "int",
        str: "字符串",
        list: "列表",
        dict: "字典",
        type(None): "None",
    }.get(type(v), type(v).__name__)


def what_went_wrong(entry: Any, want: Any, why: str) -> str:
    """What a failing input got wrong, by category: never the hidden input, never the
    expected value (a feedback page is shared; the inputs are the same for the whole
    class). ``why`` is the question's own description from ``compare``."""
    if not isinstance(entry, dict) or not any(k in entry for k in "etv"):
        return "没有得到结果"
    if "e" in entry:
        name = str(entry["e"]).split(":", 1)[0].strip()[:60] or "异常"
        return f"抛出了 {name}"
    if "t" in entry:
        return "返回了不是纯数据的值（请返回 Python 的 int/float/bool/list/dict）"
    if why:
        return why
    got = entry["v"]
    kg, kw = _kind(got), _kind(want)
    if kg != kw:
        return f"应返回 {kw}，得到 {kg}"
    if isinstance(got, (int, float)) and not isinstance(got, bool) and want:
        rel = got / want
        if got == 0:
            return "得到 0"
        if math.isfinite(rel) and rel > 0 and abs(rel - 1) < 0.1:
            return f"比正确值{'大' if rel > 1 else '小'} {abs(rel - 1):.2%}"
        if math.isfinite(rel):
            return f"是正确值的 {rel:.3g} 倍"
    if isinstance(got, (list, dict)) and len(got) != len(want):
        return f"{kg}的长度不对"
    return "返回值与参考实现不同"


def _share(raw: float, baseline: float) -> float:
    if baseline >= 1 - 1e-9:  # a lab author's mistake: every case has the same answer
        return raw
    return max(0.0, (raw - baseline) / (1 - baseline))


def score_typed(p: Prepared, entries: list) -> dict:
    q = p.question
    results = [_case_result(q, e, w) for e, w in zip(entries, p.wants)]
    types = []
    for ct in q.cases:
        idx = [i for i, (t, _) in enumerate(p.drawn) if t == ct.name]
        passed = [i for i in idx if results[i][0]]
        first = next((i for i in idx if not results[i][0]), None)
        row = {
            "name": ct.name,
            "label": ct.label,
            "weight": ct.weight,
            "passed": len(passed),
            "total": len(idx),
            "fix": ct.fix,
            "first": None,
        }
        if first is not None:  # what was wrong, not the hidden input or its answer
            row["first"] = {
                "what": what_went_wrong(
                    entries[first], p.wants[first], results[first][1]
                )[:600],
            }
        types.append(row)
    raw = _raw_share(q, p.drawn, [r[0] for r in results])
    share = _share(raw, p.baseline)
    n_ok = sum(r[0] for r in results)
    summary = (
        f"全部 {len(results)} 个输入正确"
        if n_ok == len(results)
        else f"{len(results)} 个输入中 {n_ok} 个正确；按类型加权的通过率 {raw:.0%}，"
        f"扣除常数答案可得的 {p.baseline:.0%} 后得 {share:.0%}"
    )
    return {
        "share": share,
        "raw": raw,
        "baseline": p.baseline,
        "summary": summary,
        "types": types,
    }


def _case_result(q: Question, entry: Any, want: Any) -> tuple[bool, str]:
    if not isinstance(entry, dict) or "v" not in entry:
        return False, ""
    return _verdict(q, entry["v"], want)


def score_legacy(p: Prepared, value: Any) -> dict:
    q = p.question
    try:
        verdict = q.check(p.drawn[0][1], value)
        frac, msg = verdict if isinstance(verdict, tuple) else (verdict, "")
        frac = float(frac)
        frac = min(1.0, max(0.0, frac)) if math.isfinite(frac) else 0.0
    except Exception as e:  # garbage in the student's result
        return {
            "share": 0.0,
            "raw": 0.0,
            "baseline": 0.0,
            "types": [],
            "summary": f"结果的形式不对：{type(e).__name__}: {e}",
        }
    msg = str(msg or ("全部正确" if frac == 1 else "部分正确" if frac else "错误"))
    return {"share": frac, "raw": frac, "baseline": 0.0, "summary": msg, "types": []}


def score(p: Prepared, probe: dict) -> dict:
    """Score one question from the worker's probe record; adds ``points`` and
    ``max``."""
    q = p.question
    if not probe.get("ok"):
        out = {
            "share": 0.0,
            "raw": 0.0,
            "baseline": p.baseline,
            "types": [],
            "summary": "隐藏测试没有得到结果：" + str(probe.get("error") or "未运行"),
        }
    elif q.typed:
        entries = probe.get("value")
        if not isinstance(entries, list) or len(entries) != len(p.drawn):
            entries = [None] * len(p.drawn)
        out = score_typed(p, entries)
    else:
        out = score_legacy(p, probe.get("value"))
    out["summary"] = out["summary"][:3000]
    out["points"] = round(q.points * out["share"], 2)
    out["max"] = q.points
    return out
