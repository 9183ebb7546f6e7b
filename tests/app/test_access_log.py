"""The access log has one line per model call and per tool call (issue 25, item 12): `/tools`
and MCP `tools/call` included, and a request refused for a bad run header still names its run
when its X-Run-Id was valid."""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest

from tests.support.mcp_agent import mcp_config, session
from tests.support.tool_agent import call, tools_config


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "runcap.access"]


async def test_tools_calls_are_logged(runcap_factory, tool, caplog):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="runcap.access")
    rc = await runcap_factory({**tools_config(tool), "log_requests": True})
    for _ in range(2):
        status, _, _ = await call(f"{rc.url}/tools/refund", "acc-1", {"order_id": "A1", "amount": 5})
        assert status == 200
    logged = [line for line in lines(caplog) if line.get("tool") == "refund"]
    assert [(x["run_id"], x["method"], x["path"], x["status"], x["outcome"]) for x in logged] == [
        ("acc-1", "POST", "/tools/refund", 200, "ok"),
        ("acc-1", "POST", "/tools/refund", 200, "replayed"),
    ]
    assert len(logged[0]["idempotency_key"]) == 32


async def test_a_bad_header_names_the_valid_run(runcap_factory, tool, caplog):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="runcap.access")
    rc = await runcap_factory({**tools_config(tool), "log_requests": True})
    bad = {"X-Run-Id": "acc-2", "X-Run-Max-Steps": "three"}
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{rc.openai_url}/chat/completions", json={"model": "gpt-4o", "messages": []}, headers=bad
        ) as r:
            assert r.status == 400
    status, _, _ = await call(f"{rc.url}/tools/refund", "acc-2", {"order_id": "B"}, headers=bad)
    assert status == 400
    refused = [line for line in lines(caplog) if line["status"] == 400]
    assert [x["run_id"] for x in refused] == ["acc-2", "acc-2"]


async def test_mcp_tools_call_is_logged(servers, runcap_factory, caplog):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="runcap.access")
    rc = await runcap_factory({**mcp_config(servers("stateful-json")), "log_requests": True})
    async with session(f"{rc.url}/mcp/crm", "acc-3") as s:
        await s.call_tool("lookup", {"order_id": "C"})
    (line,) = [x for x in lines(caplog) if x.get("mcp_server") == "crm"]
    assert (line["run_id"], line["path"], line["tool"], line["status"], line["outcome"]) == (
        "acc-3", "/mcp/crm", "lookup", 200, "ok",
    )  # fmt: skip
