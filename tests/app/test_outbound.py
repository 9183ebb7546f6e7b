"""Every outbound call of runcap (proxy/server/outbound.py) — model, pass-through, tools, MCP relay,
MCP GET/DELETE, runcap's own MCP `tools/list`, cancel notices, runcap's own model calls within a
run (a summary) — against a server that answers 307 to another origin, and one that hangs past
the run's deadline: no redirect is followed (the other origin sees nothing, so no configured
secret reaches it), and every call is cut at the run's deadline — also a request without
`X-Run-Id`, whose deadline is the operator's `[caps] default_timeout_s`."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from proxy.context.summarize import SUMMARY_INSTRUCTION
from tests.support.edge_server import EdgeServer

TIMEOUT_S = 1.0  # every run's deadline: [caps] default_timeout_s


@pytest.fixture
async def edges() -> AsyncIterator[tuple[EdgeServer, EdgeServer]]:
    other = await EdgeServer().start()
    edge = await EdgeServer(hang_s=10.0, other=other).start()
    yield edge, other
    await edge.stop()
    await other.stop()


def config(edge: EdgeServer) -> dict[str, Any]:
    upstreams = {m: {"url": f"{edge.url}/{m}", "api_key_env": "EDGE_KEY"} for m in ("redirect", "hang")}
    return {
        "upstreams": upstreams,
        "tools": {
            m: {
                "url": f"{edge.url}/{m}/tool",
                "headers": {"X-Tool-Secret": "tool-secret"},
                "side_effects": True,
            }
            for m in ("redirect", "hang")
        },
        "mcp": {
            m: {
                "url": f"{edge.url}/{m}/mcp",
                "headers": {"X-Server-Key": "server-secret"},
                "tools": {"refund": {"side_effects": True}},  # "lookup" is listed by runcap first
            }
            for m in ("redirect", "hang")
        },
        "caps": {"default_timeout_s": TIMEOUT_S},
        "context": {
            "summary_model": "gpt-4o-mini",
            "summarize_above_tokens": 50,
            "summary_keep_first": 1,
            "summary_keep_last": 1,
        },
    }


CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
LONG_CHAT = {
    "model": "gpt-4o",
    "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 40}
        for i in range(7)
    ],
}


def rpc(method: str, rid: int | None = 1, **params: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    if rid is not None:
        message["id"] = rid
    return message


MCP_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"}


async def eventually(condition: Callable[[], bool]) -> bool:
    """`condition` holds now or within a few seconds (the server sees a cut connection a moment
    after runcap has answered the agent)."""
    for _ in range(100):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


async def send(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    async with http.request(method, url, json=body, headers=headers or {}, allow_redirects=False) as r:
        text = await r.text()
        try:
            return r.status, await r.json(content_type=None)
        except ValueError:
            return r.status, text


async def test_no_outbound_call_follows_a_redirect(edges, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    edge, other = edges
    rc = await runcap_factory(config(edge), env={"EDGE_KEY": "sk-upstream-secret"})
    run = {"X-Run-Id": f"redir-{secrets.token_hex(4)}"}
    mcp = f"{rc.url}/mcp/redirect"
    async with aiohttp.ClientSession() as http:
        answers = {
            "model": await send(http, "POST", f"{rc.url}/u/redirect/v1/chat/completions", CHAT, run),
            "pass-through POST": await send(
                http, "POST", f"{rc.url}/u/redirect/v1/images/generations", {}, run
            ),
            "pass-through GET": await send(http, "GET", f"{rc.url}/u/redirect/v1/models", None, run),
            "tool": await send(http, "POST", f"{rc.url}/tools/redirect", {"order_id": "o-1"}, run),
            "tool again": await send(http, "POST", f"{rc.url}/tools/redirect", {"order_id": "o-1"}, run),
            "mcp relay": await send(
                http, "POST", mcp, rpc("resources/read", uri="file:///a"), {**run, **MCP_HEADERS}
            ),
            "mcp tools/call": await send(
                http,
                "POST",
                mcp,
                rpc("tools/call", name="refund", arguments={"order_id": "o-2"}),
                {**run, **MCP_HEADERS},
            ),
            "mcp GET": await send(http, "GET", mcp, None, {**run, **MCP_HEADERS}),
            "mcp DELETE": await send(http, "DELETE", mcp, None, {**run, **MCP_HEADERS}),
        }
        locations = []
        for _ in range(2):
            async with http.post(
                f"{rc.url}/tools/redirect", json={"order_id": "o-3"}, headers=run, allow_redirects=False
            ) as r:
                locations.append((r.status, r.headers.get("Location"), r.headers.get("X-Idempotent-Replay")))
        # runcap's own tools/list, before a call to a tool it has not seen listed
        listed = await send(
            http, "POST", mcp, rpc("tools/call", name="lookup", arguments={"q": 1}), {**run, **MCP_HEADERS}
        )
        # runcap's own model call within the run: the summary of a long conversation
        summarized = await send(
            http, "POST", f"{rc.url}/u/redirect/v1/chat/completions", LONG_CHAT,
            {**run, "X-Run-Context-Policy": "summarize"},
        )  # fmt: skip
    # A 3xx is an answer: relayed to the agent as it is.
    assert {what: status for what, (status, _) in answers.items()} == dict.fromkeys(answers, 307)
    assert listed[0] == 307 and summarized[0] in (307, 502), summarized
    bodies = [h.body for h in edge.on("redirect")]
    assert any(b'"tools/list"' in b and b"runcap-tools-list" in b for b in bodies)  # runcap's own listing
    assert any(SUMMARY_INSTRUCTION.encode() in b for b in bodies)  # runcap's own summary call
    # The tool's 307 was its outcome: recorded, replayed (with its Location), reached once.
    assert answers["tool again"] == answers["tool"]
    where = f"{other.url}/redirect/tool"
    assert locations == [(307, where, None), (307, where, "true")]
    assert len([h for h in edge.on("redirect") if h.path == "/redirect/tool"]) == 2  # o-1 and o-3
    # Nothing reached the other origin: not a request, not a secret.
    assert other.hits == []


async def test_every_outbound_call_is_cut_at_the_runs_deadline(edges, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    edge, other = edges
    rc = await runcap_factory(config(edge), env={"EDGE_KEY": "sk-upstream-secret"})
    mcp = f"{rc.url}/mcp/hang"
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        chat = f"{rc.url}/u/hang/v1/chat/completions"
        answers = {
            "model": await send(http, "POST", chat, CHAT, {"X-Run-Id": f"m-{secrets.token_hex(4)}"}),
            "model, no run id": await send(http, "POST", chat, CHAT),
            # The case: a pass-through call without X-Run-Id ran past the operator's timeout.
            "pass-through, no run id": await send(http, "POST", f"{rc.url}/u/hang/v1/images/generations", {}),
            "pass-through GET": await send(http, "GET", f"{rc.url}/u/hang/v1/models", None),
            "tool": await send(
                http,
                "POST",
                f"{rc.url}/tools/hang",
                {"order_id": "o-1"},
                {"X-Run-Id": f"t-{secrets.token_hex(4)}"},
            ),
            "mcp relay, no run id": await send(
                http, "POST", mcp, rpc("resources/read", uri="file:///a"), MCP_HEADERS
            ),
            "mcp tools/call": await send(
                http,
                "POST",
                mcp,
                rpc("tools/call", name="refund", arguments={"order_id": "o-2"}),
                {"X-Run-Id": f"c-{secrets.token_hex(4)}", **MCP_HEADERS},
            ),
            "mcp GET, no run id": await send(http, "GET", mcp, None, MCP_HEADERS),
            "mcp DELETE, no run id": await send(http, "DELETE", mcp, None, MCP_HEADERS),
            "summary": await send(
                http,
                "POST",
                chat,
                LONG_CHAT,
                {"X-Run-Id": f"s-{secrets.token_hex(4)}", "X-Run-Context-Policy": "summarize"},
            ),
        }
        listing = await send(
            http, "POST", mcp, rpc("tools/call", name="lookup", arguments={"q": 1}),
            {"X-Run-Id": f"l-{secrets.token_hex(4)}", **MCP_HEADERS},
        )  # fmt: skip

    def deadline(answer: tuple[int, Any]) -> bool:
        status, body = answer
        if isinstance(body, dict) and body.get("jsonrpc") == "2.0":
            return body["error"]["code"] == -32041  # run_deadline_exceeded
        if isinstance(body, dict) and "error" in body:
            return status == 504 and body["error"]["type"] == "run_deadline_exceeded"
        return status == 504

    assert {what: deadline(a) for what, a in answers.items()} == dict.fromkeys(answers, True), answers
    assert deadline(listing), listing
    # Each call was cut: the hanging server saw its caller go (every request it got, the
    # summary and runcap's own tools/list included), before it would have answered.
    requests = [h for h in edge.on("hang") if b"notifications/cancelled" not in h.body]
    assert requests and await eventually(lambda: all(h.disconnected for h in requests)), [
        (h.method, h.path, h.body[:60]) for h in requests
    ]
    assert any(SUMMARY_INSTRUCTION.encode() in h.body for h in requests)
    assert any(b"runcap-tools-list" in h.body for h in requests)
    # The cut tools/call got its cancel notice; the server answered it with a redirect, not followed.
    notices = [h for h in edge.on("hang") if b"notifications/cancelled" in h.body]
    assert notices and other.hits == []


@pytest.mark.parametrize(
    ("operator", "headers"),
    [
        ({"caps": {"ceiling_timeout_s": TIMEOUT_S}}, {}),
        ({"tasks": {"quick": {"timeout_s": TIMEOUT_S}}}, {"X-Run-Task": "quick"}),
    ],
    ids=["caps-ceiling", "task-timeout"],
)
async def test_a_request_without_a_run_id_has_the_operators_timeout(  # type: ignore[no-untyped-def]
    edges, runcap_factory, operator, headers
) -> None:
    edge, _ = edges
    cfg = {**config(edge), "caps": {}, **operator}
    rc = await runcap_factory(cfg, env={"EDGE_KEY": "sk-upstream-secret"})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        status, body = await send(http, "POST", f"{rc.url}/u/hang/v1/images/generations", {}, headers)
        assert status == 504 and body["error"]["type"] == "run_deadline_exceeded", body
        _, body = await send(
            http,
            "POST",
            f"{rc.url}/mcp/hang",
            rpc("resources/read", uri="file:///a"),
            {**headers, **MCP_HEADERS},
        )
        assert body["error"]["code"] == -32041, body
    assert len(edge.on("hang")) == 2 and await eventually(
        lambda: all(h.disconnected for h in edge.on("hang"))
    )


async def test_the_cli_never_follows_a_redirect_with_the_admin_token(edges, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`runcap cancel`, `reconcile`, `sql`, `approvals` and `approve` against a `--url` that
    redirects: they fail, and the admin token they carry never reaches the other origin (urllib
    would resend it there). One call serves them all (proxy/admin_http.call_json)."""
    from proxy.cli import main

    edge, other = edges
    monkeypatch.setenv("RUNCAP_ADMIN_TOKEN", "admin-secret-0123456789-0123456789")
    monkeypatch.chdir(tmp_path)
    url = f"{edge.url}/redirect"
    for argv in (
        ["cancel", "r-1", "--url", url],
        ["reconcile", "--url", url],
        ["sql", "SELECT 1", "--url", url],
        ["approvals", "--url", url],
        ["approve", "ap-1", "--url", url],
    ):
        assert await asyncio.to_thread(main, argv) != 0, argv
    assert len(edge.on("redirect")) == 5
    assert all(h.headers["authorization"].endswith("0123456789") for h in edge.on("redirect"))
    assert other.hits == []
