"""Where the course's notebooks are, for the tests."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def book_notebooks() -> list[Path]:
    return sorted((ROOT / "book").glob("*.ipynb"))


def solution_notebooks() -> list[Path]:
    return sorted((ROOT / "solutions").glob("*.ipynb"))


def all_notebooks() -> list[Path]:
    return book_notebooks() + solution_notebooks()


def tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))
