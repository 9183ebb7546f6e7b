"""One structured (JSON) log line per request, on the `runcap.access` logger: per model call
(`AccessLogStep`, a flow step) and per tool call — through `/tools` or an MCP server's
`tools/call` (`log_tool_call`, from the one place every tool call is recorded).

Never the request's credentials or bodies: ids, sizes, the decision runcap took and the money. A
request refused for a bad run header still names its run when its X-Run-Id was valid.
"""

from __future__ import annotations

import logging

import orjson

from proxy.caps import claimed_run_id
from proxy.money import format_usd
from proxy.server.flow import Flow, FlowStep

log = logging.getLogger("runcap.access")


class AccessLogStep(FlowStep):
    async def done(self, flow: Flow) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        record: dict[str, object] = {
            "run_id": flow.run.run_id if flow.run else claimed_run_id(flow.request.headers),
            "step": flow.step or None,
            "method": flow.request.method,
            "path": flow.request.path,
            "upstream": flow.upstream.name,
            "endpoint": flow.endpoint,
            "model": flow.info.model if flow.info else None,
            "status": flow.status,
            "outcome": flow.outcome,
            "duration_ms": round(flow.duration_ms, 3),
        }
        if flow.ttft_ms is not None:
            record["ttft_ms"] = round(flow.ttft_ms, 3)
        if flow.usage is not None:
            record["input_tokens"] = flow.usage.input_tokens
            record["output_tokens"] = flow.usage.output_tokens
            record["cost_usd"] = format_usd(flow.cost_nanos)
            if not flow.price_known:
                record["price_known"] = False
        if flow.clamped_to is not None:
            record["clamped_to"] = flow.clamped_to
        if flow.final_step:
            record["final_step"] = True
        if flow.error:
            record["error"] = flow.error[:300]
        log.info("%s", orjson.dumps(record).decode())


def log_tool_call(
    *, run_id: str | None, step: int, method: str, path: str, tool: str, status: int, outcome: str,
    duration_ms: float, idempotency_key: str | None, error: str, mcp_server: str = "",
) -> None:  # fmt: skip
    """The access log line of one tool call (`/tools/{name}` or MCP `tools/call`)."""
    if not log.isEnabledFor(logging.INFO):
        return
    record: dict[str, object] = {
        "run_id": run_id,
        "step": step or None,
        "method": method,
        "path": path,
        "tool": tool,
        "status": status,
        "outcome": outcome,
        "duration_ms": round(duration_ms, 3),
    }
    if mcp_server:
        record["mcp_server"] = mcp_server
    if idempotency_key:
        record["idempotency_key"] = idempotency_key
    if error:
        record["error"] = error[:300]
    log.info("%s", orjson.dumps(record).decode())
