"""MCP's JSON-RPC shape of runcap's refusals (proxy/mcp/wire.py)."""

from __future__ import annotations

from proxy.errors import BudgetExceeded, RunCancelled
from proxy.mcp.wire import refusal


def test_a_run_tree_refusal_names_the_run_whose_cap_binds() -> None:
    error = refusal(7, BudgetExceeded("max_usd", "X-Run-Max-Usd: run p ...", run="p"))["error"]
    assert error["code"] == -32040
    assert error["data"] == {
        "type": "run_budget_exceeded",
        "code": "max_usd",
        "message": error["message"],
        "run": "p",
    }
    assert "run" not in refusal(7, RunCancelled("run r was cancelled"))["error"]["data"]
