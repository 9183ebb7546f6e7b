"""An MCP server for tests, the example and the benchmark: the official SDK's `MCPServer` over
Streamable HTTP, in its own process on a 127.0.0.1 port, counting what it executes.

    python -m tests.support.mcp_server --port P [--stateless] [--json] [--event-store]

`--stateless`: no `Mcp-Session-Id` (every request stands alone); `--json`: JSON answers instead of
SSE streams; `--event-store`: resumable SSE streams (event ids, `Last-Event-ID`), which
`poll_refund` uses to close its stream before answering (SSE polling, revision 2025-11-25).

Tools (annotations as the spec reads them: no `readOnlyHint` = may have side effects):
  refund(order_id, amount, reason)   unannotated: side-effecting
  lookup(order_id)                   readOnlyHint: true
  slow(seconds, tag)                 unannotated; sleeps; a cancel of it is recorded
  slow_read(seconds, tag)            readOnlyHint: true; sleeps
  drop_database()                    unannotated (the one `deny` hides)
  progress(steps)                    read-only; progress notifications and a log message, then the answer
  ask_roots()                        read-only; asks the client for its roots (server → client request)
  poll_refund(order_id)              side-effecting; closes its SSE stream before it answers
  announce()                         read-only; a tools/list_changed notification on the session's GET stream
plus a resource (`info://server`), a resource template (`orders://{order_id}`) and a prompt
(`triage`).

`GET /stats` answers what happened, for tests in another process: every execution (tool,
arguments, JSON-RPC request id), every JSON-RPC message received (method, id, params of
`notifications/cancelled`, the headers tests look at), the GETs and DELETEs, and the calls
whose handler was cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

# At module level: the SDK reads the tools' type annotations (Context) from the module's globals.
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

HEADERS_SEEN = (
    "x-run-id", "idempotency-key", "x-run-deadline", "x-run-remaining-ms", "mcp-session-id",
    "mcp-protocol-version", "authorization", "x-server-key", "last-event-id", "x-run-max-tool-calls",
    "mcp-method", "mcp-name", "host", "origin", "x-forwarded-host",
)  # fmt: skip


class Stats:
    def __init__(self) -> None:
        self.executions: list[dict[str, Any]] = []
        self.messages: list[dict[str, Any]] = []
        self.http: list[dict[str, Any]] = []  # GET / DELETE
        self.cancelled: list[dict[str, Any]] = []

    def json(self) -> dict[str, Any]:
        return {
            "executions": self.executions,
            "messages": self.messages,
            "http": self.http,
            "cancelled": self.cancelled,
        }


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    out = {}
    for k, v in scope["headers"]:
        name = k.decode("latin-1").lower()
        if name in HEADERS_SEEN:
            out[name] = v.decode("latin-1")
    return out


class MessageLog:
    """ASGI middleware: records each JSON-RPC message POSTed to /mcp (and GETs / DELETEs) before
    the SDK sees it, then hands the request on unchanged."""

    def __init__(self, app: Any, stats: Stats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/mcp"):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if scope["method"] != "POST":
            self.stats.http.append({"method": scope["method"], "headers": headers})
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        for msg in parsed if isinstance(parsed, list) else [parsed]:
            if isinstance(msg, dict):
                params = msg.get("params") if isinstance(msg.get("params"), dict) else {}
                self.stats.messages.append(
                    {
                        "method": msg.get("method"),
                        "id": msg.get("id"),
                        "name": params.get("name"),
                        "params": params if msg.get("method") == "notifications/cancelled" else None,
                        "headers": headers,
                    }
                )
        given = False

        async def replay() -> dict[str, Any]:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect, when the caller goes away

        await self.app(scope, replay, send)


def _event_store() -> Any:
    """The smallest resumable event store: every event in memory, ids in one sequence."""
    from mcp.server.streamable_http import EventMessage, EventStore

    class MemoryEventStore(EventStore):
        def __init__(self) -> None:
            self.events: list[tuple[str, str, Any]] = []  # (event id, stream id, message)

        async def store_event(self, stream_id: Any, message: Any) -> str:
            event_id = str(len(self.events) + 1)
            self.events.append((event_id, stream_id, message))
            return event_id

        async def replay_events_after(self, last_event_id: Any, send_callback: Any) -> Any:
            known = [e for e in self.events if e[0] == str(last_event_id)]
            if not known:
                return None
            stream = known[0][1]
            for event_id, stream_id, message in self.events[int(known[0][0]) :]:
                if stream_id == stream and message is not None:
                    await send_callback(EventMessage(message, event_id))
            return stream

    return MemoryEventStore()


def build(stateless: bool, json_response: bool, event_store: bool) -> Any:
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    stats = Stats()
    server = MCPServer("runcap-test-crm", instructions="A CRM for runcap's tests.", log_level="WARNING")
    read_only = ToolAnnotations(read_only_hint=True)

    def executed(tool: str, ctx: Context, **args: Any) -> int:
        stats.executions.append({"tool": tool, "args": args, "request_id": ctx.request_id})
        return sum(1 for e in stats.executions if e["tool"] == tool)

    @server.tool()
    async def refund(order_id: str, amount: float, ctx: Context, reason: str = "") -> dict[str, Any]:
        """Refund an order (a side effect: it moves money)."""
        n = executed("refund", ctx, order_id=order_id, amount=amount, reason=reason)
        return {"refund_id": f"rf-{order_id}-{n}", "order_id": order_id, "amount": amount, "execution": n}

    @server.tool(annotations=read_only)
    async def lookup(order_id: str, ctx: Context) -> dict[str, Any]:
        """Look an order up (read-only)."""
        n = executed("lookup", ctx, order_id=order_id)
        return {"order_id": order_id, "status": "shipped", "execution": n}

    async def _sleep(tool: str, seconds: float, tag: str, ctx: Context) -> str:
        executed(tool, ctx, seconds=seconds, tag=tag)
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            stats.cancelled.append({"tool": tool, "tag": tag, "request_id": ctx.request_id})
            raise
        return f"slept {seconds} s"

    @server.tool()
    async def slow(seconds: float, ctx: Context, tag: str = "") -> str:
        """Work for `seconds` (may have side effects)."""
        return await _sleep("slow", seconds, tag, ctx)

    @server.tool(annotations=read_only)
    async def slow_read(seconds: float, ctx: Context, tag: str = "") -> str:
        """Read for `seconds`."""
        return await _sleep("slow_read", seconds, tag, ctx)

    @server.tool()
    async def drop_database(ctx: Context) -> str:
        """Drop everything."""
        executed("drop_database", ctx)
        return "dropped"

    @server.tool(annotations=read_only)
    async def progress(steps: int, ctx: Context) -> str:
        """Report progress `steps` times, log once, then answer."""
        executed("progress", ctx, steps=steps)
        await ctx.info("starting")
        for i in range(steps):
            await ctx.report_progress(i + 1, steps, f"step {i + 1}")
        return f"done in {steps} steps"

    @server.tool(annotations=read_only)
    async def ask_roots(ctx: Context) -> list[str]:
        """Ask the client for its roots (on the session's GET stream) and list them."""
        executed("ask_roots", ctx)
        roots = await ctx.session.list_roots()
        return [str(r.uri) for r in roots.roots]

    @server.tool()
    async def poll_refund(order_id: str, ctx: Context) -> dict[str, Any]:
        """A refund that closes its SSE stream first and answers on the resumed one."""
        n = executed("poll_refund", ctx, order_id=order_id)
        await ctx.close_sse_stream()
        await asyncio.sleep(0.3)
        return {"refund_id": f"prf-{order_id}-{n}", "execution": n}

    @server.tool(annotations=read_only)
    async def announce(ctx: Context) -> str:
        """Tell the client, on its GET stream, that the tool list changed."""
        executed("announce", ctx)
        await ctx.session.send_tool_list_changed()
        return "announced"

    @server.resource("info://server")
    def info() -> str:
        return "runcap test CRM"

    @server.resource("orders://{order_id}")
    def order(order_id: str) -> str:
        return json.dumps({"order_id": order_id, "status": "shipped"})

    @server.prompt()
    def triage(order_id: str) -> str:
        return f"Triage order {order_id}: find it, then decide on a refund."

    @server.custom_route("/stats", methods=["GET"])
    async def get_stats(request: Request) -> JSONResponse:
        return JSONResponse(stats.json())

    kwargs: dict[str, Any] = {"json_response": json_response, "stateless_http": stateless}
    if event_store:
        kwargs["event_store"] = _event_store()
        kwargs["retry_interval"] = 100
    app = server.streamable_http_app(**kwargs)
    return MessageLog(app, stats)


class MCPServerProcess:
    """The server above in a subprocess on a free port (tests, the example, the benchmark)."""

    def __init__(self, port: int, *flags: str, module: str = "tests.support.mcp_server") -> None:
        self.port = port
        self.flags = flags
        self.module = module
        self.url = f"http://127.0.0.1:{port}/mcp"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MCPServerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--port", str(self.port), *self.flags],
            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> MCPServerProcess:
        assert self.proc is not None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"the MCP server exited with {self.proc.returncode}:\n{err[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"the MCP server did not listen on port {self.port} in {timeout_s:g} s")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stateless", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--event-store", action="store_true")
    args = parser.parse_args()
    import uvicorn

    app = build(args.stateless, args.json, args.event_store)
    # Open streams (a session's GET) would hold a graceful shutdown for long: a second is plenty.
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="on", timeout_graceful_shutdown=1
    )


if __name__ == "__main__":
    main()
