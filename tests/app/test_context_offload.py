"""`X-Run-Context-Policy: offload` end to end: the official clients against runcap in front of
the scripted upstream, whose usage is counted from what it really receives.

A 30-step run whose tool returns 20 KB per call: with offload its input tokens drop by more than
70 % against the same run without, the run completes, the step where the model asks for a handle
gets exactly the bytes it asked for through `runcap_fetch`, and the agent never sees that tool —
for chat completions, Responses and Anthropic messages, streamed and not.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.context import FETCH_TOOL, HANDLE_PREFIX
from proxy.scripted_upstream import ScriptedUpstream, handles_in
from tests.support.context_agents import (
    FORMATS,
    TOOL,
    answered_history,
    run_agent,
    tool_result,
    tool_result_texts,
)

STEPS = 30
FETCH_AT = 12  # the agent's step at which the model asks for a handle
OFFSET, LENGTH = 1000, 300


def script(fetch_at: int | None) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = [
        {"tool_calls": [{"name": TOOL, "arguments": {"i": i}}]} for i in range(STEPS - 1)
    ]
    if fetch_at is not None:
        # The model reads 300 bytes of the first offloaded result (page 0) before going on.
        steps[fetch_at] = {"fetch": {"handle": 0, "offset": OFFSET, "length": LENGTH}}
    steps.append({"text": "all pages read"})
    return steps


def headers(run_id: str, script_name: str, policy: str | None) -> dict[str, str]:
    h = {"X-Run-Id": run_id, "X-Mock-Script": script_name}
    if policy:
        h["X-Run-Context-Policy"] = policy
    return h


def _run_requests(upstream: ScriptedUpstream, run_id: str) -> list[Any]:
    return [r for r in upstream.requests if r.script == run_id]


@pytest.mark.parametrize("fmt", FORMATS)
async def test_offload_cuts_input_tokens_and_fetch_reads_the_right_bytes(
    fmt: str, upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    upstream.scripts["plain30"] = script(None)
    rc = await runcap_factory()
    base = await run_agent(fmt, rc.url, headers(f"base-{fmt}", "plain30", None))
    assert base.final_text == "all pages read" and base.calls == STEPS
    assert FETCH_TOOL not in base.tool_names
    before = (await rc.run(f"base-{fmt}"))["input_tokens"]

    for stream in (False, True):
        name = f"fetch30-{stream}"
        upstream.scripts[name] = script(FETCH_AT)
        off = await run_agent(fmt, rc.url, headers(f"off-{fmt}-{stream}", name, "offload"), stream=stream)

        # The run completes; the agent never sees runcap's tool.
        assert off.final_text == "all pages read" and off.calls == STEPS
        assert set(off.tool_names) == {TOOL}

        # Input tokens as the run was charged (the provider's usage): down by more than 70 %.
        state = await rc.run(f"off-{fmt}-{stream}")
        assert state["input_tokens"] <= 0.3 * before, (before, state["input_tokens"])
        # One extra model call — the continuation after the fetch — is a step of the run.
        assert state["steps"] == STEPS + 1

        sent = _run_requests(upstream, name)
        assert len(sent) == STEPS + 1
        handle = handles_in(sent[FETCH_AT].body)[0]
        page0 = tool_result(0).encode()
        assert handle == HANDLE_PREFIX + hashlib.sha256(page0).hexdigest()
        expected = f"[{FETCH_TOOL} {handle} bytes {OFFSET}-{OFFSET + LENGTH} of {len(page0)}]\n"
        expected += page0[OFFSET : OFFSET + LENGTH].decode()
        assert tool_result_texts(fmt, sent[FETCH_AT + 1].body)[-1] == expected
        # runcap asks the upstream unstreamed when it may have to answer a fetch itself.
        assert not any(r.stream for r in sent[FETCH_AT:])

        # Old results are stubs, the last two steps' results are whole.
        texts = tool_result_texts(fmt, sent[-1].body)
        assert texts[-1] == tool_result(STEPS - 2) and texts[-2] == tool_result(STEPS - 3)
        stubbed = [t for t in texts if HANDLE_PREFIX in t]
        assert len(stubbed) == len(texts) - 2
        assert all(len(t.encode()) < 1024 for t in stubbed)


async def test_without_a_policy_or_with_nothing_to_offload_the_body_is_forwarded_byte_identical(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory()
    big = tool_result(0)
    # Odd formatting and key order, old large results: what a policy would change.
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": TOOL, "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": big},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]  # fmt: skip
    body = {
        "messages": history,
        "model": "gpt-4o-mini",
        "tools": [{"type": "function", "function": {"name": TOOL}}],
    }
    raw = orjson.dumps(body, option=orjson.OPT_INDENT_2)
    small = orjson.dumps(
        {**body, "messages": [*history[:2], {**history[2], "content": "short"}, *history[3:]]}
    )
    declared = orjson.dumps(
        {**body, "tools": [*body["tools"], {"type": "function", "function": {"name": FETCH_TOOL}}]}
    )
    cases = [(raw, None), (small, "offload"), (declared, "offload")]
    async with aiohttp.ClientSession() as s:
        for data, policy in cases:
            h = {"Content-Type": "application/json", **({"X-Run-Context-Policy": policy} if policy else {})}
            async with s.post(f"{rc.url}/v1/chat/completions", data=data, headers=h) as r:
                assert r.status == 200, await r.text()
            assert upstream.last.raw == data
    # ...and the same old result with the policy is offloaded (the cases above could fail).
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rc.url}/v1/chat/completions", data=raw, headers={"X-Run-Context-Policy": "offload"}) as r,
    ):
        assert r.status == 200
    assert upstream.last.raw != raw
    assert HANDLE_PREFIX in upstream.last.body["messages"][2]["content"]


async def _post(
    rc: Any, fmt: str, body: dict[str, Any], h: dict[str, str]
) -> tuple[int, Any, dict[str, str]]:
    path = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}.get(fmt, "/v1/messages")
    async with aiohttp.ClientSession() as s, s.post(f"{rc.url}{path}", json=body, headers=h) as r:
        return r.status, await r.json(), dict(r.headers)


def _shown_tools(fmt: str, answer: dict[str, Any]) -> list[str]:
    if fmt == "chat":
        return [c["function"]["name"] for c in answer["choices"][0]["message"].get("tool_calls") or ()]
    if fmt == "responses":
        return [item["name"] for item in answer["output"] if item["type"] == "function_call"]
    return [b["name"] for b in answer["content"] if b["type"] == "tool_use"]


@pytest.mark.parametrize("fmt", FORMATS)
async def test_mixed_calls_unknown_handles_and_the_round_limit(
    fmt: str, upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory({"context": {"max_fetch_calls": 2}})
    upstream.scripts["mixed"] = [{}] * 4 + [
        {"fetch": {"handle": 0}, "tool_calls": [{"name": TOOL, "arguments": {"i": 7}}]}
    ]
    upstream.scripts["unknown"] = [{}] * 4 + [{"fetch": {"handle": 99}}, {"text": "sorry"}]
    upstream.scripts["greedy"] = [{}] * 4 + [{"fetch": [{"handle": 0}, {"handle": 1, "length": 10}]}]
    body = answered_history(fmt, 4, 4096)

    # The model mixes a fetch with the agent's own call: the agent gets its own call only.
    status, answer, _ = await _post(
        rc, fmt, body, {"X-Mock-Script": "mixed", "X-Run-Context-Policy": "offload"}
    )
    assert status == 200 and _shown_tools(fmt, answer) == [TOOL]
    assert upstream.last.body and len(_run_all(upstream, "mixed")) == 1

    # An unknown handle: the model is told so, and goes on.
    status, answer, headers = await _post(
        rc, fmt, body, {"X-Mock-Script": "unknown", "X-Run-Context-Policy": "offload"}
    )
    assert status == 200 and _shown_tools(fmt, answer) == []
    results = tool_result_texts(fmt, upstream.last.body)
    assert results[-1].startswith(f"{FETCH_TOOL} error: unknown handle 'runcap:sha256/{'0' * 64}'")
    # No X-Run-Id: still one run of two steps (the agent's call and runcap's continuation), in the
    # ledger — not two one-step runs each decided in memory.
    assert headers["X-Run-Step"] == "2"
    assert (await rc.run(headers["X-Run-Id"]))["steps"] == 2

    # A model that only ever fetches: two rounds (max_fetch_calls), then its answer without them.
    status, answer, headers = await _post(
        rc,
        fmt,
        body,
        {"X-Run-Id": f"greedy-{fmt}", "X-Mock-Script": "greedy", "X-Run-Context-Policy": "offload"},
    )
    assert status == 200 and _shown_tools(fmt, answer) == []
    assert len(_run_all(upstream, "greedy")) == 3
    assert headers["X-Run-Step"] == "3"  # the last inner call's step
    run = await rc.run(f"greedy-{fmt}")
    assert run["steps"] == 3
    # Parallel fetches, each answered: page 1's first ten bytes in every continuation.
    assert tool_result_texts(fmt, upstream.last.body)[-1].endswith(tool_result(1, 4096)[:10])


def _run_all(upstream: ScriptedUpstream, script_name: str) -> list[Any]:
    return [r for r in upstream.requests if r.script == script_name]


async def test_a_cap_that_refuses_the_continuation_refuses_the_agents_request(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    from proxy.context import ContextSettings
    from proxy.context.offload import offload
    from proxy.providers.openai_chat import ChatCompletionsAdapter

    settings = ContextSettings(keep_last_steps=1, offload_min_bytes=1024)
    rc = await runcap_factory({"context": {"keep_last_steps": 1, "offload_min_bytes": 1024}})
    # The fetching answer is long: after it, the run's tokens cannot cover the continuation.
    upstream.scripts["costly"] = [{}] * 4 + [{"fetch": {"handle": 0}, "text_tokens": 3000}, {"text": "done"}]
    body = {**answered_history("chat", 4, 3000), "max_tokens": 3100}
    done = offload(body, "chat.completions", settings)
    assert done is not None
    forwarded = ChatCompletionsAdapter().parse_request(done.body).input_token_bound
    cap = forwarded + 3100 + 50  # the first call fits with its whole output limit
    h = {
        "X-Run-Id": "costly",
        "X-Mock-Script": "costly",
        "X-Run-Context-Policy": "offload",
        "X-Run-Max-Tokens": str(cap),
    }
    status, answer, headers = await _post(rc, "chat", body, h)
    assert status == 402, answer
    assert answer["error"]["type"] == "run_budget_exceeded" and answer["error"]["code"] == "max_tokens"
    assert headers["x-should-retry"] == "false"
    assert len(_run_all(upstream, "costly")) == 1  # the continuation was never sent
    run = await rc.run("costly")
    assert run["steps"] == 1 and run["input_tokens"] > 0  # the first call is charged


async def test_fetch_steps_are_traced_and_older_handles_are_read_from_the_payload_store(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory({"tracing": True})
    page0 = tool_result(0, 4096).encode()
    digest = hashlib.sha256(page0).hexdigest()
    upstream.scripts["traced"] = [{}] * 4 + [
        {"fetch": {"handle": 0, "offset": 5, "length": 20}},
        {"text": "ok"},
    ]
    h = {"X-Run-Id": "traced", "X-Mock-Script": "traced", "X-Run-Context-Policy": "offload"}
    status, answer, _ = await _post(rc, "chat", answered_history("chat", 4, 4096), h)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "ok"

    # Both model calls are spans of the run, the fetch call and its result too.
    query = (
        "SELECT kind, step, tool_name, tool_call_id, outcome FROM runcap.spans WHERE run_id = 'traced' "
        "AND kind IN ('model', 'tool_call', 'tool_result') ORDER BY step, kind, tool_call_id"
    )
    rows = await _wait_rows(rc, query, 4)
    models = [r for r in rows if r["kind"] == "model"]
    assert [(r["step"], r["outcome"]) for r in models] == [(1, "ok"), (2, "ok")]
    (fetch,) = [r for r in rows if r["kind"] == "tool_call"]
    assert fetch["step"] == 1 and fetch["tool_name"] == FETCH_TOOL
    assert fetch["tool_call_id"] in {r["tool_call_id"] for r in rows if r["kind"] == "tool_result"}

    # The full result is in the payload store under its handle...
    store = rc.runtime.spans.payloads
    assert store is not None
    for _ in range(200):
        try:
            assert store.get(digest) == page0
            break
        except KeyError:
            await asyncio.sleep(0.05)
    else:
        raise AssertionError("the offloaded result never reached the payload store")
    # ...but a handle is a capability of the request that offloaded it, not a key to the store:
    # a later request that does not carry that result (another conversation, a prompt naming a
    # hash seen in a span or injected by a tool's output) cannot read it.
    later = answered_history("chat", 4, 4096)
    for m in later["messages"]:
        if m.get("role") == "tool":
            m["content"] = m["content"].replace("page", "leaf")  # other results, other handles
    upstream.scripts["later"] = [{}] * 4 + [
        {"fetch": {"handle": HANDLE_PREFIX + digest, "length": 12}},
        {"text": "ok"},
    ]
    status, answer, _ = await _post(rc, "chat", later, {**h, "X-Run-Id": "other", "X-Mock-Script": "later"})
    assert status == 200
    refused = tool_result_texts("chat", upstream.last.body)[-1]
    assert refused.startswith(f"{FETCH_TOOL} error: unknown handle") and page0[:12].decode() not in refused


async def _wait_rows(rc: Any, query: str, want: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for _ in range(200):
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{rc.url}/admin/sql", json={"sql": query, "params": {}}, headers=rc.admin) as r,
        ):
            assert r.status == 200, await r.text()
            d = await r.json()
        rows = [dict(zip(d["columns"], row, strict=True)) for row in d["rows"]]
        if len(rows) >= want:
            return rows
        await asyncio.sleep(0.1)
    return rows
