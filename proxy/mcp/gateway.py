"""`/mcp/{name}`: an MCP server (Streamable HTTP) through runcap — DESIGN.md "MCP servers".

The route: which server, which run, which headers go on, and where each message goes. A POST of
JSON-RPC messages (one, or a batch answered as one JSON array) is split into its messages: every
`tools/call` request is a tool call of the run (tools_call.py); everything else is relayed
unchanged (relay.py), a `tools/list` answer read on the way (`catalog.py`: runcap learns each
tool's annotations and removes the tools the operator denied). GET (the server's stream) and
DELETE (end of a session) are relayed as they are.

`Mcp-Session-Id`, `MCP-Protocol-Version`, `Last-Event-ID` and every other header pass through —
except the agent's credentials (unless the server allow-lists one), runcap's own `X-Run-*`
(consumed; `X-Run-Id` is sent on), and the hop-by-hop ones. Revisions 2025-06-18 and later, with
and without sessions (2026-07-28 has none).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.caps import RunRequest, parse_run_headers
from proxy.config import MCPServerConfig
from proxy.errors import NotFound, Rejection
from proxy.mcp.catalog import ToolCatalog
from proxy.mcp.relay import Exchange, StreamableHTTPRelay, Watch
from proxy.mcp.reply import BatchReply, LiveReply, Reply, http_refusal
from proxy.mcp.tools_call import MCPToolCalls
from proxy.mcp.wire import (
    JSON,
    PARSE_ERROR,
    InvalidMessage,
    check_agent_message,
    dumps,
    error_message,
    is_request,
    is_response,
    parse_messages,
)
from proxy.server.headers import AGENT_CREDENTIALS, request_headers
from proxy.server.request_body import read_body
from proxy.toolcall.route import ToolRoute
from proxy.upstream_url import remaining_segments


class MCPGateway(ToolRoute):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.catalog = ToolCatalog()
        self.relay = StreamableHTTPRelay(self)
        self.tool_calls = MCPToolCalls(self, self.relay, self.catalog)

    def add_to(self, app: web.Application) -> None:
        app.router.add_route("*", "/mcp/{name}", self.handle)
        app.on_cleanup.append(self._stop)

    async def _stop(self, app: web.Application) -> None:
        # Before the tool client closes (toolcall/route.py's ToolClient): the notices go through it.
        await self.relay.stop()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        server = self.config.mcp.get(name)
        try:
            if server is None:
                known = ", ".join(sorted(self.config.mcp)) or "none"
                raise NotFound(
                    f"no MCP server named {name!r}; configured: {known} (add [mcp.{name}] to runcap.toml)",
                    param="server",
                )
            segments, query = remaining_segments(request.raw_path, 2)
            target = server.base.target(segments, query)
            run = parse_run_headers(
                request.headers,
                self.config.caps,
                require_run_id=self.config.require_run_id,
                tenant=self.clients.tenant(request),
            )
        except Rejection as rej:
            self.metrics.rejections.labels(rej.code or rej.type).inc()
            return http_refusal(rej)
        headers = self._server_headers(request, server, run)
        if request.method == "POST":
            return await self._post(request, Exchange(server, target, run, headers))
        if request.method in ("GET", "DELETE"):
            return await self.relay.stream(request, server, target, run, headers)
        return web.Response(status=405, headers={"Allow": "GET, POST, DELETE"})

    def _server_headers(
        self, request: web.Request, server: MCPServerConfig, run: RunRequest
    ) -> CIMultiDict[str]:
        """The agent's headers minus its credentials (unless the server allow-lists one) and
        runcap's own, plus the server's configured headers and the run's id."""
        drop = (*(h for h in AGENT_CREDENTIALS if h not in server.forward_headers), "idempotency-key")
        headers = request_headers(request.headers, drop)
        for name, value in server.headers.items():
            headers[name] = value
        # `Host` names the server (the hop's own authority: routing, TLS); what the agent asked
        # for goes along as X-Forwarded-Host, and its `Origin` is passed on unchanged, so a server
        # that checks them against DNS rebinding sees the agent's values, not runcap's
        # (runcap refused a Host or Origin it does not allow before this: server/local_trust.py).
        agent_host = request.headers.get("Host")
        if agent_host:
            headers["X-Forwarded-Host"] = agent_host
            headers["X-Forwarded-Proto"] = request.scheme
        if not run.generated:
            headers["X-Run-Id"] = run.run_id
        return headers

    async def _post(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        try:
            body = await read_body(request, self.config.max_body_bytes)
        except Rejection as rej:
            return http_refusal(rej)
        try:
            messages, batch = parse_messages(body)
            for m in messages:
                check_agent_message(m)
        except InvalidMessage as e:
            message = error_message(None, PARSE_ERROR, f"runcap could not route this body: {e}")
            return web.Response(status=400, body=dumps(message), headers={"Content-Type": JSON})
        if not batch:
            reply = LiveReply(request)
            await self._message(ex, messages[0], body, reply)
            return await reply.response()
        collected = BatchReply()
        for message in messages:
            await self._message(ex, message, dumps(message), collected)
        out = {**collected.headers, "X-Run-Id": ex.run.run_id}
        if not collected.messages:
            return web.Response(status=202, headers=out)
        return web.Response(body=dumps(collected.messages), headers={**out, "Content-Type": JSON})

    async def _message(self, ex: Exchange, message: dict[str, Any], body: bytes, reply: Reply) -> None:
        if message.get("method") == "tools/call" and is_request(message):
            await self.tool_calls.call(ex, message, body, reply)
        elif message.get("method") == "tools/list":
            await self.relay.relay(ex, message, body, reply, self._tools_list_watch(ex.server))
        else:
            await self.relay.relay(ex, message, body, reply)

    def _tools_list_watch(self, server: MCPServerConfig) -> Watch:
        """Reads each `tools/list` answer: the catalog learns it; denied tools are removed."""

        async def watch(message: dict[str, Any]) -> dict[str, Any] | None:
            result = message.get("result")
            if not is_response(message) or not isinstance(result, dict):
                return None
            self.catalog.learn(server.name, result)
            kept = self.catalog.without_denied(server, result)
            return None if kept is None else {**message, "result": kept}

        return watch
