"""The repository stands alone: no pointer to documents or trackers a reader does not
have.

Design notes, style guides and issue numbers live outside the repository; a comment that
says "see DESIGN.md §4" or "(issue 7)" sends a newcomer nowhere. What a contributor
needs is in CONTRIBUTING.md.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = {
    "a design document outside the repo": re.compile(r"DESIGN(\.md)?\s*§|DESIGN\.md"),
    "a style guide outside the repo": re.compile(r"STYLE\.md"),
    "an issue number": re.compile(r"\(issue \d+\)|issue \d+\b|Issue #\d+"),
    "the source documents by section": re.compile(
        r"种子(大纲|第)?\s*\d+(\.\d+)*\s*(节)?"
    ),
}
# Files whose own tests spell out the forbidden patterns as examples.
SELF_TESTING = {"test_repo_hygiene.py", "test_no_source_citations.py"}
SUFFIXES = {
    ".py",
    ".md",
    ".ipynb",
    ".toml",
    ".yml",
    ".yaml",
    ".cfg",
    ".txt",
    ".js",
    ".css",
    "",
}


def _tracked_files():
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    for name in out.stdout.splitlines():
        path = ROOT / name
        if path.suffix in SUFFIXES and path.is_file() and path.name not in SELF_TESTING:
            yield path


def test_no_pointers_outside_the_repository():
    found = []
    for path in _tracked_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for what, pattern in PATTERNS.items():
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found[:40])
