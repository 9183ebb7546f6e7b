"""`queries/duplicate_side_effects.sql` counts what reached the tool (issue 25, item 3).

"I was refunded twice": the operator's answer is how often the call ran, may have run (unknown),
was replayed from its record, or was refused by runcap before the tool — counted apart, never a
refused repeat counted as an execution. One test per outcome, through `/tools` and through an MCP
server (the official `mcp` SDK on both sides), on spans runcap recorded itself.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import aiohttp
import pytest
from mcp.shared.exceptions import MCPError

from proxy.queryfiles import bind, load_query
from tests.support.clickhouse import wait_rows
from tests.support.mcp_agent import mcp_config, session
from tests.support.tool_agent import call, tools_config, wait_for

COUNTS = ("times", "ran", "unknown", "replays", "refused")


def rid(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


async def duplicates(rc, run_id: str, spans: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The run's 'executed' row of duplicate_side_effects, once its `spans` tool spans are in."""
    await wait_rows(rc, f"SELECT 1 FROM runcap.spans WHERE run_id = '{run_id}' AND kind = 'tool'", spans)
    store = rc.runtime.spans.store
    query = load_query("duplicate_side_effects")
    loop = asyncio.get_running_loop()
    columns, rows = await loop.run_in_executor(
        None, lambda: store.query(query.sql, bind(query, {"run_id": run_id}, store))
    )
    found = [dict(zip(columns, row, strict=True)) for row in rows]
    (row,) = [r for r in found if r["seen_as"] == "executed"]
    return row


async def resolve_done(rc, key: str) -> None:  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s, s.post(
        f"{rc.url}/admin/idempotency/{key}/resolve", json={"outcome": "done", "body": "{}"}, headers=rc.admin
    ) as r:  # fmt: skip
        assert r.status == 200, await r.text()


# -- /tools ----------------------------------------------------------------------------------------


async def test_tools_unknown_then_refused_then_replayed(runcap_factory, tool):  # type: ignore[no-untyped-def]
    """The issue's refund: a timeout (it may have run), a 409 repeat, a replay once reconciled —
    it reached the tool once, at most."""
    rc = await runcap_factory(tools_config(tool, tracing=True))
    run = rid("dup-unknown")
    status, _, _ = await call(f"{rc.url}/tools/slow", run, {"sleep_s": 10})
    assert status == 504
    await wait_for(lambda: tool.hits[0].disconnected)
    status, headers, _ = await call(f"{rc.url}/tools/slow", run, {"sleep_s": 10})
    assert status == 409
    await resolve_done(rc, headers["Idempotency-Key"])
    status, headers, _ = await call(f"{rc.url}/tools/slow", run, {"sleep_s": 10})
    assert status == 200 and headers.get("X-Idempotent-Replay") == "true"
    row = await duplicates(rc, run, 3)
    assert {k: row[k] for k in COUNTS} == {"times": 3, "ran": 0, "unknown": 1, "replays": 1, "refused": 1}
    assert row["outcomes"] == ["unknown", "unknown", "replayed"]
    assert tool.executions == 1


async def refund_twice(rc, run: str, body: dict[str, Any], status: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The same refund call twice in `run`, each answered `status`; the run's duplicates row."""
    for _ in range(2):
        got, _, _ = await call(f"{rc.url}/tools/refund", run, body)
        assert got == status
    return await duplicates(rc, run, 2)


async def test_tools_ran_then_replayed(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool, tracing=True))
    run = rid("dup-ran")
    row = await refund_twice(rc, run, {"order_id": "A1", "amount": 5}, 200)
    assert {k: row[k] for k in COUNTS} == {"times": 2, "ran": 1, "unknown": 0, "replays": 1, "refused": 0}
    assert row["later_all_replayed"] is True


async def test_tools_refused_by_a_cap_did_not_reach_the_tool(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool, tracing=True))
    run = rid("dup-cap")
    body = {"order_id": "B2", "amount": 7}
    h = {"X-Run-Max-Tool-Calls": "1"}
    status, _, _ = await call(f"{rc.url}/tools/refund", run, body, headers={**h, "X-Run-Operation-Id": "1"})
    assert status == 200
    status, _, _ = await call(f"{rc.url}/tools/refund", run, body, headers={**h, "X-Run-Operation-Id": "2"})
    assert status == 402
    row = await duplicates(rc, run, 2)
    assert {k: row[k] for k in COUNTS} == {"times": 2, "ran": 1, "unknown": 0, "replays": 0, "refused": 1}
    assert tool.executions == 1


async def test_tools_unreachable_did_not_reach_the_tool(runcap_factory):  # type: ignore[no-untyped-def]
    """A 502 of a tool nobody listens for is an error outcome, yet nothing ran."""
    from tests.conftest import free_port

    dead = {"url": f"http://127.0.0.1:{free_port()}/refund", "side_effects": True}
    rc = await runcap_factory({"tools": {"refund": dead}, "tracing": True})
    run = rid("dup-down")
    row = await refund_twice(rc, run, {"order_id": "C3", "amount": 1}, 502)
    assert {k: row[k] for k in COUNTS} == {"times": 2, "ran": 0, "unknown": 0, "replays": 0, "refused": 2}
    assert row["outcomes"] == ["error", "error"]


# -- MCP -----------------------------------------------------------------------------------------


async def test_mcp_unknown_then_refused(servers, runcap_factory):  # type: ignore[no-untyped-def]
    """An MCP call cut by its timeout, then refused with -32043: it ran at most once, not twice."""
    server = servers("stateful-sse")
    rc = await runcap_factory(mcp_config(server, tools={"slow": {"timeout_s": 0.5}}, tracing=True))
    run, tag = rid("mcp-unknown"), rid("t")
    async with session(f"{rc.url}/mcp/crm", run) as s:
        cut = await s.call_tool("slow", {"seconds": 30, "tag": tag})
        assert cut.is_error
        with pytest.raises(MCPError) as err:
            await s.call_tool("slow", {"seconds": 30, "tag": tag})
        assert err.value.code == -32043
    row = await duplicates(rc, run, 2)
    assert {k: row[k] for k in COUNTS} == {"times": 2, "ran": 0, "unknown": 1, "replays": 0, "refused": 1}


async def test_mcp_ran_then_replayed(servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers("stateful-json")
    rc = await runcap_factory(mcp_config(server, tracing=True))
    run, order = rid("mcp-ran"), rid("o")
    async with session(f"{rc.url}/mcp/crm", run) as s:
        for _ in range(2):
            await s.call_tool("refund", {"order_id": order, "amount": 3.0})
    row = await duplicates(rc, run, 2)
    assert {k: row[k] for k in COUNTS} == {"times": 2, "ran": 1, "unknown": 0, "replays": 1, "refused": 0}
