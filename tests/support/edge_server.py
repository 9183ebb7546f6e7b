"""A server at the edges runcap must survive: it executes a call and then answers badly, answers
with a redirect to another origin, or hangs — for tool routes, MCP endpoints and model upstreams
alike. The first path segment chooses the behaviour (`/{mode}/...`), so one server stands behind
every configured tool, MCP server and upstream of a test:

  504, 502       execute, then a 504 without a body / a proxy's 502 HTML page
  reset          read the request, execute, then reset the connection (no answer)
  garbage        execute, then 200 `application/json` that is not JSON
  rpc-error      execute, then a JSON-RPC error (-32602, the code "nothing was executed" would use)
  redirect       307 to the same path on `other` (another origin, which records what reaches it)
  hang           answer after `hang_s` (beyond the run's deadline), unless the caller goes; a JSON-RPC
                 notification (runcap's cancel notice) is answered with a redirect as above
  ok             an MCP server that answers (tools/list: `refund`, side-effecting; tools/call: a result)

What executed is counted per (mode, order id) in `executions`; every request is in `hits`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tests.support.local_app import serve_local


@dataclass
class EdgeHit:
    mode: str
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    disconnected: bool = False  # the caller went away while the server was still working


@dataclass
class EdgeServer:
    hang_s: float = 10.0
    executions: Counter[tuple[str, str]] = field(default_factory=Counter)
    hits: list[EdgeHit] = field(default_factory=list)
    url: str | None = None
    other: EdgeServer | None = None  # where `redirect` points
    _runner: web.AppRunner | None = None

    async def start(self) -> EdgeServer:
        app = web.Application()
        app.router.add_route("*", "/{mode}/{tail:.*}", self._handle)
        app.router.add_route("*", "/{mode}", self._handle)
        self._runner, self.url = await serve_local(app, handler_cancellation=True)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def on(self, mode: str) -> list[EdgeHit]:
        return [h for h in self.hits if h.mode == mode]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        body = await request.read()
        hit = EdgeHit(
            mode, request.method, request.path, {k.lower(): v for k, v in request.headers.items()}, body
        )
        self.hits.append(hit)
        try:
            parsed: Any = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            parsed = None
        rpc = parsed if isinstance(parsed, dict) and parsed.get("jsonrpc") == "2.0" else None
        if mode == "redirect":
            assert self.other is not None and self.other.url is not None
            return web.Response(status=307, headers={"Location": f"{self.other.url}{request.path_qs}"})
        if mode == "hang":
            if rpc is not None and "id" not in rpc:  # a notification (a cancel notice): redirected
                assert self.other is not None and self.other.url is not None
                return web.Response(status=307, headers={"Location": f"{self.other.url}{request.path_qs}"})
            try:
                await asyncio.sleep(self.hang_s)
            except asyncio.CancelledError:
                hit.disconnected = True
                raise
            return web.json_response({"late": True, "id": (rpc or {}).get("id")})
        if rpc is not None and "id" not in rpc:
            return web.Response(status=202)  # a notification
        if rpc is not None and rpc.get("method") != "tools/call":
            return web.json_response(_rpc_answer(rpc))
        order = _order_id(parsed)
        self.executions[(mode, order)] += 1  # executed: what follows is only how it answers
        if mode == "504":
            return web.Response(status=504)
        if mode == "502":
            page = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"
            return web.Response(status=502, body=page, content_type="text/html")
        if mode == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=200)  # never written: the connection is gone
        if mode == "garbage":
            return web.Response(
                status=200, body=b'{"jsonrpc": "2.0", "id": ', content_type="application/json"
            )
        if mode == "rpc-error":
            rid = rpc.get("id") if rpc is not None else 1
            error = {"code": -32602, "message": "invalid params (said after it executed)"}
            return web.json_response({"jsonrpc": "2.0", "id": rid, "error": error})
        if rpc is not None:
            return web.json_response(
                {"jsonrpc": "2.0", "id": rpc["id"], "result": {"content": [{"type": "text", "text": "done"}]}}
            )
        return web.json_response({"done": order})


def _order_id(parsed: Any) -> str:
    if not isinstance(parsed, dict):
        return ""
    args = parsed.get("params", {}).get("arguments") if "jsonrpc" in parsed else parsed
    return str(args.get("order_id", "")) if isinstance(args, dict) else ""


def _rpc_answer(rpc: dict[str, Any]) -> dict[str, Any]:
    method = rpc.get("method")
    if method == "tools/list":
        tool = {"name": "refund", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": False}}
        return {"jsonrpc": "2.0", "id": rpc["id"], "result": {"tools": [tool]}}
    if method == "initialize":
        result = {
            "protocolVersion": "2025-06-18",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "edge"},
        }
        return {"jsonrpc": "2.0", "id": rpc["id"], "result": result}
    return {"jsonrpc": "2.0", "id": rpc["id"], "result": {}}
