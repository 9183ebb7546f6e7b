"""A finished tool call, counted and recorded: its `tool` span with the run's new state and the
bodies kept (one step, one record), its metric, and its access-log line — the same for `/tools`
and MCP `tools/call`.
"""

from __future__ import annotations

import logging
import time

from proxy.server.metrics import Metrics
from proxy.server.steps.accesslog import log_tool_call
from proxy.server.steps.trace import run_snapshot, run_tree
from proxy.spans.model import Span
from proxy.spans.recorder import SpanRecorder
from proxy.toolcall.call import ToolCall

log = logging.getLogger("runcap.tools")


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
            events=call.events,
            **run_tree(call.state),
        )
        # the run's state: its executed tool calls changed
        recorder.step([span], run_snapshot(call.state) if call.state is not None else None, call.bodies)
    except Exception:
        log.exception("could not record the span of a call to tool %s", call.tool)
