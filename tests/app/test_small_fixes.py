"""The smaller items of issue 25 (item 13): a plain decimal is the only dollar cap, unknown routes
answer runcap's JSON 404, `raise_for_rejection` knows `idempotency_key_reused`, and
`runcap mock-upstream` neither shares the MCP example's port nor prints test internals."""

from __future__ import annotations

import subprocess
import sys

import aiohttp
import pytest
from mcp.shared.exceptions import MCPError

from proxy import client
from tests.conftest import REPO
from tests.support.mcp_agent import mcp_config, session
from tests.support.raw_http import post_json
from tests.support.tool_agent import call, tools_config
from tests.support.tool_service import ToolService


@pytest.mark.parametrize("value", ["1e3", "1E-2", "+2.50", "NaN", "Infinity", "2.", "0x10"])
async def test_x_run_max_usd_is_a_plain_decimal(runcap, value):  # type: ignore[no-untyped-def]
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    h = {"X-Run-Id": "usd", "X-Run-Max-Usd": value}
    status, answer = await post_json(f"{runcap.openai_url}/chat/completions", body, h)
    assert status == 400
    err = answer["error"]
    assert err["param"] == "X-Run-Max-Usd" and "a decimal like 2.50" in err["message"]


@pytest.mark.parametrize("path", ["/", "/nope", "/v2/chat/completions"])
async def test_unknown_routes_answer_json(runcap, path):  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s, s.get(f"{runcap.url}{path}") as r:
        assert r.status == 404 and r.content_type == "application/json"
        err = (await r.json())["error"]
    assert err["type"] == "not_found" and "/v1/..." in err["message"] and "/tools/{name}" in err["message"]


async def test_raise_for_rejection_knows_a_reused_key(runcap_factory):  # type: ignore[no-untyped-def]
    svc = await ToolService().start()
    try:
        rc = await runcap_factory(tools_config(svc))
        h = {"Idempotency-Key": "my-key-1"}
        status, _, _ = await call(
            f"{rc.url}/tools/refund", "reuse", {"order_id": "A", "amount": 1}, headers=h
        )
        assert status == 200
        status, headers, body = await call(
            f"{rc.url}/tools/refund", "reuse", {"order_id": "B", "amount": 2}, headers=h
        )
        assert status == 422
        with pytest.raises(client.RuncapRejection) as e:
            client.raise_for_rejection(status, body, headers)
        assert type(e.value).__name__ == "IdempotencyKeyReused" and e.value.status == 422
    finally:
        await svc.stop()


def test_mock_upstream_help_and_port() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "mock-upstream", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0
    assert (
        "X-Mock-Script" in done.stdout
        and "For tests" not in done.stdout
        and "max_in_flight" not in done.stdout
    )
    assert "default 127.0.0.1:8790" in done.stdout and "9100" not in done.stdout


async def test_an_mcp_tool_never_listed_is_refused_not_forwarded(servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers("stateful-json")
    rc = await runcap_factory(mcp_config(server))
    run = "mcp-unknown-tool"
    async with session(f"{rc.url}/mcp/crm", run) as s:
        with pytest.raises(MCPError) as err:
            await s.call_tool("no_such_tool", {"x": 1})
        assert err.value.code == -32044 and err.value.data["code"] == "unknown_tool"
        assert not (await s.call_tool("lookup", {"order_id": "Z"})).is_error  # a listed one goes
    called = [
        m["name"] for m in server.stats()["messages"]
        if m["method"] == "tools/call" and m["headers"].get("x-run-id") == run
    ]  # fmt: skip
    assert called == ["lookup"]
