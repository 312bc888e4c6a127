"""The content-hash cache in ``OUT_DIR/.grade_cache.json``: unchanged submissions are
not regraded.

A submission's key covers its bytes (or why it has none), the grader's own code, the
hidden-test module, the settings and the seed; any change to one of them regrades it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .files import read_regular
from .submissions import Submission

CACHE_NAME = ".grade_cache.json"
SEED_NAME = ".grade_seed"  # the class's secret default seed (core.class_seed)
GRADER_VERSION = "2"


def code_digest() -> str:
    """Hash of the grader's own code and template: a changed grader regrades
    everything."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for p in sorted([*here.glob("*.py"), *here.glob("templates/*")]):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def key(sub: Submission, tests_digest: str, settings: dict) -> str:
    h = hashlib.sha256()
    h.update(
        f"{GRADER_VERSION}|{code_digest()}|{tests_digest}|"
        f"{json.dumps(settings, sort_keys=True)}|{sub.note}|".encode()
    )
    try:
        h.update(read_regular(sub.path) if sub.path else sub.problem.encode())
    except OSError as e:
        h.update(repr(e).encode())
    return h.hexdigest()


def load(out: Path) -> dict:
    path = out / CACHE_NAME
    try:
        cache = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def hit(cache: dict, student: str, k: str) -> dict | None:
    entry = cache.get(student)
    if (
        isinstance(entry, dict)
        and entry.get("key") == k
        and isinstance(entry.get("record"), dict)
    ):
        return entry["record"]
    return None


def cacheable(rec: dict) -> bool:
    """A record the next run may reuse: never one the grader or the machine failed
    (grader_error, or a time limit hit while the submission waited for a CPU)."""
    return rec.get("status") != "grader_error" and not rec.get("no_cache")


def dumps(keys: dict[str, str], records: dict[str, dict]) -> str:
    return json.dumps(
        {
            s: {"key": keys[s], "record": records[s]}
            for s in records
            if cacheable(records[s])
        },
        ensure_ascii=False,
        indent=1,
    )
