"""The two tool gateways share proxy/toolcall/ and nothing else: `/mcp` (proxy/mcp/) does not
import `/tools` (proxy/server/tools.py), `/tools` does not import `/mcp`, and the shared package
imports neither — so a change to one wire cannot reach the other's at-most-once path."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PROXY = Path(__file__).resolve().parent.parent / "proxy"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (a function-level import counts too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _under(modules: set[str], package: str) -> set[str]:
    return {m for m in modules if m == package or m.startswith(package + ".")}


@pytest.mark.parametrize("path", sorted((PROXY / "mcp").glob("*.py")), ids=lambda p: p.name)
def test_mcp_does_not_import_the_tools_gateway(path: Path) -> None:
    assert not _under(imported_modules(path), "proxy.server.tools")


def test_tools_gateway_does_not_import_mcp() -> None:
    assert not _under(imported_modules(PROXY / "server" / "tools.py"), "proxy.mcp")


@pytest.mark.parametrize("path", sorted((PROXY / "toolcall").glob("*.py")), ids=lambda p: p.name)
def test_shared_tool_call_package_imports_neither_gateway(path: Path) -> None:
    modules = imported_modules(path)
    assert not _under(modules, "proxy.mcp")
    assert not _under(modules, "proxy.server.tools")


def test_the_check_sees_a_gateway_import(tmp_path: Path) -> None:
    # The check itself can fail: an import of the other gateway, even inside a function, is seen.
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from proxy.server import tools\n    import proxy.mcp.gateway\n")
    modules = imported_modules(planted)
    assert _under(modules, "proxy.server.tools") and _under(modules, "proxy.mcp")
