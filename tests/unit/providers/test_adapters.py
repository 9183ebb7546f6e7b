"""Provider adapters against realistic wire samples: requests, responses and SSE streams."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from proxy.providers.anthropic_messages import MessagesAdapter
from proxy.providers.base import BodyError, Usage
from proxy.providers.body import (
    BASE_OVERHEAD,
    BUILTIN_TOOL_BOUND,
    MEDIA_TOKEN_BOUND,
    MESSAGE_OVERHEAD,
    TOOL_PROMPT_BOUND,
)
from proxy.providers.openai_basic import CompletionsAdapter, EmbeddingsAdapter
from proxy.providers.openai_chat import ChatCompletionsAdapter
from proxy.providers.openai_responses import ResponsesAdapter
from proxy.providers.registry import adapter_for
from proxy.providers.sse import SSESplitter

CHAT = ChatCompletionsAdapter()
RESPONSES = ResponsesAdapter()
COMPLETIONS = CompletionsAdapter()
EMBEDDINGS = EmbeddingsAdapter()
MESSAGES = MessagesAdapter()


def sse(*events: dict[str, Any] | str, named: bool = False, eol: str = "\n") -> bytes:
    """An SSE stream: each event a `data:` line (JSON or literal), optionally with `event:`."""
    out = []
    for event in events:
        data = event if isinstance(event, str) else orjson.dumps(event).decode()
        head = f"event: {event['type']}{eol}" if named and isinstance(event, dict) else ""
        out.append(f"{head}data: {data}{eol}{eol}")
    return "".join(out).encode()


def feed_all(reader: Any, stream: bytes, step: int | None = None, cuts: tuple[int, ...] = ()) -> bytes:
    """Feed `stream` in chunks (every `step` bytes, or at the given cut positions)."""
    bounds = list(cuts) if cuts else list(range(step or len(stream), len(stream), step or len(stream)))
    out = []
    last = 0
    for cut in [*bounds, len(stream)]:
        out.append(reader.feed(stream[last:cut]))
        last = cut
    out.append(reader.close())
    return b"".join(out)


# --- SSE splitting ------------------------------------------------------------------------------


def test_sse_splitter_handles_every_terminator_and_multiline_data() -> None:
    stream = (
        b": keep-alive comment\n\n"
        b'event: message_start\ndata: {"a":1}\n\n'
        b"data: line one\r\ndata: line two\r\n\r\n"
        b"data:no-space\r\r"
        b"id: 7\nretry: 100\ndata: [DONE]\n\r\n"
        b"data: tail-without-blank-line"
    )
    splitter = SSESplitter()
    events = splitter.feed(stream)
    assert [e.data for e in events] == [None, b'{"a":1}', b"line one\nline two", b"no-space", b"[DONE]"]
    assert events[1].event == "message_start" and events[1].json() == {"a": 1}
    assert events[4].json() is None  # [DONE] is not JSON
    tail = splitter.close()
    assert tail is not None and tail.data == b"tail-without-blank-line"
    assert b"".join(e.raw for e in events) + tail.raw == stream


def test_sse_splitter_is_independent_of_chunk_boundaries() -> None:
    stream = b'data: {"x":"\xc3\xa9"}\r\n\r\nevent: e\ndata: a\ndata: b\n\ndata: c\r\r' + b"data: d\r\n\r\n"
    whole = SSESplitter().feed(stream)
    for cut1 in range(len(stream) + 1):
        for cut2 in range(cut1, len(stream) + 1, 3):
            splitter = SSESplitter()
            events = splitter.feed(stream[:cut1]) + splitter.feed(stream[cut1:cut2])
            events += splitter.feed(stream[cut2:])
            assert [(e.raw, e.event, e.data) for e in events] == [(e.raw, e.event, e.data) for e in whole]
            assert splitter.close() is None
    assert [e.data for e in whole] == [b'{"x":"\xc3\xa9"}', b"a\nb", b"c", b"d"]


def test_sse_splitter_waits_for_the_lf_of_a_trailing_cr() -> None:
    splitter = SSESplitter()
    assert splitter.feed(b"data: x\r\n\r") == []  # may still be "\r\n\r\n"
    [event] = splitter.feed(b"\ndata: y\n\n")[:1]
    assert event.raw == b"data: x\r\n\r\n"


# --- OpenAI chat completions ---------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def chat_request(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Zürich? 天气"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 4}'},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
    }
    body.update(extra)
    return body


def test_chat_parse_request_reads_everything_the_budget_needs() -> None:
    info = CHAT.parse_request(
        chat_request(stream=True, stream_options={"include_usage": True}, max_completion_tokens=300)
    )
    assert info.model == "gpt-4o-mini"
    assert info.stream and info.client_wants_stream_usage
    assert info.max_output_tokens == 300
    assert info.has_tools
    assert [(r.tool_call_id, r.content, r.is_error) for r in info.tool_results] == [
        ("call_1", '{"temp_c": 4}', False)
    ]
    texts = ["You are terse.", "Weather in Zürich? 天气", '{"city":"Zürich"}', '{"temp_c": 4}', "get_weather"]
    floor = BASE_OVERHEAD + 4 * MESSAGE_OVERHEAD + TOOL_PROMPT_BOUND + len(orjson.dumps([WEATHER_TOOL]))
    assert info.input_token_bound >= floor + sum(len(t.encode()) for t in texts)

    plain = CHAT.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert not plain.stream and not plain.has_tools and plain.max_output_tokens is None
    assert not plain.client_wants_stream_usage and plain.tool_results == []
    legacy = CHAT.parse_request({"model": "m", "messages": [], "max_tokens": 50, "n": 3})
    assert legacy.max_output_tokens == 150  # the limit applies to each of the n choices


def test_chat_media_parts_are_bounded() -> None:
    tiny_png = "data:image/png;base64," + "iVBORw0KGgo" * 3
    big_jpeg = "data:image/jpeg;base64," + "A" * 50_000

    def bound(part: dict[str, Any]) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": [part]}]}
        return CHAT.parse_request(body).input_token_bound

    assert bound({"type": "image_url", "image_url": {"url": "https://x.test/cat.png"}}) >= MEDIA_TOKEN_BOUND
    assert bound({"type": "image_url", "image_url": {"url": tiny_png}}) >= MEDIA_TOKEN_BOUND
    assert bound({"type": "image_url", "image_url": {"url": big_jpeg}}) >= len(big_jpeg)
    assert bound({"type": "file", "file": {"file_id": "file-abc"}}) >= MEDIA_TOKEN_BOUND
    assert bound({"type": "input_audio", "input_audio": {"data": "UklGR" * 4000, "format": "wav"}}) >= 20_000


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "request body"),
        ({"messages": []}, "model"),
        ({"model": 4, "messages": []}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": {"role": "user"}}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [], "max_completion_tokens": True}, "max_completion_tokens"),
        ({"model": "m", "messages": [], "max_tokens": "100"}, "max_tokens"),
        ({"model": "m", "messages": [], "stream": "yes"}, "stream"),
        ({"model": "m", "messages": [], "tools": {}}, "tools"),
        ({"model": "m", "messages": [], "stream": True, "stream_options": 1}, "stream_options"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"model": "m", "messages": [], "max_tokens": 5, "n": 0}, "n"),
    ],
)
def test_chat_body_errors_name_the_field(body: Any, field: str) -> None:
    with pytest.raises(BodyError, match=field.replace("[", r"\[").replace("]", r"\]")):
        CHAT.parse_request(body)


def test_chat_set_output_limit_keeps_the_clients_field() -> None:
    legacy = {"model": "m", "messages": [], "max_tokens": 4000}
    CHAT.set_output_limit(legacy, 100)
    assert legacy == {"model": "m", "messages": [], "max_tokens": 100}
    modern: dict[str, Any] = {"model": "m", "messages": []}
    CHAT.set_output_limit(modern, 100)
    assert modern["max_completion_tokens"] == 100 and "max_tokens" not in modern
    both = {"model": "m", "messages": [], "max_tokens": 9, "max_completion_tokens": 9, "n": 4}
    CHAT.set_output_limit(both, 100)
    assert both["max_tokens"] == both["max_completion_tokens"] == 25


def test_chat_strip_tools_and_stream_usage() -> None:
    body = chat_request(functions=[], function_call="auto")
    CHAT.strip_tools(body)
    assert not {"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"} & body.keys()
    assert CHAT.parse_request(body).has_tools is False

    assert CHAT.request_stream_usage({"model": "m", "messages": []}) is False  # not a stream
    stream = {"model": "m", "messages": [], "stream": True}
    assert CHAT.request_stream_usage(stream) is True
    assert stream["stream_options"] == {"include_usage": True}
    assert CHAT.request_stream_usage(stream) is False
    other = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_obfuscation": False}}
    assert CHAT.request_stream_usage(other) is True
    assert other["stream_options"] == {"include_obfuscation": False, "include_usage": True}


CHAT_RESPONSE = {
    "id": "chatcmpl-AbC",
    "object": "chat.completion",
    "created": 1732000000,
    "model": "gpt-4o-2024-08-06",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    },
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                    },
                ],
                "refusal": None,
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 2006,
        "completion_tokens": 300,
        "total_tokens": 2306,
        "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 256,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    },
    "system_fingerprint": "fp_abc",
}


def test_chat_parse_response() -> None:
    info = CHAT.parse_response(CHAT_RESPONSE)
    assert info.model == "gpt-4o-2024-08-06" and info.response_id == "chatcmpl-AbC"
    assert info.usage == Usage(2006, 300, cache_read_tokens=1920, reasoning_tokens=256)
    assert [(c.id, c.name, c.arguments) for c in info.tool_calls] == [
        ("call_a", "get_weather", '{"city":"Paris"}'),
        ("call_b", "get_weather", '{"city":"Rome"}'),
    ]
    assert not info.finished

    answer = copy.deepcopy(CHAT_RESPONSE)
    answer["choices"][0]["message"] = {"role": "assistant", "content": "Sunny."}
    answer["choices"][0]["finish_reason"] = "stop"
    del answer["usage"]
    info = CHAT.parse_response(answer)
    assert info.finished and info.tool_calls == [] and info.usage is None


def chunk(choices: list[Any], usage: Any = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-S1",
        "object": "chat.completion.chunk",
        "created": 1732000000,
        "model": "gpt-4o-mini-2024-07-18",
        "system_fingerprint": "fp_1",
        "choices": choices,
        "usage": usage,
    }


def delta(d: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
    return [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]


CHAT_USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 40,
    "total_tokens": 160,
    "prompt_tokens_details": {"cached_tokens": 64, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 16, "audio_tokens": 0},
}
CHAT_STREAM_EVENTS = [
    chunk(
        delta(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_x",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ],
                "refusal": None,
            }
        )
    ),
    chunk(delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]})),
    chunk(delta({"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Oslo"}'}}]})),
    chunk(
        delta(
            {
                "tool_calls": [
                    {"index": 1, "id": "call_y", "type": "function", "function": {"name": "get_time"}}
                ]
            }
        )
    ),
    chunk(delta({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]})),
    chunk(delta({}, finish="tool_calls")),
]
USAGE_CHUNK = chunk([], CHAT_USAGE)
CHAT_STREAM = sse(*CHAT_STREAM_EVENTS, USAGE_CHUNK, "[DONE]")


def test_chat_stream_pass_through_relays_every_byte_at_once() -> None:
    for step in range(1, len(CHAT_STREAM) + 1, 7):
        reader = CHAT.stream_reader(strip_injected_usage=False)
        chunks = [CHAT_STREAM[i : i + step] for i in range(0, len(CHAT_STREAM), step)]
        for piece in chunks:
            assert reader.feed(piece) == piece  # never held back
        assert reader.close() == b""
        info = reader.info
        assert info.usage == Usage(120, 40, cache_read_tokens=64, reasoning_tokens=16)
        assert [(c.id, c.name, c.arguments) for c in info.tool_calls] == [
            ("call_x", "get_weather", '{"city":"Oslo"}'),
            ("call_y", "get_time", "{}"),
        ]
        assert info.model == "gpt-4o-mini-2024-07-18" and info.response_id == "chatcmpl-S1"
        assert not info.finished


def test_chat_stream_strip_drops_exactly_the_usage_chunk_at_every_boundary() -> None:
    expected = sse(*CHAT_STREAM_EVENTS, "[DONE]")
    for cut in range(len(CHAT_STREAM) + 1):
        reader = CHAT.stream_reader(strip_injected_usage=True)
        out = feed_all(reader, CHAT_STREAM, cuts=(cut,))
        assert out == expected, cut
        assert reader.info.usage is not None and reader.info.usage.input_tokens == 120


def test_chat_stream_strip_with_crlf_and_held_back_partial_event() -> None:
    stream = sse(chunk(delta({"content": "Hi"})), chunk(delta({}, "stop")), USAGE_CHUNK, "[DONE]", eol="\r\n")
    reader = CHAT.stream_reader(strip_injected_usage=True)
    first_end = stream.index(b"\r\n\r\n") + 4
    assert reader.feed(stream[: first_end - 2]) == b""  # incomplete: held back
    assert reader.feed(stream[first_end - 2 : first_end + 5]) == stream[:first_end]
    rest = reader.feed(stream[first_end + 5 :]) + reader.close()
    assert stream[:first_end] + rest == sse(
        chunk(delta({"content": "Hi"})), chunk(delta({}, "stop")), "[DONE]", eol="\r\n"
    )
    info = reader.info
    assert info.finished and info.tool_calls == [] and info.usage is not None


def test_chat_stream_cut_early_reports_what_it_saw() -> None:
    reader = CHAT.stream_reader(strip_injected_usage=False)
    cut = CHAT_STREAM.index(b"Oslo")  # in the middle of the third event
    reader.feed(CHAT_STREAM[:cut])
    info = reader.info
    assert info.usage is None and not info.finished
    assert [(c.id, c.name, c.arguments) for c in info.tool_calls] == [("call_x", "get_weather", '{"ci')]


def test_chat_stream_keeps_azure_filter_chunk_and_ignores_garbage() -> None:
    azure_first = {"choices": [], "prompt_filter_results": [{"prompt_index": 0}], "id": "", "model": ""}
    stream = sse(azure_first, "not json", chunk(delta({"content": "x"}, "stop")), USAGE_CHUNK, "[DONE]")
    reader = CHAT.stream_reader(strip_injected_usage=True)
    out = feed_all(reader, stream, step=13)
    assert out == sse(azure_first, "not json", chunk(delta({"content": "x"}, "stop")), "[DONE]")
    assert reader.info.finished and reader.info.model == "gpt-4o-mini-2024-07-18"


# --- OpenAI responses ----------------------------------------------------------------------------


def responses_request(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "gpt-4.1",
        "instructions": "Be brief.",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in this image? Größe"},
                    {"type": "input_image", "image_url": "https://x.test/earth.jpg", "detail": "high"},
                ],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_9",
                "name": "lookup",
                "arguments": '{"q":"earth"}',
            },
            {"type": "function_call_output", "call_id": "call_9", "output": "a planet"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "lookup",
                "description": "Look something up",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                "strict": True,
            },
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "max_output_tokens": 800,
        "stream": True,
    }
    body.update(extra)
    return body


def test_responses_parse_request() -> None:
    info = RESPONSES.parse_request(responses_request())
    assert info.model == "gpt-4.1" and info.stream and info.has_tools
    assert info.max_output_tokens == 800 and not info.client_wants_stream_usage
    assert [(r.tool_call_id, r.content) for r in info.tool_results] == [("call_9", "a planet")]
    texts = ["Be brief.", "What is in this image? Größe", '{"q":"earth"}', "a planet", "lookup"]
    floor = sum(len(t.encode()) for t in texts) + MEDIA_TOKEN_BOUND + TOOL_PROMPT_BOUND + BUILTIN_TOOL_BOUND
    assert info.input_token_bound >= floor + BASE_OVERHEAD + 3 * MESSAGE_OVERHEAD

    simple = RESPONSES.parse_request({"model": "gpt-4.1", "input": "héllo"})
    assert simple.input_token_bound >= len("héllo".encode()) and not simple.stream
    stored = RESPONSES.parse_request({"prompt": {"id": "pmpt_1", "variables": {"city": "Oslo"}}})
    assert stored.model == ""


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "x"}, "model"),
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m", "input": [3]}, r"input\[0\]"),
        ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, r"input\[0\].call_id"),
        ({"model": "m", "max_output_tokens": -1}, "max_output_tokens"),
        ({"model": "m", "stream": 1}, "stream"),
    ],
)
def test_responses_body_errors_name_the_field(body: Any, field: str) -> None:
    with pytest.raises(BodyError, match=field):
        RESPONSES.parse_request(body)


def test_responses_mutations() -> None:
    body = responses_request()
    RESPONSES.set_output_limit(body, 64)
    assert body["max_output_tokens"] == 64
    RESPONSES.strip_tools(body)
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & body.keys()
    assert RESPONSES.request_stream_usage(body) is False and "stream_options" not in body


RESPONSE_USAGE = {
    "input_tokens": 5000,
    "input_tokens_details": {"cached_tokens": 4096},
    "output_tokens": 700,
    "output_tokens_details": {"reasoning_tokens": 512},
    "total_tokens": 5700,
}
FUNCTION_CALL_ITEM = {
    "type": "function_call",
    "id": "fc_67",
    "call_id": "call_77",
    "name": "lookup",
    "arguments": '{"q":"mars"}',
    "status": "completed",
}
REASONING_ITEM = {"type": "reasoning", "id": "rs_1", "summary": []}
RESPONSE_BODY = {
    "id": "resp_67cc",
    "object": "response",
    "created_at": 1741476542,
    "status": "completed",
    "model": "o4-mini-2025-04-16",
    "output": [REASONING_ITEM, FUNCTION_CALL_ITEM],
    "usage": RESPONSE_USAGE,
}


def test_responses_parse_response() -> None:
    info = RESPONSES.parse_response(RESPONSE_BODY)
    assert info.model == "o4-mini-2025-04-16" and info.response_id == "resp_67cc"
    assert info.usage == Usage(5000, 700, cache_read_tokens=4096, reasoning_tokens=512)
    assert [(c.id, c.name, c.arguments) for c in info.tool_calls] == [("call_77", "lookup", '{"q":"mars"}')]
    assert not info.finished
    answer = dict(
        RESPONSE_BODY,
        output=[
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Red.", "annotations": []}],
            }
        ],
    )
    assert RESPONSES.parse_response(answer).finished
    assert not RESPONSES.parse_response(dict(answer, status="failed")).finished


def responses_stream() -> bytes:
    in_progress = {k: v for k, v in RESPONSE_BODY.items() if k != "usage"}
    in_progress.update(status="in_progress", output=[], usage=None)
    added = dict(FUNCTION_CALL_ITEM, arguments="", status="in_progress")
    events: list[dict[str, Any]] = [
        {"type": "response.created", "sequence_number": 0, "response": in_progress},
        {"type": "response.in_progress", "sequence_number": 1, "response": in_progress},
        {
            "type": "response.output_item.added",
            "sequence_number": 2,
            "output_index": 0,
            "item": REASONING_ITEM,
        },
        {
            "type": "response.output_item.done",
            "sequence_number": 3,
            "output_index": 0,
            "item": REASONING_ITEM,
        },
        {"type": "response.output_item.added", "sequence_number": 4, "output_index": 1, "item": added},
    ]
    for n, piece in enumerate(['{"q"', ':"ma', 'rs"}']):
        events.append(
            {
                "type": "response.function_call_arguments.delta",
                "sequence_number": 5 + n,
                "item_id": "fc_67",
                "output_index": 1,
                "delta": piece,
            }
        )
    events += [
        {
            "type": "response.function_call_arguments.done",
            "sequence_number": 8,
            "item_id": "fc_67",
            "output_index": 1,
            "arguments": '{"q":"mars"}',
        },
        {
            "type": "response.output_item.done",
            "sequence_number": 9,
            "output_index": 1,
            "item": FUNCTION_CALL_ITEM,
        },
        {"type": "response.completed", "sequence_number": 10, "response": RESPONSE_BODY},
    ]
    return sse(*events, named=True)


def test_responses_stream_relays_and_reads() -> None:
    stream = responses_stream()
    for strip in (False, True):  # nothing to strip in this format: always pass-through
        reader = RESPONSES.stream_reader(strip)
        assert feed_all(reader, stream, step=97) == stream
        info = reader.info
        assert info.usage == Usage(5000, 700, cache_read_tokens=4096, reasoning_tokens=512)
        assert [(c.id, c.name, c.arguments) for c in info.tool_calls] == [
            ("call_77", "lookup", '{"q":"mars"}')
        ]
        assert info.model == "o4-mini-2025-04-16" and info.response_id == "resp_67cc"
        assert not info.finished


def test_responses_stream_cut_early() -> None:
    stream = responses_stream()
    reader = RESPONSES.stream_reader(False)
    reader.feed(stream[: stream.index(b'rs\\"}')])  # inside the third arguments delta
    info = reader.info
    assert info.usage is None and not info.finished and info.response_id == "resp_67cc"
    assert [(c.id, c.arguments) for c in info.tool_calls] == [("call_77", '{"q":"ma')]


def test_responses_incomplete_stream_is_an_answer() -> None:
    incomplete = dict(RESPONSE_BODY, status="incomplete", output=[REASONING_ITEM])
    reader = RESPONSES.stream_reader(False)
    reader.feed(sse({"type": "response.incomplete", "sequence_number": 1, "response": incomplete}))
    assert reader.info.finished and reader.info.usage is not None


# --- Anthropic messages --------------------------------------------------------------------------

ANTHROPIC_TOOL = {
    "name": "get_stock_price",
    "description": "Latest price for a ticker",
    "input_schema": {"type": "object", "properties": {"ticker": {"type": "string"}}, "required": ["ticker"]},
}


def messages_request(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are a trader.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Price of ACME? Ñ"},
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/chart.png"}},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "get_stock_price",
                        "input": {"ticker": "ACME"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "42.10"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_02",
                        "content": [{"type": "text", "text": "timeout"}],
                        "is_error": True,
                    },
                ],
            },
        ],
        "tools": [ANTHROPIC_TOOL],
        "tool_choice": {"type": "auto"},
    }
    body.update(extra)
    return body


def test_messages_parse_request() -> None:
    info = MESSAGES.parse_request(messages_request(stream=True))
    assert info.model == "claude-sonnet-4-5" and info.stream and info.has_tools
    assert info.max_output_tokens == 1024 and not info.client_wants_stream_usage
    assert [(r.tool_call_id, r.content, r.is_error) for r in info.tool_results] == [
        ("toolu_01", "42.10", False),
        ("toolu_02", [{"type": "text", "text": "timeout"}], True),
    ]
    texts = ["You are a trader.", "Price of ACME? Ñ", "Checking.", '{"ticker":"ACME"}', "42.10", "timeout"]
    floor = sum(len(t.encode()) for t in texts) + 2 * MEDIA_TOKEN_BOUND + TOOL_PROMPT_BOUND
    floor += len(orjson.dumps([ANTHROPIC_TOOL])) + BASE_OVERHEAD + 3 * MESSAGE_OVERHEAD
    assert info.input_token_bound >= floor

    server_tool = messages_request(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert (
        MESSAGES.parse_request(server_tool).input_token_bound
        >= floor - len(orjson.dumps([ANTHROPIC_TOOL])) + BUILTIN_TOOL_BOUND
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 5, "messages": []}, "model"),
        ({"model": "c", "messages": []}, "max_tokens"),
        ({"model": "c", "max_tokens": 0, "messages": []}, "max_tokens"),
        ({"model": "c", "max_tokens": 5}, "messages"),
        ({"model": "c", "max_tokens": 5, "messages": "hi"}, "messages"),
        ({"model": "c", "max_tokens": 5, "messages": [], "stream": "true"}, "stream"),
        (
            {
                "model": "c",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}],
            },
            r"messages\[0\].content\[0\].tool_use_id",
        ),
    ],
)
def test_messages_body_errors_name_the_field(body: Any, field: str) -> None:
    with pytest.raises(BodyError, match=field):
        MESSAGES.parse_request(body)


def test_messages_strip_tools_uses_tool_choice_none_when_history_has_tool_blocks() -> None:
    body = messages_request()
    MESSAGES.strip_tools(body)
    assert body["tools"] == [ANTHROPIC_TOOL] and body["tool_choice"] == {"type": "none"}

    fresh = messages_request(messages=[{"role": "user", "content": "hi"}])
    MESSAGES.strip_tools(fresh)
    assert "tools" not in fresh and "tool_choice" not in fresh


def test_messages_set_output_limit_keeps_thinking_valid() -> None:
    body = messages_request(max_tokens=16000, thinking={"type": "enabled", "budget_tokens": 10000})
    MESSAGES.set_output_limit(body, 20000)
    assert body["max_tokens"] == 20000 and body["thinking"]["budget_tokens"] == 10000
    MESSAGES.set_output_limit(body, 5000)
    assert body["max_tokens"] == 5000 and 1024 <= body["thinking"]["budget_tokens"] < 5000
    MESSAGES.set_output_limit(body, 800)
    assert body["max_tokens"] == 800 and body["thinking"] == {"type": "disabled"}
    assert MESSAGES.request_stream_usage(body) is False


MESSAGE_RESPONSE = {
    "id": "msg_01XFD",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5-20250929",
    "content": [
        {"type": "text", "text": "Let me check."},
        {
            "type": "tool_use",
            "id": "toolu_03",
            "name": "get_stock_price",
            "input": {"ticker": "ÄCME", "n": 2},
        },
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 50,
        "cache_creation_input_tokens": 1000,
        "cache_read_input_tokens": 2000,
        "cache_creation": {"ephemeral_5m_input_tokens": 1000, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 80,
        "service_tier": "standard",
    },
}


def test_messages_parse_response() -> None:
    info = MESSAGES.parse_response(MESSAGE_RESPONSE)
    assert info.usage == Usage(3050, 80, cache_read_tokens=2000, cache_write_tokens=1000)
    assert [(c.id, c.name, c.arguments) for c in info.tool_calls] == [
        ("toolu_03", "get_stock_price", '{"ticker":"ÄCME","n":2}')
    ]
    assert (
        not info.finished and info.model == "claude-sonnet-4-5-20250929" and info.response_id == "msg_01XFD"
    )
    answer = dict(MESSAGE_RESPONSE, content=[{"type": "text", "text": "42"}], stop_reason="end_turn")
    assert MESSAGES.parse_response(answer).finished
    assert not MESSAGES.parse_response(dict(answer, stop_reason="pause_turn")).finished


def messages_stream() -> bytes:
    start = {k: v for k, v in MESSAGE_RESPONSE.items() if k != "content"}
    start.update(
        content=[],
        stop_reason=None,
        usage={
            "input_tokens": 50,
            "cache_creation_input_tokens": 1000,
            "cache_read_input_tokens": 2000,
            "output_tokens": 1,
        },
    )
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me check."}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_03", "name": "get_stock_price", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": ""},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"ticker": "ÄC'},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": 'ME"}'},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 80},
        },
        {"type": "message_stop"},
    ]
    return sse(*events, named=True)


def test_messages_stream_relays_and_reads() -> None:
    stream = messages_stream()
    for strip in (False, True):
        reader = MESSAGES.stream_reader(strip)
        assert feed_all(reader, stream, step=61) == stream
        info = reader.info
        assert info.usage == Usage(3050, 80, cache_read_tokens=2000, cache_write_tokens=1000)
        assert [(c.id, c.name, c.arguments) for c in info.tool_calls] == [
            ("toolu_03", "get_stock_price", '{"ticker":"ÄCME"}')
        ]
        assert not info.finished and info.response_id == "msg_01XFD"


def test_messages_stream_info_mid_stream() -> None:
    stream = messages_stream()
    reader = MESSAGES.stream_reader(False)
    reader.feed(stream[: stream.index(b"content_block_start")])  # only message_start so far
    info = reader.info
    assert info.usage == Usage(3050, 1, cache_read_tokens=2000, cache_write_tokens=1000)
    assert info.model == "claude-sonnet-4-5-20250929" and not info.finished
    reader.feed(stream[stream.index(b"content_block_start") : stream.index(b'ME\\"}')])
    assert [c.arguments for c in reader.info.tool_calls] == ['{"ticker": "ÄC']


def test_messages_stream_final_answer_and_cumulative_input() -> None:
    start = {"type": "message_start", "message": dict(MESSAGE_RESPONSE, content=[], stop_reason=None)}
    stream = sse(
        start,
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 9, "input_tokens": 70, "cache_read_input_tokens": None},
        },
        {"type": "message_stop"},
        eol="\r\n",
    )
    reader = MESSAGES.stream_reader(False)
    feed_all(reader, stream, step=1)
    info = reader.info
    assert info.finished and info.tool_calls == []
    assert info.usage == Usage(3070, 9, cache_read_tokens=2000, cache_write_tokens=1000)


# --- completions and embeddings ------------------------------------------------------------------


def test_completions_request_limit_and_stream_strip() -> None:
    body: dict[str, Any] = {
        "model": "gpt-3.5-turbo-instruct",
        "prompt": ["Say hi", "Say bye"],
        "max_tokens": 7,
    }
    info = COMPLETIONS.parse_request(dict(body, n=2))
    assert info.max_output_tokens == 28  # 2 prompts x 2 choices x 7
    assert info.input_token_bound >= len("Say hiSay bye") and not info.has_tools
    COMPLETIONS.set_output_limit(body, 20)
    assert body["max_tokens"] == 10
    ids = COMPLETIONS.parse_request({"model": "m", "prompt": [1, 2, 3]})
    assert ids.input_token_bound == BASE_OVERHEAD + MESSAGE_OVERHEAD + 3
    with pytest.raises(BodyError, match="prompt"):
        COMPLETIONS.parse_request({"model": "m", "prompt": {"x": 1}})
    with pytest.raises(BodyError, match=r"prompt\[1\]"):
        COMPLETIONS.parse_request({"model": "m", "prompt": ["a", 3]})

    stream_body = {"model": "m", "prompt": "x", "stream": True}
    assert (
        COMPLETIONS.request_stream_usage(stream_body)
        and not COMPLETIONS.parse_request(
            {"model": "m", "prompt": "x", "stream": True}
        ).client_wants_stream_usage
    )

    def text_chunk(text: str, finish: str | None) -> dict[str, Any]:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}

    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    tail = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": usage,
    }
    stream = sse(text_chunk("Hi", None), text_chunk("!", "stop"), tail, "[DONE]")
    reader = COMPLETIONS.stream_reader(strip_injected_usage=True)
    assert feed_all(reader, stream, step=5) == sse(text_chunk("Hi", None), text_chunk("!", "stop"), "[DONE]")
    assert reader.info.usage == Usage(5, 2) and reader.info.finished
    response = {
        "id": "cmpl-2",
        "model": "m",
        "choices": [{"text": "ok", "finish_reason": "stop"}],
        "usage": usage,
    }
    assert COMPLETIONS.parse_response(response).usage == Usage(5, 2)


def test_embeddings() -> None:
    info = EMBEDDINGS.parse_request({"model": "text-embedding-3-small", "input": ["héllo", "world"]})
    assert info.input_token_bound >= len("héllo".encode()) + 5 and info.max_output_tokens is None
    with pytest.raises(BodyError, match="input"):
        EMBEDDINGS.parse_request({"model": "text-embedding-3-small"})
    body = {"model": "e", "input": "x"}
    EMBEDDINGS.set_output_limit(body, 10)
    EMBEDDINGS.strip_tools(body)
    assert body == {"model": "e", "input": "x"} and EMBEDDINGS.request_stream_usage(body) is False
    response = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1]}],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
    info2 = EMBEDDINGS.parse_response(response)
    assert info2.usage == Usage(8, 0) and not info2.finished


# --- bound and registry --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii " * 50,
        "Grüße aus Zürich, ça va? " * 20,
        "日本語のテキストと中文文本 " * 30,
        "emoji 🧪🚀👩‍👩‍👧 " * 25,
        "\n\t  code(x) { return x**2 } // ¯\\_(ツ)_/¯" * 10,
    ],
)
def test_bound_covers_one_token_per_byte_in_every_format(text: str) -> None:
    worst = len(text.encode())  # a byte-level BPE never yields more tokens than bytes
    assert (
        CHAT.parse_request({"model": "m", "messages": [{"role": "user", "content": text}]}).input_token_bound
        > worst
    )
    assert RESPONSES.parse_request({"model": "m", "input": text}).input_token_bound > worst
    assert RESPONSES.parse_request({"model": "m", "instructions": text}).input_token_bound > worst
    anthropic = {"model": "c", "max_tokens": 1, "system": text, "messages": []}
    assert MESSAGES.parse_request(anthropic).input_token_bound > worst
    assert COMPLETIONS.parse_request({"model": "m", "prompt": text}).input_token_bound > worst
    assert EMBEDDINGS.parse_request({"model": "m", "input": [text]}).input_token_bound > worst


def test_registry() -> None:
    assert isinstance(adapter_for("openai", "/v1/chat/completions"), ChatCompletionsAdapter)
    cases = {
        ("openai", "/v1/chat/completions/"): "chat.completions",
        ("openai", "/openai/deployments/gpt4/chat/completions?api-version=2024"): "chat.completions",
        ("openai", "/v1/responses"): "responses",
        ("openai", "/v1/completions"): "completions",
        ("openai", "/v1/embeddings"): "embeddings",
        ("anthropic", "/v1/messages"): "messages",
        ("openai", "/v1/responses/resp_1"): None,
        ("openai", "/v1/models"): None,
        ("anthropic", "/v1/messages/count_tokens"): None,
        ("anthropic", "/v1/messages/batches"): None,
        # Anthropic also serves OpenAI's chat format: metered as chat completions.
        ("anthropic", "/v1/chat/completions"): "chat.completions",
        ("vertex", "/v1/messages"): None,
    }
    for (flavor, path), name in cases.items():
        adapter = adapter_for(flavor, path)
        assert (adapter.name if adapter else None) == name, (flavor, path)


def test_text_that_quotes_a_media_part_is_counted_as_text() -> None:
    quoted = 'the API takes {"type":"image_url","image_url":{"url":"https://x.test/a.png"}}'
    chat = {"model": "m", "messages": [{"role": "user", "content": quoted}]}
    assert len(quoted) <= CHAT.parse_request(chat).input_token_bound < MEDIA_TOKEN_BOUND
    anthropic = {"model": "c", "max_tokens": 1, "messages": [{"role": "user", "content": '"type":"image"'}]}
    assert MESSAGES.parse_request(anthropic).input_token_bound < MEDIA_TOKEN_BOUND


def test_anthropic_tool_input_counts_as_json_on_both_paths() -> None:
    tool_input = {"query": "x" * 300, "filters": {"lang": ["en", "de"], "limit": 10}}
    history = [
        {"role": "user", "content": "search"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": tool_input}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "none"}]},
    ]
    image = {"type": "image", "source": {"type": "url", "url": "https://x.test/i.png"}}
    text_only = MESSAGES.parse_request({"model": "c", "max_tokens": 1, "messages": history})
    with_media = MESSAGES.parse_request(
        {"model": "c", "max_tokens": 1, "messages": [*history, {"role": "user", "content": [image]}]}
    )
    assert text_only.input_token_bound >= len(orjson.dumps(tool_input))
    assert with_media.input_token_bound >= len(orjson.dumps(tool_input)) + MEDIA_TOKEN_BOUND


# --- the official SDKs read the streams these adapters relay -------------------------------------


def _transport(body: bytes) -> Any:
    import httpx2 as httpx

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_openai_sdk_iterates_the_stripped_chat_stream() -> None:
    import openai

    stripped = feed_all(CHAT.stream_reader(strip_injected_usage=True), CHAT_STREAM, step=50)
    client = openai.OpenAI(
        api_key="sk-test", base_url="http://upstream.test/v1", http_client=_transport(stripped)
    )
    chunks = list(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    )
    # A client that did not ask for usage indexes choices[0] on every chunk: none may be empty.
    assert len(chunks) == len(CHAT_STREAM_EVENTS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_sdk_accumulates_the_same_message_from_the_stream() -> None:
    import anthropic

    stream = messages_stream()
    client = anthropic.Anthropic(api_key="k", base_url="http://upstream.test", http_client=_transport(stream))
    with client.messages.stream(model="c", max_tokens=10, messages=[{"role": "user", "content": "x"}]) as s:
        final = s.get_final_message()
    reader = MESSAGES.stream_reader(False)
    feed_all(reader, stream)
    [tool_use] = [b for b in final.content if b.type == "tool_use"]
    assert reader.info.tool_calls[0].arguments == orjson.dumps(tool_use.input).decode()
    assert final.usage.output_tokens == reader.info.usage.output_tokens  # type: ignore[union-attr]
    parsed = MESSAGES.parse_response(final.model_dump())
    assert parsed.usage == reader.info.usage and parsed.tool_calls == reader.info.tool_calls


def test_openai_sdk_reads_the_responses_stream() -> None:
    import openai

    stream = responses_stream()
    client = openai.OpenAI(
        api_key="sk-test", base_url="http://upstream.test/v1", http_client=_transport(stream)
    )
    events = list(client.responses.create(model="m", input="x", stream=True))
    final = events[-1]
    assert final.type == "response.completed"
    reader = RESPONSES.stream_reader(False)
    feed_all(reader, stream)
    assert RESPONSES.parse_response(final.response.model_dump()) == reader.info
