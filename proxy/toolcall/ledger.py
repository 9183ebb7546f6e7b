"""The ledger as a tool call uses it (`ToolCallLedger`), for both tool gateways: ask for the call
(waiting out a duplicate in flight), record its outcome, mark it `unknown`, or release it — by
the rule in outcome.py — with the latency of each operation in the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from proxy.caps import RunRequest
from proxy.ledger.base import Ledger, RunState, ToolCallRequest, ToolCallStart
from proxy.server.metrics import Metrics
from proxy.toolcall.call import ToolCall
from proxy.toolcall.clock import deadline_clock
from proxy.toolcall.outcome import never_left

log = logging.getLogger("runcap.tools")


class ToolCallLedger:
    """The ledger as tool calls use it: one `begin` that waits out a duplicate in flight (here,
    woken the moment it ends; on another replica, polled), `unknown` that never raises, and the
    latency of each operation in the metrics."""

    def __init__(self, ledger: Ledger, metrics: Metrics) -> None:
        self.ledger = ledger
        self.metrics = metrics
        # Calls this process executes, by (run, key): duplicates here wake up at once.
        self._executing: dict[tuple[str, str], asyncio.Event] = {}

    async def touch_run(self, run: RunRequest, now: float) -> RunState:
        """The run's state for a request that is not a tool call (an MCP relay, a GET stream,
        runcap's own `tools/list`): refused once the run is cancelled or past its deadline."""
        return await self.metrics.timed_ledger_op("touch_run", self.ledger.touch(run, now))

    async def begin(self, req: ToolCallRequest) -> ToolCallStart:
        """Ask the ledger; while a duplicate is in flight (here or on another replica), wait for
        it — bounded by the run's deadline (the ledger refuses once it has passed)."""
        delay = 0.005
        while True:
            start = await self.metrics.timed_ledger_op("tool_begin", self.ledger.begin_tool_call(req))
            if start.action != "wait":
                return start
            deadline = start.state.deadline
            left = deadline_clock(deadline).seconds
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
            self.metrics.timed_ledger_op(
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
        """The call raised instead of answering (toolcall/outcome.py): released when it
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
