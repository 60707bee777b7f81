"""ARCHITECTURE.md's "Code map" names every module of fsagent/, controller/
and common/, and nothing that does not exist.

The map's convention: under a heading ``### `fsagent/` ...`` each table row
names one path in its first cell, relative to that directory (``cli.py``,
``api/app.py``) or from the repository root (``common/paths.py``). A
directory's row (``db/``, ``commands/``) names its ``__init__.py``; the
heading names the top package's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fsagent", "controller", "common")

_HEADING = re.compile(r"^### `([a-z_]+)/`")
_ROW = re.compile(r"^\| `([^`]+)` \|")


def code_map() -> str:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    start = text.index("\n## Code map\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def named_paths() -> set[str]:
    """Every path the map names under the packages' headings, from the root."""
    named: set[str] = set()
    package: str | None = None
    for line in code_map().splitlines():
        if line.startswith("### "):
            heading = _HEADING.match(line)
            package = heading[1] if heading and heading[1] in PACKAGES else None
            if package is not None:
                named.add(f"{package}/")
            continue
        row = _ROW.match(line)
        if package is None or row is None or row[1] in ("module", "file"):
            continue
        name = row[1]
        named.add(name if name.startswith(f"{package}/") else f"{package}/{name}")
    return named


def modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_every_module_is_in_the_code_map() -> None:
    named = named_paths()
    missing = sorted(
        m
        for m in modules()
        if m not in named and not (m.endswith("/__init__.py") and m[: -len("__init__.py")] in named)
    )
    assert not missing, f"modules missing from ARCHITECTURE.md's code map: {missing}"


def test_the_code_map_names_only_what_exists() -> None:
    gone = sorted(p for p in named_paths() if not (ROOT / p).exists())
    assert not gone, f"ARCHITECTURE.md's code map names what does not exist: {gone}"


def test_the_code_map_is_read() -> None:
    # The parser itself: a map it could not read would pass the tests above
    # only if nothing were named, so some of each package must be.
    named = named_paths()
    for package in PACKAGES:
        assert any(p.startswith(f"{package}/") and p.endswith(".py") for p in named), package
