"""One tool call's record (`ToolCall`), whichever gateway it came through: what its `tool` span
says (span.py), what a cancel sets (`cut_reason`, through `Flights`), and how a refusal ends it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from proxy.caps import RunRequest
from proxy.errors import Rejection
from proxy.ledger.base import RunState
from proxy.spans.model import Payload, SpanEvent
from proxy.spans.recorder import SpanRecorder


@dataclass(slots=True, eq=False)
class ToolCall:
    """One tool call, for its span and for `Flights` (a cancel sets `cut_reason`)."""

    tool: str
    known: bool = True  # a configured tool (metric labels name only those)
    path: str = ""  # /tools: decoded sub-path after /tools/{name}, with the query
    started: float = field(default_factory=time.perf_counter)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    run: RunRequest | None = None
    state: RunState | None = None
    key: str | None = None
    args_hash: str = ""
    result_hash: str = ""
    request_hash: str = ""
    response_hash: str = ""
    # Bodies kept for the payload store (`keep_body`), recorded with the span: one WAL record.
    bodies: list[Payload] = field(default_factory=list)
    tool_call_id: str = ""
    status: int = 0
    outcome: str = "ok"
    error: str = ""
    cut_reason: str | None = None
    # Whether the call reached the tool (span attribute `tool.reached`, read by
    # queries/duplicate_side_effects.sql): "true" the tool answered, "unknown" cut after it may
    # have, "false" never (refused by runcap, replayed from its record, tool unreachable).
    reached: str = "false"
    attributes: dict[str, str] = field(default_factory=dict)  # the span's, beyond the columns
    # What happened during the call worth its own time (a policy's verdict, an approval asked for
    # and decided): the span's events, exported as OTLP span events, in the `events` column.
    events: list[SpanEvent] = field(default_factory=list)

    def event(self, name: str, **attributes: str) -> SpanEvent:
        """Record that `name` happened now, with `attributes`; returns the event."""
        happened = SpanEvent(name, datetime.now(UTC), attributes)
        self.events.append(happened)
        return happened

    def keep_body(self, recorder: SpanRecorder, data: bytes, *, response: bool, is_error: bool = False,
                  content_type: str = "") -> None:  # fmt: skip
        """The request or response body for the payload store, if the policy keeps it: its hash
        goes in the span now, the bytes with the span when the call is recorded."""
        body = recorder.body(data, is_error=is_error, content_type=content_type)
        if body is None:
            return
        if response:
            self.response_hash = body.sha256
        else:
            self.request_hash = body.sha256
        self.bodies.append(body)

    def answer_headers(self) -> dict[str, str]:
        """What the agent is told with the call's answer: `X-Run-Id`, what the run has left of
        its tool calls and time (once the ledger has answered), and the call's `Idempotency-Key`."""
        if self.state is not None:
            headers = _run_headers(self.state, time.time())
        else:
            headers = {"X-Run-Id": self.run.run_id} if self.run is not None else {}
        if self.key is not None:
            headers["Idempotency-Key"] = self.key
        return headers

    def refused(self, rej: Rejection) -> None:
        """The call ends with `rej`: its status, outcome and error for the span."""
        self.status = rej.status
        if self.outcome != "unknown":
            self.outcome = rej.outcome
        self.error = rej.message


def _run_headers(state: RunState, now: float) -> dict[str, str]:
    headers = {"X-Run-Id": state.run_id}
    remaining = state.remaining(now)
    if remaining["tool_calls"] is not None:
        headers["X-Run-Remaining-Tool-Calls"] = str(remaining["tool_calls"])
    if remaining["ms"] is not None:
        headers["X-Run-Remaining-Ms"] = str(int(remaining["ms"]))
    return headers
