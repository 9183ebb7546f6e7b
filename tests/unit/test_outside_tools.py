"""tests/support/tools.py: a test whose outside tool (promtool, prometheus, node, the npm
packages) is missing is skipped on a developer's machine and fails under CI (`CI=true`), so a
set-up that forgot to install it cannot pass as green."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tools import need_command, need_file


def test_a_missing_tool_skips_outside_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="runcap-no-such-tool is not installed"):
        need_command("runcap-no-such-tool", "for this test")
    with pytest.raises(pytest.skip.Exception, match=r"scripts/setup\.sh installs it"):
        need_file(tmp_path / "node_modules", "npm ci")


def test_a_missing_tool_fails_under_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="runcap-no-such-tool is not installed"):
        need_command("runcap-no-such-tool", "for this test")
    with pytest.raises(pytest.fail.Exception, match="node_modules is missing"):
        need_file(tmp_path / "node_modules", "npm ci")


def test_a_tool_that_is_there_is_found() -> None:
    assert need_command("sh", "a shell").endswith("/sh")
