"""A part a test needs (root, node, the Temporal SDK, a Docker engine...) that this machine lacks.

On a developer's machine a missing part skips the test, with its reason (the suite prints every
skip at the end: tests/conftest.py). Under CI (`CI=true`) it fails instead: CI runs
scripts/setup.sh on a machine it controls, so a part missing there is a broken set-up, not a
reason to report green. Only parts this kind of machine cannot have at all (`machine_lacks`,
e.g. a Docker engine) may skip in CI too. A test module that skips itself at import
(`pytest.importorskip`) is a failure under CI as well (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(reason: str, *, machine_lacks: bool = False) -> None:
    """Skip (or, in CI, fail) the calling test: `reason` says what is missing and how to get it."""
    if in_ci() and not machine_lacks:
        pytest.fail(
            f"missing part under CI=true (scripts/setup.sh should provide it): {reason}", pytrace=False
        )
    pytest.skip(reason)
