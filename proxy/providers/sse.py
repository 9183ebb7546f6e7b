"""Server-Sent Events: incremental splitting, and the relaying reader every stream adapter extends.

Upstream streams arrive in arbitrary chunks; an event ends with a blank line (`\\n\\n`,
`\\r\\n\\r\\n`, or any mix of the three SSE line terminators). `SSESplitter` turns chunks into
complete events, keeping each event's exact bytes so a reader can relay or drop it verbatim.
`SSEStreamReader` does the relaying: pass-through (every byte relayed at once, events parsed
from a copy) or, when it may drop events, holding back only an incomplete trailing event.

An event longer than `MAX_EVENT_BYTES` (no provider sends one; a broken or hostile upstream
might send an endless line) is never buffered whole: from there on the splitter stops and the
reader relays the bytes as they come, unread. The stream then cannot be known complete, so the
call is settled at its reservation.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import orjson

from .base import ResponseInfo

log = logging.getLogger(__name__)

# A line terminator followed by an empty line. `\r` alone is a terminator only when no `\n`
# follows it, so that `\r\n` is never read as two terminators.
_EVENT_END = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r)")
# The longest event read; the largest real ones (a Responses terminal event repeating a long
# answer) are far below it.
MAX_EVENT_BYTES = 1 << 20


@dataclass(slots=True)
class SSEEvent:
    raw: bytes  # the event's exact bytes, including the blank line that ended it
    event: str  # the `event:` field, "" when absent
    data: bytes | None  # the `data:` lines joined with "\n"; None when the event has none

    def json(self) -> object:
        """The data parsed as JSON; None when absent, `[DONE]` or not JSON."""
        if not self.data or self.data == b"[DONE]":
            return None
        try:
            return orjson.loads(self.data)
        except orjson.JSONDecodeError:
            return None


def error_text(error: object) -> str:
    """`kind: message` of an error object an upstream sent inside a stream (Anthropic's `error`
    event, OpenAI's error chunk or event, a failed response's `error`)."""
    if not isinstance(error, dict):
        return "error"
    kind = next((v for v in (error.get("code"), error.get("type")) if isinstance(v, str) and v), "error")
    message = error.get("message")
    return f"{kind}: {message}" if isinstance(message, str) else kind


def parse_event(raw: bytes) -> SSEEvent:
    name = ""
    data: list[bytes] = []
    for line in raw.splitlines():
        if not line or line[0] == 0x3A:  # blank, or a ":" comment
            continue
        field, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value.decode("utf-8", "replace")
    return SSEEvent(raw, name, b"\n".join(data) if data else None)


class SSESplitter:
    """Feed chunks, get complete events back; incomplete bytes wait for the next chunk.

    An event longer than `max_event_bytes` overflows the splitter: `feed` returns the events
    before it, `overflowed` turns True, and from then on nothing is split (`feed` returns no
    events). The bytes held at that moment — the long event so far — are taken with `release`.
    """

    __slots__ = ("_buf", "max_event_bytes", "overflowed")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = bytearray()
        self.max_event_bytes = max_event_bytes
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self.overflowed:
            return []
        buf = self._buf
        # Resume the search a little before the new bytes: a terminator may straddle the chunks.
        pos = max(0, len(buf) - 3)
        buf += chunk
        events: list[SSEEvent] = []
        start = 0
        while True:
            match = _EVENT_END.search(buf, pos)
            if match is None:
                break
            end = match.end()
            if end == len(buf) and buf[-1] == 0x0D:
                break  # "\r" at the very end may be half of "\r\n": wait for the next byte
            if end - start > self.max_event_bytes:
                break
            events.append(parse_event(bytes(buf[start:end])))
            start = pos = end
        if start:
            del buf[:start]
        if len(buf) > self.max_event_bytes:
            self.overflowed = True
        return events

    def release(self) -> bytes:
        """The bytes held back (after an overflow: the long event so far); holds none after."""
        raw = bytes(self._buf)
        self._buf = bytearray()
        return raw

    def close(self) -> SSEEvent | None:
        """End of stream: the unterminated trailing event, if any bytes are left."""
        if not self._buf:
            return None
        raw = bytes(self._buf)
        self._buf.clear()
        return parse_event(raw)


class SSEStreamReader:
    """Base of the adapters' stream readers: relays the bytes, hands events to `on_event`.

    With `may_drop` False every chunk is returned as it arrived (nothing is ever held back) and
    events are parsed from a copy. With `may_drop` True complete events are relayed unless
    `on_event` returns False, and only an incomplete trailing event is held back.

    A subclass sets `_closed` when its format's closing event arrives (and `_ended` when that
    event arrived but does not make the stream complete), and `_error` when the
    upstream reports an error in the stream; `complete` and `error` combine them with the
    splitter's state for `info`. After an oversized event every byte is relayed as it comes,
    unread, whatever `may_drop` says, and the stream is not complete.
    """

    def __init__(self, may_drop: bool, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._splitter = SSESplitter(max_event_bytes)
        self._may_drop = may_drop
        self._closed = False
        self._ended = False
        self._error = ""

    def on_event(self, event: SSEEvent) -> bool:
        """Read one event; return False to drop it (honoured only when the reader may drop)."""
        raise NotImplementedError

    @property
    def info(self) -> ResponseInfo:
        raise NotImplementedError

    @property
    def complete(self) -> bool:
        """The closing event arrived, and no event before it went unread."""
        return self._closed and not self._splitter.overflowed

    @property
    def ended(self) -> bool:
        """The closing event arrived: what follows is the stream's end (forward.py relays it only
        once the call is on record)."""
        return self._closed or self._ended

    @property
    def error(self) -> str:
        if self._splitter.overflowed:
            return (
                f"an SSE event longer than {self._splitter.max_event_bytes} bytes: "
                "the stream was relayed unread from there"
            )
        return self._error

    def _read(self, event: SSEEvent) -> bool:
        try:
            return self.on_event(event)
        except Exception:  # a malformed upstream event must never break the relay
            log.debug("unreadable SSE event relayed as-is: %r", event.raw[:200], exc_info=True)
            return True

    def feed(self, chunk: bytes) -> bytes:
        splitter = self._splitter
        if splitter.overflowed:
            return chunk
        events = splitter.feed(chunk)
        if self._may_drop:
            out = b"".join(event.raw for event in events if self._read(event))
        else:
            for event in events:
                self._read(event)
            out = chunk
        if splitter.overflowed:
            log.warning("an SSE event exceeded %d bytes: relaying the rest unread", splitter.max_event_bytes)
            held = splitter.release()  # the long event so far: relayed now, never parsed
            if self._may_drop:
                out += held
        return out

    def close(self) -> bytes:
        event = self._splitter.close()
        if event is None:
            return b""
        # An unterminated last event is not dispatched by SSE clients, but it may still carry
        # what we need (some servers end the stream without the final blank line).
        keep = self._read(event)
        return event.raw if self._may_drop and keep else b""
