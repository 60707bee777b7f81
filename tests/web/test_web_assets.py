"""The Files page's static modules, as a real controller serves them.

The browser tests load the page end to end; these checks name the file when
a module is missing from the route, served with a type a browser refuses for
a module script, or imports a name another module does not export.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.support.controller import ControllerProcess

WEB = Path(__file__).resolve().parents[2] / "controller" / "web"
MODULES = sorted(p.name for p in WEB.glob("*.js"))
# `import { a, b } from "./x.js";` (possibly over several lines)
IMPORT = re.compile(r'^import\s*\{([^}]*)\}\s*from\s*"\./([^"]+)";', re.MULTILINE)
EXPORT = re.compile(r"^export\s+(?:async\s+)?(?:function|class|const|let)\s+(\w+)", re.MULTILINE)
MAX_LINES = 600


def imports(source: str) -> list[tuple[str, set[str]]]:
    return [
        (target, {name.strip() for name in names.split(",") if name.strip()})
        for names, target in IMPORT.findall(source)
    ]


@pytest.mark.parametrize(
    "name",
    [*MODULES, *sorted(p.name for p in WEB.glob("*.css")), "index.html", "pdf-viewer.html"],
)
def test_every_page_file_is_served_as_it_is_on_disk(
    controller: ControllerProcess, name: str
) -> None:
    resp = httpx.get(f"{controller.url}/files/static/{name}", timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.content == (WEB / name).read_bytes()
    assert "script-src 'self'" in resp.headers["content-security-policy"]
    assert resp.headers["x-content-type-options"] == "nosniff"
    if name.endswith(".js"):
        # With nosniff, a module script needs a JavaScript type to run at all.
        assert resp.headers["content-type"].split(";")[0] in (
            "text/javascript",
            "application/javascript",
        )


def test_the_asset_route_stays_inside_the_web_folder(controller: ControllerProcess) -> None:
    for name in ("%2e%2e/api/web.py", "..%2fapi%2fweb.py", "missing.js"):
        resp = httpx.get(f"{controller.url}/files/static/{name}", timeout=30)
        assert resp.status_code == 404, name
        assert resp.json()["code"] == "not_found"


def test_modules_import_only_what_their_neighbours_export() -> None:
    exported = {name: set(EXPORT.findall((WEB / name).read_text())) for name in MODULES}
    for name in MODULES:
        for target, names in imports((WEB / name).read_text()):
            assert target in exported, f"{name} imports missing {target}"
            missing = names - exported[target]
            assert not missing, f"{name} imports {sorted(missing)} that {target} does not export"


def test_every_module_is_used_by_the_page_and_stays_small() -> None:
    # Two documents: the page, and the PDF viewer its previews frame.
    entries = [
        re.search(r'<script type="module" src="/files/static/([^"]+)"', (WEB / doc).read_text())
        for doc in ("index.html", "pdf-viewer.html")
    ]
    assert all(entries), entries
    reached: set[str] = set()
    todo = [entry.group(1) for entry in entries if entry]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(target for target, _ in imports((WEB / name).read_text()))
    assert reached == set(MODULES)
    for name in MODULES:
        lines = len((WEB / name).read_text().splitlines())
        assert lines <= MAX_LINES, f"{name} has {lines} lines"
