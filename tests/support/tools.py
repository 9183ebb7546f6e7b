"""The outside tools some tests run (promtool, prometheus, node and the npm packages of tests/):
found, or the test is skipped with the reason — and under CI (`CI=true`) it fails instead, so a
missing install step can never pass as green."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def missing(what: str) -> None:
    message = f"{what} (scripts/setup.sh installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def need_command(name: str, why: str) -> str:
    """The path of command `name` on PATH."""
    found = shutil.which(name)
    if found is None:
        missing(f"{name} is not installed: {why}")
    assert found is not None
    return found


def need_file(path: Path, why: str) -> Path:
    if not path.exists():
        missing(f"{path} is missing: {why}")
    return path
