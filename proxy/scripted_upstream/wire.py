"""How the scripted upstream sends what it answers, whatever the wire format: SSE framing, the
playing of a stream's events (with the step's stalls, drops and early ends), JSON replies, and
`BadRequest`, the 400 each format renders in its provider's error shape.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, NoReturn

import orjson
from aiohttp import web

from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.script import Step

JSON = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def sse_data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_event(name: bytes, obj: Any) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class BadRequest(Exception):
    """A request the provider would refuse with a 400; each format renders it in its error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# Large events are written in pieces of this size, as a provider's server would send them.
WRITE_BYTES = 64 * 1024


def end_early(step: Step, events: list[bytes], error_event: bytes) -> list[bytes]:
    """The events a stream that ends early sends: cut after `end_after_events` (with half of the
    next event when `end_mid_event`) or `error_after_events` (then the error event)."""
    if step.error_after_events is not None:
        return [*events[: step.error_after_events], error_event]
    if step.end_after_events is None:
        return list(events)
    cut = step.end_after_events if step.end_after_events >= 0 else max(0, len(events) + step.end_after_events)
    kept = events[:cut]
    if step.end_mid_event and cut < len(events):
        kept.append(events[cut][: len(events[cut]) // 2])
    return kept


def oversized_comment(size: int) -> bytes:
    """An SSE comment event of `size` bytes: one long line that SSE clients ignore."""
    return b": " + b"x" * max(0, size - 4) + b"\n\n"


async def pause(step: Step, stream: bool) -> None:
    """A step's wait before the response starts (a non-stream answer also takes its stall)."""
    wait = step.delay_s + (0.0 if stream else step.stall_s)
    if wait:
        await asyncio.sleep(wait)


def text_pieces(text: str, size: int) -> list[str]:
    if not text:
        return []
    # At most ~64 pieces, so long answers do not turn into thousands of tiny events.
    size = max(size, math.ceil(len(text) / 64))
    return [text[i : i + size] for i in range(0, len(text), size)]


async def play_stream(
    request: web.Request,
    rec: RecordedRequest,
    step: Step,
    events: list[bytes],
    stall_at: int,
    headers: dict[str, str],
    error_event: bytes,
) -> web.StreamResponse:
    """Play a stream's events; `error_event` is the format's mid-stream error."""
    if step.drop_after_events == 0:
        drop(request, rec)
    events = end_early(step, events, error_event)
    if step.oversized_event_bytes and events:
        events.insert(1, oversized_comment(step.oversized_event_bytes))
        if stall_at >= 1:
            stall_at += 1
    ended_early = step.end_after_events is not None or step.error_after_events is not None
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers, **dict(step.headers)})
    await resp.prepare(request)
    try:
        last = len(events) - 1
        for i, event in enumerate(events):
            for start in range(0, len(event), WRITE_BYTES):
                await resp.write(event[start : start + WRITE_BYTES])
            if step.drop_after_events == i + 1:
                drop(request, rec)
            if i == stall_at and step.stall_s:
                await asyncio.sleep(step.stall_s)
            elif step.chunk_delay_s and i < last:
                await asyncio.sleep(step.chunk_delay_s)
        await resp.write_eof()
    except ConnectionError:
        rec.disconnected = True
        return resp
    rec.ended_early = ended_early
    rec.completed = not ended_early
    return resp


def drop(request: web.Request, rec: RecordedRequest) -> NoReturn:
    """Close the connection without finishing the response, like a provider that failed."""
    rec.dropped = True
    if request.transport is not None:
        request.transport.close()  # flushes what was written, then closes (no final chunk)
    # aiohttp treats a cancelled handler as a gone connection: nothing more is written or logged.
    raise asyncio.CancelledError


def reply(
    request: web.Request, rec: RecordedRequest, step: Step, body: bytes, headers: dict[str, str]
) -> web.Response:
    """A successful non-stream answer (or the connection dropped, when the step says so)."""
    if step.drop_after_events is not None:
        drop(request, rec)
    return json_reply(rec, 200, body, headers)


def json_reply(rec: RecordedRequest, status: int, body: bytes, headers: dict[str, str]) -> web.Response:
    rec.status = status
    rec.completed = True
    return web.Response(status=status, body=body, content_type=JSON, headers=headers)
