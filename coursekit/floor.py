"""The floor environment: the lowest library versions the course declares, built for
testing.

``pyproject.toml`` declares a range for every library a notebook imports; its lower
bounds are what older Colab images ship. ``make floor`` builds ``.venv-floor`` at
exactly those lower bounds and runs every chapter and solution in a kernel started from
it (``tests/test_floor.py``; pytest itself runs in ``.venv``). This module turns
``pyproject.toml`` into that environment's pins, so the ranges and the tested versions
come from one place:

    python -m coursekit.floor constraints          # name==lower-bound lines for pip -c
    python -m coursekit.floor requirements # what to install: the project + what the
        notebooks import from its dev extra
    python -m coursekit.floor link-torch .venv-floor # reuse this interpreter's CPU
        torch there

torch is the exception: the floor environment reuses the CPU torch of ``.venv``
(symlinked, never downloaded or rebuilt), as Colab keeps its preinstalled torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Libraries pinned to their declared lower bound in the floor environment.
FLOOR_PACKAGES = ("transformers", "peft", "numpy", "ipython", "ipykernel", "ipywidgets")
#: What the notebooks import besides the project's own dependencies (its ``dev`` extra).
#: The tests themselves run in ``.venv``; only the notebooks' kernel runs here.
FLOOR_TOOLS = ("ipywidgets", "accelerate")


def _requirements(pyproject: Path) -> dict[str, str]:
    """``{name: requirement string}`` of the runtime and ``dev`` dependencies."""
    import tomllib

    from packaging.requirements import Requirement

    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    out = {}
    for spec in [
        *data["dependencies"],
        *data.get("optional-dependencies", {}).get("dev", []),
    ]:
        out[Requirement(spec).name.lower()] = spec
    return out


def floor_pins(pyproject: str | Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``{package: version}``: the ``>=`` lower bound declared for each of
    :data:`FLOOR_PACKAGES`.

    Raises ``ValueError`` naming the package when one has no ``>=`` bound in
    ``pyproject.toml``.
    """
    from packaging.requirements import Requirement

    reqs = _requirements(Path(pyproject))
    pins = {}
    for name in FLOOR_PACKAGES:
        if name not in reqs:
            raise ValueError(
                f"pyproject.toml declares no range for {name!r} (the floor run pins it)"
            )
        lower = [
            s.version for s in Requirement(reqs[name]).specifier if s.operator == ">="
        ]
        if len(lower) != 1:
            raise ValueError(
                f"pyproject.toml: {reqs[name]!r} needs exactly one '>=' lower bound"
            )
        pins[name] = lower[0]
    return pins


def constraints(pyproject: str | Path = ROOT / "pyproject.toml") -> list[str]:
    """pip constraint lines ``name==version`` for the floor environment."""
    return [f"{name}=={version}" for name, version in floor_pins(pyproject).items()]


def requirements(pyproject: str | Path = ROOT / "pyproject.toml") -> list[str]:
    """What the floor environment installs: the project (editable) and
    :data:`FLOOR_TOOLS`, as declared."""
    reqs = _requirements(Path(pyproject))
    missing = [t for t in FLOOR_TOOLS if t not in reqs]
    if missing:
        raise ValueError(
            f"pyproject.toml declares no range for {missing} (the floor run needs them)"
        )
    return ["-e", str(ROOT), *(reqs[t] for t in FLOOR_TOOLS)]


def link_torch(target_venv: str | Path) -> list[Path]:
    """Reuse this interpreter's installed torch in ``target_venv``: its package folders
    are symlinked, its ``.dist-info`` folder (metadata, a few KB) is copied.

    An installer in the target then sees torch as installed and never downloads or
    replaces it. The metadata is a real folder because uv skips a symlinked
    ``.dist-info`` when it lists what is installed (it would fetch torch again);
    pip accepts either. Returns the paths made. Raises ``FileNotFoundError`` when
    ``target_venv`` has no site-packages folder.
    """
    import shutil

    from importlib import metadata

    dist = metadata.distribution("torch")
    site = Path(dist.locate_file("")).resolve()
    target = Path(target_venv).resolve()
    found = sorted(target.glob("lib/python*/site-packages"))
    if not found:
        raise FileNotFoundError(
            f"{target} has no lib/python*/site-packages: "
            "create it with python -m venv first"
        )
    dest = found[0]
    if (
        dest.parent.name != site.parent.name
    ):  # compiled extensions only load in the same Python
        raise ValueError(
            f"{target} is {dest.parent.name} but torch is installed for "
            f"{site.parent.name}: "
            f"create it with the interpreter of {site.parents[2]}"
        )
    tops = {
        Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")
    }
    links = []
    for top in sorted(tops):
        src, link = site / top, dest / top
        if not src.exists() or top.endswith(".pth") or top == "__pycache__":
            continue
        metadata_dir = top.endswith(".dist-info")
        if link.is_symlink() or link.exists():
            if metadata_dir and not link.is_symlink():
                same = (link / "RECORD").read_bytes() == (src / "RECORD").read_bytes()
            else:
                same = link.is_symlink() and link.resolve() == src.resolve()
            if same:
                continue
            what = "a copy of" if metadata_dir else "a link to"
            raise FileExistsError(
                f"{link} exists and is not {what} {src}: delete {target} and rebuild"
            )
        if metadata_dir:
            shutil.copytree(src, link)
        else:
            link.symlink_to(src, target_is_directory=src.is_dir())
        links.append(link)
    return links


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["constraints"] and len(args) == 1:
        print("\n".join(constraints()))
    elif args[:1] == ["requirements"] and len(args) == 1:
        # no spaces inside one requirement: safe to word-split
        print(" ".join(requirements()))
    elif args[:1] == ["link-torch"] and len(args) == 2:
        for link in link_torch(args[1]):
            print(f"linked {link}")
    else:
        print(
            "usage: python -m coursekit.floor constraints | requirements | link-torch "
            "VENV",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
