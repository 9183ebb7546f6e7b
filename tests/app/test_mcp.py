"""`/mcp/{name}`: MCP through runcap, with the official `mcp` SDK on both sides — an `MCPServer`
(Streamable HTTP, in a subprocess: stateful and stateless, SSE and JSON answers) that counts what
it executes, and the SDK's `ClientSession` over its Streamable HTTP client as the agent."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import mcp_types as types
import openai
import pytest
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from proxy.config import ConfigError, build_config
from tests.conftest import REPO, RuncapProcess, free_port, reconcile
from tests.support.mcp_agent import FLAGS, mcp_config, rid, session  # noqa: F401
from tests.support.mcp_server import MCPServerProcess
from tests.support.redis_server import wait_subscribed


def executions(server: MCPServerProcess, tool: str, **args: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in server.stats()["executions"]
        if e["tool"] == tool and all(e["args"].get(k) == v for k, v in args.items())
    ]


def replayed(result: types.CallToolResult) -> bool:
    return bool(result.meta and result.meta.get("runcap/replay"))


async def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


# -- at-most-once ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stateful-sse", "stateless-json", "stateful-json", "stateless-sse"])
async def test_same_call_twice_executes_once(kind, servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers(kind)
    rc = await runcap_factory(mcp_config(server))
    run, order = rid(f"twice-{kind}"), rid("o")
    async with session(f"{rc.url}/mcp/crm", run) as s:
        first = await s.call_tool("refund", {"order_id": order, "amount": 12.0, "reason": "late"})
        # Same arguments in another order: the same operation, replayed from its record.
        again = await s.call_tool("refund", {"reason": "late", "amount": 12.0, "order_id": order})
        assert not replayed(first) and replayed(again)
        assert again.structured_content == first.structured_content and again.content == first.content
        assert len(executions(server, "refund", order_id=order)) == 1
        # readOnlyHint: true — executed every time; unannotated (refund): at most once.
        for _ in range(2):
            looked = await s.call_tool("lookup", {"order_id": order})
            assert not replayed(looked)
        assert len(executions(server, "lookup", order_id=order)) == 2
    state = await rc.run(run)
    assert state["tool_calls_executed"] == 3
    calls = [
        m
        for m in server.stats()["messages"]
        if m["method"] == "tools/call" and m["headers"].get("x-run-id") == run
    ]
    assert len(calls) == 3  # the replay never reached the server
    refund_call, lookup_call = calls[0]["headers"], calls[1]["headers"]
    assert len(refund_call["idempotency-key"]) == 32 and "idempotency-key" not in lookup_call
    # The server's configured header goes to it; the agent's credential does not.
    assert refund_call["x-server-key"] == "server-secret" and "authorization" not in refund_call


async def test_twenty_concurrent_copies_execute_once(servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers("stateful-sse")
    rc = await runcap_factory(mcp_config(server))
    tag = rid("conc")
    async with session(f"{rc.url}/mcp/crm", rid("conc")) as s:
        results = await asyncio.gather(
            *(s.call_tool("slow", {"seconds": 0.3, "tag": tag}) for _ in range(20))
        )
    assert len(executions(server, "slow", tag=tag)) == 1
    assert all(r.content == results[0].content and not r.is_error for r in results)
    assert sum(replayed(r) for r in results) == 19


async def test_two_replicas_sharing_redis(servers, runcap_factory, redis_server, tmp_path):  # type: ignore[no-untyped-def]
    server = servers("stateless-json")
    cfg = mcp_config(server, redis_url=redis_server.url)
    a = await runcap_factory(cfg, data_dir=tmp_path / "a")
    b = await runcap_factory(cfg, data_dir=tmp_path / "b")
    run, order, tag = rid("rep"), rid("o"), rid("t")
    async with session(f"{a.url}/mcp/crm", run) as sa, session(f"{b.url}/mcp/crm", run) as sb:
        first = await sa.call_tool("refund", {"order_id": order, "amount": 3})
        again = await sb.call_tool("refund", {"order_id": order, "amount": 3})
        assert replayed(again) and again.structured_content == first.structured_content
        # Concurrent copies spread over both replicas while the first is in flight.
        results = await asyncio.gather(
            *((sa, sb)[i % 2].call_tool("slow", {"seconds": 0.3, "tag": tag}) for i in range(20))
        )
        # A read-only tool is executed every time, whichever replica saw the listing (none did).
        for s in (sa, sb):
            assert not replayed(await s.call_tool("lookup", {"order_id": order}))
    assert len(executions(server, "refund", order_id=order)) == 1
    assert len(executions(server, "slow", tag=tag)) == 1
    assert len(executions(server, "lookup", order_id=order)) == 2
    assert sum(replayed(r) for r in results) == 19


# -- deadline, cancel, timeout ------------------------------------------------------------------


async def test_a_childs_mcp_call_is_cut_at_its_parents_deadline(servers, runcap_factory):  # type: ignore[no-untyped-def]
    """A sub-run's `tools/call` is bounded by its parent's deadline, earlier than its own, and
    leaves the child `ancestor_deadline_exceeded` (not terminal)."""
    server = servers("stateless-json")
    rc = await runcap_factory(mcp_config(server))
    parent, child, tag = rid("p"), rid("c"), rid("t")
    async with session(f"{rc.url}/mcp/crm", parent, headers={"X-Run-Timeout": "2"}) as s:
        await s.call_tool("lookup", {"order_id": tag})
    kid = {"X-Run-Parent": parent, "X-Run-Timeout": "3600"}
    async with session(f"{rc.url}/mcp/crm", child, headers=kid) as s:
        with pytest.raises(MCPError) as err:
            await s.call_tool("slow", {"seconds": 30, "tag": tag})
        assert err.value.code == -32041 and err.value.data["type"] == "run_deadline_exceeded"
    assert (await rc.run(child))["status"] == "ancestor_deadline_exceeded"


@pytest.mark.parametrize("kind", ["stateful-sse", "stateless-json"])
async def test_deadline_cuts_the_call_and_cancels_it_on_the_server(kind, servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers(kind)
    rc = await runcap_factory(mcp_config(server))
    run, tag = rid("dl"), rid("t")
    async with session(f"{rc.url}/mcp/crm", run, headers={"X-Run-Timeout": "2"}) as s:
        deadline = datetime.fromisoformat((await rc.run(run))["caps"]["deadline"]).timestamp()
        with pytest.raises(MCPError) as err:
            await s.call_tool("slow", {"seconds": 30, "tag": tag})
        late = time.time() - deadline
        assert err.value.code == -32041 and err.value.data["type"] == "run_deadline_exceeded"
        assert -0.2 < late < 3.0  # at the deadline, within a generous margin on a busy machine
        # The run is over: a later call is refused before it reaches the server.
        with pytest.raises(MCPError) as later:
            await s.call_tool("lookup", {"order_id": tag})
        assert later.value.code == -32041
    [execution] = executions(server, "slow", tag=tag)

    def cancelled() -> list[dict[str, Any]]:
        # The notice names the request by its id, which is per session: the run's header (which
        # runcap must send on it) tells this run's from another test's on the shared server.
        notices = [m for m in server.stats()["messages"] if m["method"] == "notifications/cancelled"]
        ours = execution["request_id"]
        notices = [m for m in notices if m["headers"].get("x-run-id") == run]
        return [m for m in notices if str(m["params"]["requestId"]) == ours]

    await wait_for(cancelled)
    if kind.startswith("stateful"):
        # The server cancelled the tool's handler on that notification.
        await wait_for(lambda: [c for c in server.stats()["cancelled"] if c["tag"] == tag])
    assert executions(server, "lookup", order_id=tag) == []
    assert (await rc.run(run))["status"] == "deadline_exceeded"


async def _cancel_in_flight(server: MCPServerProcess, call_url: str, cancel_rc, run: str) -> None:  # type: ignore[no-untyped-def]
    tag = rid("t")
    async with session(call_url, run) as s:
        in_flight = asyncio.create_task(s.call_tool("slow", {"seconds": 30, "tag": tag}))
        await wait_for(lambda: executions(server, "slow", tag=tag))
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{cancel_rc.url}/runs/{run}/cancel", headers=cancel_rc.admin) as r,
        ):
            assert r.status == 200, await r.text()
        with pytest.raises(MCPError) as err:
            await asyncio.wait_for(in_flight, 10)
        assert err.value.code == -32042 and err.value.data["type"] == "run_cancelled"
        with pytest.raises(MCPError) as later:
            await s.call_tool("lookup", {"order_id": tag})
        assert later.value.code == -32042
    # The server saw the cancellation: its handler was cancelled (notifications/cancelled).
    await wait_for(lambda: [c for c in server.stats()["cancelled"] if c["tag"] == tag])
    assert executions(server, "lookup", order_id=tag) == []


async def test_cancel_while_a_call_is_in_flight(servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers("stateful-sse")
    rc = await runcap_factory(mcp_config(server))
    await _cancel_in_flight(server, f"{rc.url}/mcp/crm", rc, rid("cx"))


async def test_cancel_on_one_replica_reaches_a_call_on_another(
    servers, runcap_factory, redis_server, tmp_path
):  # type: ignore[no-untyped-def]
    server = servers("stateful-sse")
    cfg = mcp_config(server, redis_url=redis_server.url)
    a = await runcap_factory(cfg, data_dir=tmp_path / "a")
    b = await runcap_factory(cfg, data_dir=tmp_path / "b")
    # Both replicas listen for cancels: the readiness signal, not a sleep that hopes so.
    await wait_subscribed(redis_server.url, a.ledger.backend.cancel_channel, 2)
    await _cancel_in_flight(server, f"{b.url}/mcp/crm", a, rid("cxr"))


async def test_a_tools_own_timeout_is_a_result_the_model_can_read(servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers("stateful-sse")
    rc = await runcap_factory(mcp_config(server, tools={"slow": {"timeout_s": 0.5}}))
    run, tag = rid("to"), rid("t")
    async with session(f"{rc.url}/mcp/crm", run) as s:
        result = await s.call_tool("slow_read", {"seconds": 30, "tag": tag})  # read-only, timeout_s 0.5
        assert result.is_error and "timeout_s = 0.5" in result.content[0].text
        # The run goes on; a side-effecting call cut by its timeout is `unknown` after it.
        cut = await s.call_tool("slow", {"seconds": 30, "tag": tag})
        assert cut.is_error and "reconciles" in cut.content[0].text
        with pytest.raises(MCPError) as err:
            await s.call_tool("slow", {"seconds": 30, "tag": tag})
        assert err.value.code == -32043 and err.value.data["type"] == "idempotency_outcome_unknown"
        assert not (await s.call_tool("lookup", {"order_id": tag})).is_error
    assert len(executions(server, "slow", tag=tag)) == 1
    assert (await rc.run(run))["status"] == "active"


# -- caps, deny --------------------------------------------------------------------------------


async def test_tool_call_cap_max_calls_per_run_and_deny(servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers("stateful-json")
    rc = await runcap_factory(mcp_config(server, tools={"refund": {"max_calls_per_run": 2}}))
    run = rid("caps")
    o1, o2, o3 = rid("o"), rid("o"), rid("o")
    async with session(f"{rc.url}/mcp/crm", run, headers={"X-Run-Max-Tool-Calls": "3"}) as s:
        listed = {t.name for t in (await s.list_tools()).tools}
        assert "drop_database" not in listed and {"refund", "lookup"} <= listed
        with pytest.raises(MCPError) as denied:
            await s.call_tool("drop_database", {})
        assert denied.value.code == -32044 and denied.value.data["type"] == "tool_denied"

        await s.call_tool("refund", {"order_id": o1, "amount": 1})
        assert replayed(await s.call_tool("refund", {"order_id": o1, "amount": 1}))  # a replay is free
        await s.call_tool("refund", {"order_id": o2, "amount": 1})
        with pytest.raises(MCPError) as per_tool:
            await s.call_tool("refund", {"order_id": o3, "amount": 1})
        assert per_tool.value.code == -32040 and per_tool.value.data["code"] == "max_calls_per_run"
        # Refused by the tool's own cap: not counted against the run's.
        await s.call_tool("lookup", {"order_id": o1})
        with pytest.raises(MCPError) as run_cap:
            await s.call_tool("lookup", {"order_id": o2})
        assert run_cap.value.code == -32040 and run_cap.value.data["code"] == "max_tool_calls"
    assert executions(server, "drop_database") == [] and executions(server, "refund", order_id=o3) == []
    assert executions(server, "lookup", order_id=o2) == []
    state = await rc.run(run)
    assert state["tool_calls_executed"] == 3 and state["status"] == "tool_calls_exceeded"


# -- everything else, unchanged -------------------------------------------------------------------


async def test_everything_but_tools_call_is_relayed_unchanged(servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers("stateful-sse")
    rc = await runcap_factory(mcp_config(server))
    run = rid("relay")
    progress: list[float] = []
    logs: list[Any] = []
    notices: list[Any] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)

    async def on_log(params: types.LoggingMessageNotificationParams) -> None:
        logs.append(params.data)

    async def roots(context: Any) -> types.ListRootsResult:
        return types.ListRootsResult(roots=[types.Root(uri="file:///srv/orders", name="orders")])

    async def on_message(message: Any) -> None:
        notices.append(message)

    kwargs = {"logging_callback": on_log, "list_roots_callback": roots, "message_handler": on_message}
    async with session(f"{rc.url}/mcp/crm", run, **kwargs) as s:
        assert s.initialize_result is not None and s.initialize_result.server_info.name == "runcap-test-crm"
        assert {r.uri for r in (await s.list_resources()).resources} == {"info://server"}
        assert (await s.read_resource("info://server")).contents[0].text == "runcap test CRM"
        templates = (await s.list_resource_templates()).resource_templates
        assert [t.uri_template for t in templates] == ["orders://{order_id}"]
        assert json.loads((await s.read_resource("orders://A1")).contents[0].text)["order_id"] == "A1"
        assert [p.name for p in (await s.list_prompts()).prompts] == ["triage"]
        prompt = await s.get_prompt("triage", {"order_id": "A1"})
        assert "Triage order A1" in prompt.messages[0].content.text
        # Notifications on a call's SSE stream: progress and a log message, relayed as they come.
        done = await s.call_tool("progress", {"steps": 3}, progress_callback=on_progress)
        assert done.content[0].text == "done in 3 steps" and progress == [1, 2, 3] and logs == ["starting"]
        # Server → client on the GET stream: a roots/list request (answered by a POST through
        # runcap) and a tools/list_changed notification.
        await wait_for(lambda: [h for h in server.stats()["http"] if h["headers"].get("x-run-id") == run])
        assert (await s.call_tool("ask_roots", {})).structured_content == {"result": ["file:///srv/orders"]}
        await s.call_tool("announce", {})
        await wait_for(
            lambda: [n for n in notices if "ToolListChanged" in type(n).__name__ or "list_changed" in repr(n)]
        )
    # The session's DELETE went through too, and every message carried the session and run.
    stats = server.stats()
    mine = [m for m in stats["messages"] if m["headers"].get("x-run-id") == run]
    assert {"initialize", "notifications/initialized", "resources/list", "resources/read", "prompts/get"} <= {
        m["method"] for m in mine
    }
    assert any(m["method"] is None for m in mine)  # the client's answer to roots/list
    assert all(m["headers"].get("mcp-session-id") for m in mine if m["method"] != "initialize")
    assert any(h["method"] == "DELETE" and h["headers"].get("x-run-id") == run for h in stats["http"])


async def test_a_resumable_stream_is_resumed_by_runcap(servers, runcap_factory):  # type: ignore[no-untyped-def]
    """SSE polling (2025-11-25): the server closes a call's stream before it answers; runcap
    resumes it with Last-Event-ID, records the outcome and hands the agent one stream."""
    server = servers("resumable")
    rc = await runcap_factory(mcp_config(server))
    run, order = rid("poll"), rid("o")
    async with session(f"{rc.url}/mcp/crm", run) as s:
        first = await s.call_tool("poll_refund", {"order_id": order})
        again = await s.call_tool("poll_refund", {"order_id": order})
    assert first.structured_content["execution"] == 1 and replayed(again)
    assert again.structured_content == first.structured_content
    assert len(executions(server, "poll_refund", order_id=order)) == 1
    assert any(
        h["headers"].get("last-event-id") and h["headers"].get("x-run-id") == run
        for h in server.stats()["http"]
    )


async def test_protocol_2026_without_sessions(servers, runcap_factory):  # type: ignore[no-untyped-def]
    """Revision 2026-07-28 (no initialize, no session; `server/discover`, a `_meta` envelope and
    `Mcp-Method` headers on each request), negotiated by the SDK's high-level Client."""
    server = servers("stateful-sse")
    rc = await runcap_factory(mcp_config(server))
    run, order = rid("modern"), rid("o")
    headers = {"X-Run-Id": run}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=60)) as http,
        Client(streamable_http_client(f"{rc.url}/mcp/crm", http_client=http), mode="auto") as client,
    ):
        assert client.protocol_version == "2026-07-28"
        first = await client.call_tool("refund", {"order_id": order, "amount": 2})
        again = await client.call_tool("refund", {"order_id": order, "amount": 2})
        for _ in range(2):
            await client.call_tool("lookup", {"order_id": order})
    assert replayed(again) and again.structured_content == first.structured_content
    assert len(executions(server, "refund", order_id=order)) == 1
    assert len(executions(server, "lookup", order_id=order)) == 2
    mine = [m for m in server.stats()["messages"] if m["headers"].get("x-run-id") == run]
    assert all("mcp-session-id" not in m["headers"] for m in mine)


async def test_a_batch_is_handled_message_by_message(servers, runcap_factory):  # type: ignore[no-untyped-def]
    """A JSON-RPC array (removed in 2025-06-18, still handled): each message on its own, the
    answers as one array; here from a 2025-06-18 client without a session library."""
    server = servers("stateless-json")
    rc = await runcap_factory(mcp_config(server))
    run, order = rid("batch"), rid("o")
    refund = {"name": "refund", "arguments": {"order_id": order, "amount": 4}}
    batch = [
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": refund},
        {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": 1}},
        {"jsonrpc": "2.0", "id": "two", "method": "tools/call", "params": refund},
    ]
    headers = {
        "X-Run-Id": run,
        "MCP-Protocol-Version": "2025-06-18",
        "Accept": "application/json, text/event-stream",
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{rc.url}/mcp/crm", json=batch, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        answers = await r.json()
    assert [a["id"] for a in answers] == [1, "two"]
    assert answers[1]["result"]["_meta"]["runcap/replay"] is True
    assert answers[1]["result"]["structuredContent"] == answers[0]["result"]["structuredContent"]
    assert len(executions(server, "refund", order_id=order)) == 1
    mine = [m for m in server.stats()["messages"] if m["headers"].get("x-run-id") == run]
    assert {m["headers"]["mcp-protocol-version"] for m in mine} == {"2025-06-18"}


# -- kill -9 and reconcile ------------------------------------------------------------------------


async def test_kill9_during_a_call_then_reconcile(servers, tmp_path: Path):  # type: ignore[no-untyped-def]
    server = servers("stateless-json")
    config = tmp_path / "runcap.toml"
    config.write_text(f'log_requests = false\ntracing = false\n[mcp.crm]\nurl = "{server.url}"\n')
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    tag, run = rid("t"), rid("crash")
    args = {"seconds": 30, "tag": tag}
    try:
        url = f"{proc.url}/mcp/crm"
        # What the agent sees at the kill: the SDK's transport fails with the connection (closed
        # with no answer), its session's task group cancels the call in flight and ends with
        # that error.
        with pytest.raises(ExceptionGroup) as ended:
            async with session(url, run) as s:
                in_flight = asyncio.create_task(s.call_tool("slow", args))
                await wait_for(lambda: executions(server, "slow", tag=tag))
                proc.kill9()
                await asyncio.wait_for(in_flight, 10)
        assert in_flight.cancelled()
        [cause] = ended.value.exceptions
        assert isinstance(cause, httpx2.RemoteProtocolError), repr(cause)
        assert "disconnected without sending a response" in str(cause)
        proc.start()  # same data directory: the dead process's in-flight call is unknown now
        async with session(url, run) as s:
            with pytest.raises(MCPError) as err:
                await s.call_tool("slow", args)
            assert err.value.code == -32043 and err.value.data["type"] == "idempotency_outcome_unknown"

            at = ("--url", proc.url, "--config", str(config), "--data-dir", str(proc.data_dir))
            listed = reconcile(*at, "--json")
            assert listed.returncode == 0, listed.stderr
            [row] = json.loads(listed.stdout)
            assert row["tool"] == "mcp:crm/slow" and row["state"] == "unknown" and row["run_id"] == run
            # The operator's outcome is the MCP `result` a repeat gets (this tool declares an
            # output schema, so it carries structured content too).
            outcome = {
                "content": [{"type": "text", "text": "done by hand"}],
                "structuredContent": {"result": "done by hand"},
            }
            done = reconcile(*at, row["key"], "--done", "--body", json.dumps(outcome))
            assert done.returncode == 0, done.stderr

            result = await s.call_tool("slow", args)
            assert replayed(result) and result.content[0].text == "done by hand"
    finally:
        proc.stop()
    assert len(executions(server, "slow", tag=tag)) == 1


# -- spans: model steps and MCP tool calls in one trace -----------------------------------------


async def test_agent_loop_model_and_mcp_tools_in_one_trace(servers, runcap_factory, upstream):  # type: ignore[no-untyped-def]
    from proxy.queryfiles import bind, load_query
    from tests.support.clickhouse import wait_rows

    server = servers("stateful-sse")
    rc = await runcap_factory(mcp_config(server, tracing=True))
    run, order = rid("loop"), rid("o")
    refund = {"name": "refund", "arguments": {"order_id": order, "amount": 5}}
    # The model asks for the same refund twice (the duplicate on-call asks about), then answers.
    upstream.scripts["mcp-agent"] = [
        {"tool_calls": [refund]},
        {"tool_calls": [refund]},
        {"text": "Refunded."},
    ]
    model = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")
    model_headers = {"X-Run-Id": run, "X-Mock-Script": "mcp-agent"}
    async with session(f"{rc.url}/mcp/crm", run) as s:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in (await s.list_tools()).tools
        ]
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"refund {order}"}]
        for _ in range(5):
            answer = await model.chat.completions.create(
                model="gpt-4o-mini", messages=messages, tools=tools, extra_headers=model_headers
            )
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for tc in message.tool_calls:
                result = await s.call_tool(
                    tc.function.name, json.loads(tc.function.arguments), meta={"runcap/tool_call_id": tc.id}
                )
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": result.content[0].text})
    assert message.content == "Refunded." and len(executions(server, "refund", order_id=order)) == 1

    rows = await wait_rows(
        rc,
        "SELECT kind, tool_name, trace_id, tool_call_id, outcome, args_hash, result_hash, "
        "attributes['mcp.server'] AS server, attributes['mcp.method.name'] AS mcp_method "
        f"FROM runcap.spans WHERE run_id = '{run}' ORDER BY started_at",
        9,
    )
    kinds = sorted(r["kind"] for r in rows)
    assert kinds == ["model"] * 3 + ["tool"] * 2 + ["tool_call"] * 2 + ["tool_result"] * 2
    assert len({r["trace_id"] for r in rows}) == 1  # one trace for the run
    tool_spans = [r for r in rows if r["kind"] == "tool"]
    assert [r["outcome"] for r in tool_spans] == ["ok", "replayed"]
    assert all(
        r["server"] == "crm" and r["mcp_method"] == "tools/call" and r["tool_name"] == "refund"
        for r in tool_spans
    )
    requested = [r for r in rows if r["kind"] == "tool_call"]
    assert {r["tool_call_id"] for r in tool_spans} == {r["tool_call_id"] for r in requested}
    assert {r["args_hash"] for r in tool_spans + requested} == {tool_spans[0]["args_hash"]}
    assert tool_spans[0]["result_hash"] == tool_spans[1]["result_hash"]

    store = rc.runtime.spans.store
    query = load_query("duplicate_side_effects")
    loop = asyncio.get_running_loop()
    columns, found = await loop.run_in_executor(
        None, lambda: store.query(query.sql, bind(query, {"run_id": run}, store))
    )
    by_kind = {r["seen_as"]: r for r in (dict(zip(columns, row, strict=True)) for row in found)}
    assert by_kind["executed"]["times"] == 2 and by_kind["executed"]["replays"] == 1
    assert by_kind["executed"]["later_all_replayed"] is True and by_kind["requested"]["times"] == 2
    # slow_tools: the MCP call is an executed tool call; its replay is left out.
    query = load_query("slow_tools")
    columns, found = await loop.run_in_executor(
        None, lambda: store.query(query.sql, bind(query, {"tool": "refund"}, store))
    )
    executed = [
        dict(zip(columns, row, strict=True)) for row in found if row[columns.index("source")] == "executed"
    ]
    assert executed[0]["calls"] == 1 and executed[0]["errors"] == 0


# -- configuration and OTLP -----------------------------------------------------------------------


def test_configuration_errors_name_the_setting() -> None:
    good = build_config(
        {"mcp": {"crm": {"url": "http://127.0.0.1:9/mcp", "tools": {"refund": {"max_calls_per_run": 1}}}}}
    )
    assert good.mcp["crm"].tools["refund"].max_calls_per_run == 1
    for raw, setting in [
        ({"mcp": {"crm": {}}}, "mcp.crm.url"),
        ({"mcp": {"crm": {"url": "ftp://x/mcp"}}}, "mcp.crm.url"),
        ({"mcp": {"crm": {"url": "http://x", "deny": "drop"}}}, "mcp.crm.deny"),
        ({"mcp": {"crm": {"url": "http://x", "timeout_s": 0}}}, "mcp.crm.timeout_s"),
        (
            {"mcp": {"crm": {"url": "http://x", "tools": {"a": {"max_calls_per_run": 0}}}}},
            "mcp.crm.tools.a.max_calls_per_run",
        ),
        (
            {"mcp": {"crm": {"url": "http://x", "tools": {"a": {"key_fields": "id"}}}}},
            "mcp.crm.tools.a.key_fields",
        ),
        ({"mcp": {"crm": {"url": "http://x", "tools": {"a": {"retries": 1}}}}}, "mcp.crm.tools.a.retries"),
        ({"mcp": {"crm": {"url": "http://x", "tools": {"a": 1}}}}, "mcp.crm.tools.a"),
    ]:
        with pytest.raises(ConfigError) as err:
            build_config(raw)
        assert str(err.value).startswith(setting), err.value


def test_otlp_names_an_mcp_call_by_the_conventions() -> None:
    from datetime import UTC

    from proxy.spans.model import Span
    from proxy.spans.otlp import span_attributes, span_name

    span = Span(
        run_id="r", kind="tool", step=1, started_at=datetime.now(UTC), tool_name="refund",
        tool_call_id="call_1",
        attributes={"mcp.server": "crm", "mcp.method.name": "tools/call", "jsonrpc.request.id": "7"},
    )  # fmt: skip
    attrs = span_attributes(span)
    # the MCP conventions' name, `{mcp.method.name} {target}` (it was `execute_tool refund`)
    assert span_name(span) == "tools/call refund" and attrs["gen_ai.operation.name"] == "execute_tool"
    assert attrs["mcp.method.name"] == "tools/call" and attrs["gen_ai.tool.call.id"] == "call_1"
    assert attrs["jsonrpc.request.id"] == "7" and attrs["runcap.attr.mcp.server"] == "crm"


async def test_the_example_agent(runcap_factory, tmp_path):  # type: ignore[no-untyped-def]
    """examples/mcp: its server, its runcap.toml, its agent — the retry is replayed."""
    import tomllib

    from examples.mcp.agent import run_agent

    server = MCPServerProcess(free_port(), module="examples.mcp.server").start()
    try:
        config = tomllib.loads((REPO / "examples/mcp/runcap.toml").read_text())
        config["mcp"]["crm"]["url"] = server.wait_ready().url
        rc = await runcap_factory(config)
        first, retry = await run_agent(f"{rc.url}/mcp/crm", rid("example"), say=lambda _: None)
    finally:
        server.stop()
    assert not first.pop("replayed") and retry.pop("replayed") and retry == first


async def test_a_call_the_server_refuses_at_the_http_level_is_relayed_and_not_recorded(
    servers, runcap_factory
):  # type: ignore[no-untyped-def]
    """An expired session is a 404 the agent must see (it starts a new session); nothing was
    executed, so the call's record is released and the retry in the new session executes."""
    server = servers("stateful-sse")
    rc = await runcap_factory(mcp_config(server))
    run, order = rid("gone"), rid("o")
    call = {
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "refund", "arguments": {"order_id": order, "amount": 1}},
    }  # fmt: skip
    headers = {
        "X-Run-Id": run, "Mcp-Session-Id": "expired-session", "MCP-Protocol-Version": "2025-11-25",
        "Accept": "application/json, text/event-stream",
    }  # fmt: skip
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{rc.url}/mcp/crm", json=call, headers=headers) as r,
    ):
        assert r.status == 404, await r.text()
    async with session(f"{rc.url}/mcp/crm", run) as s:
        result = await s.call_tool("refund", {"order_id": order, "amount": 1})
    assert not replayed(result) and len(executions(server, "refund", order_id=order)) == 1


def test_sse_events_survive_any_chunking() -> None:
    """The parser relays each event's bytes unchanged, whatever line endings and chunk borders."""
    from proxy.mcp.wire import SSEParser

    stream = (
        b": keep-alive\r\n\r\n\r\n"
        b"id: 7\r\nretry: 100\r\ndata:\r\n\r\n"  # a priming event: an id, no message
        b'event: message\ndata: {"jsonrpc": "2.0",\ndata:  "id": 1, "result": {}}\n\n'
        b'data: {"jsonrpc":"2.0","method":"notifications/progress"}\r\r'
    )
    for size in (1, 2, 3, 7, len(stream)):
        parser = SSEParser(max_event_bytes=1024)
        events = [e for i in range(0, len(stream), size) for e in parser.feed(stream[i : i + size])]
        assert b"".join(e.raw for e in events) == stream
        assert [e.id for e in events] == [None, "7", None, None] and events[1].retry == 100
        assert [e.message() for e in events][2:] == [
            {"jsonrpc": "2.0", "id": 1, "result": {}},
            {"jsonrpc": "2.0", "method": "notifications/progress"},
        ]
