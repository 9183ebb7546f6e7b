"""Tool calls held for a person (proxy/toolcall/approvals.py, approval_routes.py) in a runcap app
with its real ledger (SQLite, or Redis for the two-replica case): the gate holds one exact call
until `POST /approvals/{id}` decides it — the same tool with other arguments stays held — `defer`
answers 428 at once, a run's deadline or cancel ends a wait with a clear answer, and a tenant sees
and decides only its own approvals."""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from typing import Any

import aiohttp
import orjson
import pytest
import standardwebhooks
from aiohttp import web
from mcp.shared.exceptions import MCPError

from proxy.caps import RunCaps, RunRequest
from proxy.errors import DeadlineExceeded, RunCancelled
from proxy.hashing import args_hash
from proxy.ledger.base import APPROVED, DENIED, PENDING, ToolCallRequest
from proxy.queryfiles import load_query
from proxy.toolcall.approvals import ApprovalDenied, ApprovalDesk, ApprovalRequired
from proxy.toolcall.call import ToolCall
from proxy.toolcall.policy import PolicyDecision
from tests.support.approvals import decide, listed, until_pending
from tests.support.clickhouse import sql, wait_rows
from tests.support.mcp_agent import mcp_config, rid
from tests.support.mcp_agent import session as mcp_session
from tests.support.tool_agent import call, refund_tool
from tests.support.tool_service import ToolService


def Decision(mode: str = "wait") -> PolicyDecision:
    """The policy's decision to hold a call for a person (what PolicyCheck hands the gate)."""
    return PolicyDecision("approve", "large", "refunds over 100 need a person", mode)


def held_call(run_id: str, key: str, *, deadline: float | None = None) -> tuple[ToolCall, ToolCallRequest]:
    caps = RunCaps(deadline=deadline)
    call = ToolCall("refund", run=RunRequest(run_id, False, "t", caps), args_hash=f"sha-{key}")
    call.key = key
    return call, ToolCallRequest(run_id, "t", caps, time.time(), "refund", key, f"sha-{key}")


async def test_wait_releases_exactly_the_approved_call(runcap) -> None:  # type: ignore[no-untyped-def]
    desk = runcap.runtime.approvals
    run = f"run-{secrets.token_hex(4)}"
    big, big_req = held_call(run, "amount-500")
    other, other_req = held_call(run, "amount-700")
    first = asyncio.create_task(desk.hold(big, big_req, Decision()))
    second = asyncio.create_task(desk.hold(other, other_req, Decision()))
    async with aiohttp.ClientSession() as s:
        rows = await until_pending(s, runcap.url, runcap.admin, run, 2)
        by_hash = {r["args_hash"]: r for r in rows}
        assert set(by_hash) == {"sha-amount-500", "sha-amount-700"}
        row = by_hash["sha-amount-500"]
        assert (row["state"], row["tool"], row["rule"], row["run_id"]) == (PENDING, "refund", "large", run)
        assert len(row["id"]) == 32
        status, record = await decide(s, runcap.url, runcap.admin, row["id"], decision="approve",
                                      by="alice", reason="order checked")  # fmt: skip
        assert status == 200 and (record["state"], record["by"]) == (APPROVED, "alice")
        await asyncio.wait_for(first, timeout=10)  # released
        assert big.attributes["approval.state"] == APPROVED
        # the same tool with other arguments is still held
        assert not second.done()
        still = await listed(s, runcap.url, runcap.admin, run=run)
        assert [r["args_hash"] for r in still] == ["sha-amount-700"]
        # a decision is final
        status, err = await decide(s, runcap.url, runcap.admin, row["id"], decision="deny", reason="x")
        assert status == 409 and err["error"]["code"] == "approval_not_pending"
        # a denial needs a reason, and reaches the held call with it
        held_id = by_hash["sha-amount-700"]["id"]
        status, err = await decide(s, runcap.url, runcap.admin, held_id, decision="deny")
        assert status == 400 and err["error"]["param"] == "reason"
        status, _ = await decide(s, runcap.url, runcap.admin, held_id,
                                 decision="deny", by="bob", reason="customer already refunded")  # fmt: skip
        assert status == 200
        with pytest.raises(ApprovalDenied) as e:
            await asyncio.wait_for(second, timeout=10)
        assert e.value.status == 403 and e.value.type == "tool_call_denied"
        assert "customer already refunded" in e.value.message and "bob" in e.value.message
        # asked again, the approved call passes at once and the denied one is refused at once
        await desk.hold(*held_call(run, "amount-500"), Decision())
        with pytest.raises(ApprovalDenied):
            await desk.hold(*held_call(run, "amount-700"), Decision())


async def test_defer_answers_at_once_then_follows_the_decision(runcap) -> None:  # type: ignore[no-untyped-def]
    desk: ApprovalDesk = runcap.runtime.approvals
    run = f"run-{secrets.token_hex(4)}"
    with pytest.raises(ApprovalRequired) as e:
        await asyncio.wait_for(desk.hold(*held_call(run, "k"), Decision(mode="defer")), timeout=10)
    rej = e.value
    assert rej.status == 428 and rej.headers["Retry-After"] == "30" and len(rej.approval_id) == 32
    assert b'"approval_id":"' + rej.approval_id.encode() in rej.body("openai")
    # sent again before anyone decided: the same approval, still 428
    with pytest.raises(ApprovalRequired) as again:
        await asyncio.wait_for(desk.hold(*held_call(run, "k"), Decision(mode="defer")), timeout=10)
    assert again.value.approval_id == rej.approval_id
    async with aiohttp.ClientSession() as s:
        status, _ = await decide(s, runcap.url, runcap.admin, rej.approval_id, decision="approve")
        assert status == 200
    await desk.hold(*held_call(run, "k"), Decision(mode="defer"))  # approved: goes


async def test_deadline_and_cancel_end_a_wait(runcap) -> None:  # type: ignore[no-untyped-def]
    desk: ApprovalDesk = runcap.runtime.approvals
    run = f"run-{secrets.token_hex(4)}"
    soon = time.time() + 0.3
    await runcap.ledger.touch_run(run, "t", RunCaps(deadline=soon), time.time())
    with pytest.raises(DeadlineExceeded) as e:
        await desk.hold(*held_call(run, "k", deadline=soon), Decision())
    assert e.value.status == 504 and "waited for a person's approval" in e.value.message

    run2 = f"run-{secrets.token_hex(4)}"
    waiting = asyncio.create_task(desk.hold(*held_call(run2, "k"), Decision()))
    async with aiohttp.ClientSession() as s:
        [row] = await until_pending(s, runcap.url, runcap.admin, run2)
        async with s.post(f"{runcap.url}/runs/{run2}/cancel", headers=runcap.admin) as r:
            assert r.status == 200
        with pytest.raises(RunCancelled) as c:
            await asyncio.wait_for(waiting, timeout=10)
        assert c.value.status == 410 and "was not executed" in c.value.message
        [after] = await listed(s, runcap.url, runcap.admin, run=run2, state="all")
        assert after["state"] == DENIED and after["id"] == row["id"]


async def test_a_decision_on_another_replica_releases_the_wait(  # type: ignore[no-untyped-def]
    runcap_factory, redis_server, tmp_path
) -> None:
    """Two runcaps on one Redis: the call is held on A, approved on B, and A's call goes on."""
    extra = {"redis_url": redis_server.url}
    a = await runcap_factory(extra, data_dir=tmp_path / "a")
    b = await runcap_factory(extra, data_dir=tmp_path / "b")
    run = f"run-{secrets.token_hex(4)}"
    call, req = held_call(run, "k")
    held = asyncio.create_task(a.runtime.approvals.hold(call, req, Decision()))
    async with aiohttp.ClientSession() as s:
        [row] = await until_pending(s, b.url, b.admin, run)
        status, _ = await decide(s, b.url, b.admin, row["id"], decision="approve", by="carol")
        assert status == 200
    await asyncio.wait_for(held, timeout=10)
    assert call.attributes["approval.state"] == APPROVED


APPROVER = {"acme": "acme-approver-0123456789abcdef-0123", "globex": "globex-approver-0123456789abcdef-01"}


async def test_tenants_see_only_their_own_and_only_their_approver_decides(runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """A client token lists its tenant's approvals but may not decide one (the agent holds it: it
    would approve its own call); the tenant's approver token decides its own, never another's."""
    tokens = {
        "acme": {"token": "acme-token-0123456789abcdef", "approver_token": APPROVER["acme"]},
        "globex": {"token": "globex-token-0123456789abcd", "approver_token": APPROVER["globex"]},
    }
    rc = await runcap_factory({"auth": {"client_tokens": tokens}})
    desk: ApprovalDesk = rc.runtime.approvals
    acme = {"X-Run-Client-Token": "acme-token-0123456789abcdef"}
    globex = {"X-Run-Client-Token": "globex-token-0123456789abcd"}
    for tenant in ("acme", "globex"):
        with pytest.raises(ApprovalRequired):
            await desk.hold(*held_call(f"{tenant}:r1", "k"), Decision(mode="defer"))
    async with aiohttp.ClientSession() as s:
        mine = await listed(s, rc.url, acme)
        assert [(r["run_id"], r["tenant"]) for r in mine] == [("r1", "acme")]
        theirs = await listed(s, rc.url, globex, run="r1")
        assert [r["tenant"] for r in theirs] == ["globex"]
        assert {r["tenant"] for r in await listed(s, rc.url, rc.admin)} == {"acme", "globex"}
        approver = {name: {"Authorization": f"Bearer {t}"} for name, t in APPROVER.items()}
        assert [r["id"] for r in await listed(s, rc.url, approver["acme"])] == [mine[0]["id"]]
        status, refused = await decide(s, rc.url, acme, mine[0]["id"], decision="approve")
        assert status == 403 and refused["error"]["code"] == "approval_needs_a_person", refused
        assert (await desk.ledger.get_approval(mine[0]["id"], time.time())).state == PENDING  # type: ignore[union-attr]
        status, _ = await decide(s, rc.url, approver["globex"], mine[0]["id"], decision="approve")
        assert status == 404
        status, record = await decide(
            s, rc.url, approver["acme"], mine[0]["id"], decision="approve", by="dana"
        )
        assert status == 200 and record["by"] == "acme: dana" and record["run_id"] == "r1"
        async with s.get(f"{rc.url}/approvals", headers={"X-Run-Client-Token": "nope"}) as r:
            assert r.status == 401


def test_approver_token_configuration_errors_name_the_setting() -> None:
    """An approver token releases held side effects: as long as an admin token, and never a token
    the agent also holds (any tenant's client token, or another tenant's approver token)."""
    from proxy.config import ConfigError, build_config

    acme, globex = "acme-token-0123456789abcdef", "globex-token-0123456789abcd"
    long = "x" * 32
    for tokens, message in [
        (
            {"acme": {"token": acme, "approver_token": "x" * 31}},
            "acme.approver_token: an approver token needs at least 32",
        ),
        ({"acme": {"token": long, "approver_token": long}}, "acme.approver_token: must differ"),
        (
            {
                "acme": {"token": acme, "approver_token": long},
                "globex": {"token": globex, "approver_token": long},
            },
            "globex.approver_token: must differ",
        ),
        (
            {"acme": {"token": acme, "approver_token": "g" * 40}, "globex": "g" * 40},
            "acme.approver_token: must differ from every client token (it is tenant 'globex'",
        ),
        (
            {"acme": {"token": acme, "approver_token": "env:NOT_SET"}},
            "acme.approver_token: environment variable",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            build_config({"auth": {"client_tokens": tokens}}, {})
        assert str(err.value).startswith(f"auth.client_tokens.{message}"), err.value
    config = build_config(
        {"auth": {"client_tokens": {"acme": {"token": acme, "approver_token": "env:A"}}}}, {"A": long}
    )
    assert config.approver_tokens == {long: "acme"}


# -- through /tools, with the tool's rules (toolcall/policy.py) ------------------------------------

LARGE = {"name": "large", "when": "args.amount > 100", "effect": "approve", "reason": "over 100"}


def refund_with(svc: ToolService, **rule: str) -> dict[str, Any]:
    return {"tools": {"refund": {**refund_tool(svc), "rules": [{**LARGE, **rule}]}}}


async def test_tools_call_held_on_one_replica_approved_on_another(  # type: ignore[no-untyped-def]
    runcap_factory, redis_server, tool, tmp_path
) -> None:
    extra = {**refund_with(tool), "redis_url": redis_server.url}
    a = await runcap_factory(extra, data_dir=tmp_path / "a")
    b = await runcap_factory(extra, data_dir=tmp_path / "b")
    run = f"run-{secrets.token_hex(4)}"
    first = asyncio.create_task(call(f"{a.url}/tools/refund", run, {"order_id": "o-1", "amount": 500}))
    second = asyncio.create_task(call(f"{a.url}/tools/refund", run, {"order_id": "o-1", "amount": 700}))
    small = await call(f"{a.url}/tools/refund", run, {"order_id": "o-2", "amount": 20})
    assert small[0] == 200 and tool.executions == 1  # no rule holds: at once
    async with aiohttp.ClientSession() as s:
        rows = {r["args_hash"]: r for r in await until_pending(s, b.url, b.admin, run, 2)}
        first_id = rows[args_hash(orjson.dumps({"order_id": "o-1", "amount": 500}))]["id"]
        status, _ = await decide(s, b.url, b.admin, first_id, decision="approve", by="carol")
        assert status == 200
        status, _, body = await asyncio.wait_for(first, timeout=10)
        assert status == 200 and body["execution"] == 2
        assert not second.done() and tool.executions == 2  # the same tool, other arguments: held
        # the approved call sent again (to either replica) is replayed, not executed again
        status, headers, _ = await call(f"{b.url}/tools/refund", run, {"order_id": "o-1", "amount": 500})
        assert status == 200 and headers.get("X-Idempotent-Replay") == "true" and tool.executions == 2
        # cancelling the run (on B) ends the wait on A: a clear 410, and nothing executed
        async with s.post(f"{b.url}/runs/{run}/cancel", headers=b.admin) as r:
            assert r.status == 200
    status, _, body = await asyncio.wait_for(second, timeout=10)
    assert status == 410 and body["error"]["type"] == "run_cancelled", body
    assert "waited for a person's approval" in body["error"]["message"]
    assert tool.executions == 2


async def test_tools_call_held_until_the_runs_deadline(runcap_factory, tool) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory(refund_with(tool))
    run = f"run-{secrets.token_hex(4)}"
    big, timeout = {"order_id": "o-1", "amount": 500}, {"X-Run-Timeout": "1"}
    status, _, body = await asyncio.wait_for(call(f"{rc.url}/tools/refund", run, big, headers=timeout), 10)
    assert status == 504 and body["error"]["type"] == "run_deadline_exceeded", body
    assert "waited for a person's approval" in body["error"]["message"] and tool.executions == 0
    async with aiohttp.ClientSession() as s:
        [row] = await listed(s, rc.url, rc.admin, run=run, state="all")
    assert row["state"] == "expired"


async def test_tools_defer_then_approve_executes_once(runcap_factory, tool) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory(refund_with(tool, mode="defer"))
    run, big = f"run-{secrets.token_hex(4)}", {"order_id": "o-1", "amount": 500}
    status, headers, body = await call(f"{rc.url}/tools/refund", run, big)
    assert status == 428 and headers["Retry-After"] == "30" and headers["x-should-retry"] == "false"
    approval_id = body["error"]["approval_id"]
    assert body["error"]["type"] == "approval_required" and approval_id in body["error"]["message"]
    assert tool.executions == 0
    async with aiohttp.ClientSession() as s:
        assert (await decide(s, rc.url, rc.admin, approval_id, decision="approve"))[0] == 200
    results = await asyncio.gather(*(call(f"{rc.url}/tools/refund", run, big) for _ in range(5)))
    assert {r[0] for r in results} == {200} and tool.executions == 1


async def test_the_approvals_query_says_who_decided_and_how_long_the_run_waited(  # type: ignore[no-untyped-def]
    runcap_factory, tool
) -> None:
    """queries/approvals.sql on the embedded span store (chdb), on approval spans the gate wrote."""
    rc = await runcap_factory({**refund_with(tool), "tracing": True})
    run = f"run-{secrets.token_hex(4)}"
    url = f"{rc.url}/tools/refund"
    held = asyncio.create_task(call(url, run, {"order_id": "o-1", "amount": 500}))
    async with aiohttp.ClientSession() as s:
        [first] = await until_pending(s, rc.url, rc.admin, run)
        assert (await decide(s, rc.url, rc.admin, first["id"], decision="approve", by="alice"))[0] == 200
        assert (await asyncio.wait_for(held, 10))[0] == 200
        refused = asyncio.create_task(call(url, run, {"order_id": "o-2", "amount": 900}))
        second = next(r for r in await until_pending(s, rc.url, rc.admin, run) if r["id"] != first["id"])
        await decide(s, rc.url, rc.admin, second["id"], decision="deny", by="bob", reason="duplicate")
        assert (await asyncio.wait_for(refused, 10))[0] == 403
    # requested + decided + released, requested + decided + refused
    await wait_rows(rc, f"SELECT 1 FROM runcap.spans WHERE kind = 'approval' AND run_id = '{run}'", 6)
    query = load_query("approvals")
    params = {"since": "2000-01-01 00:00:00", "run_id": run, "state": ""}
    rows = await sql(rc, query.sql, params)
    columns = ("approval_id", "state", "decided_by", "reason", "held_calls", "rule")
    seen = [tuple(r[c] for c in columns) for r in rows]
    assert seen == [
        (first["id"], "approved", "alice", "", 1, "large"),
        (second["id"], "denied", "bob", "duplicate", 0, "large"),
    ]
    assert all(r["waited_ms"] > 0 and r["tool_name"] == "refund" for r in rows)
    denied = await sql(rc, query.sql, {**params, "state": "denied"})
    assert [r["approval_id"] for r in denied] == [second["id"]]


async def test_the_webhook_announces_each_pending_approval_and_retries(  # type: ignore[no-untyped-def]
    runcap_factory, tool, tmp_path
) -> None:
    """A real receiver that fails its first delivery: the announcement is retried; a receiver that
    is down is logged and counted, and the agent's answer never waits for it. Every attempt is
    signed the Standard Webhooks way: the reference library (standardwebhooks) verifies it with the
    configured secret, refuses it with another, and the retry keeps the approval's id."""
    got: list[Any] = []
    ids: list[str] = []
    delivered = asyncio.Event()
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    other = standardwebhooks.Webhook("whsec_" + base64.b64encode(secrets.token_bytes(32)).decode())

    async def receive(request: web.Request) -> web.Response:
        raw = await request.read()
        got.append(standardwebhooks.Webhook(secret).verify(raw, dict(request.headers)))
        try:
            other.verify(raw, dict(request.headers))
            ids.append("verified with another secret!")
        except standardwebhooks.webhooks.WebhookVerificationError:
            ids.append(request.headers["webhook-id"])
        if len(got) == 1:
            return web.Response(status=503)
        delivered.set()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        hook = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
        announced = {
            **refund_with(tool, mode="defer"),
            "approvals": {"approval_webhook_url": hook, "approval_webhook_secret": secret},
        }
        rc = await runcap_factory(announced, data_dir=tmp_path / "a")
        run = f"run-{secrets.token_hex(4)}"
        status, _, body = await call(f"{rc.url}/tools/refund", run, {"order_id": "o-1", "amount": 500})
        assert status == 428
        await asyncio.wait_for(delivered.wait(), timeout=10)
        assert len(got) == 2 and got[0] == got[1]
        sent = got[1]
        # one message id across the retry; a receiver with another secret refused both
        assert ids == [sent["id"], sent["id"]]
        assert (sent["id"], sent["run_id"], sent["tool"], sent["rule"]) == (
            body["error"]["approval_id"], run, "refund", "large",
        )  # fmt: skip
        assert sent["args_hash"] == args_hash(orjson.dumps({"order_id": "o-1", "amount": 500}))
        assert "order_id" not in orjson.dumps(sent).decode()  # the hash, never the arguments
        desk: ApprovalDesk = rc.runtime.approvals
        assert (desk.webhook.sent, desk.webhook.failures) == (1, 0)
    finally:
        await runner.cleanup()

    down = await runcap_factory(announced, data_dir=tmp_path / "b")  # the receiver is gone now
    status, _, _ = await call(f"{down.url}/tools/refund", run, {"order_id": "o-9", "amount": 900})
    assert status == 428  # answered while the webhook is still trying
    webhook = down.runtime.approvals.webhook
    for _ in range(200):
        if webhook.failures:
            break
        await asyncio.sleep(0.05)
    assert (webhook.sent, webhook.failures) == (0, 1)
    async with aiohttp.ClientSession() as s, s.get(f"{down.url}/metrics", headers=down.admin) as r:
        text = await r.text()
    assert "runcap_approval_webhook_failures_total 1.0" in text
    assert 'runcap_approvals_total{event="requested"} 1.0' in text


async def test_an_approval_nobody_decides_expires_and_the_call_asks_anew(runcap_factory, tool) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory({**refund_with(tool), "approvals": {"approval_ttl_s": 1.0}})
    run, big = f"run-{secrets.token_hex(4)}", {"order_id": "o-1", "amount": 500}
    status, _, body = await asyncio.wait_for(call(f"{rc.url}/tools/refund", run, big), 10)
    assert status == 403 and body["error"]["code"] == "approval_expired", body
    assert body["error"]["param"] == "approval_ttl_s" and tool.executions == 0
    async with aiohttp.ClientSession() as s:
        [old] = await listed(s, rc.url, rc.admin, run=run, state="expired")
        status, err = await decide(s, rc.url, rc.admin, old["id"], decision="approve")
        assert status == 409 and "expired" in err["error"]["message"]
        again = asyncio.create_task(call(f"{rc.url}/tools/refund", run, big))
        [fresh] = await until_pending(s, rc.url, rc.admin, run)
        assert fresh["id"] != old["id"]
        assert (await decide(s, rc.url, rc.admin, fresh["id"], decision="approve"))[0] == 200
        assert (await asyncio.wait_for(again, 10))[0] == 200 and tool.executions == 1
        status, err = await decide(s, rc.url, rc.admin, "f" * 32, decision="approve")
        assert status == 404 and err["error"]["param"] == "approval_id"
        async with s.get(f"{rc.url}/approvals", params={"state": "maybe"}, headers=rc.admin) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "state"


@pytest.mark.parametrize("kind", ["stateful-sse", "stateless-json"])
async def test_mcp_call_held_then_approved_executes_once(kind, servers, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """The official MCP SDK on both sides: a large refund waits; approving it releases exactly that
    call (the other one stays held, then its run's cancel ends it); a repeat is a replay."""
    server = servers(kind)
    rc = await runcap_factory(mcp_config(server, tools={"refund": {"rules": [LARGE]}}))
    run, big, other = rid("mcp-appr"), rid("big"), rid("other")

    def ran(order: str) -> int:
        return len([e for e in server.stats()["executions"] if e["args"].get("order_id") == order])

    big_args = {"order_id": big, "amount": 500, "currency": "EUR"}
    other_args = {"order_id": other, "amount": 700, "currency": "EUR"}
    async with mcp_session(f"{rc.url}/mcp/crm", run) as agent, aiohttp.ClientSession() as s:
        first = asyncio.create_task(agent.call_tool("refund", big_args))
        second = asyncio.create_task(agent.call_tool("refund", other_args))
        rows = {r["args_hash"]: r for r in await until_pending(s, rc.url, rc.admin, run, 2)}
        assert {r["tool"] for r in rows.values()} == {"mcp:crm/refund"}
        target = rows[args_hash(orjson.dumps(big_args))]["id"]
        assert (await decide(s, rc.url, rc.admin, target, decision="approve", by="alice"))[0] == 200
        result = await asyncio.wait_for(first, 10)
        assert not result.is_error and ran(big) == 1
        assert not second.done() and ran(other) == 0  # the same tool, other arguments: still held
        again = await agent.call_tool("refund", big_args)
        assert not again.is_error and ran(big) == 1  # replayed, not executed again
        async with s.post(f"{rc.url}/runs/{run}/cancel", headers=rc.admin) as r:
            assert r.status == 200
        with pytest.raises(MCPError) as e:  # the run's cancel ends the wait: -32042
            await asyncio.wait_for(second, 10)
        assert e.value.error.code == -32042 and "approval" in e.value.error.message
    assert ran(big) + ran(other) == 1


async def test_the_operator_sees_the_arguments_of_a_held_mcp_call(servers, runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """The call's body is kept before the rules hold it: `GET /approvals` (what `runcap approvals`
    prints) has its `params.arguments`, not only their hash."""
    server = servers("stateless-json")
    rc = await runcap_factory(
        mcp_config(server, tools={"refund": {"rules": [LARGE]}}, payloads="all", tracing=True)
    )
    run, order = rid("args"), rid("o")
    args = {"order_id": order, "amount": 500, "currency": "EUR"}
    async with mcp_session(f"{rc.url}/mcp/crm", run) as agent, aiohttp.ClientSession() as s:
        held = asyncio.create_task(agent.call_tool("refund", args))
        [row] = await until_pending(s, rc.url, rc.admin, run)
        for _ in range(200):  # the shipper stores the body in the background
            if row["args"] is not None:
                break
            await asyncio.sleep(0.05)
            [row] = await listed(s, rc.url, rc.admin, run=run)
        assert row["args"] == args
        assert (await decide(s, rc.url, rc.admin, row["id"], decision="approve"))[0] == 200
        assert not (await asyncio.wait_for(held, 10)).is_error
    assert len([e for e in server.stats()["executions"] if e["args"].get("order_id") == order]) == 1


async def test_a_deferred_call_fixes_its_runs_deadline_and_a_cancelled_run_asks_nobody(  # type: ignore[no-untyped-def]
    runcap_factory, tool
) -> None:
    rc = await runcap_factory(refund_with(tool, mode="defer"))
    run, big = f"run-{secrets.token_hex(4)}", {"order_id": "o-1", "amount": 500}
    status, _, _ = await call(f"{rc.url}/tools/refund", run, big, headers={"X-Run-Timeout": "60"})
    assert status == 428
    first = (await rc.run(run))["caps"]["deadline"]
    assert first is not None  # the run was opened by its first (held) call
    status, _, _ = await call(f"{rc.url}/tools/refund", run, big, headers={"X-Run-Timeout": "60"})
    assert status == 428 and (await rc.run(run))["caps"]["deadline"] == first  # not moved by a resend

    cancelled = f"run-{secrets.token_hex(4)}"
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{rc.url}/runs/{cancelled}/cancel", headers=rc.admin) as r:
            assert r.status == 200
        status, _, body = await call(f"{rc.url}/tools/refund", cancelled, big)
        assert status == 410 and body["error"]["type"] == "run_cancelled"
        assert await listed(s, rc.url, rc.admin, run=cancelled, state="all") == []


async def test_a_cancel_that_denies_a_deferred_approval_is_a_span(runcap_factory, tool) -> None:  # type: ignore[no-untyped-def]
    """No call waits on it (defer), yet the cancel's denial is on the record: an `approval` span
    `decided` by `runcap: run cancelled` — once, however often the run is cancelled."""
    rc = await runcap_factory({**refund_with(tool, mode="defer"), "tracing": True})
    run = f"run-{secrets.token_hex(4)}"
    status, _, body = await call(f"{rc.url}/tools/refund", run, {"order_id": "o-1", "amount": 500})
    assert status == 428
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(f"{rc.url}/runs/{run}/cancel", headers=rc.admin) as r:
                assert r.status == 200
        [after] = await listed(s, rc.url, rc.admin, run=run, state="all")
    assert after["state"] == "denied" and after["by"] == "runcap: run cancelled"
    decided = (
        "SELECT attributes['approval.id'] AS id, attributes['approval.state'] AS state, "
        "attributes['approval.by'] AS by FROM runcap.spans "
        f"WHERE kind = 'approval' AND run_id = '{run}' AND attributes['approval.event'] = 'decided'"
    )
    # A refused call after the cancels: its span is behind theirs in the WAL, so once it is in
    # the store every span the cancels wrote is too.
    status, _, _ = await call(f"{rc.url}/tools/refund", run, {"order_id": "o-1", "amount": 500})
    assert status == 410
    marker = f"SELECT 1 FROM runcap.spans WHERE kind = 'tool' AND run_id = '{run}' AND status_code = 410"
    assert len(await wait_rows(rc, marker, 1)) == 1
    rows = await sql(rc, decided)
    assert [(r["id"], r["state"], r["by"]) for r in rows] == [
        (body["error"]["approval_id"], "denied", "runcap: run cancelled")
    ]


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_cancel_denies_the_pending_approvals_of_the_whole_subtree(  # type: ignore[no-untyped-def]
    runcap_factory, redis_server, tool, tmp_path, backend
) -> None:
    """Cancelling a run cancels its subtree, so the deferred approvals its child and grandchild
    left pending are denied with its own — and a run outside the tree keeps its approval."""
    extra = {
        **refund_with(tool, mode="defer"),
        **({"redis_url": redis_server.url} if backend == "redis" else {}),
    }
    rc = await runcap_factory(extra, data_dir=tmp_path / backend)
    tag = secrets.token_hex(4)
    parent, child, grandchild, other = (
        f"{name}-{tag}" for name in ("parent", "child", "grandchild", "other")
    )
    big = {"order_id": "o-1", "amount": 500}
    for run, up in ((parent, None), (child, parent), (grandchild, child), (other, None)):
        status, _, body = await call(
            f"{rc.url}/tools/refund", run, big, headers={"X-Run-Parent": up} if up else None
        )
        assert status == 428, body
        assert (await rc.run(run))["parent"] == up  # a held call opens the run under its parent
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{rc.url}/runs/{parent}/cancel", headers=rc.admin) as r:
            assert r.status == 200
        for run in (parent, child, grandchild):
            [after] = await listed(s, rc.url, rc.admin, run=run, state="all")
            assert (after["state"], after["by"]) == ("denied", "runcap: run cancelled"), run
        [untouched] = await listed(s, rc.url, rc.admin, run=other, state="all")
        assert untouched["state"] == "pending"
    tool_calls = tool.executions
    status, _, body = await call(f"{rc.url}/tools/refund", grandchild, big, headers={"X-Run-Parent": child})
    assert status == 410 and body["error"]["type"] == "run_cancelled" and tool.executions == tool_calls == 0
