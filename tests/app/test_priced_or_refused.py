"""Priced or refused (DESIGN.md "Enforcement rules"): every dimension a call is billed for is bounded
before it is forwarded, or the call is a 402 `unpriced_feature` — one test per row of issue 20's
table, against runcap in front of the scripted upstream, which bills as the provider documents.

"The bill" is computed here, independently of runcap, with genai-prices' own `calc_price` on the
usage the upstream reported (`RecordedRequest.usage`) at the price variant it served the call at.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from decimal import ROUND_CEILING, Decimal
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from proxy.providers.base import Usage
from proxy.scripted_upstream import ScriptedUpstream
from tests.support.context_agents import tool_result
from tests.support.genai_bill import genai_price

NANO = Decimal("1e-9")


def bill(provider: str, model: str, usage: Usage, context: dict[str, str] | None = None) -> Decimal:
    """What the provider charges for `usage`, by genai-prices (rounded up to a nano-dollar)."""
    price = genai_price(provider, model, usage, context)
    return price.total_price.quantize(NANO, rounding=ROUND_CEILING)


async def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


def error_of(answer: dict[str, Any]) -> dict[str, Any]:
    return answer["error"]


# -- row 1: price-selecting options --------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_priority_tier_is_reserved_and_settled_at_its_price(
    stream: bool, runcap: Any, upstream: ScriptedUpstream
) -> None:
    """gpt-5 `service_tier: "priority"` bills $2.50 / $20 per M, not $1.25 / $10: a $0.01 cap
    clamps the output at the priority rate, and the run's cost is the priority bill."""
    upstream.scripts["long"] = [{"text_tokens": 5000}]
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="sk-agent")
    h = {"X-Run-Id": f"tier-{stream}", "X-Mock-Script": "long", "X-Run-Max-Usd": "0.01"}
    msgs = [{"role": "user", "content": "write a long story"}]
    if stream:
        async for _ in await c.chat.completions.create(
            model="gpt-5", messages=msgs, service_tier="priority", stream=True, extra_headers=h
        ):
            pass
    else:
        await c.chat.completions.create(
            model="gpt-5", messages=msgs, service_tier="priority", extra_headers=h
        )
    seen = upstream.last
    assert seen.usage is not None
    real = bill("openai", "gpt-5", seen.usage, {"service_tier": "priority"})
    run = await runcap.run(f"tier-{stream}")
    assert Decimal(run["cost_usd"]) == real  # the span's cost is the bill, priority rates
    assert real <= Decimal("0.01")  # the cap held (on main: $0.0199)


async def test_anthropic_fast_mode_is_reserved_at_its_price(runcap: Any, upstream: ScriptedUpstream) -> None:
    upstream.scripts["long"] = [{"text_tokens": 5000}]
    c = anthropic.AsyncAnthropic(base_url=f"{runcap.url}/anthropic", api_key="sk-ant")
    h = {"X-Run-Id": "fast-1", "X-Mock-Script": "long", "X-Run-Max-Usd": "0.01"}
    await c.messages.create(
        model="claude-opus-4-8",
        max_tokens=4000,
        messages=[{"role": "user", "content": "write"}],
        extra_body={"speed": "fast"},
        extra_headers=h,
    )
    seen = upstream.last
    assert seen.usage is not None
    real = bill("anthropic", "claude-opus-4-8", seen.usage, {"speed": "fast"})
    run = await runcap.run("fast-1")
    assert Decimal(run["cost_usd"]) == real
    assert real <= Decimal("0.01")  # on main: $0.0193


async def test_auto_tier_is_reserved_at_the_dearest_it_may_pick(
    runcap: Any, upstream: ScriptedUpstream
) -> None:
    """`auto` is served at the project's tier, which may be priority: reserved at priority."""
    upstream.scripts["auto"] = [{"text_tokens": 5000, "service_tier": "priority"}]
    body = {"model": "gpt-5", "service_tier": "auto", "messages": [{"role": "user", "content": "go"}]}
    h = {"X-Run-Id": "auto-1", "X-Mock-Script": "auto", "X-Run-Max-Usd": "0.01"}
    status, _ = await post(f"{runcap.openai_url}/chat/completions", body, h)
    assert status == 200
    seen = upstream.last
    assert seen.usage is not None
    real = bill("openai", "gpt-5", seen.usage, {"service_tier": "priority"})
    assert Decimal((await runcap.run("auto-1"))["cost_usd"]) == real <= Decimal("0.01")


async def test_a_tier_without_a_price_is_refused_under_a_dollar_cap(
    runcap: Any, upstream: ScriptedUpstream
) -> None:
    body = {"model": "gpt-5", "service_tier": "scale", "messages": [{"role": "user", "content": "go"}]}
    status, answer = await post(
        f"{runcap.openai_url}/chat/completions", body, {"X-Run-Id": "scale-1", "X-Run-Max-Usd": "1"}
    )
    assert status == 402, answer
    err = error_of(answer)
    assert err["type"] == "run_budget_exceeded" and err["code"] == "unpriced_feature"
    assert "service_tier=scale" in err["message"] and err["param"] == '[prices."gpt-5"]'
    assert upstream.hits("/v1/chat/completions") == 0
    # A malformed tier is a 400 naming the field.
    body["service_tier"] = "turbo"
    status, answer = await post(f"{runcap.openai_url}/chat/completions", body, {"X-Run-Max-Usd": "1"})
    assert status == 400 and "service_tier" in error_of(answer)["message"]


# -- row 2: server-side tool fees ------------------------------------------------------------------


async def test_anthropic_web_search_fees_are_charged_and_bounded(
    runcap: Any, upstream: ScriptedUpstream
) -> None:
    """$10 per 1,000 searches (genai-prices `web_searches_kcount`): charged at settlement, and a
    request without `max_uses` gets one that the cap allows — each search an internal call of up
    to the model's context window (200k tokens for claude-sonnet-4-5) plus its fee."""
    upstream.scripts["search"] = [{"hosted_uses": 25, "use_input_tokens": 400, "text": "found"}]
    c = anthropic.AsyncAnthropic(base_url=f"{runcap.url}/anthropic", api_key="sk-ant")
    tools: Any = [{"type": "web_search_20250305", "name": "web_search"}]
    msgs: Any = [{"role": "user", "content": "search"}]
    # Under $0.05 not even one search fits the bound: refused before anything is spent (on main:
    # 25 searches, really $0.2536, recorded $0.0036).
    with pytest.raises(anthropic.APIStatusError) as e:
        await c.messages.create(
            model="claude-sonnet-4-5", max_tokens=200, messages=msgs, tools=tools,
            extra_headers={"X-Run-Id": "ws-small", "X-Mock-Script": "search", "X-Run-Max-Usd": "0.05"},
        )  # fmt: skip
    assert e.value.status_code == 402 and "hosted tools" in str(e.value)
    assert upstream.hits("/v1/messages") == 0
    # Under $3: max_uses set to what the cap leaves, the searches charged at $0.01 each.
    h = {"X-Run-Id": "ws-big", "X-Mock-Script": "search", "X-Run-Max-Usd": "3"}
    await c.messages.create(
        model="claude-sonnet-4-5", max_tokens=200, messages=msgs, tools=tools, extra_headers=h
    )
    seen = upstream.last
    set_uses = seen.body["tools"][0]["max_uses"]
    assert 1 <= set_uses < 25
    assert seen.usage is not None and seen.usage.tool_uses == {"web_search": set_uses}
    real = bill("anthropic", "claude-sonnet-4-5", seen.usage)
    run = await runcap.run("ws-big")
    assert Decimal(run["cost_usd"]) == real <= Decimal(3)
    assert real >= Decimal("0.01") * set_uses
    # The request's own max_uses, when the cap allows it, is left as it is.
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]
    # (a use may cost 200k tokens at the long-context cache-write rate, $7.50/M: $1.51 with its fee)
    h = {"X-Run-Id": "ws-own", "X-Mock-Script": "search", "X-Run-Max-Usd": "5"}
    await c.messages.create(
        model="claude-sonnet-4-5", max_tokens=200, messages=msgs, tools=tools, extra_headers=h
    )
    assert upstream.last.body["tools"][0]["max_uses"] == 2
    assert upstream.last.usage is not None and upstream.last.usage.tool_uses == {"web_search": 2}
    # ... and lowered when it does not: 2 uses do not fit in $3.
    h = {"X-Run-Id": "ws-lower", "X-Mock-Script": "search", "X-Run-Max-Usd": "3"}
    await c.messages.create(
        model="claude-sonnet-4-5", max_tokens=200, messages=msgs, tools=tools, extra_headers=h
    )
    assert upstream.last.body["tools"][0]["max_uses"] == 1


async def test_a_fee_the_price_table_lacks_is_refused_or_declared(
    runcap_factory: Callable[..., Any], upstream: ScriptedUpstream
) -> None:
    """Code interpreter sessions have no genai-prices price: refused under a dollar cap naming the
    setting, priced once the operator declares it (per container session)."""
    upstream.scripts["code"] = [{"hosted_uses": 3, "use_input_tokens": 100, "text": "ran"}]
    body = {
        "model": "gpt-4o-mini",
        "input": "compute",
        "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}],
        "max_tool_calls": 3,
    }
    h = {"X-Run-Id": "ci-1", "X-Mock-Script": "code", "X-Run-Max-Usd": "1"}
    rc = await runcap_factory()
    status, answer = await post(f"{rc.openai_url}/responses", body, h)
    assert status == 402, answer
    assert error_of(answer)["code"] == "unpriced_feature"
    assert error_of(answer)["param"] == '[prices."gpt-4o-mini"] code_execution_usd'
    rc = await runcap_factory({"prices": {"*": {"code_execution_usd": 0.03}}})
    status, answer = await post(f"{rc.openai_url}/responses", body, {**h, "X-Run-Id": "ci-2"})
    assert status == 200, answer
    seen = upstream.last
    assert seen.usage is not None
    # Three calls in one container: one session fee.
    real = bill("openai", "gpt-4o-mini", seen.usage) + Decimal("0.03")
    assert Decimal((await rc.run("ci-2"))["cost_usd"]) == real


# -- row 3: audio ----------------------------------------------------------------------------------


async def test_audio_output_is_priced_at_the_audio_rate(runcap: Any, upstream: ScriptedUpstream) -> None:
    """gpt-audio's audio output is $64/M, its text $10/M: a $0.02 cap clamps at the audio rate."""
    upstream.scripts["speak"] = [{"text": "hi", "audio_tokens": 20000}]
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="sk-agent")
    h = {"X-Run-Id": "audio-1", "X-Mock-Script": "speak", "X-Run-Max-Usd": "0.02"}
    await c.chat.completions.create(
        model="gpt-audio",
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
        messages=[{"role": "user", "content": "say hi"}],
        extra_headers=h,
    )
    seen = upstream.last
    assert seen.usage is not None and seen.usage.output_audio_tokens > 0
    real = bill("openai", "gpt-audio", seen.usage)
    assert Decimal((await runcap.run("audio-1"))["cost_usd"]) == real <= Decimal("0.02")  # main: $0.126


# -- row 4: deployments ----------------------------------------------------------------------------


async def test_a_deployment_is_priced_as_the_model_it_serves(
    runcap_factory: Callable[..., Any], upstream: ScriptedUpstream
) -> None:
    """The body says gpt-4o-mini; the deployment serves o1 ($15 / $60 per M)."""
    upstream.deployments["reasoner"] = "o1"
    upstream.scripts["long"] = [{"text_tokens": 20000}]
    assert upstream.url is not None
    path = "/u/azure/openai/deployments/reasoner/chat/completions?api-version=2024-10-21"
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "think"}]}
    h = {"X-Run-Id": "dep-1", "X-Mock-Script": "long", "X-Run-Max-Usd": "0.05"}
    # Undeclared: refused under a dollar cap, naming the deployment and the setting.
    rc = await runcap_factory({"upstreams": {"azure": {"url": upstream.url}}})
    status, answer = await post(f"{rc.url}{path}", body, h)
    assert status == 402, answer
    err = error_of(answer)
    assert err["code"] == "unpriced_feature" and "'reasoner'" in err["message"]
    assert err["param"] == "[upstreams.azure] deployments"
    assert upstream.hits() == 0
    # Declared: reserved and settled as o1 (on main: a $0.05 cap spent $0.98).
    rc = await runcap_factory(
        {"upstreams": {"azure": {"url": upstream.url, "deployments": {"reasoner": "o1"}}}}
    )
    status, answer = await post(f"{rc.url}{path}", body, h)
    assert status == 200, answer
    assert answer["model"] == "o1"
    seen = upstream.last
    assert seen.usage is not None
    real = bill("openai", "o1", seen.usage)
    assert Decimal((await rc.run("dep-1"))["cost_usd"]) == real <= Decimal("0.05")


async def test_deployments_config_errors_name_the_setting(upstream: ScriptedUpstream, tmp_path: Any) -> None:
    from proxy.config import ConfigError
    from tests.conftest import runcap_config

    assert upstream.url is not None
    with pytest.raises(ConfigError, match=r"upstreams\.azure\.deployments"):
        runcap_config(
            upstream.url, tmp_path, {"upstreams": {"azure": {"url": upstream.url, "deployments": ["o1"]}}}
        )
    with pytest.raises(ConfigError, match=r'prices\."\*": only tool fees'):
        runcap_config(upstream.url, tmp_path, {"prices": {"*": {"input_mtok": 1, "output_mtok": 2}}})
    with pytest.raises(ConfigError, match=r'prices\."gpt-5": set input_mtok'):
        runcap_config(upstream.url, tmp_path, {"prices": {"gpt-5": {}}})


# -- row 5: inputs by reference, hosted tools ------------------------------------------------------


async def test_a_document_by_url_is_bounded_by_the_context_window(
    runcap: Any, upstream: ScriptedUpstream
) -> None:
    """A 100-page PDF by URL can be 150,000 tokens: a 10k-token cap cannot bound it (the model's
    200k window is the only true bound), so it is refused; on main it used 150,002 tokens."""
    upstream.scripts["pdf"] = [{"reference_tokens": 150_000, "text": "summary"}]
    doc = {"type": "document", "source": {"type": "url", "url": "https://example.com/report.pdf"}}
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 500,
        "messages": [{"role": "user", "content": [doc, {"type": "text", "text": "summarise"}]}],
    }
    h = {"X-Run-Id": "pdf-1", "X-Mock-Script": "pdf", "X-Run-Max-Tokens": "10000", "X-Run-Max-Usd": "0.05"}
    status, answer = await post(f"{runcap.url}/anthropic/v1/messages", body, h)
    assert status == 402, answer
    assert upstream.hits("/v1/messages") == 0
    # With room for the window it goes through, and is charged what the provider billed.
    h = {"X-Run-Id": "pdf-2", "X-Mock-Script": "pdf", "X-Run-Max-Tokens": "250000", "X-Run-Max-Usd": "2"}
    status, answer = await post(f"{runcap.url}/anthropic/v1/messages", body, h)
    assert status == 200, answer
    seen = upstream.last
    assert seen.usage is not None and seen.usage.input_tokens > 150_000
    run = await runcap.run("pdf-2")
    assert Decimal(run["cost_usd"]) == bill("anthropic", "claude-sonnet-4-5", seen.usage)
    assert run["input_tokens"] + run["output_tokens"] <= 250_000


async def test_hosted_web_search_gets_a_max_tool_calls_the_budget_allows(
    runcap: Any, upstream: ScriptedUpstream
) -> None:
    upstream.scripts["ws"] = [{"hosted_uses": 50, "use_input_tokens": 3000, "text": "news"}]
    body = {"model": "gpt-4o-mini", "input": "what happened today", "tools": [{"type": "web_search"}]}
    # $0.005 cannot bound one search (128k tokens of results at most, plus $0.01): refused (on
    # main it spent $0.0096).
    h = {"X-Run-Id": "hws-1", "X-Mock-Script": "ws", "X-Run-Max-Usd": "0.005"}
    status, answer = await post(f"{runcap.openai_url}/responses", body, h)
    assert status == 402, answer
    h = {"X-Run-Id": "hws-2", "X-Mock-Script": "ws", "X-Run-Max-Usd": "0.5"}
    status, answer = await post(f"{runcap.openai_url}/responses", body, h)
    assert status == 200, answer
    seen = upstream.last
    set_calls = seen.body["max_tool_calls"]
    assert 1 <= set_calls < 50  # set on the forwarded body, from the remaining budget
    assert seen.usage is not None and seen.usage.tool_uses == {"web_search": set_calls}
    real = bill("openai", "gpt-4o-mini", seen.usage)
    assert Decimal((await runcap.run("hws-2"))["cost_usd"]) == real <= Decimal("0.5")


# -- row 6: provider-executed tool calls -----------------------------------------------------------


async def test_remote_mcp_calls_count_against_the_tool_call_cap(
    runcap: Any, upstream: ScriptedUpstream
) -> None:
    """The provider calls a remote MCP server for the model (`mcp_call` items): capped by
    X-Run-Max-Tool-Calls through `max_tool_calls`, and counted (on main: five refunds executed,
    runcap counted 0 and reported 1 left)."""
    upstream.scripts["mcp"] = [{"hosted_uses": 5, "use_input_tokens": 50, "text": "refunded"}]
    mcp = {
        "type": "mcp",
        "server_label": "crm",
        "server_url": "https://crm.example/mcp",
        "require_approval": "never",
    }
    body = {"model": "gpt-4o-mini", "input": "refund everything", "tools": [mcp]}
    h = {"X-Run-Id": "mcp-1", "X-Mock-Script": "mcp", "X-Run-Max-Tool-Calls": "1"}
    status, answer = await post(f"{runcap.openai_url}/responses", body, h)
    assert status == 200, answer
    assert upstream.last.body["max_tool_calls"] == 1
    assert [i["type"] for i in answer["output"]].count("mcp_call") == 1
    run = await runcap.run("mcp-1")
    assert run["tool_calls"] == 1 and run["remaining"]["max_tool_calls"] == 0
    # The cap is used up: the next call is answer-only (its tools stripped).
    status, answer = await post(f"{runcap.openai_url}/responses", body, h)
    assert status == 200 and "tools" not in upstream.last.body


async def test_provider_executed_calls_are_tool_call_spans(
    runcap_factory: Callable[..., Any], upstream: ScriptedUpstream
) -> None:
    from tests.support.clickhouse import wait_rows

    rc = await runcap_factory({"tracing": True})
    upstream.scripts["mcp"] = [{"hosted_uses": 2, "use_input_tokens": 50, "text": "done"}]
    mcp = {"type": "mcp", "server_label": "crm", "server_url": "https://crm.example/mcp"}
    tools = [mcp, {"type": "web_search"}]
    body = {"model": "gpt-4o-mini", "input": "go", "tools": tools, "max_tool_calls": 2}
    status, answer = await post(
        f"{rc.openai_url}/responses", body, {"X-Run-Id": "sp-1", "X-Mock-Script": "mcp"}
    )
    assert status == 200, answer
    rows = await wait_rows(
        rc,
        "SELECT kind, tool_name, args_hash, attributes FROM runcap.spans WHERE run_id = 'sp-1' ORDER BY kind",
        3,
    )
    calls = [r for r in rows if r["kind"] == "tool_call"]
    assert sorted(r["tool_name"] for r in calls) == ["crm/refund", "web_search"]
    assert all(r["attributes"]["tool.executed_by"] == "provider" and r["args_hash"] for r in calls)
    (model,) = [r for r in rows if r["kind"] == "model"]
    # What made up the step's cost: tokens and the search fee.
    assert model["attributes"]["cost.web_search"] == "0.01"
    assert model["attributes"]["billed.web_search"] == "1"
    assert Decimal(model["attributes"]["cost.input"]) > 0
    # `runcap run` (run_timeline) and run_cost show the kinds that made up the cost.
    from proxy.queryfiles import bind, load_query
    from proxy.readcli import AdminSqlReader

    reader = AdminSqlReader(rc.url, rc.runtime.config.admin_token)

    async def named(name: str) -> list[dict[str, Any]]:
        query = load_query(name)
        bound = await asyncio.to_thread(bind, query, {"run_id": "sp-1"}, reader)
        cols, rows = await asyncio.to_thread(reader.query, query.sql, bound)
        return [dict(zip(cols, row, strict=True)) for row in rows]

    timeline = await named("run_timeline")
    (step,) = [r for r in timeline if r["kind"] == "model"]
    assert "web_search 0.01" in step["cost_parts"] and "input " in step["cost_parts"]
    assert "web_search x1" in step["cost_parts"]
    assert {r["tool"] for r in timeline if r["kind"] == "tool_call"} == {
        "(provider) crm/refund",
        "(provider) web_search",
    }
    (cost,) = [r for r in await named("run_cost") if r["row"] == "run"]
    assert "web_search 0.01" in cost["cost_parts"] and cost["billed_units"] == "web_search 1"
    parts = dict(p.rsplit(" ", 1) for p in cost["cost_parts"].split(", "))
    assert sum(Decimal(v) for v in parts.values()) == Decimal(cost["cost_usd"])


# -- row 7: runcap's own calls ---------------------------------------------------------------------


async def test_fetch_continuations_pass_the_context_cap(
    runcap_factory: Callable[..., Any], upstream: ScriptedUpstream
) -> None:
    """The offloaded request fits a 3,000-token context cap; a continuation carrying a fetched
    20 KB page (over 3,000 words) does not, and is refused like an agent's call would be (on
    main: one agent request became 9 steps, the last sending 133,736 input tokens)."""
    rc = await runcap_factory({"context": {"keep_last_steps": 0, "offload_min_bytes": 1024}})
    msgs: list[Any] = [{"role": "user", "content": "read all pages"}]
    for i in range(4):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": tool_result(i)})
    body = {
        "model": "gpt-4o-mini",
        "messages": msgs,
        "tools": [{"type": "function", "function": {"name": "read"}}],
    }
    upstream.scripts["fetcher"] = [{}] * 4 + [{"fetch": {"handle": i}} for i in range(4)] + [{"text": "done"}]
    h = {
        "X-Run-Id": "ctx-1",
        "X-Mock-Script": "fetcher",
        "X-Run-Context-Policy": "offload",
        "X-Run-Max-Context-Tokens": "3000",
    }
    status, answer = await post(f"{rc.openai_url}/chat/completions", body, h)
    assert status == 402, answer
    assert error_of(answer)["code"] == "max_context_tokens"
    from proxy.server.steps.context import text_words

    sent = [r for r in upstream.requests if r.script == "fetcher"]
    # The continuation that would read over 3,000 words was not sent: each sent call reads fewer.
    assert 1 <= len(sent) < 5
    assert all(text_words(r.body["messages"]) <= 3000 for r in sent)
    run = await rc.run("ctx-1")
    assert run["steps"] == len(sent)
