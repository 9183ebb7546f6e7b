"""Anthropic messages through runcap with the official `anthropic` client."""

from __future__ import annotations

from decimal import Decimal

import anthropic
import pytest

from proxy.money import usd_to_nanos
from proxy.pricing import PriceBook
from proxy.providers.base import Usage

MODEL = "claude-sonnet-4-5"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TOOLS = [{"name": "refund", "description": "refund an order", "input_schema": {"type": "object"}}]


@pytest.mark.parametrize("prefix", ["", "/anthropic"])
@pytest.mark.parametrize("stream", [False, True])
async def test_messages_tool_use_and_answer(runcap, upstream, stream, prefix):  # type: ignore[no-untyped-def]
    upstream.scripts["a"] = [
        {"tool_calls": [{"name": "refund", "arguments": {"order_id": "D4"}}],
         "cache_read_tokens": 30, "cache_write_tokens": 10},
        {"text": "Refund issued for D4."},
    ]  # fmt: skip
    c = anthropic.AsyncAnthropic(base_url=runcap.url + prefix, api_key="sk-ant-agent")
    rid = f"anth-{stream}-{prefix.strip('/')}"
    h = {"X-Run-Id": rid, "X-Mock-Script": "a", "X-Run-Max-Usd": "2"}
    msgs = [{"role": "user", "content": "refund D4"}]

    async def call(messages):  # type: ignore[no-untyped-def]
        if stream:
            async with c.messages.stream(
                model=MODEL, max_tokens=300, messages=messages, tools=TOOLS, extra_headers=h
            ) as s:
                return await s.get_final_message()
        return await c.messages.create(
            model=MODEL, max_tokens=300, messages=messages, tools=TOOLS, extra_headers=h
        )

    first = await call(msgs)
    tool_use = [b for b in first.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in tool_use] == [("refund", {"order_id": "D4"})]
    # The agent's credentials reach the upstream unchanged (this SDK sends them as a bearer token).
    assert "sk-ant-agent" in (upstream.last.header("x-api-key") or upstream.last.header("authorization"))
    assert upstream.last.path == "/v1/messages"
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use[0].id, "content": "ok"}],
        },
    ]
    second = await call(msgs)
    assert second.content[0].text == "Refund issued for D4."

    run = await runcap.run(rid)
    assert run["status"] == "completed" and run["steps"] == 2 and run["tool_calls"] == 1
    book = PriceBook()
    total_in = total_out = 0
    nanos = 0
    for m in (first, second):
        u = m.usage
        inp = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
        total_in += inp
        total_out += u.output_tokens
        nanos += usd_to_nanos(
            book.cost(
                "anthropic", MODEL,
                Usage(inp, u.output_tokens, u.cache_read_input_tokens or 0,
                      u.cache_creation_input_tokens or 0),
            ).usd
        )  # fmt: skip
    assert first.usage.cache_read_input_tokens == 30
    assert (run["input_tokens"], run["output_tokens"]) == (total_in, total_out)
    assert Decimal(run["cost_usd"]) * 10**9 == nanos


async def test_anthropic_rejection_shape(runcap, upstream):  # type: ignore[no-untyped-def]
    c = anthropic.AsyncAnthropic(base_url=runcap.url, api_key="k", max_retries=3)
    with pytest.raises(anthropic.BadRequestError) as e:
        await c.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Run-Max-Steps": "many"},
        )  # fmt: skip
    assert e.value.body == {
        "type": "error",
        "error": {"type": "invalid_request", "message": e.value.body["error"]["message"]},
    }
    assert "X-Run-Max-Steps" in e.value.body["error"]["message"]
    assert upstream.hits() == 0
