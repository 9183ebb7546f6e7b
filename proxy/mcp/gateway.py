"""`/mcp/{name}`: an MCP server (Streamable HTTP) through runcap — DESIGN.md "MCP servers".

Transport, both ways: a POST of JSON-RPC messages is forwarded to the server's endpoint and its
answer (JSON, or an SSE stream relayed event by event) comes back; GET (the server's stream) and
DELETE (end of a session) are relayed as they are. `Mcp-Session-Id`, `MCP-Protocol-Version`,
`Last-Event-ID` and every other header pass through — except the agent's credentials (unless the
server allow-lists one), runcap's own `X-Run-*` (consumed; `X-Run-Id` is sent on), and the
hop-by-hop ones. Revisions 2025-06-18 and later, with and without sessions (2026-07-28 has none).

Every message but `tools/call` is relayed unchanged, bound to the run's deadline and cancel (a
cut request gets `notifications/cancelled` sent to the server, and a JSON-RPC error). `tools/list`
answers are read on the way (`catalog.py`): runcap learns each tool's annotations and removes
the tools the operator denied.

A `tools/call` is a tool call of the run, through the same ledger machinery as `/tools`
(proxy/toolcall/):
  1. denied tool → -32044; side effects from the operator's override or the annotations (a tool
     not seen listed yet: runcap lists the server's tools first, in the agent's session);
  2. the ledger, atomically: run live? `X-Run-Max-Tool-Calls`? For a side-effecting call its
     idempotency record — key = sha256({"run", "tool": "mcp:{server}/{tool}", "args":
     params.arguments restricted to `key_fields`, "op": `params._meta["runcap/operation_id"]` or
     `X-Run-Operation-Id`})[:32] — replay a completed one (its `result`, under this request's id,
     `_meta["runcap/replay"] = true`), wait for one in flight, refuse an unknown one (-32043), or
     record the intent; then the tool's `max_calls_per_run`;
  3. forward, with the run's remaining time (or the tool's `timeout_s`) as the timeout, and
     `X-Run-Id`, `Idempotency-Key`, `X-Run-Deadline`, `X-Run-Remaining-Ms`; a cancel or the
     deadline cuts it: the server's stream is closed and it gets `notifications/cancelled` for
     the request id; the tool's own timeout is a result with `isError: true` the model can read;
  4. the outcome, by the rule `/tools` follows too (toolcall/outcome.py): the server's
     JSON-RPC response (a result or an error, whatever its code) is recorded before the agent
     sees it; a stream that ends without it is resumed (`Last-Event-ID`) when the server made it
     resumable; an HTTP answer without it (a proxy's 502/504, a redirect), a reset or an
     unreadable body is `unknown`; only a call that never left (no connection) is released;
  5. one `tool` span (tool_name = the MCP tool, `mcp.server`, `mcp.method.name`).

Per-tool `max_calls_per_run` is counted in the ledger as a run of its own
(`{run}/mcp:{server}/{tool}`, with that cap as its tool-call cap): atomic across replicas, and
nothing new in the ledger. A replay does not use it; a side-effecting call refused by it is not
counted against the run either.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.caps import RunCaps, RunRequest, parse_run_headers
from proxy.config import Config, MCPServerConfig
from proxy.errors import (
    BudgetExceeded,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Rejection,
    RunCancelled,
    UpstreamUnavailable,
)
from proxy.hashing import canonical_json, idempotency_key, parse_json, result_hash
from proxy.ledger.base import IdempotencyRecord, Ledger, RunState, ToolCallRequest
from proxy.mcp.catalog import ToolCatalog
from proxy.mcp.reply import BatchReply, LiveReply, Reply, http_refusal
from proxy.mcp.wire import (
    EVENT_STREAM,
    JSON,
    PARSE_ERROR,
    EventTooLarge,
    InvalidMessage,
    SSEParser,
    ToolDenied,
    check_agent_message,
    dumps,
    error_message,
    is_request,
    is_response,
    parse_messages,
    refusal,
    result_message,
    sse_event,
)
from proxy.server.auth import ClientAuth
from proxy.server.flow import Flights
from proxy.server.forward import release_or_drop
from proxy.server.headers import AGENT_CREDENTIALS, request_headers, response_headers
from proxy.server.metrics import Metrics
from proxy.server.outbound import call_timeout, deadline_headers, run_deadline
from proxy.server.request_body import read_body
from proxy.server.upstream_url import UpstreamTarget, remaining_segments
from proxy.spans.recorder import SpanRecorder
from proxy.toolcall.call import ToolCall
from proxy.toolcall.outcome import (
    ToolResponseTooLarge,
    never_left,
    read_bounded,
    session_refused,
    tool_run_headers,
)
from proxy.toolcall.route import ToolClient, ToolRoute
from proxy.toolcall.span import record_tool_call

log = logging.getLogger("runcap.mcp")

# The content type an MCP error outcome is recorded under (a result is application/json).
MCP_ERROR_TYPE = "application/vnd.runcap.mcp-error+json"
# A resumable stream that ends without the answer is resumed this many times at most.
MAX_RESUMES = 3
LISTING_TIMEOUT_S = 5.0
LISTING_PAGES = 10
CANCEL_NOTICE_TIMEOUT_S = 5.0
DRAIN_S = 0.05  # how long the end of a stream is waited for after its answer
_ENVELOPE = "io.modelcontextprotocol/"  # 2026-07-28: the per-request `_meta` envelope's keys

Watch = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(slots=True, eq=False)
class Relayed:
    """A relayed exchange in `Flights` (a cancel sets `cut_reason`)."""

    cut_reason: str | None = None


@dataclass(slots=True, frozen=True)
class Exchange:
    """One POST of the agent to an MCP server: where its messages go, for which run, with which
    headers (a batch's messages share it)."""

    server: MCPServerConfig
    target: UpstreamTarget
    run: RunRequest
    headers: CIMultiDict[str]  # to the server


@dataclass(slots=True)
class StreamEnd:
    answered: bool  # the response to the request was seen
    last_event_id: str | None = None
    retry_ms: int | None = None


# -- the gateway --------------------------------------------------------------------------------


class MCPGateway(ToolRoute):
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
        super().__init__(config, ledger, flights, metrics, client, recorder, clients)
        self.catalog = ToolCatalog()
        self._notices: set[asyncio.Task[None]] = set()  # notifications/cancelled being sent

    def add_to(self, app: web.Application) -> None:
        app.router.add_route("*", "/mcp/{name}", self.handle)
        app.on_cleanup.append(self._stop)

    async def _stop(self, app: web.Application) -> None:
        # Before the tool client closes (toolcalls.ToolClient): the notices go through it.
        if self._notices:
            await asyncio.wait(self._notices, timeout=CANCEL_NOTICE_TIMEOUT_S)

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
            return await self._stream(request, server, target, run, headers)
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

    # -- POST: JSON-RPC messages --------------------------------------------------------------

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

    async def _message(
        self,
        ex: Exchange,
        message: dict[str, Any],
        body: bytes,
        reply: Reply,
    ) -> None:
        if message.get("method") == "tools/call" and is_request(message):
            await self._tools_call(ex, message, body, reply)
        else:
            await self._relay(ex, message, body, reply)

    async def _relay(
        self,
        ex: Exchange,
        message: dict[str, Any],
        body: bytes,
        reply: Reply,
    ) -> None:
        """Anything but `tools/call`, unchanged — within the run's deadline and cancel."""
        server, target, run, headers = ex.server, ex.target, ex.run, ex.headers
        method = message.get("method")
        rid = message.get("id") if is_request(message) else None
        answer_headers = {"X-Run-Id": run.run_id} if not run.generated else {}
        watch = self._tools_list_watch(server) if method == "tools/list" else None
        task = asyncio.current_task()
        assert task is not None
        relayed = Relayed()
        upstream: aiohttp.ClientResponse | None = None
        try:
            started, state = time.time(), None
            if rid is not None and not run.generated:
                # A request of a run: refused once the run is cancelled or past its deadline.
                state = await self.calls.timed(
                    "touch_run", self.ledger.touch_run(run.run_id, run.task, run.caps, started)
                )
            # Also a message the ledger did not see (no X-Run-Id, a notification): its own caps.
            timeout = call_timeout(run_deadline(run, state, started)).seconds
            if not run.generated:
                self.flights.add(run.run_id, task, relayed)
            try:
                async with asyncio.timeout(timeout):
                    upstream = await self.client.request("POST", target.url, data=body, headers=headers)
                    end = await self._answer(upstream, reply, answer_headers, watch, rid)
                    if rid is not None:
                        upstream, end = await self._resume(target, headers, reply, watch, rid, upstream, end)
            except TimeoutError:
                self._cut(server, target, headers, rid, method, upstream, "the run's deadline passed")
                if not run.generated:
                    await self.ledger.set_status(run.run_id, "deadline_exceeded", time.time())
                raise DeadlineExceeded(
                    f"run {run.run_id} reached its deadline during {method} on MCP server {server.name!r}; "
                    "the request was cancelled. End the run."
                ) from None
            except asyncio.CancelledError:
                if relayed.cut_reason != "cancel":
                    raise
                task.uncancel()
                self._cut(server, target, headers, rid, method, upstream, "the run was cancelled")
                raise RunCancelled(
                    f"run {run.run_id} was cancelled during {method} on MCP server {server.name!r}; "
                    "start a new run to continue"
                ) from None
            except (aiohttp.ClientError, OSError, ToolResponseTooLarge, EventTooLarge) as e:
                raise self._unavailable(server, method, e) from None
            finally:
                if upstream is not None:
                    release_or_drop(upstream)
                if not run.generated:
                    self.flights.remove(run.run_id, task)
        except Rejection as rej:
            self.metrics.rejections.labels(rej.code or rej.type).inc()
            if rid is None:
                reply.refuse(rej, answer_headers)
            else:
                await reply.message(refusal(rid, rej), answer_headers)

    def _tools_list_watch(self, server: MCPServerConfig) -> Watch:
        async def watch(message: dict[str, Any]) -> dict[str, Any] | None:
            result = message.get("result")
            if not is_response(message) or not isinstance(result, dict):
                return None
            self.catalog.learn(server.name, result)
            kept = self.catalog.without_denied(server, result)
            return None if kept is None else {**message, "result": kept}

        return watch

    def _unavailable(self, server: MCPServerConfig, method: Any, e: BaseException) -> UpstreamUnavailable:
        if isinstance(e, (ToolResponseTooLarge, EventTooLarge)):
            return UpstreamUnavailable(
                f"MCP server {server.name!r} answered {method} with more than tool_max_response_bytes = "
                f"{self.config.tool_max_response_bytes} bytes in one message",
                code="tool_response_too_large",
                param="tool_max_response_bytes",
            )
        return UpstreamUnavailable(
            f"MCP server {server.name!r} ({server.display_url}) failed during {method}: "
            f"{type(e).__name__}: {e}"
        )

    # -- the server's answer ------------------------------------------------------------------

    async def _answer(
        self,
        upstream: aiohttp.ClientResponse,
        reply: Reply,
        extra_headers: dict[str, str],
        watch: Watch | None,
        rid: Any,
    ) -> StreamEnd:
        """Relay the server's answer to `reply`. `watch` sees every JSON-RPC message (and may
        replace it) before the agent does."""
        headers = response_headers(upstream.headers)
        headers.update(extra_headers)
        ctype = upstream.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if ctype == EVENT_STREAM and upstream.status == 200:
            await reply.start_stream(upstream.status, headers)
            return await self._events(upstream, reply, watch, rid)
        if watch is None and isinstance(reply, LiveReply):
            # Nothing to read in it (not tools/call, not tools/list): byte for byte, unbuffered.
            await reply.start_stream(upstream.status, headers, sse=False)
            async for chunk in upstream.content.iter_any():
                await reply.event(chunk, None)
            return StreamEnd(answered=True)
        data = await read_bounded(upstream, self.config.tool_max_response_bytes)
        messages: list[dict[str, Any]] = []
        if ctype == JSON and data:
            try:
                messages, batch = parse_messages(data)
            except InvalidMessage:
                messages, batch = [], False
            if watch is not None and messages:
                changed = False
                for i, m in enumerate(messages):
                    new = await watch(m)
                    if new is not None:
                        messages[i], changed = new, True
                if changed:
                    data = dumps(messages if batch else messages[0])
        reply.body(upstream.status, headers, data, messages)
        answered = any(is_response(m) and m.get("id") == rid for m in messages)
        return StreamEnd(answered=answered or rid is None or upstream.status >= 400)

    async def _events(
        self, upstream: aiohttp.ClientResponse, reply: Reply, watch: Watch | None, rid: Any
    ) -> StreamEnd:
        parser = SSEParser(self.config.tool_max_response_bytes)
        end = StreamEnd(answered=False)
        async for chunk in upstream.content.iter_any():
            for event in parser.feed(chunk):
                if event.id:
                    end.last_event_id = event.id
                if event.retry is not None:
                    end.retry_ms = event.retry
                message = event.message()
                raw = event.raw
                if message is not None and watch is not None:
                    new = await watch(message)
                    if new is not None:
                        message, raw = new, sse_event(new, event.id)
                await reply.event(raw, message)
                if message is not None and is_response(message) and message.get("id") == rid:
                    end.answered = True
            if end.answered:
                # The server ends the stream right after the answer: read up to its end (briefly),
                # so the connection goes back to the pool instead of being dropped.
                with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                    async with asyncio.timeout(DRAIN_S):
                        while await upstream.content.readany():
                            pass
                break
        return end

    async def _resume(
        self,
        target: UpstreamTarget,
        headers: CIMultiDict[str],
        reply: Reply,
        watch: Watch | None,
        rid: Any,
        upstream: aiohttp.ClientResponse,
        end: StreamEnd,
    ) -> tuple[aiohttp.ClientResponse, StreamEnd]:
        """A resumable stream that ended before the answer (SSE polling, 2025-11-25): GET it again
        from its last event id, as a client would — the agent sees one stream."""
        for _ in range(MAX_RESUMES):
            if end.answered or end.last_event_id is None:
                break
            await asyncio.sleep(min(end.retry_ms if end.retry_ms is not None else 1000, 5000) / 1000)
            release_or_drop(upstream)
            again = CIMultiDict(headers)
            again.popall("Content-Type", None)
            again["Accept"] = EVENT_STREAM
            again["Last-Event-ID"] = end.last_event_id
            upstream = await self.client.request("GET", target.url, headers=again)
            ctype = upstream.headers.get("Content-Type", "").partition(";")[0].strip().lower()
            if upstream.status != 200 or ctype != EVENT_STREAM:
                break
            resumed = await self._events(upstream, reply, watch, rid)
            end = StreamEnd(
                resumed.answered,
                resumed.last_event_id or end.last_event_id,
                resumed.retry_ms if resumed.retry_ms is not None else end.retry_ms,
            )
        return upstream, end

    def _cut(
        self,
        server: MCPServerConfig,
        target: UpstreamTarget,
        headers: CIMultiDict[str],
        rid: Any,
        method: Any,
        upstream: aiohttp.ClientResponse | None,
        reason: str,
    ) -> None:
        """Stop a request in flight: close its stream (what cancels it from revision 2026-07-28
        on) and send the server `notifications/cancelled` for it (what cancels it before; an
        `initialize` is never cancelled). The notice is sent in the background: the agent's
        answer does not wait for it."""
        if upstream is not None:
            upstream.close()
        if rid is None or method == "initialize":
            return
        task = asyncio.create_task(self._cancelled_notice(server, target, headers, rid, reason))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    async def _cancelled_notice(
        self,
        server: MCPServerConfig,
        target: UpstreamTarget,
        headers: CIMultiDict[str],
        rid: Any,
        reason: str,
    ) -> None:
        notice = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": rid, "reason": reason},
        }
        out = CIMultiDict(headers)
        for name in ("Idempotency-Key", "Last-Event-ID", "Mcp-Name"):
            out.popall(name, None)
        if "Mcp-Method" in out:
            out["Mcp-Method"] = "notifications/cancelled"
        try:
            async with asyncio.timeout(CANCEL_NOTICE_TIMEOUT_S):
                async with self.client.request("POST", target.url, data=dumps(notice), headers=out) as answer:
                    await answer.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning(
                "could not send notifications/cancelled for request %r to MCP server %s: %s",
                rid,
                server.name,
                e,
            )

    # -- tools/call ---------------------------------------------------------------------------

    async def _tools_call(
        self,
        ex: Exchange,
        message: dict[str, Any],
        body: bytes,
        reply: Reply,
    ) -> None:
        server, run, headers = ex.server, ex.run, ex.headers
        rid = message["id"]
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        name = params.get("name")
        call = ToolCall(name if isinstance(name, str) else "", run=run)
        call.attributes.update(
            {"mcp.server": server.name, "mcp.method.name": "tools/call", "jsonrpc.request.id": str(rid)}
        )
        for header, attribute in (
            ("Mcp-Session-Id", "mcp.session.id"),
            ("MCP-Protocol-Version", "mcp.protocol.version"),
        ):
            if headers.get(header):
                call.attributes[attribute] = headers[header]
        # The model's tool call id when the agent passes it on, else the request's own id.
        given = meta.get("runcap/tool_call_id")
        call.tool_call_id = given if isinstance(given, str) else str(rid)
        label = f"mcp:{server.name}"
        try:
            await self._call(ex, message, params, meta, body, reply, call)
        except Rejection as rej:
            call.refused(rej)
            self.metrics.rejections.labels(rej.code or rej.type).inc()
            await reply.message(refusal(rid, rej), self._answer_headers(run, call))
        finally:
            access = ("POST", f"/mcp/{server.name}", run.run_id) if self.config.log_requests else None
            record_tool_call(
                self.recorder, self.metrics, call, endpoint="tools/call", metric_label=label, access=access
            )

    def _answer_headers(self, run: RunRequest, call: ToolCall) -> dict[str, str]:
        headers = (
            tool_run_headers(call.state, time.time()) if call.state is not None else {"X-Run-Id": run.run_id}
        )
        if call.key is not None:
            headers["Idempotency-Key"] = call.key
        return headers

    async def _call(
        self,
        ex: Exchange,
        message: dict[str, Any],
        params: dict[str, Any],
        meta: dict[str, Any],
        body: bytes,
        reply: Reply,
        call: ToolCall,
    ) -> None:
        server, target, run, headers = ex.server, ex.target, ex.run, ex.headers
        name = call.tool
        if not name:
            raise InvalidRequest("tools/call: params.name must be the name of a tool", param="params.name")
        if name in server.deny:
            raise ToolDenied(
                f"tool {name!r} of MCP server {server.name!r} is denied by this runcap's operator "
                f"([mcp.{server.name}] deny); it was not called — answer without it"
            )
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise InvalidRequest("tools/call: params.arguments must be an object", param="params.arguments")
        if self.catalog.needs_listing(server, name):
            now, state = time.time(), None
            if not run.generated:  # the run's own deadline bounds runcap's listing too
                state = await self.calls.timed(
                    "touch_run", self.ledger.touch_run(run.run_id, run.task, run.caps, now)
                )
            listed = await self._list_tools(server, target, headers, meta, run_deadline(run, state, now))
            if listed and not self.catalog.knows(server.name, name):
                # The server's whole tools/list does not have it: never forwarded (-32044).
                raise ToolDenied(
                    f"tool {name!r} is not one of MCP server {server.name!r}'s tools (its tools/list "
                    "does not have it); it was not called — call one of the listed tools",
                    code="unknown_tool",
                )
        tool = server.tools.get(name)
        side_effects = self.catalog.side_effects(server, name)
        call.attributes["mcp.side_effects"] = "true" if side_effects else "false"
        try:
            canonical_args = canonical_json(arguments)
        except ValueError as e:
            raise InvalidRequest(f"tools/call: params.arguments: {e}", param="params.arguments") from None
        call.args_hash = sha256_hex(canonical_args)
        qualified = f"mcp:{server.name}/{name}"
        if side_effects:
            if run.generated:
                # A generated run id is new every time: no repeat could ever be recognised.
                raise InvalidRequest(
                    f"X-Run-Id: required on calls to side-effecting tool {name!r} of MCP server "
                    f"{server.name!r} — the idempotency key is namespaced by the run, so without one a "
                    "retry would execute again (set it on the client's Streamable HTTP transport)",
                    param="X-Run-Id",
                )
            key_args: Any = arguments
            if tool is not None and tool.key_fields is not None:
                key_args = {k: arguments[k] for k in tool.key_fields if k in arguments}
            operation = meta.get("runcap/operation_id")
            operation_id = operation if isinstance(operation, str) and operation else run.operation_id
            call.key = idempotency_key(run.run_id, qualified, key_args, operation_id)
        req = ToolCallRequest(
            run.run_id, run.task, run.caps, time.time(), qualified, call.key, call.args_hash,
            method="tools/call", path="", op_hash=call.key or "",
        )  # fmt: skip
        limit = tool.max_calls_per_run if tool is not None else None

        task = asyncio.current_task()
        assert task is not None
        self.flights.add(run.run_id, task, call)  # a cancel also ends a wait for a duplicate
        try:
            if limit is not None and call.key is None:
                await self._claim(server, name, limit, run)
            start = await self.calls.begin(req)
            call.state = start.state
            if start.action == "replay":
                assert start.record is not None
                await self._replay(call, start.record, message["id"], reply, label=f"mcp:{server.name}")
                return
            if limit is not None and call.key is not None:
                try:
                    await self._claim(server, name, limit, run)
                except Rejection:
                    await self.calls.release(run.run_id, call.key)  # never executed: not counted
                    raise
            try:
                await self._execute(ex, message, body, reply, call, start.state)
            except (Rejection, asyncio.CancelledError):
                raise
            except Exception:
                await self.calls.unknown(call, "runcap failed during the call", f"mcp:{server.name}")
                raise
        except asyncio.CancelledError:
            if call.cut_reason != "cancel":
                raise  # shutting down
            task.uncancel()
            raise RunCancelled(
                f"run {run.run_id} was cancelled while its call to tool {name!r} of MCP server "
                f"{server.name!r} waited for a duplicate in flight; start a new run to continue"
            ) from None
        finally:
            self.flights.remove(run.run_id, task)

    async def _claim(self, server: MCPServerConfig, tool: str, limit: int, run: RunRequest) -> None:
        """One of the tool's `max_calls_per_run`, counted atomically in the ledger as the tool
        calls of a run of its own (a `/` never occurs in a run id, so it meets no real run)."""
        qualified = f"mcp:{server.name}/{tool}"
        quota = ToolCallRequest(
            f"{run.run_id}/{qualified}", "", RunCaps(max_tool_calls=limit), time.time(), qualified, None
        )
        try:
            await self.calls.timed("tool_quota", self.ledger.begin_tool_call(quota))
        except BudgetExceeded:
            raise BudgetExceeded(
                "max_calls_per_run",
                f"max_calls_per_run: tool {tool!r} of MCP server {server.name!r} may be called {limit} "
                f"time{'s' if limit != 1 else ''} per run ([mcp.{server.name}.tools.{tool}]) and run "
                f"{run.run_id} has used {'them' if limit != 1 else 'it'}; the call was not executed — "
                "answer without it",
            ) from None

    async def _replay(
        self, call: ToolCall, record: IdempotencyRecord, rid: Any, reply: Reply, label: str
    ) -> None:
        call.status = 200
        call.outcome = "replayed"
        call.result_hash = result_hash(record.body)
        self.metrics.tool_replays.labels(label).inc()
        if record.headers.get("content-type", "").startswith(MCP_ERROR_TYPE):
            ok, error = parse_json(record.body)
            answer = {
                "jsonrpc": "2.0",
                "id": rid,
                "error": error if ok else {"code": -32603, "message": "error"},
            }
        else:
            ok, result = parse_json(record.body)
            if not ok or not isinstance(result, dict):
                # An operator's outcome in plain text (`runcap reconcile --done --body ...`).
                result = {"content": [{"type": "text", "text": record.body.decode("utf-8", "replace")}]}
            meta = result.get("_meta") if isinstance(result.get("_meta"), dict) else {}
            answer = result_message(rid, {**result, "_meta": {**meta, "runcap/replay": True}})
        assert call.run is not None
        headers = {**self._answer_headers(call.run, call), "X-Idempotent-Replay": "true"}
        await reply.message(answer, headers)

    async def _execute(
        self,
        ex: Exchange,
        message: dict[str, Any],
        body: bytes,
        reply: Reply,
        call: ToolCall,
        state: RunState,
    ) -> None:
        server, target, run, headers = ex.server, ex.target, ex.run, ex.headers
        rid, name, label = message["id"], call.tool, f"mcp:{server.name}"
        tool = server.tools.get(name)
        timeout_s = tool.timeout_s if tool is not None and tool.timeout_s is not None else server.timeout_s
        now = time.time()
        deadline = run_deadline(run, state, now)
        clock = call_timeout(deadline, timeout_s, now)
        timeout, by_deadline = clock.seconds, clock.by_deadline
        headers = CIMultiDict(headers)
        if call.key is not None:
            headers["Idempotency-Key"] = call.key
        headers.update(deadline_headers(deadline, now))
        call.request_hash = self.recorder.payload(body)
        task = asyncio.current_task()
        assert task is not None
        executing = self.calls.executing(run.run_id, call.key)
        answered: dict[str, Any] | None = None
        clock: asyncio.Timeout | None = None

        async def watch(m: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal answered
            if answered is None and is_response(m) and m.get("id") == rid:
                answered = m
                # Answered: from here on the call is not cut any more (a cut now would only lose
                # the outcome), and the outcome is recorded before the agent sees it.
                if clock is not None:
                    clock.reschedule(None)
                self.flights.remove(run.run_id, task)
                await self._outcome(call, m, label)
                self.calls.finished(run.run_id, call.key, executing)
            return None

        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                async with asyncio.timeout(timeout) as clock:
                    upstream = await self.client.request("POST", target.url, data=body, headers=headers)
                    end = await self._answer(upstream, reply, self._answer_headers(run, call), watch, rid)
                    upstream, end = await self._resume(target, headers, reply, watch, rid, upstream, end)
            except TimeoutError:
                if answered is not None:
                    return
                why = "the run's deadline" if by_deadline else f"its timeout_s = {timeout_s:g} s"
                self._cut(server, target, headers, rid, "tools/call", upstream, f"runcap: {why} passed")
                await self.calls.unknown(call, "deadline" if by_deadline else "tool timeout", label)
                if by_deadline:
                    call.cut_reason = "deadline"
                    await self.ledger.set_status(run.run_id, "deadline_exceeded", time.time())
                    raise DeadlineExceeded(
                        f"run {run.run_id} reached its deadline during the call to tool {name!r} of MCP "
                        f"server {server.name!r}; the call was cancelled (it may or may not have taken "
                        "effect). End the run."
                    ) from None
                # The tool's own timeout: a result the model can read, and the run goes on.
                text = (
                    f"runcap: tool {name!r} did not answer within its timeout_s = {timeout_s:g} s; the call "
                    "was cancelled and may or may not have taken effect"
                    + (" — a repeat is refused until an operator reconciles it" if call.key else "")
                )
                call.status, call.error = 504, text
                if call.outcome != "unknown":
                    call.outcome = "timeout"
                result = {"content": [{"type": "text", "text": text}], "isError": True}
                await reply.message(result_message(rid, result), self._answer_headers(run, call))
                return
            except asyncio.CancelledError:
                if answered is not None and call.cut_reason == "cancel":
                    # The cancel raced the answer: the call happened, and the agent gets its result.
                    task.uncancel()
                    await reply.message(answered, self._answer_headers(run, call))
                    return
                if call.cut_reason != "cancel":
                    if answered is None:
                        await self.calls.unknown(call, "runcap shut down during the call", label)
                    raise
                task.uncancel()
                self._cut(
                    server, target, headers, rid, "tools/call", upstream, "runcap: the run was cancelled"
                )
                await self.calls.unknown(call, "run cancelled during the call", label)
                raise RunCancelled(
                    f"run {run.run_id} was cancelled during the call to tool {name!r} of MCP server "
                    f"{server.name!r}; the call was cancelled (it may or may not have taken effect)"
                ) from None
            except (aiohttp.ClientError, OSError, ToolResponseTooLarge, EventTooLarge) as e:
                if answered is not None:
                    return
                # Released only when it provably never left; else unknown (toolcall/outcome.py).
                await self.calls.failed(call, e, label)
                if never_left(e):
                    raise UpstreamUnavailable(
                        f"MCP server {server.name!r} ({server.display_url}) is unreachable: {e}"
                    ) from None
                raise self._unavailable(server, f"tools/call {name!r}", e) from None
        finally:
            if upstream is not None:
                release_or_drop(upstream)
            self.calls.finished(run.run_id, call.key, executing)
        if answered is None and upstream is not None and session_refused(upstream.status, headers):
            # The session is gone (toolcall/outcome.py): refused before dispatch. The 404 went to
            # the agent as it was; it starts a new session and sends the call again.
            if call.key is not None:
                await self.calls.release(run.run_id, call.key)
            call.status, call.outcome = upstream.status, "error"
            call.error = f"MCP server {server.name!r} answered HTTP 404: no such session"
            return
        if answered is None and upstream is not None and upstream.status >= 300:
            # An HTTP answer without the JSON-RPC response (a 502/504 of a proxy in front of the
            # server, a redirect, an error page): the bytes reached something that may have passed
            # them on, and nothing says what happened. Relayed to the agent as it was; unknown.
            why = f"the server answered HTTP {upstream.status} without a result"
            await self.calls.unknown(call, why, label)  # (a read-only call has no record to mark)
            call.status, call.outcome = upstream.status, "unknown" if call.key is not None else "error"
            call.error = (
                f"MCP server {server.name!r} answered HTTP {upstream.status} without a JSON-RPC response; "
                "the call may or may not have taken effect"
            )
            return
        if answered is None:
            await self.calls.unknown(call, "the server ended its answer without the result", label)
            raise UpstreamUnavailable(
                f"MCP server {server.name!r} ended its answer to tools/call {name!r} without the result; "
                "the call may or may not have taken effect"
                + (" — a repeat is refused until an operator reconciles it" if call.key else "")
            )

    async def _outcome(self, call: ToolCall, message: dict[str, Any], label: str) -> None:
        """The server's answer is the call's outcome: recorded against the key (a repeat replays
        it), a JSON-RPC error as much as a result (toolcall/outcome.py)."""
        assert call.run is not None
        call.status = 200
        call.reached = "true"
        # Recorded as the server sent it (a replay gives back the same JSON), hashed canonically.
        if "result" in message:
            result = message["result"]
            data = dumps(result)
            if isinstance(result, dict) and result.get("isError") is True:
                call.outcome, call.error = "error", _text(result)[:500]
            recorded = {"content-type": JSON}
        else:
            error = message.get("error") if isinstance(message.get("error"), dict) else {}
            data = dumps(error)
            call.outcome, call.error = "error", str(error.get("message", ""))[:500]
            recorded = {"content-type": MCP_ERROR_TYPE}
        outcome = message.get("result", message.get("error"))
        try:
            canonical = canonical_json(outcome)
        except ValueError:  # no canonical form (nested too deep): the bytes as relayed
            canonical = dumps(outcome)
        call.result_hash = sha256_hex(canonical)
        call.response_hash = self.recorder.payload(
            dumps(message), is_error=call.outcome != "ok", content_type=JSON
        )
        if call.key is None:
            return
        await self.calls.complete(call.run.run_id, call.key, 200, recorded, data)

    async def _list_tools(
        self,
        server: MCPServerConfig,
        target: UpstreamTarget,
        headers: CIMultiDict[str],
        meta: dict[str, Any],
        deadline: float | None,
    ) -> bool:
        """Learn the server's tools before a call to one runcap has not seen listed: a
        `tools/list` of runcap's own, in the agent's session (best effort; what stays unknown is
        side-effecting); each page within LISTING_TIMEOUT_S and the run's `deadline`. True when
        the whole listing was read (every page)."""
        out = CIMultiDict(headers)
        for h in ("Mcp-Name", "Idempotency-Key", "Last-Event-ID"):
            out.popall(h, None)
        for h in [h for h in out if h.lower().startswith("mcp-param-")]:
            out.popall(h, None)
        if "Mcp-Method" in out:
            out["Mcp-Method"] = "tools/list"
        envelope = {k: v for k, v in meta.items() if k.startswith(_ENVELOPE)}
        cursor = None
        for _ in range(LISTING_PAGES):
            params: dict[str, Any] = {}
            if envelope:
                params["_meta"] = envelope
            if cursor:
                params["cursor"] = cursor
            rid = f"runcap-tools-list-{secrets.token_hex(6)}"
            request = {"jsonrpc": "2.0", "id": rid, "method": "tools/list", "params": params}
            collected = BatchReply()
            try:
                async with asyncio.timeout(call_timeout(deadline, LISTING_TIMEOUT_S).seconds):
                    upstream = await self.client.request("POST", target.url, data=dumps(request), headers=out)
                    try:
                        await self._answer(upstream, collected, {}, None, rid)
                    finally:
                        release_or_drop(upstream)
            except (TimeoutError, aiohttp.ClientError, OSError, ToolResponseTooLarge, EventTooLarge) as e:
                log.warning("could not list the tools of MCP server %s: %s", server.name, e)
                return False
            answer = next((m for m in collected.messages if m.get("id") == rid), None)
            result = answer.get("result") if answer is not None else None
            if not isinstance(result, dict):
                return False
            self.catalog.learn(server.name, result)
            cursor = result.get("nextCursor")
            if not cursor:
                return True
        return False

    # -- GET (the server's stream) and DELETE (end of a session) ---------------------------------

    async def _stream(
        self,
        request: web.Request,
        server: MCPServerConfig,
        target: UpstreamTarget,
        run: RunRequest,
        headers: CIMultiDict[str],
    ) -> web.StreamResponse:
        """Relayed byte for byte (server → client requests and notifications, resumptions with
        `Last-Event-ID`); a run's GET stream ends at its deadline or cancel."""
        task = asyncio.current_task()
        assert task is not None
        answer_headers = {"X-Run-Id": run.run_id} if not run.generated else {}
        started, state = time.time(), None
        try:
            if request.method == "GET" and not run.generated:
                state = await self.calls.timed(
                    "touch_run", self.ledger.touch_run(run.run_id, run.task, run.caps, started)
                )
            timeout = call_timeout(run_deadline(run, state, started)).seconds
        except Rejection as rej:
            self.metrics.rejections.labels(rej.code or rej.type).inc()
            return http_refusal(rej, answer_headers)
        relayed = Relayed()
        if not run.generated:
            self.flights.add(run.run_id, task, relayed)
        upstream: aiohttp.ClientResponse | None = None
        out: web.StreamResponse | None = None
        try:
            async with asyncio.timeout(timeout):
                upstream = await self.client.request(request.method, target.url, headers=headers)
                out = web.StreamResponse(status=upstream.status, headers=response_headers(upstream.headers))
                out.headers.update(answer_headers)
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
        except TimeoutError:
            pass  # the run's deadline: the stream ends
        except asyncio.CancelledError:
            if relayed.cut_reason != "cancel":
                raise
            task.uncancel()
        except (aiohttp.ClientError, OSError) as e:
            if out is None:
                return http_refusal(self._unavailable(server, request.method, e), answer_headers)
        finally:
            if upstream is not None:
                release_or_drop(upstream)
            if not run.generated:
                self.flights.remove(run.run_id, task)
        if out is None:
            rej: Rejection = (
                RunCancelled(f"run {run.run_id} was cancelled; start a new run to continue")
                if relayed.cut_reason == "cancel"
                else DeadlineExceeded(f"run {run.run_id} reached its deadline; end the run")
            )
            return http_refusal(rej, answer_headers)
        try:
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return out


def _text(result: dict[str, Any]) -> str:
    """The text parts of a result's content, for a span's error."""
    content = result.get("content")
    if not isinstance(content, list):
        return ""
    return " ".join(c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text")
