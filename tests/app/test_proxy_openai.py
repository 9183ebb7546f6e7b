"""OpenAI chat completions and responses through runcap with the official `openai` client:
the agent sees what the upstream sent, and the ledger holds the exact usage and cost."""

from __future__ import annotations

from decimal import Decimal

import openai
import pytest

from proxy.money import usd_to_nanos
from proxy.pricing import PriceBook
from proxy.providers.base import Usage

TOOLS = [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}]
RESP_TOOLS = [{"type": "function", "name": "refund", "parameters": {"type": "object"}}]
PRICES = PriceBook()


def cost_nanos(model: str, inp: int, out: int, cached: int = 0, provider: str = "openai") -> int:
    return usd_to_nanos(PRICES.cost(provider, model, Usage(inp, out, cache_read_tokens=cached)).usd)


def client(runcap, **kw) -> openai.AsyncOpenAI:  # type: ignore[no-untyped-def]
    return openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="sk-agent", **kw)


async def test_chat_tool_call_then_answer_exact_usage(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["refund"] = [
        {
            "tool_calls": [{"name": "refund", "arguments": {"order_id": "A1", "amount": 5}}],
            "cache_read_tokens": 8,
        },
        {"text": "Refunded."},
    ]
    c = client(runcap)
    h = {"X-Run-Id": "chat-1", "X-Mock-Script": "refund", "X-Run-Max-Usd": "1", "X-Run-Task": "support"}
    msgs = [{"role": "user", "content": "refund order A1"}]
    raw = await c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=msgs, tools=TOOLS, extra_headers=h
    )
    first = raw.parse()
    assert raw.headers["x-run-id"] == "chat-1"
    assert raw.headers["x-run-step"] == "1"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "refund" and call.function.arguments == '{"order_id":"A1","amount":5}'
    # What arrived upstream: credentials forwarded, run headers consumed.
    seen = upstream.last
    assert seen.header("authorization") == "Bearer sk-agent"
    assert not any(k.startswith("x-run-") for k in seen.headers)
    assert seen.body["messages"] == msgs

    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'}]  # fmt: skip
    second = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=TOOLS, extra_headers=h)
    assert second.choices[0].message.content == "Refunded."

    u1, u2 = first.usage, second.usage
    assert u1.prompt_tokens_details.cached_tokens == 8
    run = await runcap.run("chat-1")
    assert run["status"] == "completed"
    assert run["steps"] == 2 and run["tool_calls"] == 1 and run["task"] == "support"
    assert run["input_tokens"] == u1.prompt_tokens + u2.prompt_tokens
    assert run["output_tokens"] == u1.completion_tokens + u2.completion_tokens
    expected = cost_nanos("gpt-4o-mini", u1.prompt_tokens, u1.completion_tokens, 8) + cost_nanos(
        "gpt-4o-mini", u2.prompt_tokens, u2.completion_tokens
    )
    assert Decimal(run["cost_usd"]) == Decimal(expected) / 10**9
    assert run["reserved_usd"] == "0.000000000"
    assert run["caps"]["max_usd"] == "1.000000000"
    assert Decimal(run["remaining"]["max_usd"]) == 1 - Decimal(expected) / 10**9


async def test_response_body_is_what_upstream_sent(runcap, upstream):  # type: ignore[no-untyped-def]
    """Byte-for-byte: compare with the same request made directly to the upstream (ids aside)."""
    import aiohttp

    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{upstream.url}/v1/chat/completions", json=body) as r:
            direct = await r.json()
        async with s.post(f"{runcap.openai_url}/chat/completions", json=body) as r:
            via = await r.json()
            assert r.headers["x-run-id"].startswith("run_")  # its own one-step run
    for d in (direct, via):
        d.pop("id"), d.pop("created")
    assert via == direct


async def test_stream_without_include_usage_has_no_empty_choices_chunk(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["long"] = [{"text": "one two three four five six seven eight nine ten"}]
    c = client(runcap)
    stream = await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "count"}], stream=True,
        extra_headers={"X-Run-Id": "s-1", "X-Mock-Script": "long"},
    )  # fmt: skip
    text = ""
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""  # crashes if the usage chunk leaks through
        assert chunk.usage is None
    assert text == "one two three four five six seven eight nine ten"
    # runcap asked the upstream for usage, and settled it exactly.
    assert upstream.last.body["stream_options"] == {"include_usage": True}
    run = await runcap.run("s-1")
    assert run["output_tokens"] > 0 and run["input_tokens"] > 0
    direct = await openai.AsyncOpenAI(base_url=f"{upstream.url}/v1", api_key="x").chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "count"}],
        extra_headers={"X-Mock-Script": "long"},
    )
    assert run["input_tokens"] == direct.usage.prompt_tokens
    assert run["output_tokens"] == direct.usage.completion_tokens
    assert Decimal(run["cost_usd"]) * 10**9 == cost_nanos(
        "gpt-4o-mini", direct.usage.prompt_tokens, direct.usage.completion_tokens
    )


async def test_stream_with_include_usage_keeps_usage_chunk(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["tools"] = [{"tool_calls": [{"name": "refund", "arguments": {"order_id": "B2"}}]}]
    c = client(runcap)
    stream = await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "refund"}], tools=TOOLS, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Run-Id": "s-2", "X-Mock-Script": "tools"},
    )  # fmt: skip
    usage = None
    args = ""
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                args += tc.function.arguments or ""
    assert args == '{"order_id":"B2"}'
    run = await runcap.run("s-2")
    assert usage is not None
    assert (run["input_tokens"], run["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert run["tool_calls"] == 1 and run["status"] == "active"


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_api_with_tool_call(runcap, upstream, stream):  # type: ignore[no-untyped-def]
    upstream.scripts["r"] = [{"tool_calls": [{"name": "refund", "arguments": {"order_id": "C3"}}]}]
    c = client(runcap)
    rid = f"resp-{stream}"
    h = {"X-Run-Id": rid, "X-Mock-Script": "r", "X-Run-Max-Tokens": "5000"}
    kwargs = dict(
        model="gpt-4.1", input="refund C3", tools=RESP_TOOLS, max_output_tokens=200, extra_headers=h
    )
    if stream:
        final = None
        async with c.responses.stream(**kwargs) as s:
            async for _event in s:
                pass
            final = await s.get_final_response()
    else:
        final = await c.responses.create(**kwargs)
    calls = [o for o in final.output if o.type == "function_call"]
    assert [(o.name, o.arguments) for o in calls] == [("refund", '{"order_id":"C3"}')]
    run = await runcap.run(rid)
    assert (run["input_tokens"], run["output_tokens"]) == (
        final.usage.input_tokens,
        final.usage.output_tokens,
    )
    assert run["tool_calls"] == 1
    assert Decimal(run["cost_usd"]) * 10**9 == cost_nanos(
        "gpt-4.1", final.usage.input_tokens, final.usage.output_tokens
    )
    assert upstream.last.body["max_output_tokens"] == 200  # fits the token cap: untouched


async def test_embeddings_and_prefixed_routes(runcap, upstream):  # type: ignore[no-untyped-def]
    for base in (runcap.openai_url, f"{runcap.url}/openai/v1", f"{runcap.url}/u/local/v1"):
        c = openai.AsyncOpenAI(base_url=base, api_key="x")
        e = await c.embeddings.create(
            model="text-embedding-3-small", input=["a b c"], extra_headers={"X-Run-Id": "emb"}
        )
        assert len(e.data[0].embedding) > 0
    run = await runcap.run("emb")
    assert run["steps"] == 0  # embeddings spend tokens but are not agent steps
    assert run["input_tokens"] == 3 * e.usage.prompt_tokens


async def test_passthrough_unknown_endpoint(runcap, upstream):  # type: ignore[no-untyped-def]
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{upstream.url}/v1/models") as r:
            direct = await r.read()
        async with s.get(f"{runcap.openai_url}/models") as r:
            assert r.status == 200
            assert await r.read() == direct
        async with s.get(f"{runcap.openai_url}/no/such/thing?x=1") as r:
            assert r.status == 404  # the upstream's own 404, passed through
            assert upstream.last.query == "x=1"


async def test_upstream_api_key_replaces_agent_credentials(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"upstreams": {"local": {"url": upstream.url, "api_key_env": "LOCAL_KEY"}}},
                              env={"LOCAL_KEY": "sk-operator"})  # fmt: skip
    c = openai.AsyncOpenAI(base_url=f"{rc.url}/u/local/v1", api_key="sk-agent")
    await c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}])
    assert upstream.last.header("authorization") == "Bearer sk-operator"


async def test_connection_listed_headers_are_not_forwarded(runcap, upstream):  # type: ignore[no-untyped-def]
    import aiohttp

    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}
    h = {
        "Connection": "keep-alive, X-Hop-Secret",
        "X-Hop-Secret": "1",
        "X-End-To-End": "2",
        "X-Run-Task": "t",
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{runcap.openai_url}/chat/completions", json=body, headers=h) as r,
    ):
        assert r.status == 200
    seen = upstream.last
    assert seen.header("x-hop-secret") is None and seen.header("x-run-task") is None
    assert seen.header("x-end-to-end") == "2"
