"""Tool policies (issue 23 item 1): `[[tools.NAME.rules]]` and `[[mcp.SERVER.tools.TOOL.rules]]`
decide before the ledger, on `/tools` (raw HTTP, the counting tool service) and over MCP (the
official `mcp` SDK on both sides). The acceptance policy: `amount > 100 → approve`,
`currency != "EUR" → deny`, else allow."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import mcp_types as types
import openai
import pytest

from proxy.hashing import idempotency_key
from tests.support.approvals import decide, until_pending
from tests.support.clickhouse import wait_rows
from tests.support.mcp_agent import mcp_config, rid, session
from tests.support.mcp_server import MCPServerProcess
from tests.support.tool_agent import call, refund_tool
from tests.support.tool_service import ToolService

LARGE = "refunds over 100 need a person"
ACCEPTANCE = [
    {"name": "large", "when": "args.amount > 100", "effect": "approve", "reason": LARGE},
    {"name": "non-eur", "when": "args.currency != 'EUR'", "effect": "deny", "reason": "only EUR refunds"},
]


def http_policy(svc: ToolService, rules: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"tools": {"refund": {**refund_tool(svc), "rules": rules}}, **extra}


def mcp_policy(server: MCPServerProcess, rules: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return mcp_config(server, tools={"refund": {"rules": rules}}, **extra)


async def metric(rc: Any, tool: str, effect: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{rc.url}/metrics", headers=rc.admin) as r:
        text = await r.text()
    line = f'runcap_policy_decisions_total{{effect="{effect}",tool="{tool}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def executions(server: MCPServerProcess, **args: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in server.stats()["executions"]
        if e["tool"] == "refund" and all(e["args"].get(k) == v for k, v in args.items())
    ]


# -- /tools ---------------------------------------------------------------------------------------


async def test_http_acceptance_policy(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(http_policy(tool, ACCEPTANCE))
    url, run = f"{rc.url}/tools/refund", rid("pol")
    status, _, body = await call(url, run, {"order_id": "o-1", "amount": 20, "currency": "EUR"})
    assert status == 200 and body["execution"] == 1  # a small EUR refund executes at once

    status, headers, body = await call(url, run, {"order_id": "o-2", "amount": 20, "currency": "USD"})
    assert status == 403 and headers["x-should-retry"] == "false"
    assert body["error"]["type"] == "tool_call_denied" and body["error"]["param"] == "non-eur"
    assert "rule 'non-eur'" in body["error"]["message"] and "only EUR refunds" in body["error"]["message"]
    # Nothing of it reached the tool, nor the ledger: no idempotency record, not counted.
    assert tool.executions == 1
    key = idempotency_key(run, "refund", {"order_id": "o-2", "amount": 20}, None)
    assert headers["Idempotency-Key"] == key and await rc.ledger.get_tool_call(run, key) is None
    assert (await rc.run(run))["tool_calls_executed"] == 1

    # A large one needs a person: held until one decides; denied, it never reaches the tool.
    held = asyncio.create_task(call(url, run, {"order_id": "o-3", "amount": 500, "currency": "EUR"}))
    async with aiohttp.ClientSession() as s:
        [pending] = await until_pending(s, rc.url, rc.admin, run)
        assert await decide(s, rc.url, rc.admin, pending["id"], decision="deny", reason="not today")
    status, _, body = await asyncio.wait_for(held, timeout=10)
    assert status == 403 and body["error"]["type"] == "tool_call_denied"
    assert "rule 'large'" in body["error"]["message"] and LARGE in body["error"]["message"]
    assert tool.executions == 1
    assert [await metric(rc, "refund", e) for e in ("allow", "deny", "approve")] == [1, 1, 1]


async def test_http_rule_that_cannot_be_evaluated_denies(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(http_policy(tool, ACCEPTANCE, tracing=True))
    url, run = f"{rc.url}/tools/refund", rid("closed")
    # No amount: `args.amount > 100` has no value to compare. Fail closed, and say why.
    status, _, body = await call(url, run, {"order_id": "o-1", "currency": "EUR"})
    assert status == 403 and body["error"]["type"] == "tool_call_denied"
    assert "rule 'large' could not be evaluated" in body["error"]["message"]
    assert "Key not found in map" in body["error"]["message"]
    # An argument of another type: the same.
    status, _, body = await call(url, run, {"order_id": "o-1", "amount": "lots", "currency": "EUR"})
    assert status == 403 and "No matching overloads" in body["error"]["message"]
    assert tool.executions == 0 and await metric(rc, "refund", "error") == 2
    rows = await wait_rows(
        rc,
        "SELECT status_code, attributes['policy.rule'] AS rule, attributes['policy.effect'] AS effect, "
        "attributes['policy.error'] AS error, attributes['tool.reached'] AS reached FROM runcap.spans "
        f"WHERE run_id = '{run}' AND kind = 'tool' ORDER BY started_at",
        2,
    )
    seen = [(r["status_code"], r["rule"], r["effect"], r["reached"]) for r in rows]
    assert seen == [(403, "large", "deny", "false")] * 2
    assert "Key not found in map" in rows[0]["error"] and "No matching overloads" in rows[1]["error"]


async def test_http_rules_on_method_path_and_the_runs_state(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rules = [
        {"name": "no-delete", "when": "method == 'DELETE'", "effect": "deny", "reason": "refunds are final"},
        {"name": "third", "when": "run.tool_calls >= 2 && run.task == 'triage'", "effect": "deny"},
    ]
    rc = await runcap_factory(http_policy(tool, rules))
    url, run = f"{rc.url}/tools/refund", rid("state")
    status, _, body = await call(f"{url}/r-1", run, method="DELETE")
    assert status == 403 and "refunds are final" in body["error"]["message"]
    h = {"X-Run-Task": "triage"}
    for i in range(2):
        status, _, _ = await call(url, run, {"order_id": f"o-{i}", "amount": 1}, headers=h)
        assert status == 200
    status, _, body = await call(url, run, {"order_id": "o-9", "amount": 1}, headers=h)
    assert status == 403 and body["error"]["param"] == "third"
    assert "the operator's policy denies it" in body["error"]["message"]  # a rule without a reason
    other = rid("other")  # another task's run is not bound by it
    for i in range(3):
        assert (await call(url, other, {"order_id": f"o-{i}", "amount": 1}))[0] == 200
    assert tool.executions == 5
    # A child's first request is a tool call whose rules read the run's state: the read that
    # opens the child opens it under its parent (it opened it as a root before).
    child = rid("child")
    status, _, _ = await call(
        url, child, {"order_id": "o-c", "amount": 1}, headers={**h, "X-Run-Parent": run}
    )
    assert status == 200
    assert (await rc.run(child))["parent"] == run


async def test_rules_see_the_tenant_and_the_agents_own_run_id(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rules = [{"name": "acme-r1", "when": "run.tenant == 'acme' && run.id == 'r1'", "effect": "deny"}]
    tokens = {"acme": "acme-token-0123456789", "globex": "globex-token-0123456789"}
    rc = await runcap_factory(http_policy(tool, rules, auth={"client_tokens": tokens}))
    url, body = f"{rc.url}/tools/refund", {"order_id": "o-1", "amount": 1}

    async def as_(tenant: str, run: str) -> int:
        return (await call(url, run, body, headers={"X-Run-Client-Token": tokens[tenant]}))[0]

    # The ledger knows acme's run as "acme:r1"; the rule reads the tenant and the id apart.
    assert [await as_("acme", "r1"), await as_("globex", "r1"), await as_("acme", "r2")] == [403, 200, 200]
    assert tool.executions == 2


async def test_cap_rule_counts_across_two_replicas_on_redis(runcap_factory, tool, redis_server, tmp_path):  # type: ignore[no-untyped-def]
    rules = [
        {"name": "non-eur", "when": "args.currency != 'EUR'", "effect": "deny", "reason": "only EUR"},
        {"name": "two-refunds", "when": "true", "effect": "cap", "max_calls": 2, "reason": "two per run"},
    ]
    cfg = http_policy(tool, rules, redis_url=redis_server.url)
    a = await runcap_factory(cfg, data_dir=tmp_path / "a")
    b = await runcap_factory(cfg, data_dir=tmp_path / "b")
    run = rid("cap")
    first = {"order_id": "o-1", "amount": 5, "currency": "EUR"}
    assert (await call(f"{a.url}/tools/refund", run, first))[0] == 200
    # A denied call (an earlier rule decides) is not one of the cap's.
    assert (await call(f"{b.url}/tools/refund", run, {**first, "currency": "USD"}))[0] == 403
    assert (await call(f"{b.url}/tools/refund", run, {**first, "order_id": "o-2"}))[0] == 200
    # The same call again, on the other replica: replayed from its record, not counted again.
    status, headers, _ = await call(f"{b.url}/tools/refund", run, first)
    assert status == 200 and headers["X-Idempotent-Replay"] == "true"
    status, _, body = await call(f"{a.url}/tools/refund", run, {**first, "order_id": "o-3"})
    assert status == 403 and body["error"]["param"] == "two-refunds"
    message = body["error"]["message"]
    assert "allows 2 such calls per run" in message and "two per run" in message
    assert tool.executions == 2
    # Another run has its own count.
    assert (await call(f"{b.url}/tools/refund", rid("cap2"), first))[0] == 200


async def test_cap_claim_is_given_back_when_the_ledger_refuses(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rules = [{"name": "one-large", "when": "args.amount > 10", "effect": "cap", "max_calls": 1}]
    rc = await runcap_factory(http_policy(tool, rules))
    url, run = f"{rc.url}/tools/refund", rid("give")
    mine = {"Idempotency-Key": "caller-key-1"}
    assert (await call(url, run, {"order_id": "o-1", "amount": 5}, headers=mine))[0] == 200
    # The rule counts this one, then the ledger refuses it (the caller's key reused for another
    # operation): never executed, so the count is given back ...
    status, _, body = await call(url, run, {"order_id": "o-2", "amount": 50}, headers=mine)
    assert status == 422 and body["error"]["type"] == "idempotency_key_reused"
    # ... and the rule's one call is still there.
    assert (await call(url, run, {"order_id": "o-3", "amount": 50}))[0] == 200
    status, _, body = await call(url, run, {"order_id": "o-4", "amount": 50})
    assert status == 403 and body["error"]["param"] == "one-large"
    assert tool.executions == 2


# -- MCP --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stateful-sse", "stateless-json"])
async def test_mcp_acceptance_policy(kind, servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers(kind)
    rc = await runcap_factory(mcp_policy(server, ACCEPTANCE))
    run = rid(f"mcp-pol-{kind}")
    small, foreign, large = rid("small"), rid("foreign"), rid("large")
    async with session(f"{rc.url}/mcp/crm", run) as s:
        ok = await s.call_tool("refund", {"order_id": small, "amount": 20, "currency": "EUR"})
        assert not ok.is_error and len(executions(server, order_id=small)) == 1
        denied = await s.call_tool("refund", {"order_id": foreign, "amount": 20, "currency": "USD"})
        # A result the model reads, not a protocol error: the rule and its reason as text.
        assert denied.is_error
        text = denied.content[0]
        assert isinstance(text, types.TextContent)
        assert "only EUR refunds" in text.text and "'non-eur'" in text.text
        assert denied.meta is not None
        refusal = denied.meta["runcap/refusal"]
        assert refusal["type"] == "tool_call_denied" and refusal["rule"] == "non-eur"
        # Approval needed: held until a person decides; denied, the model reads why.
        big = {"order_id": large, "amount": 500, "currency": "EUR"}
        held = asyncio.create_task(s.call_tool("refund", big))
        async with aiohttp.ClientSession() as admin:
            [pending] = await until_pending(admin, rc.url, rc.admin, run)
            await decide(admin, rc.url, rc.admin, pending["id"], decision="deny", reason="not today")
        refused = await asyncio.wait_for(held, timeout=10)
        assert refused.is_error and isinstance(refused.content[0], types.TextContent)
        assert LARGE in refused.content[0].text and "not today" in refused.content[0].text
        # Another tool of the server has no rules: untouched.
        assert not (await s.call_tool("lookup", {"order_id": small})).is_error
    assert executions(server, order_id=foreign) == [] and executions(server, order_id=large) == []
    assert (await rc.run(run))["tool_calls_executed"] == 2
    assert [await metric(rc, "mcp:crm/refund", e) for e in ("allow", "deny", "approve")] == [1, 1, 1]


async def test_mcp_rule_reads_tool_and_server_and_fails_closed(servers, runcap_factory):  # type: ignore[no-untyped-def]
    server = servers("stateless-json")
    rules = [
        {"name": "crm-only", "when": "tool.server != 'crm' || tool.name != 'refund'", "effect": "deny"},
        {"name": "small", "when": "args.amount <= 100 && args.reason.startsWith('late')", "effect": "allow"},
        {"name": "rest", "when": "true", "effect": "deny", "reason": "only small late refunds"},
    ]
    rc = await runcap_factory(mcp_policy(server, rules))
    run, order = rid("mcp-closed"), rid("o")
    async with session(f"{rc.url}/mcp/crm", run) as s:
        ok = await s.call_tool("refund", {"order_id": order, "amount": 5, "reason": "late delivery"})
        assert not ok.is_error
        other = await s.call_tool("refund", {"order_id": order, "amount": 5, "reason": "changed mind"})
        assert other.is_error and "only small late refunds" in other.content[0].text  # type: ignore[union-attr]
        # No reason argument: rule "small" cannot be evaluated, and the call is denied.
        broken = await s.call_tool("refund", {"order_id": rid("o"), "amount": 5})
        assert broken.is_error and "rule 'small' could not be evaluated" in broken.content[0].text  # type: ignore[union-attr]
    assert len(executions(server, order_id=order)) == 1
    assert await metric(rc, "mcp:crm/refund", "error") == 1


# -- calls the model requests (executed by the agent or the provider, not through runcap) ---------


async def test_requested_calls_carry_what_the_rules_would_decide(runcap_factory, upstream, tool):  # type: ignore[no-untyped-def]
    frozen = [{"name": "frozen", "when": "args.order_id == 'A1'", "effect": "deny", "reason": "A1 is frozen"}]
    cfg = http_policy(tool, ACCEPTANCE, tracing=True)
    cfg["mcp"] = {"crm": {"url": "http://127.0.0.1:9/mcp", "tools": {"refund": {"rules": frozen}}}}
    rc = await runcap_factory(cfg)
    run = rid("asked")
    upstream.scripts["ask"] = [{"tool_calls": [
        {"name": "refund", "arguments": {"order_id": "o-1", "amount": 20, "currency": "USD"}},
        {"name": "refund", "arguments": {"order_id": "o-2", "amount": 20, "currency": "EUR"}},
        {"name": "refund", "arguments": {"order_id": "o-3"}},
        {"name": "lookup", "arguments": {"order_id": "o-1"}},
    ]}]  # fmt: skip
    model = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    headers = {"X-Run-Id": run, "X-Mock-Script": "ask"}
    schema = {"type": "object"}
    functions = [
        {"type": "function", "function": {"name": n, "parameters": schema}} for n in ("refund", "lookup")
    ]
    await model.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "refund"}], extra_headers=headers,
        tools=functions,  # type: ignore[arg-type]
    )  # fmt: skip
    # The provider runs a hosted MCP tool itself: crm/refund {"order_id": "A1"} (scripted).
    upstream.scripts["hosted"] = [{"hosted_uses": 1, "use_input_tokens": 50, "text": "done"}]
    hosted = {"type": "mcp", "server_label": "crm", "server_url": "https://crm.example/mcp"}
    await model.responses.create(
        model="gpt-4o-mini", input="go", tools=[hosted], max_tool_calls=1,  # type: ignore[list-item]
        extra_headers={"X-Run-Id": run, "X-Mock-Script": "hosted"},
    )  # fmt: skip
    rows = await wait_rows(
        rc,
        "SELECT tool_name, attributes FROM runcap.spans "
        f"WHERE run_id = '{run}' AND kind = 'tool_call' ORDER BY started_at, tool_call_id",
        5,
    )
    seen = sorted(
        (r["tool_name"], r["attributes"].get("policy.rule"), r["attributes"].get("policy.effect"),
         r["attributes"].get("policy.enforced"), bool(r["attributes"].get("policy.error")))
        for r in rows
    )  # fmt: skip
    assert seen == [
        ("crm/refund", "frozen", "deny", "false", False),  # executed by the provider: on record only
        ("lookup", None, None, None, False),  # a tool without rules
        ("refund", "", "allow", "false", False),
        ("refund", "large", "deny", "false", True),  # no amount: would fail closed
        ("refund", "non-eur", "deny", "false", False),
    ]
    assert tool.executions == 0  # nothing was executed through runcap; no decision was counted
    assert await metric(rc, "refund", "deny") == 0
