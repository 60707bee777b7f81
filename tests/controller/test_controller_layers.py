"""The controller's API layer stays thin: no SQL of its own, no route module
importing another.

Route modules parse, authorize, call the domain layer (``controller/*.py``)
and serialize (``api/serialize.py``); what two of them share lives in a
module that has no routes (``api/objects.py``, ``api/common.py``).
"""

from __future__ import annotations

import ast

import pytest

from tests.support.constants import REPO

API = REPO / "controller" / "api"
MODULES = sorted(p.stem for p in API.glob("*.py") if p.stem != "__init__")
# The connection helpers open transactions; nothing else in api/ talks SQL.
SQL_ALLOWED = {"common"}
# Modules whose job is to assemble the route modules.
ASSEMBLERS = {"app", "openapi"}


def tree(name: str) -> ast.Module:
    return ast.parse((API / f"{name}.py").read_text("utf-8"), f"{name}.py")


def route_modules() -> set[str]:
    found = set()
    for name in MODULES:
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.Name) and node.id == "Route":
                found.add(name)
    return found - ASSEMBLERS


def api_imports(module: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and node.module == "controller.api":
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("controller.api."):
                names.add(node.module.removeprefix("controller.api.").split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("controller.api."):
                    names.add(alias.name.removeprefix("controller.api.").split(".")[0])
    return names


def test_the_route_modules_are_found() -> None:
    assert {"workfolders", "bridge", "web"} <= route_modules()


@pytest.mark.parametrize("name", sorted(set(MODULES) - SQL_ALLOWED))
def test_api_module_runs_no_sql(name: str) -> None:
    calls = [
        node.lineno
        for node in ast.walk(tree(name))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("execute", "executemany", "cursor")
    ]
    assert calls == [], f"controller/api/{name}.py runs SQL at lines {calls}: use a domain function"


@pytest.mark.parametrize("name", sorted(route_modules()))
def test_route_module_imports_no_other_route_module(name: str) -> None:
    siblings = api_imports(tree(name)) & (route_modules() - {name})
    assert siblings == set(), f"controller/api/{name}.py imports route modules {siblings}"


def test_checks_see_a_violation() -> None:
    """The checks above would notice SQL and a sibling import (not vacuous)."""
    module = ast.parse(
        "from controller.api.workfolders import object_response\n"
        "async def f(conn):\n    await conn.execute('SELECT 1')\n"
    )
    assert api_imports(module) == {"workfolders"}
    assert any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "execute"
        for n in ast.walk(module)
    )
