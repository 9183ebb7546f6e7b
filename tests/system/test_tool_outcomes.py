"""One outcome rule for `/tools` and MCP `tools/call` (proxy/toolcall/outcome.py): once a call's
bytes may have reached the server, its outcome is what the server answered (recorded, replayed)
or `unknown` — never "not executed". A server executes each call and then answers with a 504
without a body, a proxy's 502, a reset, an unparseable body or a JSON-RPC error: three tries of
the same call execute once, on both gateways, across a restart of runcap and across two replicas
sharing Redis."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import RuncapProcess
from tests.support.edge_server import EdgeServer

MODES = ("504", "502", "reset", "garbage", "rpc-error")


def name(mode: str) -> str:
    return "x" + mode.replace("-", "")


def gateways_config(edge: EdgeServer) -> dict[str, Any]:
    return {
        "tools": {f"t{name(m)}": {"url": f"{edge.url}/{m}/tool", "side_effects": True} for m in MODES},
        "mcp": {
            f"m{name(m)}": {
                "url": f"{edge.url}/{m}/mcp",
                "headers": {"X-Server-Key": "server-secret"},
                "tools": {"refund": {"side_effects": True}},
            }
            for m in MODES
        },
    }


def toml(config: dict[str, Any]) -> str:
    lines = ["log_requests = false", "tracing = false"]
    for tool, t in config["tools"].items():
        lines += [f"[tools.{tool}]", f'url = "{t["url"]}"', "side_effects = true"]
    for server, s in config["mcp"].items():
        lines += [f"[mcp.{server}]", f'url = "{s["url"]}"', 'headers = { X-Server-Key = "server-secret" }']
        lines += [f"[mcp.{server}.tools.refund]", "side_effects = true"]
    return "\n".join(lines) + "\n"


@pytest.fixture
async def edge() -> AsyncIterator[EdgeServer]:
    server = await EdgeServer().start()
    yield server
    await server.stop()


# Each case: (gateway, mode, method); PUT is there because an HTTP client may resend a PUT whose
# connection reset on its own ("idempotent" methods): a second execution of a tool call.
CASES = (
    [("tools", m, "POST") for m in MODES] + [("tools", "reset", "PUT")] + [("mcp", m, "POST") for m in MODES]
)


async def attempt(http: aiohttp.ClientSession, base: str, run: str, case: tuple[str, str, str], order: str):  # type: ignore[no-untyped-def]
    """One try of the case's call; returns (HTTP status, headers, body as JSON or text)."""
    gateway, mode, method = case
    headers = {"X-Run-Id": run}
    if gateway == "tools":
        url, body = f"{base}/tools/t{name(mode)}", {"order_id": order, "amount": 1}
    else:
        url = f"{base}/mcp/m{name(mode)}"
        body = {
            "jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "refund", "arguments": {"order_id": order, "amount": 1}},
        }  # fmt: skip
        headers["Accept"] = "application/json, text/event-stream"
    async with http.request(method, url, json=body, headers=headers) as r:
        text = await r.text()
        try:
            parsed: Any = await r.json(content_type=None)
        except ValueError:
            parsed = text
        return r.status, r.headers, parsed


def is_repeat_answer(case: tuple[str, str, str], answer: tuple[int, Any, Any]) -> bool:
    """A repeat gets the recorded outcome (a replay) or the unknown-outcome refusal."""
    status, headers, body = answer
    if headers.get("X-Idempotent-Replay") == "true":
        return True
    if case[0] == "tools":
        return status == 409 and body["error"]["type"] == "idempotency_outcome_unknown"
    return isinstance(body, dict) and body.get("error", {}).get("code") == -32043


def orders(run: str) -> dict[tuple[str, str, str], str]:
    return {case: f"{run}-{'-'.join(case)}" for case in CASES}


def executions(edge: EdgeServer, case: tuple[str, str, str], order: str) -> int:
    return edge.executions[(case[1], order)]


async def test_one_execution_across_a_restart_of_runcap(edge: EdgeServer, tmp_path: Path) -> None:
    config = tmp_path / "runcap.toml"
    config.write_text(toml(gateways_config(edge)))
    run = f"restart-{secrets.token_hex(4)}"
    want = orders(run)
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        async with aiohttp.ClientSession() as http:
            for case, order in want.items():
                await attempt(http, proc.url, run, case, order)
    finally:
        proc.stop()
    assert {case: executions(edge, case, order) for case, order in want.items()} == dict.fromkeys(CASES, 1)
    proc = RuncapProcess(config, tmp_path / "data")  # the same data directory: the same ledger
    proc.start()
    try:
        async with aiohttp.ClientSession() as http:
            for case, order in want.items():
                for _ in range(2):
                    answer = await attempt(http, proc.url, run, case, order)
                    assert is_repeat_answer(case, answer), (case, answer)
    finally:
        proc.stop()
    counted = {case: executions(edge, case, order) for case, order in want.items()}
    assert counted == dict.fromkeys(CASES, 1)


async def test_one_execution_across_two_replicas_on_redis(  # type: ignore[no-untyped-def]
    edge: EdgeServer, runcap_factory, redis_server, tmp_path: Path
) -> None:
    cfg = {**gateways_config(edge), "redis_url": redis_server.url}
    a = await runcap_factory(cfg, data_dir=tmp_path / "a")
    b = await runcap_factory(cfg, data_dir=tmp_path / "b")
    assert a.ledger.name == "redis"
    run = f"replicas-{secrets.token_hex(4)}"
    want = orders(run)
    async with aiohttp.ClientSession() as http:
        for case, order in want.items():
            await attempt(http, a.url, run, case, order)
            for replica in (b, a):
                answer = await attempt(http, replica.url, run, case, order)
                assert is_repeat_answer(case, answer), (case, answer)
    counted = {case: executions(edge, case, order) for case, order in want.items()}
    assert counted == dict.fromkeys(CASES, 1)


async def test_a_call_that_never_left_is_released(runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """Connection refused: provably not executed, so the record is released — each new attempt
    is tried again (and says "unreachable"), none is refused as "outcome unknown"."""
    from tests.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    cfg = {
        "tools": {"gone": {"url": f"{dead}/ok/tool", "side_effects": True}},
        "mcp": {"gone": {"url": f"{dead}/ok/mcp", "tools": {"refund": {"side_effects": True}}}},
    }
    rc = await runcap_factory(cfg)
    run = f"gone-{secrets.token_hex(4)}"
    headers = {"X-Run-Id": run, "Accept": "application/json, text/event-stream"}
    call = {
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "refund", "arguments": {"order_id": "o-1"}},
    }  # fmt: skip
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(f"{rc.url}/tools/gone", json={"order_id": "o-1"}, headers=headers) as r:
                body = await r.json()
                assert r.status == 502 and "unreachable" in body["error"]["message"], body
            async with http.post(f"{rc.url}/mcp/gone", json=call, headers=headers) as r:
                body = await r.json()
                assert (
                    body["error"]["code"] != -32043 and "unreachable" in body["error"]["data"]["message"]
                ), body
