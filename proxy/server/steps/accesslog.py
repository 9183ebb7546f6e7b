"""One structured (JSON) log line per request, on the `runcap.access` logger: per model call
(`AccessLogStep`, a flow step) and per tool call — through `/tools` or an MCP server's
`tools/call` (`log_tool_call`, from the one place every tool call is recorded).

Never the request's credentials or bodies: ids, sizes, the decision runcap took and the money. A
request refused for a bad run header still names its run when its X-Run-Id was valid.

`runcap serve` (app.py) writes the lines itself through `AccessLogWriter`, when logging would
only have put each message on a line of stderr (the `basicConfig` it installs): the same text, in
the same order, but no `LogRecord` and no write per request — the lines of one event-loop turn
are written together at its end (and at shutdown). A `LogRecord` and a stream write per request
were ~7 % of a request's CPU. Anywhere else (tests, an embedding application with its own
handlers) the lines go through the `runcap.access` logger as before.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
from typing import TextIO

import orjson

from proxy.caps import claimed_run_id
from proxy.money import format_usd
from proxy.server.flow import Flow, FlowStep

log = logging.getLogger("runcap.access")


class AccessLogWriter:
    """The access log lines of one event-loop turn, written to `stream` in one write at its end."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lines: list[str] = []

    def write(self, line: str) -> None:
        if not self._lines:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop running (shutting down): at once
                self._lines.append(line)
                self.flush()
                return
        self._lines.append(line)

    def flush(self) -> None:
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: as logging would, drop the lines
            pass


_writer: AccessLogWriter | None = None


def write_lines_directly() -> AccessLogWriter | None:
    """Write the access log without `logging`, when all logging would do with a line is write its
    message to stderr: `runcap.access` has no handler, filter or level of its own, propagates to
    a root logger whose only handler is a plain `%(message)s` stream handler on stderr. Returns
    the writer (flush it at shutdown; it is flushed at exit too), or None when logging stays."""
    global _writer
    root = logging.getLogger()
    handler = root.handlers[0] if len(root.handlers) == 1 else None
    if (
        log.handlers or log.filters or not log.propagate or log.level != logging.NOTSET
        or root.filters or type(handler) is not logging.StreamHandler
        or handler.stream is not sys.stderr or handler.filters or handler.level != logging.NOTSET
        or handler.formatter is None or handler.formatter._fmt != "%(message)s"
    ):  # fmt: skip
        return None
    _writer = AccessLogWriter(handler.stream)
    atexit.register(_writer.flush)
    return _writer


def _emit(record: dict[str, object]) -> None:
    line = orjson.dumps(record).decode()
    if _writer is not None:
        _writer.write(line)
    else:
        log.info("%s", line)


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
        _emit(record)


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
    _emit(record)
