"""The generated reference pages (docs/reference/openapi.*, cli.md) match the
code: a route, a schema or a flag changed without ``python docs/gen_api.py``
fails here."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.support.constants import REPO


def gen_api() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", REPO / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_pages_are_up_to_date() -> None:
    for path, text in gen_api().pages().items():
        assert path.exists(), f"{path} missing: run python docs/gen_api.py"
        assert path.read_text() == text, f"{path} is out of date: run python docs/gen_api.py"


def test_openapi_json_is_what_the_controller_serves() -> None:
    import json

    from controller.api import openapi

    served = json.loads((REPO / "docs" / "reference" / "openapi.json").read_text())
    assert served == openapi.document()
