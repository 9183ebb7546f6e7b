"""The scripted upstream, driven directly by the official `openai` and `anthropic` clients.

These tests pin the wire formats (the clients must parse everything the server sends) and the
deterministic token accounting that the proxy's own tests rely on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from proxy.providers.base import Usage
from proxy.scripted_upstream import (
    DEFAULT_TEXT,
    FALLBACK_TEXT,
    ScriptedUpstream,
    count_tokens,
    load_scripts,
)

REFUND_ARGS = {"order_id": "A-17", "amount": 25}
REFUND_ARGS_JSON = '{"order_id":"A-17","amount":25}'
LOOKUP_ARGS_JSON = '{"order_id":"A-17"}'

SCRIPTS: dict[str, list[dict[str, Any]]] = {
    "hello": [{"text": "Hello world!"}],
    "refund": [
        {"tool_calls": [{"name": "refund", "arguments": REFUND_ARGS}]},
        {"text": "Refund issued."},
    ],
    "parallel": [
        {
            "tool_calls": [
                {"name": "lookup", "arguments": {"order_id": "A-17"}},
                {"name": "refund", "arguments": REFUND_ARGS},
            ]
        },
        {"text": "All done."},
    ],
    "long": [{"text_tokens": 50}],
    "cached": [{"text": "ok", "cache_read_tokens": 100, "cache_write_tokens": 20, "reasoning_tokens": 7}],
    "boom": [{"status": 500, "error": "scripted failure"}],
    "overloaded": [{"status": 529, "error": "Overloaded"}],
    "stall": [{"text": "first second third fourth fifth", "stall_s": 5.0}],
    "slow": [{"text": "late", "delay_s": 0.2}],
    "drop": [{"text_tokens": 30, "drop_after_events": 3}],
}

CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "refund",
            "description": "Refund an order",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
]
RESPONSES_TOOLS = [{"type": "function", "name": "refund", "parameters": {"type": "object", "properties": {}}}]
ANTHROPIC_TOOLS = [{"name": "refund", "input_schema": {"type": "object", "properties": {}}}]


def tools_tokens(tools: Any) -> int:
    return count_tokens(orjson.dumps(tools).decode())


def script(name: str) -> dict[str, str]:
    return {"X-Mock-Script": name}


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedUpstream]:
    upstream = ScriptedUpstream(SCRIPTS)
    await upstream.start()
    yield upstream
    await upstream.stop()


@pytest.fixture
def oai(scripted: ScriptedUpstream) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{scripted.url}/v1", api_key="x", max_retries=0)


@pytest.fixture
def claude(scripted: ScriptedUpstream) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=scripted.url, api_key="x", max_retries=0)


# ------------------------------------------------------------------ token counting


def test_count_tokens_is_ceil_of_utf8_bytes_over_4() -> None:
    assert count_tokens("") == 0
    assert count_tokens("abcd") == 1
    assert count_tokens("abcde") == 2
    assert count_tokens("é") == 1  # 2 bytes
    assert count_tokens("ééé") == 2  # 6 bytes


# ------------------------------------------------------------------ OpenAI chat


async def test_chat_text_answer_with_exact_usage(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        extra_headers=script("hello"),
    )
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    assert resp.model == "gpt-4o-mini"
    choice = resp.choices[0]
    assert choice.message.content == "Hello world!"
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    # 3 base + (4 + "Be brief." 9 bytes -> 3) + (4 + "Hi there" 8 bytes -> 2)
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == 3 + 7 + 6
    assert resp.usage.completion_tokens == 3
    assert resp.usage.total_tokens == 19
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0
    assert scripted.hits("/v1/chat/completions") == 1


async def test_chat_default_script(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert resp.choices[0].message.content == DEFAULT_TEXT
    assert resp.usage.completion_tokens == count_tokens(DEFAULT_TEXT)


async def test_chat_tool_calls_parallel_non_stream(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "refund A-17"}],
        tools=CHAT_TOOLS,
        extra_headers=script("parallel"),
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["lookup", "refund"]
    assert [c.function.arguments for c in calls] == [LOOKUP_ARGS_JSON, REFUND_ARGS_JSON]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    assert json.loads(calls[1].function.arguments) == REFUND_ARGS
    assert resp.usage.prompt_tokens == 3 + 4 + count_tokens("refund A-17") + tools_tokens(CHAT_TOOLS)
    assert resp.usage.completion_tokens == count_tokens(LOOKUP_ARGS_JSON) + count_tokens(REFUND_ARGS_JSON)


async def test_chat_stream_without_usage(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        extra_headers=script("long"),
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
    assert all(c.choices for c in chunks), "no usage-only chunk without include_usage"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert count_tokens(text) == 50
    content_chunks = [c for c in chunks if c.choices[0].delta.content]
    assert len(content_chunks) > 3
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len({c.id for c in chunks}) == 1


async def test_chat_stream_include_usage(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=script("hello"),
    )
    chunks = [chunk async for chunk in stream]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == 3 + 4 + 1
    assert last.usage.completion_tokens == 3
    assert last.usage.total_tokens == 11
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "Hello world!"
    assert scripted.last.stream and scripted.last.completed and not scripted.last.disconnected


async def test_chat_stream_raw_wire_format(scripted: ScriptedUpstream) -> None:
    """Every chunk carries `"usage": null` when include_usage is set, and the stream ends with [DONE]."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": CHAT_TOOLS,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{scripted.url}/v1/chat/completions", json=body, headers=script("refund")) as resp,
    ):
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant"
    head = first["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "refund", "arguments": ""}
    fragments = [c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks[1:-2]]
    assert len(fragments) >= 2
    assert "".join(fragments) == REFUND_ARGS_JSON
    assert chunks[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == count_tokens(REFUND_ARGS_JSON)


async def test_chat_stream_parallel_tool_calls_accumulate(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "go"}],
        tools=CHAT_TOOLS,
        stream=True,
        extra_headers=script("parallel"),
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i]["name"] for i in (0, 1)] == ["lookup", "refund"]
    assert [calls[i]["arguments"] for i in (0, 1)] == [LOOKUP_ARGS_JSON, REFUND_ARGS_JSON]
    assert all(c["id"].startswith("call_") for c in calls.values())


async def test_chat_max_tokens_truncates(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, extra_headers=script("long")
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 10
    assert count_tokens(resp.choices[0].message.content) == 10

    # max_completion_tokens works the same, and in streams too
    stream = await oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=script("long"),
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-2].choices[0].finish_reason == "length"
    assert count_tokens("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)) == 7


async def test_chat_limit_cuts_tool_call_arguments(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        tools=CHAT_TOOLS,
        max_tokens=3,
        extra_headers=script("refund"),
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3
    assert REFUND_ARGS_JSON.startswith(resp.choices[0].message.tool_calls[0].function.arguments)


async def test_step_selected_by_history(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "refund A-17"}]
    first = await oai.chat.completions.create(
        model="m", messages=history, tools=CHAT_TOOLS, extra_headers=script("refund")
    )
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "refund"
    history += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"ok":true}'},
    ]
    second = await oai.chat.completions.create(
        model="m", messages=history, tools=CHAT_TOOLS, extra_headers=script("refund")
    )
    assert second.choices[0].message.content == "Refund issued."
    expected_input = (
        3
        + tools_tokens(CHAT_TOOLS)
        + (4 + count_tokens("refund A-17"))
        + (4 + count_tokens("refund" + REFUND_ARGS_JSON))
        + (4 + count_tokens('{"ok":true}'))
    )
    assert second.usage.prompt_tokens == expected_input
    # past the end of the script the last step repeats
    history += [
        second.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "thanks"},
    ]
    third = await oai.chat.completions.create(
        model="m", messages=history, tools=CHAT_TOOLS, extra_headers=script("refund")
    )
    assert third.choices[0].message.content == "Refund issued."
    assert [r.step for r in scripted.requests] == [0, 1, 2]


async def test_concurrent_conversations_do_not_interfere(oai: openai.AsyncOpenAI) -> None:
    fresh = [{"role": "user", "content": "go"}]
    later = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "refund", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]  # fmt: skip
    results = await asyncio.gather(
        *[
            oai.chat.completions.create(
                model="m", messages=msgs, tools=CHAT_TOOLS, extra_headers=script("refund")
            )
            for msgs in [fresh, later] * 5
        ]
    )
    for i, resp in enumerate(results):
        if i % 2 == 0:
            assert resp.choices[0].message.tool_calls[0].function.name == "refund"
        else:
            assert resp.choices[0].message.content == "Refund issued."


async def test_tool_step_without_tools_answers_with_text(oai: openai.AsyncOpenAI) -> None:
    no_tools = await oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "go"}], extra_headers=script("refund")
    )
    assert no_tools.choices[0].message.content == FALLBACK_TEXT
    assert no_tools.choices[0].message.tool_calls is None
    assert no_tools.choices[0].finish_reason == "stop"
    assert no_tools.usage.completion_tokens == count_tokens(FALLBACK_TEXT)

    choice_none = await oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "go"}],
        tools=CHAT_TOOLS,
        tool_choice="none",
        extra_headers=script("refund"),
    )
    assert choice_none.choices[0].message.content == FALLBACK_TEXT


async def test_chat_rejects_tool_settings_without_tools(oai: openai.AsyncOpenAI) -> None:
    """As the real API does: a proxy that strips `tools` must strip these too."""
    msgs = [{"role": "user", "content": "go"}]
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model="m", messages=msgs, tool_choice="auto")
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model="m", messages=msgs, parallel_tool_calls=False)
    assert info.value.body["param"] == "parallel_tool_calls"
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model="m", messages=msgs, tools=[])
    assert info.value.body["code"] == "empty_array"


async def test_cache_and_reasoning_tokens(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], extra_headers=script("cached")
    )
    # the scripted cache tokens exceed this tiny prompt, so they set the input size
    assert resp.usage.prompt_tokens == 120
    assert resp.usage.prompt_tokens_details.cached_tokens == 100
    assert resp.usage.completion_tokens_details.reasoning_tokens == 7
    assert resp.usage.completion_tokens == 7 + count_tokens("ok")


async def test_error_step_openai_shape(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], extra_headers=script("boom")
        )
    assert info.value.status_code == 500
    assert info.value.body == {
        "message": "scripted failure",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert scripted.hits() == 1


async def test_delay_step_and_in_flight(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    started = time.monotonic()
    results = await asyncio.gather(
        *[
            oai.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], extra_headers=script("slow")
            )
            for _ in range(5)
        ]
    )
    assert [r.choices[0].message.content for r in results] == ["late"] * 5
    assert time.monotonic() - started >= 0.2  # the delay is kept
    # ... by the five at once, not one after the other (which took 1 s): the upstream saw them so.
    assert scripted.max_in_flight == 5 and scripted.in_flight == 0


async def test_unknown_script_and_bad_body(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], extra_headers=script("nope")
        )
    assert "X-Mock-Script" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    assert info.value.body["param"] == "max_tokens"


async def test_records_requests(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    await oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        tools=CHAT_TOOLS,
        max_tokens=33,
        extra_headers={"X-Mock-Script": "hello", "X-Custom": "1"},
    )
    rec = scripted.last
    assert rec.method == "POST" and rec.path == "/v1/chat/completions"
    assert rec.header("x-custom") == "1" and rec.header("X-Mock-Script") == "hello"
    assert rec.headers["authorization"] == "Bearer x"
    assert rec.body["max_tokens"] == 33 and rec.body["tools"] == CHAT_TOOLS
    assert rec.script == "hello" and rec.step == 0 and rec.status == 200 and rec.completed
    expected_input = 3 + tools_tokens(CHAT_TOOLS) + 4 + 1
    assert rec.usage == Usage(input_tokens=expected_input, output_tokens=3)
    assert scripted.in_flight == 0 and scripted.max_in_flight == 1
    scripted.clear()
    assert scripted.requests == []


# ------------------------------------------------------------------ stalls and disconnects


async def test_stall_and_client_disconnect_is_recorded(scripted: ScriptedUpstream) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{scripted.url}/v1/chat/completions", json=body, headers=script("stall"))
        first = await resp.content.readuntil(b"\n\n")
        assert b'"role":"assistant"' in first
        second = await resp.content.readuntil(b"\n\n")
        assert b'"content":"first second thi"' in second
        # the server is now stalling for 5 s: nothing more arrives
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.2)
        assert scripted.in_flight == 1
        resp.close()
    for _ in range(100):
        if scripted.last.disconnected:
            break
        await asyncio.sleep(0.01)
    rec = scripted.last
    assert rec.disconnected and not rec.completed
    assert scripted.in_flight == 0


async def test_drop_after_events_cuts_the_connection(
    scripted: ScriptedUpstream, oai: openai.AsyncOpenAI
) -> None:
    received = []
    with pytest.raises(openai.APIConnectionError):
        stream = await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True, extra_headers=script("drop")
        )
        async for chunk in stream:
            received.append(chunk)
    assert len(received) == 3
    assert scripted.last.dropped and not scripted.last.completed and not scripted.last.disconnected
    with pytest.raises(openai.APIConnectionError):
        await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], extra_headers=script("drop")
        )
    assert scripted.last.dropped and scripted.in_flight == 0


async def test_stop_does_not_wait_for_stalled_streams() -> None:
    # A stream stalled for 10 minutes: a stop that waited for it fails the liveness guard.
    upstream = ScriptedUpstream({**SCRIPTS, "stall-long": [{"text": "first second", "stall_s": 600.0}]})
    url = await upstream.start()
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{url}/v1/chat/completions", json=body, headers=script("stall-long"))
        await resp.content.readuntil(b"\n\n")
        await asyncio.wait_for(upstream.stop(), 30)
        resp.close()


# ------------------------------------------------------------------ OpenAI Responses


async def test_responses_text_non_stream(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.responses.create(
        model="gpt-4.1", input="Hi there", instructions="Be brief.", extra_headers=script("hello")
    )
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.model == "gpt-4.1"
    assert resp.output_text == "Hello world!"
    message = resp.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert resp.usage.input_tokens == 3 + (4 + count_tokens("Be brief.")) + (4 + count_tokens("Hi there"))
    assert resp.usage.output_tokens == 3
    assert resp.usage.total_tokens == resp.usage.input_tokens + 3
    assert resp.usage.input_tokens_details.cached_tokens == 0
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


async def test_responses_function_calls_and_history(
    scripted: ScriptedUpstream, oai: openai.AsyncOpenAI
) -> None:
    first = await oai.responses.create(
        model="gpt-4.1", input="refund A-17", tools=RESPONSES_TOOLS, extra_headers=script("parallel")
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["lookup", "refund"]
    assert [c.arguments for c in calls] == [LOOKUP_ARGS_JSON, REFUND_ARGS_JSON]
    assert all(
        c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed" for c in calls
    )
    assert first.usage.output_tokens == count_tokens(LOOKUP_ARGS_JSON) + count_tokens(REFUND_ARGS_JSON)
    assert first.usage.input_tokens == 3 + tools_tokens(RESPONSES_TOOLS) + 4 + count_tokens("refund A-17")

    # parallel calls then their outputs: one assistant turn -> step 1
    items: list[Any] = [{"role": "user", "content": "refund A-17"}]
    items += [c.model_dump(exclude_none=True) for c in calls]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls]
    second = await oai.responses.create(
        model="gpt-4.1", input=items, tools=RESPONSES_TOOLS, extra_headers=script("parallel")
    )
    assert second.output_text == "All done."
    assert scripted.last.step == 1
    expected = (
        3
        + tools_tokens(RESPONSES_TOOLS)
        + (4 + count_tokens("refund A-17"))
        + (4 + count_tokens("lookup" + LOOKUP_ARGS_JSON))
        + (4 + count_tokens("refund" + REFUND_ARGS_JSON))
        + 2 * (4 + count_tokens("ok"))
    )
    assert second.usage.input_tokens == expected

    # previous_response_id carries the turns of the response it points at
    chained = await oai.responses.create(
        model="gpt-4.1",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls],
        tools=RESPONSES_TOOLS,
        extra_headers=script("parallel"),
    )
    assert chained.output_text == "All done."
    with pytest.raises(openai.BadRequestError) as info:
        await oai.responses.create(model="gpt-4.1", previous_response_id="resp_unknown", input="x")
    assert info.value.body["code"] == "previous_response_not_found"


async def test_responses_stored_conversation_and_item_references(
    scripted: ScriptedUpstream, oai: openai.AsyncOpenAI
) -> None:
    """Stored responses as the provider keeps them: a `previous_response_id` continuation and an
    `item_reference` (what the Vercel AI SDK sends for an earlier answer's text) are answered
    and billed as if the stored items had been sent; tool outputs must pair with their calls."""
    scripted.scripts["say-then-call"] = [
        {"text": "Let me check.", "tool_calls": [{"name": "refund", "arguments": REFUND_ARGS}]},
        {"text": "Refund issued."},
    ]
    h = script("say-then-call")
    first = await oai.responses.create(
        model="gpt-4.1", input="refund A-17", tools=RESPONSES_TOOLS, extra_headers=h
    )
    message, call = first.output
    assert message.type == "message" and call.type == "function_call"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}
    sent = [
        {"role": "user", "content": "refund A-17"},
        message.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True),
        output,
    ]
    resent = await oai.responses.create(model="gpt-4.1", input=sent, tools=RESPONSES_TOOLS, extra_headers=h)
    referenced = await oai.responses.create(
        model="gpt-4.1", tools=RESPONSES_TOOLS, extra_headers=h,
        input=[sent[0], {"type": "item_reference", "id": message.id}, sent[2], output],
    )  # fmt: skip
    chained = await oai.responses.create(
        model="gpt-4.1", previous_response_id=first.id, input=[output], tools=RESPONSES_TOOLS, extra_headers=h
    )
    assert resent.output_text == referenced.output_text == chained.output_text == "Refund issued."
    assert resent.usage.input_tokens == referenced.usage.input_tokens == chained.usage.input_tokens
    assert chained.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    async def refused(**kwargs: Any) -> str:
        with pytest.raises(openai.BadRequestError) as info:
            await oai.responses.create(model="gpt-4.1", tools=RESPONSES_TOOLS, extra_headers=h, **kwargs)
        return str(info.value.body["message"])  # type: ignore[index]

    assert "Item with id 'msg_unknown' not found" in await refused(
        input=[sent[0], {"type": "item_reference", "id": "msg_unknown"}]
    )
    assert f"No tool output found for function call {call.call_id}" in await refused(input=sent[:3])
    assert "No tool call found for function call output" in await refused(input=[sent[0], output])
    assert f"No tool output found for function call {call.call_id}" in await refused(
        previous_response_id=first.id, input="and now?"
    )
    # `store: false` keeps nothing to continue
    unstored = await oai.responses.create(
        model="gpt-4.1", input="hi", store=False, extra_headers=script("hello")
    )
    assert "not found" in await refused(previous_response_id=unstored.id, input="again")


async def test_responses_stream_event_sequence(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.responses.create(
        model="gpt-4.1", input="Hi", stream=True, extra_headers=script("long"), max_output_tokens=20
    )
    events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    text = "".join(deltas)
    assert count_tokens(text) == 20
    assert events[-4].text == text
    final = events[-1].response
    assert final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 20
    assert final.output[0].content[0].text == text
    assert events[0].response.status == "in_progress" and events[0].response.usage is None


async def test_responses_stream_function_call(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.responses.create(
        model="gpt-4.1", input="go", tools=RESPONSES_TOOLS, stream=True, extra_headers=script("refund")
    )
    events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added"
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert events[2].item.name == "refund"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == REFUND_ARGS_JSON
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == REFUND_ARGS_JSON
    assert types[-1] == "response.completed"
    assert events[-1].response.usage.output_tokens == count_tokens(REFUND_ARGS_JSON)
    assert events[-1].response.output[0].call_id == events[2].item.call_id


async def test_responses_raw_stream_has_event_lines(scripted: ScriptedUpstream) -> None:
    body = {"model": "m", "input": "Hi", "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{scripted.url}/v1/responses", json=body, headers=script("hello")) as resp,
    ):
        raw = (await resp.read()).decode()
    for block in filter(None, raw.split("\n\n")):
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]


async def test_responses_reasoning_and_cache(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.responses.create(model="o4-mini", input="Hi", extra_headers=script("cached"))
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.usage.input_tokens == 120
    assert resp.usage.input_tokens_details.cached_tokens == 100
    assert resp.usage.output_tokens_details.reasoning_tokens == 7
    assert resp.usage.output_tokens == 7 + 1


# ------------------------------------------------------------------ Anthropic


async def test_anthropic_text_non_stream(claude: anthropic.AsyncAnthropic) -> None:
    msg = await claude.messages.create(
        model="claude-mock-1",
        max_tokens=100,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi there"}],
        extra_headers=script("hello"),
    )
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "claude-mock-1"
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello world!"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens == 3 + (4 + count_tokens("Be brief.")) + (4 + count_tokens("Hi there"))
    assert msg.usage.output_tokens == 3
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.cache_creation_input_tokens == 0


async def test_anthropic_tool_use_and_history(
    scripted: ScriptedUpstream, claude: anthropic.AsyncAnthropic
) -> None:
    first = await claude.messages.create(
        model="c",
        max_tokens=200,
        messages=[{"role": "user", "content": "refund A-17"}],
        tools=ANTHROPIC_TOOLS,
        extra_headers=script("parallel"),
    )
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["lookup", "refund"]
    assert uses[1].input == REFUND_ARGS
    assert all(u.id.startswith("toolu_") for u in uses)
    assert first.usage.output_tokens == count_tokens(LOOKUP_ARGS_JSON) + count_tokens(REFUND_ARGS_JSON)
    assert first.usage.input_tokens == 3 + tools_tokens(ANTHROPIC_TOOLS) + 4 + count_tokens("refund A-17")

    second = await claude.messages.create(
        model="c",
        max_tokens=200,
        messages=[
            {"role": "user", "content": "refund A-17"},
            {"role": "assistant", "content": [u.model_dump(exclude_none=True) for u in uses]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "ok"} for u in uses],
            },
        ],
        tools=ANTHROPIC_TOOLS,
        extra_headers=script("parallel"),
    )
    assert second.content[0].text == "All done."
    assert scripted.last.step == 1


async def test_anthropic_cache_tokens_excluded_from_input(
    scripted: ScriptedUpstream, claude: anthropic.AsyncAnthropic
) -> None:
    msg = await claude.messages.create(
        model="c",
        max_tokens=100,
        messages=[{"role": "user", "content": "Hi"}],
        extra_headers=script("cached"),
    )
    assert msg.usage.cache_read_input_tokens == 100
    assert msg.usage.cache_creation_input_tokens == 20
    assert msg.usage.input_tokens == 0  # 120 in all, all of it cache reads and writes
    assert scripted.last.usage == Usage(
        120, 8, cache_read_tokens=100, cache_write_tokens=20, reasoning_tokens=7
    )
    assert msg.usage.output_tokens == 7 + 1


async def test_anthropic_stream_events(claude: anthropic.AsyncAnthropic) -> None:
    stream = await claude.messages.create(
        model="c",
        max_tokens=100,
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        extra_headers=script("refund"),
        tools=ANTHROPIC_TOOLS,
    )
    events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert types[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = events[0].message
    assert start.usage.input_tokens == 3 + tools_tokens(ANTHROPIC_TOOLS) + 4 + 1
    assert start.usage.output_tokens == 1
    assert events[1].content_block.type == "tool_use" and events[1].content_block.input == {}
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert partial == REFUND_ARGS_JSON
    delta = events[-2]
    assert delta.delta.stop_reason == "tool_use"
    assert delta.usage.output_tokens == count_tokens(REFUND_ARGS_JSON)


async def test_anthropic_stream_helper_and_max_tokens(
    scripted: ScriptedUpstream, claude: anthropic.AsyncAnthropic
) -> None:
    async with claude.messages.stream(
        model="c", max_tokens=5, messages=[{"role": "user", "content": "Hi"}], extra_headers=script("long")
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert count_tokens(text) == 5
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5
    assert final.usage.input_tokens == 3 + 4 + 1
    raw = await _raw_post(scripted, "/v1/messages", {"model": "c", "max_tokens": 5, "stream": True,
                          "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert [line for line in raw.splitlines() if line.startswith("event: ")][:3] == [
        "event: message_start",
        "event: content_block_start",
        "event: ping",
    ]


async def test_anthropic_errors(scripted: ScriptedUpstream, claude: anthropic.AsyncAnthropic) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "c", "messages": [{"role": "user", "content": "Hi"}]}
        async with session.post(f"{scripted.url}/v1/messages", json=body) as resp:
            assert resp.status == 400
            err = await resp.json()
    assert err["type"] == "error"
    assert err["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}

    with pytest.raises(anthropic.APIStatusError) as info:
        await claude.messages.create(
            model="c",
            max_tokens=10,
            messages=[{"role": "user", "content": "x"}],
            extra_headers=script("overloaded"),
        )
    assert info.value.status_code == 529
    assert info.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}


async def test_anthropic_tool_step_without_tools(claude: anthropic.AsyncAnthropic) -> None:
    msg = await claude.messages.create(
        model="c", max_tokens=100, messages=[{"role": "user", "content": "x"}], extra_headers=script("refund")
    )
    assert msg.stop_reason == "end_turn"
    assert msg.content[0].text == FALLBACK_TEXT
    choice_none = await claude.messages.create(
        model="c",
        max_tokens=100,
        messages=[{"role": "user", "content": "x"}],
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "none"},
        extra_headers=script("refund"),
    )
    assert [b.type for b in choice_none.content] == ["text"]
    assert choice_none.content[0].text == FALLBACK_TEXT


# ------------------------------------------------------------------ other OpenAI endpoints


async def test_embeddings(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.embeddings.create(model="text-embedding-3-small", input=["hello", "hello world"])
    assert resp.object == "list" and resp.model == "text-embedding-3-small"
    assert [d.index for d in resp.data] == [0, 1]
    assert all(len(d.embedding) == 8 for d in resp.data)
    assert resp.usage.prompt_tokens == count_tokens("hello") + count_tokens("hello world")
    assert resp.usage.total_tokens == resp.usage.prompt_tokens
    again = await oai.embeddings.create(
        model="text-embedding-3-small", input="hello", encoding_format="float", dimensions=16
    )
    assert len(again.data[0].embedding) == 16
    same = await oai.embeddings.create(model="text-embedding-3-small", input="hello", encoding_format="float")
    assert same.data[0].embedding == pytest.approx(resp.data[0].embedding, abs=1e-6)


async def test_legacy_completions(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.completions.create(
        model="gpt-3.5-turbo-instruct", prompt="Say hi", extra_headers=script("long")
    )
    # the real API's default max_tokens of 16 applies
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 16
    assert resp.usage.prompt_tokens == count_tokens("Say hi")
    stream = await oai.completions.create(
        model="gpt-3.5-turbo-instruct",
        prompt="Say hi",
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=script("hello"),
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello world!"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


async def test_models_and_not_found(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    models = await oai.models.list()
    assert "gpt-4o-mini" in [m.id for m in models.data]
    with pytest.raises(openai.NotFoundError) as info:
        await oai.post("/nope", cast_to=object, body={})
    assert info.value.body["type"] == "invalid_request_error"
    assert "Invalid URL" in info.value.body["message"]


# ------------------------------------------------------------------ script files


def test_load_scripts_toml_and_json(tmp_path: Path) -> None:
    toml_file = tmp_path / "s.toml"
    toml_file.write_text(
        '[[refund]]\ntool_calls = [{name = "refund", arguments = {order_id = "A-17"}}]\n'
        '[[refund]]\ntext = "Done."\n'
    )
    assert load_scripts(str(toml_file)) == {
        "refund": [{"tool_calls": [{"name": "refund", "arguments": {"order_id": "A-17"}}]}, {"text": "Done."}]
    }
    json_file = tmp_path / "s.json"
    json_file.write_text(json.dumps({"scripts": {"a": [{"text_tokens": 3}]}}))
    assert load_scripts(str(json_file)) == {"a": [{"text_tokens": 3}]}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": [{"txet": "typo"}]}))
    with pytest.raises(ValueError, match=r"script 'a' step 0: unknown step key\(s\) \['txet'\]"):
        load_scripts(str(bad))


async def _raw_post(upstream: ScriptedUpstream, path: str, body: dict[str, Any]) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{upstream.url}{path}", json=body) as resp,
    ):
        return (await resp.read()).decode()


async def test_scripts_can_change_while_running(scripted: ScriptedUpstream, oai: openai.AsyncOpenAI) -> None:
    scripted.scripts["late"] = [{"text": "added later"}]
    resp = await oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], extra_headers=script("late")
    )
    assert resp.choices[0].message.content == "added later"
    scripted.scripts["broken"] = [{"text_tokens": -1}]
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], extra_headers=script("broken")
        )
    assert "script 'broken' step 0" in info.value.message


async def test_responses_tool_choice_none_answers_with_text(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.responses.create(
        model="m", input="go", tools=RESPONSES_TOOLS, tool_choice="none", extra_headers=script("refund")
    )
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output_text == FALLBACK_TEXT


def test_example_script_and_help_document_the_format() -> None:
    """The shipped example script loads, and `runcap mock-upstream --help` lists every step key."""
    import dataclasses
    import subprocess
    import sys

    from proxy.scripted_upstream import Step, load_scripts
    from tests.conftest import REPO

    scripts = load_scripts(str(REPO / "examples" / "scripts" / "refund.toml"))
    assert {name: len(steps) for name, steps in scripts.items()} == {"refund": 3, "flaky": 2, "essayist": 1}
    out = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "mock-upstream", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    for f in dataclasses.fields(Step):
        if not f.name.startswith("_"):
            assert f.name in out, f.name
