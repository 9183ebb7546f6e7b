"""What the request path hands its records to: `SpanRecorder`.

The request path (model calls, `/tools` calls, MCP) builds `Span`s, `RunSnapshot`s and payload
bodies and gives them to a recorder, which returns at once. `WalRecorder` appends them to the
write-ahead log (proxy/spans/wal.py: one `write` per call, no thread hand-off, no store client);
`NullRecorder` drops everything, for a runcap configured without tracing.

A finished step is one call, `step(spans, run, bodies)`, and so one WAL record: its spans, the
run's new state and its bodies land together or not at all. `body()` applies the payload policy
and hashes a body without writing it (the hash goes in the span first). `span()`, `run()` and
`payload()` record one thing each (a record of its own). Within `group()`, records are written
together when it ends (one write for all of them: the steps that end in one event-loop turn).

A step's `on_done` is told when its record's fate is known — "" once it is in the WAL, else why
it was dropped — so that the caller answers only what is on record (server/steps/trace.py). While the
WAL has no room a record is held in memory (bounded: `wal_hold_bytes`, `wal_hold_ms`), and
`on_done` waits with it; `flush_held()` tries the held records again.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.payloads import PayloadPolicy
from proxy.spans.wal import WalWriter


class SpanRecorder(Protocol):
    def span(self, span: Span) -> None: ...

    def run(self, snapshot: RunSnapshot) -> None: ...

    def payload(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> str:
        """Record a body for the payload store; return its sha256 hex ('' when not stored:
        payloads off, errors-only and this is no error, over the size limit, or dropped by the
        WAL). Not inside `group()`: there the write, and so a drop, comes after the return."""

    def body(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> Payload | None:
        """A body to pass to `step` (None when the policy does not keep it); nothing written."""

    def step(
        self,
        spans: Sequence[Span],
        run: RunSnapshot | None = None,
        bodies: Sequence[Payload] = (),
        *,
        on_done: Callable[[str], None] | None = None,
    ) -> None:
        """Record one finished step — spans, the run's state, bodies — as one record. `on_done`
        (when given) is called exactly once: with "" when the record is in the WAL, with the
        reason when it was dropped."""

    def group(self) -> AbstractContextManager[None]:
        """Records made inside are written together, in order, when it exits."""

    def held(self) -> int:
        """Records waiting in memory for room in the WAL."""

    def flush_held(self) -> int:
        """Try the held records again; returns how many are still held."""


class NullRecorder:
    def span(self, span: Span) -> None:
        pass

    def run(self, snapshot: RunSnapshot) -> None:
        pass

    def payload(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> str:
        return ""

    def body(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> Payload | None:
        return None

    def step(
        self,
        spans: Sequence[Span],
        run: RunSnapshot | None = None,
        bodies: Sequence[Payload] = (),
        *,
        on_done: Callable[[str], None] | None = None,
    ) -> None:
        if on_done is not None:
            on_done("")  # nothing to record: nothing to wait for

    def group(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def held(self) -> int:
        return 0

    def flush_held(self) -> int:
        return 0


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class WalRecorder:
    """Appends to the WAL; bodies are hashed here (the hash goes in the span) and kept only when
    the payload policy says so."""

    def __init__(self, writer: WalWriter, policy: PayloadPolicy) -> None:
        self.writer = writer
        self.policy = policy

    def span(self, span: Span) -> None:
        self.writer.append_step([span])

    def run(self, snapshot: RunSnapshot) -> None:
        self.writer.append_step((), [snapshot])

    def payload(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> str:
        body = self.body(data, is_error=is_error, content_type=content_type)
        if body is None:
            return ""
        dropped = self.writer.dropped_payloads
        self.writer.append_step((), (), [body])
        return body.sha256 if self.writer.dropped_payloads == dropped else ""

    def body(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> Payload | None:
        if not self.policy.keep(is_error, len(data)):
            return None
        return Payload(sha256_hex(data), data, content_type)

    def step(
        self,
        spans: Sequence[Span],
        run: RunSnapshot | None = None,
        bodies: Sequence[Payload] = (),
        *,
        on_done: Callable[[str], None] | None = None,
    ) -> None:
        self.writer.append_step(spans, (run,) if run is not None else (), bodies, on_done=on_done)

    def group(self) -> AbstractContextManager[None]:
        return self.writer.group()

    def held(self) -> int:
        return self.writer.held_records

    def flush_held(self) -> int:
        return self.writer.flush_held()
