"""Server-Sent Events: incremental splitting, and the relaying reader every stream adapter extends.

Upstream streams arrive in arbitrary chunks; an event ends with a blank line (`\\n\\n`,
`\\r\\n\\r\\n`, or any mix of the three SSE line terminators). `SSESplitter` turns chunks into
complete events, keeping each event's exact bytes so a reader can relay or drop it verbatim.
`SSEStreamReader` does the relaying: pass-through (every byte relayed at once, events parsed
from a copy) or, when it may drop events, holding back only an incomplete trailing event.
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
    """Feed chunks, get complete events back; incomplete bytes wait for the next chunk."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[SSEEvent]:
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
            events.append(parse_event(bytes(buf[start:end])))
            start = pos = end
        if start:
            del buf[:start]
        return events

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
    """

    def __init__(self, may_drop: bool) -> None:
        self._splitter = SSESplitter()
        self._may_drop = may_drop

    def on_event(self, event: SSEEvent) -> bool:
        """Read one event; return False to drop it (honoured only when the reader may drop)."""
        raise NotImplementedError

    @property
    def info(self) -> ResponseInfo:
        raise NotImplementedError

    def _read(self, event: SSEEvent) -> bool:
        try:
            return self.on_event(event)
        except Exception:  # a malformed upstream event must never break the relay
            log.debug("unreadable SSE event relayed as-is: %r", event.raw[:200], exc_info=True)
            return True

    def feed(self, chunk: bytes) -> bytes:
        events = self._splitter.feed(chunk)
        if not self._may_drop:
            for event in events:
                self._read(event)
            return chunk
        return b"".join(event.raw for event in events if self._read(event))

    def close(self) -> bytes:
        event = self._splitter.close()
        if event is None:
            return b""
        # An unterminated last event is not dispatched by SSE clients, but it may still carry
        # what we need (some servers end the stream without the final blank line).
        keep = self._read(event)
        return event.raw if self._may_drop and keep else b""
