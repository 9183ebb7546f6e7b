"""A `tools/call` held for a person over MCP, with keep-alives (proxy/mcp/tools_call.py `_keepalive`,
proxy/mcp/reply.py `LiveReply.open_events`): the official SDK's client with a short HTTP read
timeout waits longer than it for an approval and gets its result once, because runcap answers at
once with an SSE stream and writes a comment (and `notifications/progress`) on it every
`approval_keepalive_s`; with the interval above the timeout the same client times out. A denial
and a cancel end the stream with the refusal the model reads; a client that takes only JSON gets a
JSON answer."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from mcp.shared.exceptions import MCPError

from tests.support.approvals import decide, listed, until_pending
from tests.support.mcp_agent import mcp_config, rid
from tests.support.mcp_agent import session as mcp_session
from tests.support.mcp_server import MCPServerProcess

LARGE = {"name": "large", "when": "args.amount > 100", "effect": "approve", "reason": "over 100"}
READ_TIMEOUT_S = 2.0  # the agent's HTTP read timeout: the longest silence it takes


def held_config(server: MCPServerProcess, keepalive_s: float, **extra: Any) -> dict[str, Any]:
    return mcp_config(
        server, tools={"refund": {"rules": [LARGE]}}, approvals={"approval_keepalive_s": keepalive_s}, **extra
    )


def ran(server: MCPServerProcess, order: str) -> int:
    return len([e for e in server.stats()["executions"] if e["args"].get("order_id") == order])


class Beats:
    """The progress notifications the agent got for its call, and a wait for the n-th."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str | None]] = []
        self._changed = asyncio.Event()

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.seen.append((progress, message))
        self._changed.set()

    async def until(self, n: int, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.seen) < n:
                self._changed.clear()
                await self._changed.wait()


@pytest.mark.parametrize("kind", ["stateful-sse", "stateless-json"])
async def test_keepalives_carry_a_short_read_timeout_through_the_wait(kind, servers, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """Held for longer than the agent's read timeout (beats counted, not slept), then approved:
    the result comes once on the stream runcap opened — the server's SSE events relayed, or its
    JSON answer as an event — and the tool ran once."""
    server = servers(kind)
    rc = await runcap_factory(held_config(server, 0.25))
    run, order = rid("ka"), rid("o")
    args = {"order_id": order, "amount": 500, "currency": "EUR"}
    beats = Beats()
    async with mcp_session(f"{rc.url}/mcp/crm", run, read_timeout_s=READ_TIMEOUT_S) as agent:
        held = asyncio.create_task(agent.call_tool("refund", args, progress_callback=beats))
        # 12 beats of 0.25 s: held for about 3 s, longer than the read timeout
        await beats.until(12)
        assert not held.done() and ran(server, order) == 0
        assert [p for p, _ in beats.seen] == [float(n) for n in range(1, len(beats.seen) + 1)]
        async with aiohttp.ClientSession() as s:
            [row] = await listed(s, rc.url, rc.admin, run=run)
            assert beats.seen[0][1] is not None and row["id"] in beats.seen[0][1]
            assert (await decide(s, rc.url, rc.admin, row["id"], decision="approve", by="alice"))[0] == 200
        result = await asyncio.wait_for(held, 10)
        assert not result.is_error and result.structured_content is not None
        assert result.structured_content["order_id"] == order, result
        assert ran(server, order) == 1
        again = await agent.call_tool("refund", args)  # approved, so not held: replayed at once
        assert not again.is_error and ran(server, order) == 1


async def test_without_keepalives_the_same_client_times_out(servers, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """The interval above the read timeout: nothing reaches the agent in time and its call fails
    — what the keep-alives are for (and proof the test above can fail)."""
    server = servers("stateful-sse")
    rc = await runcap_factory(held_config(server, 30.0))
    run, order = rid("no-ka"), rid("o")
    args = {"order_id": order, "amount": 500, "currency": "EUR"}
    async with mcp_session(f"{rc.url}/mcp/crm", run, read_timeout_s=READ_TIMEOUT_S) as agent:
        held = asyncio.create_task(agent.call_tool("refund", args))
        async with aiohttp.ClientSession() as s:
            await until_pending(s, rc.url, rc.admin, run)
            with pytest.raises(MCPError) as timed_out:  # the SDK's read of the stream timed out
                await asyncio.wait_for(held, 20)
            assert "without a response" in timed_out.value.error.message
            # the agent gave up; runcap still holds the call (a disconnect is not a cancel): end it
            async with s.post(f"{rc.url}/runs/{run}/cancel", headers=rc.admin) as r:
                assert r.status == 200
    assert ran(server, order) == 0


async def test_a_denial_and_a_cancel_end_the_stream_with_the_refusal(servers, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    server = servers("stateful-sse")
    rc = await runcap_factory(held_config(server, 0.25))
    run, denied_order, cancelled_order = rid("ka-end"), rid("d"), rid("c")
    async with mcp_session(f"{rc.url}/mcp/crm", run, read_timeout_s=READ_TIMEOUT_S) as agent:
        async with aiohttp.ClientSession() as s:
            beats = Beats()
            args = {"order_id": denied_order, "amount": 500, "currency": "EUR"}
            denied = asyncio.create_task(agent.call_tool("refund", args, progress_callback=beats))
            await beats.until(2)  # on the stream
            [row] = await listed(s, rc.url, rc.admin, run=run)
            status, _ = await decide(s, rc.url, rc.admin, row["id"], decision="deny", by="bob",
                                     reason="customer already refunded")  # fmt: skip
            assert status == 200
            result = await asyncio.wait_for(denied, 10)
            assert result.is_error and "customer already refunded" in result.content[0].text  # type: ignore[union-attr]
            assert result.meta is not None and result.meta["runcap/refusal"]["code"] == "approval_denied"

            beats = Beats()
            args = {"order_id": cancelled_order, "amount": 700, "currency": "EUR"}
            cancelled = asyncio.create_task(agent.call_tool("refund", args, progress_callback=beats))
            await beats.until(2)
            async with s.post(f"{rc.url}/runs/{run}/cancel", headers=rc.admin) as r:
                assert r.status == 200
            with pytest.raises(MCPError) as e:
                await asyncio.wait_for(cancelled, 10)
            assert e.value.error.code == -32042 and "approval" in e.value.error.message
    assert ran(server, denied_order) + ran(server, cancelled_order) == 0


async def test_a_client_that_takes_only_json_gets_a_json_answer(servers, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """No SSE in its `Accept`: no stream is opened for it, nothing is sent while it waits, and the
    decision's answer is the JSON body it is today."""
    server = servers("stateless-json")
    rc = await runcap_factory(held_config(server, 0.1))
    run, order = rid("json"), rid("o")
    message = {
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "refund", "arguments": {"order_id": order, "amount": 500, "currency": "EUR"},
                   "_meta": {"progressToken": 7}},
    }  # fmt: skip
    headers = {"X-Run-Id": run, "Accept": "application/json", "MCP-Protocol-Version": "2025-06-18"}
    async with aiohttp.ClientSession() as s:
        held = asyncio.create_task(s.post(f"{rc.url}/mcp/crm", json=message, headers=headers))
        [row] = await until_pending(s, rc.url, rc.admin, run)
        assert (await decide(s, rc.url, rc.admin, row["id"], decision="approve"))[0] == 200
        async with await asyncio.wait_for(held, 10) as r:
            assert r.status == 200 and r.content_type == "application/json"
            answer = orjson.loads(await r.read())  # one JSON-RPC response, no progress before it
    assert answer["id"] == 7 and answer["result"]["structuredContent"]["order_id"] == order
    assert ran(server, order) == 1


class RawAgent:
    """An MCP session in plain HTTP (initialize, initialized), to read the bytes of an answer."""

    PROTOCOL = "2025-06-18"

    def __init__(self, s: aiohttp.ClientSession, url: str, run: str) -> None:
        self.s, self.url = s, url
        self.headers = {"X-Run-Id": run, "Accept": "application/json, text/event-stream"}

    async def start(self) -> str:
        init = {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": self.PROTOCOL, "capabilities": {},
                       "clientInfo": {"name": "raw", "version": "1"}},
        }  # fmt: skip
        async with self.s.post(self.url, json=init, headers=self.headers) as r:
            assert r.status == 200
            session = r.headers["Mcp-Session-Id"]
            await r.read()
        self.headers.update({"Mcp-Session-Id": session, "MCP-Protocol-Version": self.PROTOCOL})
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        async with self.s.post(self.url, json=initialized, headers=self.headers) as r:
            assert r.status == 202
        return session

    def refund(self, rid: int, order: str, **meta: Any) -> Any:
        arguments = {"order_id": order, "amount": 500, "currency": "EUR"}
        params: dict[str, Any] = {"name": "refund", "arguments": arguments}
        if meta:
            params["_meta"] = meta
        call = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}
        return self.s.post(self.url, json=call, headers=self.headers)


def data_of(stream: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[5:]) for line in stream.splitlines() if line.startswith(b"data:")]


async def test_the_stream_carries_progress_then_exactly_one_result_and_ends(servers, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """The bytes of a held call's answer: at once a 200 event stream with the session's headers,
    comments and numbered `notifications/progress` while it waits, then — once approved — one
    response for the request, and the end of the stream."""
    server = servers("stateful-sse")
    rc = await runcap_factory(held_config(server, 0.1))
    run, order = rid("bytes"), rid("o")
    async with aiohttp.ClientSession() as s:
        agent = RawAgent(s, f"{rc.url}/mcp/crm", run)
        session = await agent.start()
        async with agent.refund(2, order, progressToken="p-2") as held:
            assert held.status == 200 and held.content_type == "text/event-stream"
            assert held.headers["Mcp-Session-Id"] == session and held.headers["X-Run-Id"] == run
            assert held.headers["Idempotency-Key"]
            waited = b""
            while waited.count(b"notifications/progress") < 3:  # three beats, then the decision
                waited += await asyncio.wait_for(held.content.readline(), 10)
            [row] = await listed(s, rc.url, rc.admin, run=run)
            assert (await decide(s, rc.url, rc.admin, row["id"], decision="approve"))[0] == 200
            rest = await asyncio.wait_for(held.content.read(), 10)  # ends: read returns at its end
    assert waited.startswith(f": runcap: waiting for a person's approval ({row['id']})".encode())
    beats = [m for m in data_of(waited + rest) if m.get("method") == "notifications/progress"]
    assert [m["params"]["progress"] for m in beats] == list(range(1, len(beats) + 1))
    assert {m["params"]["progressToken"] for m in beats} == {"p-2"}
    [answer] = [m for m in data_of(rest) if "id" in m]
    assert answer["id"] == 2 and answer["result"]["structuredContent"]["order_id"] == order
    assert ran(server, order) == 1


async def test_a_server_error_after_the_stream_began_comes_as_an_error_event(servers, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """The session is gone when the approved call is forwarded: the server answers HTTP 404, a
    status runcap can no longer send on the stream it opened — the agent reads it as a JSON-RPC
    error event for its request, and the stream ends."""
    server = servers("stateful-sse")
    rc = await runcap_factory(held_config(server, 0.25))
    run, order = rid("gone"), rid("o")
    async with aiohttp.ClientSession() as s:
        agent = RawAgent(s, f"{rc.url}/mcp/crm", run)
        await agent.start()
        async with agent.refund(2, order) as held:
            assert held.status == 200 and held.content_type == "text/event-stream"
            first = await asyncio.wait_for(held.content.readline(), 10)
            assert first.startswith(b": runcap: waiting for a person's approval")
            async with s.delete(agent.url, headers=agent.headers) as r:  # the session ends meanwhile
                assert r.status in (200, 204)
            [row] = await listed(s, rc.url, rc.admin, run=run)
            assert (await decide(s, rc.url, rc.admin, row["id"], decision="approve"))[0] == 200
            rest = await asyncio.wait_for(held.content.read(), 10)
    [answer] = [m for m in data_of(rest) if m.get("id") == 2]
    assert "HTTP 404" in answer["error"]["message"] and "start a new one" in answer["error"]["message"]
    assert answer["error"]["data"]["type"] == "upstream_unavailable"
    assert ran(server, order) == 0
