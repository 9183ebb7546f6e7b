"""Run caps enforced in the host: hard ceilings under concurrency, each cap with its own code,
the answer-only final step, and the deadline as the upstream timeout."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

import openai
import pytest

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "write"}]


def err(e: openai.APIStatusError) -> dict:  # type: ignore[type-arg]
    """The error object (the SDK unwraps OpenAI's {"error": {...}} into .body)."""
    return e.body.get("error", e.body) if isinstance(e.body, dict) else {}


def client(runcap, retries: int = 2) -> openai.AsyncOpenAI:  # type: ignore[no-untyped-def]
    return openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=retries)


async def test_hard_dollar_ceiling_under_concurrency(runcap, upstream):  # type: ignore[no-untyped-def]
    # Each call wants up to 1,000 output tokens of gpt-4o ($10/M): $0.01 worst case; the upstream
    # writes 400 tokens ($0.004) after a delay, so all 16 are in flight at once.
    upstream.scripts["essay"] = [{"text_tokens": 400, "delay_s": 0.3}]
    c = client(runcap, retries=5)  # the SDK would retry a 402 if runcap let it
    h = {"X-Run-Id": "conc", "X-Run-Max-Usd": "0.03", "X-Mock-Script": "essay"}

    async def one():  # type: ignore[no-untyped-def]
        try:
            return await c.chat.completions.with_raw_response.create(
                model="gpt-4o", messages=USER, max_tokens=1000, extra_headers=h
            )
        except openai.APIStatusError as e:
            return e

    results = await asyncio.gather(*(one() for _ in range(16)))
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    allowed = [r for r in results if not isinstance(r, openai.APIStatusError)]
    assert refused and allowed
    for e in refused:
        assert e.status_code == 402
        assert e.response.headers["x-should-retry"] == "false"
        assert err(e)["type"] == "run_budget_exceeded" and err(e)["code"] == "max_usd"
    # No retries: the upstream saw exactly the calls runcap allowed.
    assert upstream.hits("/v1/chat/completions") == len(allowed)
    run = await runcap.run("conc")
    assert Decimal(run["cost_usd"]) <= Decimal("0.03")
    assert run["reserved_usd"] == "0.000000000"
    # Every allowed call reserved its worst case at once, so the limits it was sent never add up
    # to more than the cap could pay for.
    limits = [r.body["max_tokens"] for r in upstream.requests]
    assert sum(limits) * Decimal("0.00001") <= Decimal("0.03")

    # Sequential calls until refused: the ceiling is reached by clamping, not by refusing early.
    upstream.scripts["essay"] = [{"text_tokens": 400}]
    upstream.clear()
    seq = 0
    while True:
        try:
            raw = await c.chat.completions.with_raw_response.create(
                model="gpt-4o", messages=USER, max_tokens=1000, extra_headers=h
            )
            seq += 1
            assert seq < 50
        except openai.APIStatusError as e:
            assert e.status_code == 402 and err(e)["code"] == "max_usd"
            assert "X-Run-Max-Usd" in err(e)["message"]
            break
    assert any(r.body["max_tokens"] < 1000 for r in upstream.requests)  # the last ones were clamped
    assert raw.headers.get("x-run-clamped-output-tokens") is not None or seq == 0
    run = await runcap.run("conc")
    spent = Decimal(run["cost_usd"])
    # Close to the cap: refused only when even the input plus a useful output (16 tokens) no longer fits.
    assert Decimal("0.03") - spent < Decimal("0.0005"), spent
    assert spent <= Decimal("0.03")
    assert run["status"] == "budget_exceeded"


async def test_token_cap(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["essay"] = [{"text_tokens": 300}]
    c = client(runcap)
    h = {"X-Run-Id": "tok", "X-Run-Max-Tokens": "1000", "X-Mock-Script": "essay"}
    with pytest.raises(openai.APIStatusError) as e:
        for _ in range(10):
            await c.chat.completions.create(
                model="gpt-4o-mini", messages=USER, max_tokens=500, extra_headers=h
            )
    assert e.value.status_code == 402 and err(e.value)["code"] == "max_tokens"
    run = await runcap.run("tok")
    assert run["input_tokens"] + run["output_tokens"] <= 1000
    assert run["status"] == "budget_exceeded"


async def test_token_cap_clamps_an_answer_that_would_write_past_it(runcap, upstream):  # type: ignore[no-untyped-def]
    """The upstream would write 900 tokens each call; what the run has left is less. Each call is
    sent with the output limit lowered to what is left after its input bound, the upstream writes
    exactly that, and the run's settled tokens never pass the cap."""
    upstream.scripts["long"] = [{"text_tokens": 900}]
    c = client(runcap, retries=0)
    h = {"X-Run-Id": "tok-clamp", "X-Run-Max-Tokens": "1500", "X-Mock-Script": "long"}
    first = await c.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers=h)
    assert first.usage is not None and first.usage.completion_tokens == 900  # it fitted: not clamped
    used = first.usage.total_tokens
    second = await c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER, max_tokens=900, extra_headers=h
    )
    sent = upstream.last.body
    limit = sent.get("max_completion_tokens") or sent.get("max_tokens")
    answer = second.parse()
    assert answer.usage is not None
    assert isinstance(limit, int) and limit < 900 and limit <= 1500 - used - answer.usage.prompt_tokens
    assert answer.usage.completion_tokens == limit
    assert answer.choices[0].finish_reason == "length"
    assert second.headers["x-run-clamped-output-tokens"] == str(limit)
    run = await runcap.run("tok-clamp")
    assert run["input_tokens"] + run["output_tokens"] <= 1500
    assert run["input_tokens"] + run["output_tokens"] == used + answer.usage.total_tokens


async def test_step_cap_answer_only_final_step(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["loop"] = [{"tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]}]
    c = client(runcap)
    h = {"X-Run-Id": "steps", "X-Run-Max-Steps": "3", "X-Mock-Script": "loop"}
    msgs = list(USER)
    finals = []
    for _ in range(3):
        raw = await c.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs, tools=TOOLS, tool_choice="auto", extra_headers=h
        )
        finals.append(raw.headers.get("x-run-final-step"))
        msg = raw.parse().choices[0].message
        msgs.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": "found"})
    assert finals == [None, None, "true"]
    last = upstream.last.body
    assert "tools" not in last and "tool_choice" not in last  # answer-only: tools stripped
    assert msg.tool_calls is None and msg.content  # so the model answered
    assert raw.headers["x-run-remaining-steps"] == "0"
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=TOOLS, extra_headers=h)
    assert e.value.status_code == 402 and err(e.value)["code"] == "max_steps"
    assert e.value.response.headers["x-should-retry"] == "false"
    assert (await runcap.run("steps"))["status"] == "steps_exceeded"


async def test_tool_call_cap(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["loop"] = [{"tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}] * 2}]
    c = client(runcap)
    h = {"X-Run-Id": "tools", "X-Run-Max-Tool-Calls": "2", "X-Mock-Script": "loop"}
    raw = await c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER, tools=TOOLS, extra_headers=h
    )
    assert raw.headers.get("x-run-final-step") is None
    assert len(raw.parse().choices[0].message.tool_calls) == 2
    # The cap is used up: the next call may only answer.
    raw = await c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER, tools=TOOLS, extra_headers=h
    )
    assert raw.headers["x-run-final-step"] == "true" and "tools" not in upstream.last.body
    assert raw.headers["x-run-remaining-tool-calls"] == "0"
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER, tools=TOOLS, extra_headers=h)
    assert e.value.status_code == 402 and err(e.value)["code"] == "max_tool_calls"
    assert (await runcap.run("tools"))["status"] == "tool_calls_exceeded"


async def test_deadline_cuts_a_stalled_upstream(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["stall"] = [{"text": "late", "delay_s": 30}]
    c = client(runcap, retries=3)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(
            model="gpt-4o-mini", messages=USER,
            extra_headers={"X-Run-Id": "dl", "X-Run-Timeout": "0.5", "X-Mock-Script": "stall"},
        )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert e.value.status_code == 504 and err(e.value)["type"] == "run_deadline_exceeded"
    assert e.value.response.headers["x-should-retry"] == "false"
    # Cut by the run's deadline (the type says so, and the upstream saw the disconnect below), not
    # before it; the upper bound is a liveness guard at 10x the deadline (the upstream takes 30 s).
    assert 0.45 <= elapsed < 10 * 0.5
    assert upstream.hits() == 1  # not retried
    for _ in range(50):  # the upstream saw the disconnect
        if upstream.last.disconnected:
            break
        await asyncio.sleep(0.05)
    assert upstream.last.disconnected
    run = await runcap.run("dl")
    assert run["status"] == "deadline_exceeded" and run["reserved_usd"] == "0.000000000"
    # Later calls are refused before reaching the upstream.
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers={"X-Run-Id": "dl"})
    assert e.value.status_code == 504 and upstream.hits() == 1


async def test_deadline_mid_stream_ends_stream_with_error_event(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["stall"] = [{"text": "a long answer that stalls half way", "stall_s": 30}]
    c = client(runcap)
    # The deadline must fall after the stream has begun (its headers and first events): 0.5 s
    # was once not enough for that on a loaded machine (a 504 before the stream, not this test's
    # case); the stall after them is 30 s.
    stream = await c.chat.completions.create(
        model="gpt-4o-mini", messages=USER, stream=True,
        extra_headers={"X-Run-Id": "dls", "X-Run-Timeout": "2", "X-Mock-Script": "stall"},
    )  # fmt: skip
    with pytest.raises(openai.APIError) as e:
        async for _chunk in stream:
            pass
    assert "deadline" in str(e.value.message)
    # The stream's own error event (the SDK raises APIError itself), not a cut connection.
    assert type(e.value) is openai.APIError, type(e.value)
    run = await runcap.run("dls")
    assert run["status"] == "deadline_exceeded"
    assert run["output_tokens"] > 0  # cut before usage: settled at what was reserved


async def test_caps_only_lower_and_ceilings_clamp(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"caps": {"ceiling_max_usd": 1.0, "default_max_steps": 7}})
    c = client(rc)
    base = {"X-Run-Id": "lower"}
    await c.chat.completions.create(
        model="gpt-4o-mini",
        messages=USER,
        extra_headers={**base, "X-Run-Max-Usd": "5", "X-Run-Max-Tokens": "9000"},
    )
    run = await rc.run("lower")
    assert run["caps"]["max_usd"] == "1.000000000"  # ceiling
    assert run["caps"]["max_steps"] == 7  # default
    await c.chat.completions.create(
        model="gpt-4o-mini",
        messages=USER,
        extra_headers={**base, "X-Run-Max-Usd": "9", "X-Run-Max-Tokens": "8000"},
    )
    run = await rc.run("lower")
    assert (
        run["caps"]["max_usd"] == "1.000000000" and run["caps"]["max_tokens"] == 8000
    )  # lowered, never raised


async def test_unpriced_model_with_dollar_cap(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"prices": {"my-finetune": {"input_mtok": 1.0, "output_mtok": 2.0}}})
    c = client(rc)
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(
            model="totally-unknown-model",
            messages=USER,
            extra_headers={"X-Run-Id": "u1", "X-Run-Max-Usd": "1"},
        )
    assert err(e.value)["code"] == "unpriced_model" and "[prices." in err(e.value)["message"]
    assert upstream.hits() == 0
    # Without a dollar cap it goes through, and is never silently $0: the price is unknown.
    await c.chat.completions.create(
        model="totally-unknown-model", messages=USER, extra_headers={"X-Run-Id": "u2"}
    )
    # An operator price makes it enforceable.
    r = await c.chat.completions.create(
        model="my-finetune", messages=USER, extra_headers={"X-Run-Id": "u3", "X-Run-Max-Usd": "1"}
    )
    run = await rc.run("u3")
    expected = (Decimal(r.usage.prompt_tokens) * 1 + Decimal(r.usage.completion_tokens) * 2) / 10**6
    assert Decimal(run["cost_usd"]) == expected
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"{rc.url}/metrics") as m:
        text = await m.text()
    assert 'runcap_unpriced_calls_total{model="totally-unknown-model"} 1.0' in text


async def test_long_conversation_ends_close_to_its_cap(runcap, upstream):  # type: ignore[no-untyped-def]
    """Long answers resent as history: the byte bound alone would refuse with ~1/3 of the budget
    left; the run's own usage tightens it, so the run ends within a useful output of its cap."""
    upstream.scripts["essay"] = [{"text_tokens": 900}]
    c = client(runcap)
    h = {"X-Run-Id": "long", "X-Run-Max-Usd": "0.03", "X-Mock-Script": "essay"}
    msgs: list[dict] = [{"role": "user", "content": "write"}]  # type: ignore[type-arg]
    with pytest.raises(openai.APIStatusError) as e:
        for _ in range(10):
            r = await c.chat.completions.create(
                model="gpt-4o", messages=msgs, max_tokens=1000, extra_headers=h
            )
            msgs += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Go on."},
            ]
    assert err(e.value)["code"] == "max_usd"
    spent = Decimal((await runcap.run("long"))["cost_usd"])
    assert Decimal("0.0295") <= spent <= Decimal("0.03"), spent


def test_conversation_memory_bounds():  # type: ignore[no-untyped-def]
    from proxy.providers.base import Usage
    from proxy.providers.openai_chat import ChatCompletionsAdapter
    from proxy.server.steps.history import ANSWER_MARGIN, ConversationMemory

    a = ChatCompletionsAdapter()
    memory = ConversationMemory()
    answer = "x" * 4000
    first = {"model": "gpt-4o", "messages": [{"role": "user", "content": "write"}]}
    info1 = a.parse_request(first)
    resp = a.parse_response(
        {"model": "gpt-4o", "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
    )
    memory.remember("r", info1, Usage(10, 1000), resp)
    nxt = {
        "model": "gpt-4o",
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "more"},
        ],
    }
    info2 = a.parse_request(nxt)
    new_user = a.history_item(nxt["messages"][2])[0]
    assert memory.bound("r", a, info2) == 10 + 1000 + ANSWER_MARGIN + new_user
    assert info2.input_token_bound > 4000  # the byte bound it replaces
    # Anything that does not match falls back to the byte bound.
    edited = {**nxt, "messages": [{"role": "user", "content": "wrote"}, *nxt["messages"][1:]]}
    assert memory.bound("r", a, a.parse_request(edited)) == a.parse_request(edited).input_token_bound
    changed_answer = {
        **nxt,
        "messages": [nxt["messages"][0], {"role": "assistant", "content": answer + "!"}, nxt["messages"][2]],
    }
    info3 = a.parse_request(changed_answer)
    assert memory.bound("r", a, info3) == 10 + sum(
        a.history_item(m)[0] for m in changed_answer["messages"][1:]
    )
    other_model = {**nxt, "model": "gpt-4o-mini"}
    assert (
        memory.bound("r", a, a.parse_request(other_model)) == a.parse_request(other_model).input_token_bound
    )
    assert memory.bound("unknown-run", a, info2) == info2.input_token_bound


async def test_previous_response_id_is_bounded_by_what_it_stored(runcap, upstream):  # type: ignore[no-untyped-def]
    """Responses continuing a stored response bill its tokens too, which are not in the body."""
    c = client(runcap, retries=0)
    h = {"X-Run-Id": "prev", "X-Run-Max-Usd": "0.05"}
    first = await c.responses.create(model="gpt-4.1", input="hello", max_output_tokens=50, extra_headers=h)
    second = await c.responses.create(
        model="gpt-4.1",
        input="and again",
        previous_response_id=first.id,
        max_output_tokens=50,
        extra_headers=h,
    )
    assert second.usage.input_tokens > first.usage.input_tokens  # the stored turn was billed again
    # A response this runcap never saw: its size is unknown, so the whole context window of
    # gpt-4.1 (1M tokens, $2) is reserved — more than the cap: refused before reaching upstream.
    hits = upstream.hits()
    with pytest.raises(openai.APIStatusError) as e:
        await c.responses.create(
            model="gpt-4.1",
            input="x",
            previous_response_id="resp_elsewhere",
            max_output_tokens=50,
            extra_headers=h,
        )
    assert e.value.status_code == 402 and err(e.value)["code"] == "max_usd"
    assert "1000" in err(e.value)["message"] and upstream.hits() == hits


async def test_injected_output_limit_field_per_upstream(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    """A capped call without an output limit gets one: `max_completion_tokens` for OpenAI,
    `max_tokens` (the field OpenAI-compatible servers know) for other upstreams, unless configured."""
    rc = await runcap_factory(
        {"upstreams": {"vllm": {"url": upstream.url, "output_limit_field": "max_completion_tokens"}}}
    )
    h = {"X-Run-Max-Usd": "1"}
    sent = {}
    for base in ("v1", "u/local/v1", "u/vllm/v1"):
        c = openai.AsyncOpenAI(base_url=f"{rc.url}/{base}", api_key="k")
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers=h)
        body = upstream.last.body
        sent[base] = sorted(k for k in ("max_tokens", "max_completion_tokens") if k in body)
    assert sent == {
        "v1": ["max_completion_tokens"],
        "u/local/v1": ["max_tokens"],
        "u/vllm/v1": ["max_completion_tokens"],
    }
    from proxy.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"upstreams\.x\.output_limit_field"):
        build_config({"upstreams": {"x": {"url": "http://h", "output_limit_field": "max"}}}, {})
