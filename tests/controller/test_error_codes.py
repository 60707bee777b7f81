"""The documented error table (docs/reference/errors.md) and the controller's
errors agree, both ways."""

from __future__ import annotations

import re

import controller.api.app as app_module
from common.errors import AppError, Conflict, QuotaExceeded, WorkFolderError
from fsagent.errors import FsagentError
from tests.support.constants import REPO

ABSTRACT = {Conflict, QuotaExceeded}
"""Grouping classes that are never raised themselves."""


def _subclasses(cls: type[WorkFolderError]) -> set[type[WorkFolderError]]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def controller_codes() -> dict[str, int]:
    classes = {WorkFolderError, *_subclasses(WorkFolderError)} - ABSTRACT
    codes = {cls.code: cls.status for cls in classes}
    source = (REPO / "controller/api/app.py").read_text()
    for status, code in re.findall(r'(\d{3}): "([a-z0-9_]+)"', source):
        codes[code] = int(status)
    return codes


def documented_codes() -> dict[str, int]:
    section = (REPO / "docs" / "reference" / "errors.md").read_text()
    codes: dict[str, int] = {}
    for status, cell in re.findall(r"^\| (\d{3}) \| ([^|]+) \|", section, re.M):
        for code in re.findall(r"`([a-z0-9_]+)`", cell):
            codes[code] = int(status)
    return codes


def test_documented_error_table_matches_the_code() -> None:
    assert app_module.create_app is not None  # every API module (and its errors) is imported
    assert documented_codes() == controller_codes()


def test_codes_are_unique_and_both_sides_share_the_root() -> None:
    classes = [c for c in {WorkFolderError, *_subclasses(WorkFolderError)} if c not in ABSTRACT]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), sorted(codes)
    assert issubclass(WorkFolderError, AppError) and issubclass(FsagentError, AppError)
