"""A stream is final only when its closing event arrived; an oversized SSE event is relayed
unread; context the provider holds is reserved, and the answer-only step holds for it.

Every way an upstream can end a stream early — an error event mid-stream, a clean close after the
deltas, a close just before the closing event, a truncated closing event, a stream without usage,
`[DONE]` without the usage chunk, a reset — must settle at least the call's reservation (the
provider bills what it generated, which runcap did not see), so a dollar cap holds however many
such calls a run makes.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from decimal import Decimal
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from proxy.ledger.base import RunState
from proxy.money import usd_to_nanos
from proxy.pricing import PriceBook
from proxy.providers.anthropic_messages import MessagesAdapter
from proxy.providers.openai_basic import CompletionsAdapter
from proxy.providers.openai_chat import ChatCompletionsAdapter
from proxy.providers.openai_responses import ResponsesAdapter
from proxy.providers.sse import SSESplitter
from proxy.scripted_upstream import MESSAGE_THREADS_BETA, filler_text

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PRICES = PriceBook()
LIMIT = 300  # the client's output limit: the reservation's output tokens under a generous cap

# format -> (path, pricing provider, model, request body)
FORMATS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "messages": (
        "/v1/messages",
        "anthropic",
        "claude-sonnet-4-5",
        {"max_tokens": LIMIT, "messages": [{"role": "user", "content": "write"}]},
    ),
    "chat": (
        "/v1/chat/completions",
        "openai",
        "gpt-4o-mini",
        {"max_tokens": LIMIT, "messages": [{"role": "user", "content": "write"}]},
    ),
    "completions": (
        "/v1/completions",
        "openai",
        "gpt-3.5-turbo-instruct",
        {"max_tokens": LIMIT, "prompt": "write"},
    ),
    "responses": ("/v1/responses", "openai", "gpt-4.1", {"max_output_tokens": LIMIT, "input": "write"}),
}
# How the scripted upstream ends the stream (added to a 200-token answer).
ENDINGS: dict[str, dict[str, Any]] = {
    "error_event": {"error_after_events": 3},
    "clean_close_after_deltas": {"end_after_events": 3},
    "close_before_closing_event": {"end_after_events": -1},
    "truncated_closing_event": {"end_after_events": -1, "end_mid_event": True},
    "no_usage_and_cut": {"omit_usage": True, "end_after_events": 3},
    "oversized_event": {"oversized_event_bytes": 3 * 1024 * 1024},
    # chat/completions: `[DONE]` arrives, but not the usage chunk runcap asked for.
    "done_without_usage": {"omit_usage": True},
}
CASES = [(fmt, ending) for fmt in FORMATS for ending in ENDINGS if ending != "done_without_usage"]
CASES += [("chat", "done_without_usage"), ("completions", "done_without_usage")]
MIXED = [
    "error_event",
    "clean_close_after_deltas",
    "close_before_closing_event",
    "truncated_closing_event",
    "reset",
    "complete",
]


def billed_nanos(provider: str, model: str, requests: list[Any]) -> int:
    """What the (scripted) provider billed for these requests: the whole answer it generated."""
    return sum(usd_to_nanos(PRICES.cost(provider, model, r.usage).usd) for r in requests if r.usage)


async def settled(rc: Any, run_id: str) -> RunState:
    """The run once no reservation is pending (settlement runs after the last byte is relayed)."""
    for _ in range(200):
        state = await rc.ledger.get_run(run_id)
        if state is not None and state.steps and state.reserved_usd_nanos == 0:
            return state
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {run_id} never settled: {state}")


async def access_record(caplog: pytest.LogCaptureFixture, run_id: str) -> dict[str, Any]:
    for _ in range(200):
        for record in caplog.records:
            if record.name == "runcap.access":
                line = orjson.loads(record.getMessage())
                if line.get("run_id") == run_id:
                    return line  # type: ignore[no-any-return]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no access log line for run {run_id}")


@pytest.mark.parametrize(("fmt", "ending"), CASES)
async def test_stream_ended_early_settles_at_least_its_reservation(  # type: ignore[no-untyped-def]
    runcap_factory, upstream, caplog, fmt, ending
):
    caplog.set_level(logging.INFO, logger="runcap.access")
    rc = await runcap_factory({"log_requests": True})
    path, provider, model, body = FORMATS[fmt]
    upstream.scripts["early"] = [{"text_tokens": 200, **ENDINGS[ending]}]
    run_id = f"early-{fmt}-{ending}"
    cap = Decimal("1")
    headers = {"X-Run-Id": run_id, "X-Run-Max-Usd": str(cap), "X-Mock-Script": "early"}
    if fmt == "messages":
        headers["anthropic-version"] = "2023-06-01"
    async with (
        aiohttp.ClientSession() as s,
        s.post(rc.url + path, json={**body, "model": model, "stream": True}, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        remaining = Decimal(r.headers["X-Run-Remaining-Usd"])
        received = await r.read()  # the upstream ended cleanly: so does runcap's relay
    reserved = usd_to_nanos(cap - remaining)  # what the call reserved (nothing else in this run)
    assert upstream.last.ended_early or ending in ("oversized_event", "done_without_usage")
    if ending == "oversized_event":
        assert len(received) > 3 * 1024 * 1024  # relayed, not dropped

    state = await settled(rc, run_id)
    assert state.spent_usd_nanos >= reserved > 0
    assert state.spent_usd_nanos >= billed_nanos(provider, model, upstream.requests)
    assert state.output_tokens >= LIMIT  # the output reserved, not the part seen (Anthropic: 1)
    line = await access_record(caplog, run_id)
    assert line["outcome"] == "incomplete", line


@pytest.mark.parametrize(
    ("endings", "answer_tokens"),
    [
        pytest.param(["error_event"], 150, id="error_event"),
        pytest.param(["clean_close_after_deltas"], 150, id="clean_close"),
        # Short answers, so that every way of ending (and a complete stream) gets its turn.
        pytest.param(MIXED, 40, id="mixed"),
    ],
)
async def test_dollar_cap_holds_over_many_anthropic_streams_ended_early(  # type: ignore[no-untyped-def]
    runcap, upstream, endings, answer_tokens
):
    """The reproduced bug: each stream settled at its `message_start` usage (1 output token), so a
    $0.01 run went on and on (60 calls) while the provider billed every answer in full (13.7x the
    cap with 150-token answers)."""
    steps = {**ENDINGS, "reset": {"drop_after_events": 4}, "complete": {}}
    for name in endings:
        upstream.scripts[name] = [{"text_tokens": answer_tokens, **steps[name]}]
    c = anthropic.AsyncAnthropic(base_url=runcap.url, api_key="k", max_retries=0)
    run_id = "many-" + "-".join(endings)
    cap = Decimal("0.01")
    served = refused = 0
    for name in itertools.islice(itertools.cycle(endings), 60):
        h = {"X-Run-Id": run_id, "X-Run-Max-Usd": str(cap), "X-Mock-Script": name}
        try:
            async with c.messages.stream(
                model="claude-sonnet-4-5", max_tokens=answer_tokens + 10,
                messages=[{"role": "user", "content": "write"}], extra_headers=h,
            ) as s:  # fmt: skip
                async for _event in s:
                    pass
        except anthropic.APIStatusError as e:
            if e.status_code == 402:
                assert e.body["error"]["type"] == "run_budget_exceeded"  # type: ignore[index]
                refused += 1
                continue
        except anthropic.APIError:
            pass  # the stream broke (reset): the agent saw an error
        served += 1
    state = await settled(runcap, run_id)
    billed = billed_nanos("anthropic", "claude-sonnet-4-5", upstream.requests)
    assert served == upstream.hits() and served >= len(endings) and refused == 60 - served
    assert billed <= state.spent_usd_nanos <= usd_to_nanos(cap), (served, billed, state.spent_usd_nanos)


# --- oversized events --------------------------------------------------------------------------


def _readers() -> list[tuple[str, Any]]:
    return [
        ("messages", MessagesAdapter().stream_reader(False)),
        ("chat", ChatCompletionsAdapter().stream_reader(False)),
        ("chat-strip", ChatCompletionsAdapter().stream_reader(True)),
        ("completions-strip", CompletionsAdapter().stream_reader(True)),
        ("responses", ResponsesAdapter().stream_reader(False)),
    ]


def test_a_50mb_event_is_relayed_without_being_buffered() -> None:
    from proxy.providers.sse import MAX_EVENT_BYTES

    piece = b"x" * 65536
    head = b'event: message_start\ndata: {"type":"ping"}\n\ndata: ' + piece
    body_pieces = 50 * 1024 * 1024 // len(piece)
    tail = b'\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\ndata: [DONE]\n\n'
    for name, reader in _readers():
        sent, relayed = hashlib.sha256(), hashlib.sha256()
        for chunk in itertools.chain([head], itertools.repeat(piece, body_pieces), [tail]):
            sent.update(chunk)
            relayed.update(reader.feed(chunk))
            # Bounded: never more than the bound plus the chunk that crossed it.
            assert len(reader._splitter._buf) <= MAX_EVENT_BYTES + len(piece), name
        relayed.update(reader.close())
        assert relayed.digest() == sent.digest(), f"{name}: every byte relayed, in order"
        assert not reader.info.complete, f"{name}: an unread stream is never complete"

    splitter = SSESplitter(max_event_bytes=1000)
    assert [e.data for e in splitter.feed(b"data: a\n\ndata: " + b"y" * 2000)] == [b"a"]
    assert splitter.overflowed and splitter.release() == b"data: " + b"y" * 2000
    assert splitter.feed(b"\n\ndata: b\n\n") == [] and splitter.close() is None


def test_closing_events_make_a_stream_complete() -> None:
    """Each reader's `complete`: only its format's closing event (after the usage it asked for)."""
    messages = MessagesAdapter().stream_reader(False)
    start = {"type": "message_start", "message": {"id": "m", "model": "c", "usage": {"input_tokens": 5}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}}
    messages.feed(b"data: " + orjson.dumps(start) + b"\n\ndata: " + orjson.dumps(delta) + b"\n\n")
    assert not messages.info.complete
    messages.feed(b'event: message_stop\ndata: {"type":"message_stop"}')  # unterminated, but whole
    messages.close()
    assert messages.info.complete

    error = MessagesAdapter().stream_reader(False)
    error.feed(b"data: " + orjson.dumps(start) + b"\n\n")
    error.feed(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"x"}}\n\n')
    assert not error.info.complete and "overloaded_error" in error.info.error

    chat = ChatCompletionsAdapter().stream_reader(True)
    choice = {"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}
    chunk = {"id": "c", "model": "m", "choices": [choice]}
    chat.feed(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
    assert not chat.info.complete  # [DONE] without the usage chunk runcap asked for
    chat = ChatCompletionsAdapter().stream_reader(True)
    usage = {"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    chat.feed(b"data: " + orjson.dumps(chunk) + b"\n\ndata: " + orjson.dumps(usage) + b"\n\ndata: [DO")
    assert not chat.info.complete and chat.close() == b"data: [DO"  # a truncated [DONE]
    assert not chat.info.complete

    # Responses: every terminal event closes the stream with its final usage; `failed` is an error.
    for kind, error_text in (("completed", ""), ("incomplete", ""), ("failed", "server_error: boom")):
        responses = ResponsesAdapter().stream_reader(False)
        response = {
            "id": "r", "model": "m", "status": kind, "output": [],
            "usage": {"input_tokens": 4, "output_tokens": 2},
            "error": {"code": "server_error", "message": "boom"} if kind == "failed" else None,
        }  # fmt: skip
        responses.feed(b"data: " + orjson.dumps({"type": f"response.{kind}", "response": response}) + b"\n\n")
        info = responses.info
        assert info.complete and info.usage is not None and info.usage.output_tokens == 2
        assert info.error == error_text
    cut = ResponsesAdapter().stream_reader(False)
    cut.feed(b'event: error\ndata: {"type":"error","code":"server_error","message":"boom"}\n\n')
    assert not cut.info.complete and cut.info.error == "server_error: boom"


def test_an_oversized_event_after_the_closing_event_still_leaves_the_stream_unread() -> None:
    """Decided (issue 28): not an equivalent mutant. The closing event is the last one a stream
    reads, so an overflow can only follow it — and bytes relayed unread after it (a hostile or
    broken upstream's megabyte) are bytes runcap cannot vouch for. The stream stays incomplete and
    is settled at least at its reservation, never below what the provider may bill."""
    start = {"type": "message_start", "message": {"id": "m", "model": "c", "usage": {"input_tokens": 5}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}}
    choice = {"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}
    usage = {"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    tokens = {"input_tokens": 4, "output_tokens": 2}
    done = {"id": "r", "model": "m", "status": "completed", "output": [], "usage": tokens}
    completed = {"type": "response.completed", "response": done}
    chunk = {"id": "c", "model": "m", "choices": [choice]}
    closings = {
        "messages": (MessagesAdapter().stream_reader(False), [start, delta, {"type": "message_stop"}]),
        "chat": (ChatCompletionsAdapter().stream_reader(False), [chunk, usage, "[DONE]"]),
        "chat-strip": (ChatCompletionsAdapter().stream_reader(True), [chunk, usage, "[DONE]"]),
        "responses": (ResponsesAdapter().stream_reader(False), [completed]),
    }
    oversized = b"data: " + b"z" * (2 << 20) + b"\n\n"
    for name, (reader, events) in closings.items():
        for event in events:
            data = event.encode() if isinstance(event, str) else orjson.dumps(event)
            reader.feed(b"data: " + data + b"\n\n")
        assert reader.info.complete, f"{name}: closed and fully read"
        relayed = reader.feed(oversized[: 1 << 20]) + reader.feed(oversized[1 << 20 :]) + reader.close()
        assert relayed == oversized, f"{name}: the trailing event is relayed as it came"
        info = reader.info
        assert not info.complete, f"{name}: an event relayed unread leaves the stream incomplete"
        assert f"longer than {1 << 20} bytes" in info.error, (name, info.error)
        assert info.usage is not None  # what was read before still counts


# --- provider-held context: Anthropic message threads, Responses stored context -----------------


async def lookup(q: str) -> str:
    """Look something up."""
    return "found " + q


@pytest.mark.parametrize("stream", [False, True])
async def test_final_step_of_a_threaded_tool_run_is_an_answer(runcap, upstream, stream):  # type: ignore[no-untyped-def]
    """The SDK's tool runner continues a server-held thread: the second request carries no tools,
    yet the thread's tools are live. The answer-only step must forbid them (tool choice none)."""
    upstream.scripts["loop"] = [{"tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]}]
    run_id = f"thread-final-{stream}"
    c = anthropic.AsyncAnthropic(
        base_url=runcap.url, api_key="k", max_retries=0,
        default_headers={"X-Run-Id": run_id, "X-Run-Max-Steps": "2", "X-Mock-Script": "loop"},
    )  # fmt: skip
    runner = c.beta.messages.tool_runner(
        model="claude-sonnet-4-5", max_tokens=200, system="Be brief.", stream=stream,
        tools=[anthropic.beta_async_tool(lookup)], messages=[{"role": "user", "content": "look x up"}],
    )  # fmt: skip
    replies = []
    async for item in runner:
        replies.append(await item.get_final_message() if stream else item)
    assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"]
    assert all(b.type == "text" for b in replies[-1].content)
    first, last = upstream.requests
    assert first.body["thread"] == {"type": "create"} and "tools" in first.body
    assert last.body["thread"] == {"type": "continue", "previous_message_id": replies[0].id}
    assert MESSAGE_THREADS_BETA in (last.header("anthropic-beta") or "")
    assert last.body["tool_choice"] == {"type": "none"} and "tools" not in last.body
    state = await settled(runcap, run_id)
    assert state.status == "steps_exceeded" and state.steps == 2


async def test_threaded_conversation_stays_under_its_dollar_cap(runcap, upstream):  # type: ignore[no-untyped-def]
    """Each `continue` is billed for the whole thread (system prompt, tools, history) though it
    sends only the new tool result: runcap reserves the thread's size, so the cap holds."""
    upstream.scripts["loop"] = [{"tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]}]
    run_id = "thread-cap"
    cap = Decimal("1")
    c = anthropic.AsyncAnthropic(
        base_url=runcap.url, api_key="k", max_retries=0,
        default_headers={"X-Run-Id": run_id, "X-Run-Max-Usd": str(cap), "X-Mock-Script": "loop"},
    )  # fmt: skip
    runner = c.beta.messages.tool_runner(
        model="claude-sonnet-4-5", max_tokens=20, system=filler_text(20_000),
        tools=[anthropic.beta_async_tool(lookup)], messages=[{"role": "user", "content": "look x up"}],
    )  # fmt: skip
    with pytest.raises(anthropic.APIStatusError) as e:
        async for _reply in runner:
            pass
    assert e.value.status_code == 402 and e.value.body["error"]["type"] == "run_budget_exceeded"  # type: ignore[index]
    assert upstream.hits() >= 3 and all(r.body["thread"]["type"] == "continue" for r in upstream.requests[1:])
    state = await settled(runcap, run_id)
    billed = billed_nanos("anthropic", "claude-sonnet-4-5", upstream.requests)
    assert billed <= state.spent_usd_nanos <= usd_to_nanos(cap), (billed, state.spent_usd_nanos)


async def test_final_step_with_a_stored_responses_context_forbids_tools(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["r"] = [{"tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]}]
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "resp-final", "X-Run-Max-Steps": "2", "X-Mock-Script": "r"}
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    first = await c.responses.create(model="gpt-4.1", input="look x up", tools=tools, extra_headers=h)  # type: ignore[arg-type]
    [call] = [item for item in first.output if item.type == "function_call"]
    raw = await c.responses.with_raw_response.create(
        model="gpt-4.1", previous_response_id=first.id, extra_headers=h,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "found"}],
    )  # fmt: skip
    assert raw.headers["x-run-final-step"] == "true"
    assert upstream.last.body["tool_choice"] == "none"  # the stored context's tools are not live


async def test_referenced_output_items_are_reserved(runcap, upstream):  # type: ignore[no-untyped-def]
    """The Vercel AI SDK sends an earlier answer's text back as an `item_reference`: the provider
    bills the stored item as input though the body does not carry it, so runcap reserves it (at
    the answer's output tokens, which it saw) — here the difference between fitting the token cap
    and overshooting it."""
    upstream.scripts["ref"] = [{"text_tokens": 2000}, {"text": "ok"}]
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "item-ref", "X-Run-Max-Tokens": "3500", "X-Mock-Script": "ref"}
    first = await c.responses.create(model="gpt-4.1", input="write", extra_headers=h)
    assert first.usage is not None and first.usage.output_tokens == 2000
    [message] = first.output
    with pytest.raises(openai.APIStatusError) as e:
        await c.responses.create(
            model="gpt-4.1", extra_headers=h,
            input=[{"role": "user", "content": "write"}, {"type": "item_reference", "id": message.id},
                   {"role": "user", "content": "and shorten it"}],
        )  # fmt: skip
    assert e.value.status_code == 402 and e.value.body["code"] == "max_tokens"  # type: ignore[index]
    assert upstream.hits() == 1


async def test_scripted_upstream_holds_threads_like_the_provider(upstream):  # type: ignore[no-untyped-def]
    """What the threaded tests stand on: a `continue` is billed for the kept thread, and refused
    when it cannot be one."""
    beta = {"anthropic-beta": MESSAGE_THREADS_BETA, "anthropic-version": "2023-06-01"}
    body = {"model": "claude-sonnet-4-5", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}

    async def post(payload: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(upstream.url + "/v1/messages", json=payload, headers=headers) as r,
        ):
            return r.status, await r.json()

    status, first = await post({**body, "system": filler_text(500), "thread": {"type": "create"}}, beta)
    assert status == 200
    then = {**body, "thread": {"type": "continue", "previous_message_id": first["id"]}}
    status, second = await post(then, beta)
    assert status == 200 and second["usage"]["input_tokens"] > first["usage"]["input_tokens"] > 500
    assert (await post(then, {"anthropic-version": "2023-06-01"}))[0] == 400  # without the beta
    assert (await post({**then, "system": "x"}, beta))[0] == 400  # a continue keeps the thread's
    lost = {**body, "thread": {"type": "continue", "previous_message_id": "msg_unknown"}}
    status, err = await post(lost, beta)
    assert status == 404 and err["error"]["details"] == {"error_code": "thread_not_found"}
