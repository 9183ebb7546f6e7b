"""A tool call through runcap, whatever the wire it came on: `/tools/{name}` (plain HTTP) and MCP
`tools/call` (`/mcp/{name}`) share this — the call's record (`ToolCall`), its side of the ledger
(`ToolCallLedger`: ask, wait for a duplicate in flight, record the outcome or `unknown`), and its
`tool` span. The gateways differ only in how they forward the call and shape the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TypeVar

from proxy.caps import RunRequest
from proxy.config import Config
from proxy.errors import DeadlineExceeded, Rejection, RunCancelled, ToolTimeout
from proxy.ledger.base import Ledger, RunState, ToolCallRequest, ToolCallStart
from proxy.server.accesslog import log_tool_call
from proxy.server.auth import ClientAuth
from proxy.server.flow import Flights
from proxy.server.metrics import Metrics
from proxy.server.outbound import OutboundClient, call_timeout
from proxy.server.tool_outcome import never_left
from proxy.server.trace import run_snapshot
from proxy.spans.model import Payload, Span
from proxy.spans.recorder import NullRecorder, SpanRecorder

log = logging.getLogger("runcap.tools")

_T = TypeVar("_T")
_OUTCOME = {DeadlineExceeded: "deadline_exceeded", RunCancelled: "cancelled", ToolTimeout: "timeout"}


class ToolClient(OutboundClient):
    """The connection pool to tool services and MCP servers, shared by `/tools` and `/mcp`: those
    are other hosts than the model providers, so a pool of their own (sending as every outbound
    call does: server/outbound.py). Closed at clean-up after the gateways' own (an MCP gateway
    still sends `notifications/cancelled` through it), so `add_to` comes after theirs."""

    def __init__(self) -> None:
        super().__init__(keepalive_timeout_s=30, connect_timeout_s=10)


class ToolRoute:
    """What `/tools/{name}` (server/tools.py) and `/mcp/{name}` (mcp/gateway.py) are built on: the
    ledger's side of a tool call, the shared tool-side pool, the span recorder, the client
    tokens, and the in-flight calls a cancel can cut."""

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        flights: Flights,
        metrics: Metrics,
        client: ToolClient,
        recorder: SpanRecorder | None = None,
        clients: ClientAuth | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.flights = flights
        self.metrics = metrics
        self.client = client
        self.recorder: SpanRecorder = recorder or NullRecorder()
        self.clients = clients or ClientAuth({})
        self.calls = ToolCallLedger(ledger, metrics)


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

    def refused(self, rej: Rejection) -> None:
        """The call ends with `rej`: its status, outcome and error for the span."""
        self.status = rej.status
        if self.outcome != "unknown":
            self.outcome = next((o for cls, o in _OUTCOME.items() if isinstance(rej, cls)), "error")
            if rej.type == "run_budget_exceeded":
                self.outcome = "budget_exceeded"
            elif rej.type == "idempotency_outcome_unknown":
                self.outcome = "unknown"
        self.error = rej.message


class ToolCallLedger:
    """The ledger as tool calls use it: one `begin` that waits out a duplicate in flight (here,
    woken the moment it ends; on another replica, polled), `unknown` that never raises, and the
    latency of each operation in the metrics."""

    def __init__(self, ledger: Ledger, metrics: Metrics) -> None:
        self.ledger = ledger
        self.metrics = metrics
        # Calls this process executes, by (run, key): duplicates here wake up at once.
        self._executing: dict[tuple[str, str], asyncio.Event] = {}

    async def timed(self, op: str, call: Awaitable[_T]) -> _T:
        t0 = time.perf_counter()
        try:
            return await call
        finally:
            self.metrics.ledger_op(op, time.perf_counter() - t0)

    async def begin(self, req: ToolCallRequest) -> ToolCallStart:
        """Ask the ledger; while a duplicate is in flight (here or on another replica), wait for
        it — bounded by the run's deadline (the ledger refuses once it has passed)."""
        delay = 0.005
        while True:
            start = await self.timed("tool_begin", self.ledger.begin_tool_call(req))
            if start.action != "wait":
                return start
            deadline = start.state.caps.deadline
            left = call_timeout(deadline).seconds
            left = None if left is None else left + 0.001
            pause = delay if left is None else min(delay, left)
            event = self._executing.get((req.run_id, req.key or ""))
            if event is not None:
                # Executing here: woken the moment it ends (the ledger is asked again after).
                try:
                    await asyncio.wait_for(event.wait(), timeout=0.5 if left is None else min(0.5, left))
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(pause)
                delay = min(delay * 2, 0.1)
            req = replace(req, now=time.time())

    def executing(self, run_id: str, key: str | None) -> asyncio.Event:
        """Mark a keyed call as executing in this process; `finished` wakes its duplicates."""
        event = asyncio.Event()
        if key is not None:
            self._executing[(run_id, key)] = event
        return event

    def finished(self, run_id: str, key: str | None, event: asyncio.Event) -> None:
        if key is not None and self._executing.get((run_id, key)) is event:
            del self._executing[(run_id, key)]
        event.set()

    async def complete(
        self, run_id: str, key: str, status: int, headers: dict[str, str], body: bytes
    ) -> None:
        """Record the outcome; not interrupted by a cancel (the call did happen)."""
        await asyncio.shield(
            self.timed(
                "tool_complete",
                self.ledger.complete_tool_call(run_id, key, status, headers, body, time.time()),
            )
        )

    async def unknown(self, call: ToolCall, reason: str, metric_label: str) -> None:
        """The call was cut after it may have reached the tool: `unknown` until reconciled."""
        if call.reached != "true":  # runcap failing after the answer: the tool was reached
            call.reached = "unknown"
        if call.key is None or call.run is None:
            return
        call.outcome = "unknown"
        self.metrics.tool_unknown.labels(metric_label).inc()
        try:
            await self.ledger.mark_unknown(call.run.run_id, call.key, time.time(), reason)
        except Exception:
            # The process's death (or the sweep) turns it unknown anyway.
            log.exception("could not mark tool call %s of run %s unknown", call.key, call.run.run_id)

    async def failed(self, call: ToolCall, error: BaseException, metric_label: str) -> None:
        """The call raised instead of answering (server/tool_outcome.py): released when it
        provably never left, else `unknown`."""
        if never_left(error):
            if call.key is not None and call.run is not None:
                await self.release(call.run.run_id, call.key)
            return
        await self.unknown(call, f"connection failed: {type(error).__name__}", metric_label)

    async def release(self, run_id: str, key: str) -> None:
        """The call never reached the tool: delete its intent (and its count), so the next
        attempt executes."""
        await self.ledger.resolve_tool_call(run_id, key, done=False, now=time.time(), force=True)


def record_tool_call(
    recorder: SpanRecorder, metrics: Metrics, call: ToolCall, *, endpoint: str, metric_label: str,
    access: tuple[str, str, str | None] | None = None,
) -> None:  # fmt: skip
    """Count the call and hand its `tool` span, the run's new state and the bodies kept to the
    recorder: one step, one record. `access`: (method, path, the run id the request claimed) for
    the access log line, when `log_requests` is on."""
    metrics.tool_calls.labels(metric_label, call.outcome).inc()
    if access is not None:
        method, path, claimed = access
        log_tool_call(
            run_id=call.run.run_id if call.run is not None else claimed,
            step=call.state.steps if call.state is not None else 0, method=method, path=path,
            tool=call.tool, status=call.status, outcome=call.outcome,
            duration_ms=(time.perf_counter() - call.started) * 1000.0, idempotency_key=call.key,
            error=call.error, mcp_server=call.attributes.get("mcp.server", ""),
        )  # fmt: skip
    if call.run is None:
        return
    try:
        span = Span(
            run_id=call.run.run_id,
            kind="tool",
            step=call.state.steps if call.state is not None else 0,
            started_at=call.started_at,
            duration_ms=(time.perf_counter() - call.started) * 1000.0,
            task=call.run.task,
            endpoint=endpoint,
            status_code=call.status,
            outcome=call.outcome,
            error=call.error,
            tool_name=call.tool,
            tool_call_id=call.tool_call_id,
            args_hash=call.args_hash,
            result_hash=call.result_hash,
            idempotency_key=call.key or "",
            request_hash=call.request_hash,
            response_hash=call.response_hash,
            attributes={**call.attributes, "tool.reached": call.reached},
        )
        # the run's state: its executed tool calls changed
        recorder.step([span], run_snapshot(call.state) if call.state is not None else None, call.bodies)
    except Exception:
        log.exception("could not record the span of a call to tool %s", call.tool)
