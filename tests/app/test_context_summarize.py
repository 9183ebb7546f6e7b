"""`X-Run-Context-Policy: summarize` end to end: the official clients against runcap in front of
the scripted upstream. Past the threshold the middle of the conversation is replaced by a summary
the configured model writes — one summary call per summarised span, charged to the run as a step
of its own and capped like one — and no tool call is ever separated from its result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import aiohttp
import pytest

from proxy.context.summarize import SUMMARY_INSTRUCTION, SUMMARY_PREFIX
from proxy.scripted_upstream import FALLBACK_TEXT, ScriptedUpstream
from tests.support.context_agents import TOOL, run_agent
from tests.support.raw_http import post_json

STEPS = 14
SUMMARY_MODELS = {"chat": "gpt-4o-mini", "responses": "gpt-4o-mini", "messages": "claude-sonnet-4-5"}
CONTEXT = {"summarize_above_tokens": 12_000, "summary_keep_first": 1, "summary_keep_last": 4}


def _is_summary_call(fmt: str, body: dict[str, Any]) -> bool:
    if fmt == "messages":
        return body.get("system") == SUMMARY_INSTRUCTION
    if fmt == "responses":
        return body.get("instructions") == SUMMARY_INSTRUCTION
    return body["messages"][0].get("content") == SUMMARY_INSTRUCTION


def _items(fmt: str, body: dict[str, Any]) -> list[Any]:
    return body["input"] if fmt == "responses" else body["messages"]


def _pairs(fmt: str, body: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(call ids, result ids) of a request body, in order."""
    calls, results = [], []
    for item in _items(fmt, body):
        if fmt == "chat":
            calls += [c["id"] for c in item.get("tool_calls") or ()]
            if item.get("role") == "tool":
                results.append(item["tool_call_id"])
        elif fmt == "responses":
            if item.get("type") == "function_call":
                calls.append(item["call_id"])
            elif item.get("type") == "function_call_output":
                results.append(item["call_id"])
        elif isinstance(item.get("content"), list):
            calls += [b["id"] for b in item["content"] if b.get("type") == "tool_use"]
            results += [b["tool_use_id"] for b in item["content"] if b.get("type") == "tool_result"]
    return calls, results


def run_sent_last(upstream: ScriptedUpstream, fmt: str) -> dict[str, Any]:
    return [r for r in upstream.requests if not _is_summary_call(fmt, r.body)][-1].body


@pytest.mark.parametrize("fmt", ["chat", "responses", "messages"])
async def test_summary_made_once_per_span_charged_and_pairs_intact(
    fmt: str, upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory({"context": {**CONTEXT, "summary_model": SUMMARY_MODELS[fmt]}})
    # The scripted model picks its step by the assistant turns it is sent, which a summary
    # changes: this one always reads, and the agent stops after STEPS calls.
    upstream.scripts["pages"] = [{"tool_calls": [{"name": TOOL, "arguments": {"i": 1}}]}]
    h = {"X-Run-Id": f"sum-{fmt}", "X-Mock-Script": "pages", "X-Run-Context-Policy": "summarize"}
    run = await run_agent(fmt, rc.url, h, result_size=3000, max_calls=STEPS)
    assert run.calls == STEPS and run.tool_names == [TOOL] * STEPS

    summaries = [r for r in upstream.requests if _is_summary_call(fmt, r.body)]
    forwarded = [r for r in upstream.requests if not _is_summary_call(fmt, r.body)]
    assert len(forwarded) == STEPS
    # Summaries were made, far fewer than the steps that were past the threshold...
    summarized = [r for r in forwarded if SUMMARY_PREFIX.split("{")[0] in str(_items(fmt, r.body))]
    assert 1 <= len(summaries) < len(summarized), (len(summaries), len(summarized))
    # After the first, a summary is made of the previous one plus what followed it, not again of
    # the whole middle.
    assert all("summary_of_earlier_items" in str(r.body) for r in summaries[1:])
    assert "summary_of_earlier_items" not in str(summaries[0].body)
    # ...each of a different span (a span summarised once), each a step of the run, charged.
    assert len({str(r.body) for r in summaries}) == len(summaries)
    assert all(r.body["model"] == SUMMARY_MODELS[fmt] for r in summaries)
    state = await rc.run(f"sum-{fmt}")
    assert state["steps"] == STEPS + len(summaries)
    assert state["input_tokens"] == sum(r.usage.input_tokens for r in upstream.requests)
    # The summary the model wrote is what the forwarded request carries.
    assert FALLBACK_TEXT in str(_items(fmt, summarized[-1].body))

    # No call ever travels without its result, nor a result without its call; the first item and
    # the last four are the agent's own.
    for r in forwarded:
        calls, results = _pairs(fmt, r.body)
        assert calls == results  # every call with its result, in order
    last = _items(fmt, summarized[-1].body)
    assert last[0]["content"] == "read the pages"
    assert last[-4:] == _items(fmt, run_sent_last(upstream, fmt))[-4:]


async def test_a_dollar_cap_too_small_for_the_summary_refuses_the_step_cleanly(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory({"context": {**CONTEXT, "summary_model": "gpt-4o-mini"}})
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(10):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": TOOL, "arguments": "{}"}}]})  # fmt: skip
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": "x" * 3000})
    body = {"model": "gpt-4o-mini", "messages": msgs, "max_tokens": 100}
    h = {"X-Run-Id": "tight", "X-Run-Max-Usd": "0.0001", "X-Run-Context-Policy": "summarize"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rc.url}/v1/chat/completions", json=body, headers=h) as r,
    ):
        assert r.status == 402
        assert r.headers["x-should-retry"] == "false"
        error = (await r.json())["error"]
    assert error["type"] == "run_budget_exceeded" and error["code"] == "max_usd"
    assert upstream.requests == []  # neither the summary nor the step went upstream
    state = await rc.run("tight")
    assert state["steps"] == 0 and Decimal(state["cost_usd"]) == 0


async def test_summarize_without_a_summary_model_is_a_400_naming_the_header_and_setting(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory()
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    h = {"X-Run-Context-Policy": "summarize"}
    status, answer = await post_json(f"{rc.url}/v1/chat/completions", body, h)
    assert status == 400
    error = answer["error"]
    assert error["param"] == "X-Run-Context-Policy" and "summary_model" in error["message"]
    assert upstream.requests == []


async def test_concurrent_requests_of_a_run_share_one_summary(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory({"context": {**CONTEXT, "summary_model": "gpt-4o-mini"}})
    # The summary call (no assistant turn: step 0) takes a while, so the two requests overlap.
    upstream.scripts["slow-summary"] = [{"text": "the summary", "delay_s": 0.3}, {"text": "answer"}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(10):
        call = {"id": f"c{i}", "type": "function", "function": {"name": TOOL, "arguments": "{}"}}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"{i} " + "y" * 3000})
    body = {
        "model": "gpt-4o-mini",
        "messages": msgs,
        "tools": [{"type": "function", "function": {"name": TOOL}}],
    }
    h = {"X-Run-Id": "twice", "X-Mock-Script": "slow-summary", "X-Run-Context-Policy": "summarize"}
    url = f"{rc.url}/v1/chat/completions"

    async def post() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=h) as r:
            assert r.status == 200
            return await r.json()  # type: ignore[no-any-return]

    await asyncio.gather(post(), post())
    summaries = [r for r in upstream.requests if _is_summary_call("chat", r.body)]
    assert len(summaries) == 1
    forwarded = [r.body for r in upstream.requests if not _is_summary_call("chat", r.body)]
    assert len(forwarded) == 2 and forwarded[0] == forwarded[1]
    assert "the summary" in str(forwarded[0]["messages"])
    assert (await rc.run("twice"))["steps"] == 3


async def test_an_operators_cancel_cuts_the_summary_call(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    """The summary is a model call of the run: a cancel cuts it as it cuts the agent's own, and the
    agent's request is answered `run_cancelled` at once, not when the summary is done."""
    rc = await runcap_factory({"context": {**CONTEXT, "summary_model": "gpt-4o-mini"}})
    upstream.scripts["slow-summary"] = [{"text": "a summary", "delay_s": 60}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for i in range(12):
        call = {"id": f"c{i}", "type": "function", "function": {"name": TOOL, "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "page " * 1500},
        ]
    body = {"model": "gpt-4o-mini", "messages": messages}
    h = {"X-Run-Id": "cut-summary", "X-Mock-Script": "slow-summary", "X-Run-Context-Policy": "summarize"}
    async with aiohttp.ClientSession() as s:
        sent = asyncio.create_task(s.post(f"{rc.url}/v1/chat/completions", json=body, headers=h))
        for _ in range(300):
            if upstream.in_flight:
                break
            await asyncio.sleep(0.02)
        assert upstream.in_flight == 1 and _is_summary_call("chat", upstream.requests[-1].body)
        async with s.post(f"{rc.url}/runs/cut-summary/cancel", headers=rc.admin) as r:
            assert r.status == 200
        answer = await asyncio.wait_for(sent, 20)
        status, err = answer.status, await answer.json()
    assert status == 410 and err["error"]["type"] == "run_cancelled", err
    for _ in range(100):  # the upstream saw the summary call cut
        if not upstream.in_flight:
            break
        await asyncio.sleep(0.05)
    assert upstream.in_flight == 0
    assert len(upstream.requests) == 1  # nothing was forwarded after the cut
