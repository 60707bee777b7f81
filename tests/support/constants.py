"""Constants every helper agrees on."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
"""The checkout: subprocesses run from here so ``python -m fsagent.cli`` finds the code."""

SCOPES = ("task", "agent", "user", "project")
