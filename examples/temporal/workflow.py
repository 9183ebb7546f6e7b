"""The agent loop as a Temporal workflow: it only orchestrates — every model call and tool call is
an activity (`activities.py`), so the loop's state survives a killed worker and is replayed
deterministically on another one.

The run id runcap enforces caps for is the workflow id: stable across activity retries, worker
restarts and continue-as-new, so a resumed workflow keeps spending from the same budget. The caps
go with every call (`RunHeaders`); runcap fixes them when it first sees the run, so a resumed
workflow cannot raise them.

How it ends:
* the model answers without tool calls → `AgentResult`;
* runcap refuses a call (cap, deadline, cancel) → the activity fails non-retryably and so does the
  workflow, with the rejection's type (`BudgetExceeded`, ...) in the failure;
* the workflow is cancelled → `cancel_run` tells runcap, which cuts the calls still in flight;
* a side-effecting tool call whose outcome runcap does not know (409 `OutcomeUnknown`, or a
  `ToolTimeout`): the workflow waits — durably, for days if need be — for the `reconciled`
  signal, sent once an operator has run `runcap reconcile KEY --done|--not-done`; then it repeats
  the call, which replays the reconciled outcome or executes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from examples.temporal.activities import (
        AgentActivities,
        ModelRequest,
        ToolRequest,
        ToolResult,
    )
    from proxy.client import RunHeaders

TASK_QUEUE = "runcap-agent"

REFUND_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "refund",
            "description": "Refund an order (a side effect: runcap executes it at most once per run)",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
                "required": ["order_id", "amount"],
            },
        },
    }
]

_UNKNOWN_OUTCOME = ("OutcomeUnknown", "ToolTimeout")


@dataclass
class AgentInput:
    prompt: str
    task: str = "agent"
    model: str = "gpt-4o-mini"
    system: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=lambda: list(REFUND_TOOLS))
    # The run's caps, sent as X-Run-* headers on every call.
    max_usd: str | None = "0.50"
    max_steps: int | None = 20
    max_tool_calls: int | None = 20
    timeout_s: float | None = 600.0
    max_output_tokens: int | None = 1024
    # Extra headers for the model calls (e.g. X-Mock-Script for runcap's scripted upstream).
    model_headers: dict[str, str] = field(default_factory=dict)
    # How long a tool call may go without a heartbeat before Temporal retries it elsewhere:
    # the time it takes to notice a dead worker.
    tool_heartbeat_timeout_s: float = 10.0


@dataclass
class AgentResult:
    answer: str
    steps: int
    tool_calls: int
    replayed_tool_calls: int
    final_step: bool


@dataclass
class PendingReconciliation:
    tool: str
    call_id: str
    idempotency_key: str | None
    error: str


@workflow.defn
class AgentWorkflow:
    def __init__(self) -> None:
        self._pending: PendingReconciliation | None = None
        self._reconciled = False

    @workflow.signal
    def reconciled(self) -> None:
        """The operator resolved the pending call with `runcap reconcile`: repeat it."""
        self._reconciled = True

    @workflow.query
    def pending_reconciliation(self) -> PendingReconciliation | None:
        return self._pending

    @workflow.run
    async def run(self, inp: AgentInput) -> AgentResult:
        run = RunHeaders(
            workflow.info().workflow_id,
            task=inp.task,
            max_usd=inp.max_usd,
            max_steps=inp.max_steps,
            max_tool_calls=inp.max_tool_calls,
            timeout_s=inp.timeout_s,
        )
        messages: list[dict[str, Any]] = []
        if inp.system:
            messages.append({"role": "system", "content": inp.system})
        messages.append({"role": "user", "content": inp.prompt})
        steps = tool_calls = replayed = 0
        try:
            while True:
                turn = await workflow.execute_activity_method(
                    AgentActivities.call_model,
                    ModelRequest(
                        run, inp.model, messages, inp.tools, inp.max_output_tokens, inp.model_headers
                    ),
                    start_to_close_timeout=timedelta(seconds=120),
                )
                steps += 1
                messages.append(turn.message)
                calls = turn.message.get("tool_calls") or []
                if not calls:
                    return AgentResult(
                        turn.message.get("content") or "", steps, tool_calls, replayed, turn.final_step
                    )
                for call in calls:
                    req = ToolRequest(
                        run, call["function"]["name"], call["function"]["arguments"], call["id"]
                    )
                    result = await self._tool(req, inp)
                    tool_calls += 1
                    replayed += result.replayed
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.content})
        except BaseException as e:
            if is_cancelled_exception(e):
                # Cancelled: stop the run in runcap too — its calls still in flight are cut there
                # (the tool sees the disconnect) and any late retry gets 410.
                await workflow.execute_activity_method(
                    AgentActivities.cancel_run, run.run_id, start_to_close_timeout=timedelta(seconds=30)
                )
            raise

    async def _tool(self, req: ToolRequest, inp: AgentInput) -> ToolResult:
        while True:
            try:
                return await workflow.execute_activity_method(
                    AgentActivities.call_tool,
                    req,
                    start_to_close_timeout=timedelta(seconds=max(120.0, inp.timeout_s or 0)),
                    heartbeat_timeout=timedelta(seconds=inp.tool_heartbeat_timeout_s),
                )
            except ActivityError as e:
                cause = e.cause
                if not (isinstance(cause, ApplicationError) and cause.type in _UNKNOWN_OUTCOME):
                    raise
                details = cause.details[0] if cause.details else {}
                self._pending = PendingReconciliation(
                    req.name, req.call_id, details.get("idempotency_key"), cause.message
                )
                workflow.logger.warning(
                    "tool call %s has an unknown outcome (key %s): waiting for `runcap reconcile` "
                    "and the `reconciled` signal", req.name, self._pending.idempotency_key,
                )  # fmt: skip
                await workflow.wait_condition(lambda: self._reconciled)
                self._pending, self._reconciled = None, False
