"""MCP Streamable HTTP, relayed both ways (DESIGN.md "MCP servers"): the transport under `/mcp/{name}`.

A POST's JSON-RPC message is forwarded to the server's endpoint and its answer — JSON, or an SSE
stream relayed event by event — comes back through a `Reply`; a resumable stream that ends
before the answer is resumed (`Last-Event-ID`), as a client would; GET (the server's stream) and
DELETE (end of a session) are relayed byte for byte. Each is bound to the run's deadline and
cancel: a cut request has its stream closed and the server gets `notifications/cancelled`
(sent in the background; `_notices` until they are out).

The `tools/call` path (tools_call.py) forwards through the same `answer` / `resume` / `cut`,
with a `watch` that records the outcome the moment the response is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.caps import RunRequest
from proxy.config import MCPServerConfig
from proxy.errors import DeadlineExceeded, Rejection, RunCancelled, UpstreamUnavailable
from proxy.mcp.reply import LiveReply, Reply, http_refusal
from proxy.mcp.wire import (
    EVENT_STREAM,
    JSON,
    EventTooLarge,
    InvalidMessage,
    SSEParser,
    dumps,
    is_request,
    is_response,
    parse_messages,
    refusal,
    sse_event,
)
from proxy.server.headers import response_headers
from proxy.server.outbound import ResponseTooLarge, read_bounded, release_or_drop
from proxy.toolcall.clock import tool_clock
from proxy.toolcall.route import ToolRoute
from proxy.upstream_url import UpstreamTarget

log = logging.getLogger("runcap.mcp")

# A resumable stream that ends without the answer is resumed this many times at most.
MAX_RESUMES = 3
CANCEL_NOTICE_TIMEOUT_S = 5.0
DRAIN_S = 0.05  # how long the end of a stream is waited for after its answer

Watch = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]
# What sending a message or reading the server's answer to it raises when it fails.
ANSWER_FAILED = (aiohttp.ClientError, OSError, ResponseTooLarge, EventTooLarge)


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


class StreamableHTTPRelay:
    def __init__(self, route: ToolRoute) -> None:
        self.route = route  # the gateway's config, ledger, in-flight calls, metrics, tool client
        self._notices: set[asyncio.Task[None]] = set()  # notifications/cancelled being sent

    async def stop(self) -> None:
        """Let the cancel notices go out (before the tool client closes: they go through it)."""
        if self._notices:
            await asyncio.wait(self._notices, timeout=CANCEL_NOTICE_TIMEOUT_S)

    # -- POST: a JSON-RPC message ---------------------------------------------------------------

    async def relay(
        self,
        ex: Exchange,
        message: dict[str, Any],
        body: bytes,
        reply: Reply,
        watch: Watch | None = None,
    ) -> None:
        """Anything but `tools/call`, unchanged — within the run's deadline and cancel. `watch`
        sees each message of the answer before the agent does (and may replace it)."""
        server, target, run, headers = ex.server, ex.target, ex.run, ex.headers
        method = message.get("method")
        rid = message.get("id") if is_request(message) else None
        answer_headers = {"X-Run-Id": run.run_id} if not run.generated else {}
        relayed = Relayed()
        upstream: aiohttp.ClientResponse | None = None
        try:
            started, state = time.time(), None
            if rid is not None and not run.generated:
                # A request of a run: refused once the run is cancelled or past its deadline.
                state = await self.route.calls.touch_run(run, started)
            # Also a message the ledger did not see (no X-Run-Id, a notification): its own caps.
            timeout = tool_clock(run, state, now=started).seconds
            async with self._relaying(run, relayed) as task:
                try:
                    async with asyncio.timeout(timeout):
                        upstream = await self.route.client.request(
                            "POST", target.url, data=body, headers=headers
                        )
                        end = await self.answer(upstream, reply, answer_headers, watch, rid)
                        if rid is not None:
                            upstream, end = await self.resume(
                                target, headers, reply, watch, rid, upstream, end
                            )
                except TimeoutError:
                    self.cut(server, target, headers, rid, method, upstream, "the run's deadline passed")
                    if not run.generated:
                        status = "deadline_exceeded" if state is None else state.deadline_status
                        await self.route.ledger.set_status(run.run_id, status, time.time())
                    raise DeadlineExceeded(
                        f"run {run.run_id} reached its deadline during {method} on MCP server "
                        f"{server.name!r}; the request was cancelled. End the run."
                    ) from None
                except asyncio.CancelledError:
                    if relayed.cut_reason != "cancel":
                        raise
                    task.uncancel()
                    self.cut(server, target, headers, rid, method, upstream, "the run was cancelled")
                    raise RunCancelled(
                        f"run {run.run_id} was cancelled during {method} on MCP server {server.name!r}; "
                        "start a new run to continue"
                    ) from None
                except ANSWER_FAILED as e:
                    raise self.unavailable(server, method, e) from None
                finally:
                    if upstream is not None:
                        release_or_drop(upstream)
        except Rejection as rej:
            self.route.metrics.rejections.labels(rej.code or rej.type).inc()
            if rid is None:
                reply.refuse(rej, answer_headers)
            else:
                await reply.message(refusal(rid, rej), answer_headers)

    @contextlib.asynccontextmanager
    async def _relaying(self, run: RunRequest, relayed: Relayed) -> AsyncIterator[asyncio.Task[Any]]:
        """The current task, one of the run's calls in flight (a cancel cuts it) while it relays; a
        run id runcap made up has no calls to cut."""
        task = asyncio.current_task()
        assert task is not None
        if not run.generated:
            self.route.flights.add(run.run_id, task, relayed)
        try:
            yield task
        finally:
            if not run.generated:
                self.route.flights.remove(run.run_id, task)

    def unavailable(self, server: MCPServerConfig, method: Any, e: BaseException) -> UpstreamUnavailable:
        if isinstance(e, (ResponseTooLarge, EventTooLarge)):
            return UpstreamUnavailable(
                f"MCP server {server.name!r} answered {method} with more than tool_max_response_bytes = "
                f"{self.route.config.tool_max_response_bytes} bytes in one message",
                code="tool_response_too_large",
                param="tool_max_response_bytes",
            )
        return UpstreamUnavailable(
            f"MCP server {server.name!r} ({server.display_url}) failed during {method}: "
            f"{type(e).__name__}: {e}"
        )

    async def answer(
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
        data = await read_bounded(upstream, self.route.config.tool_max_response_bytes)
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
        await reply.body(upstream.status, headers, data, messages)
        answered = any(is_response(m) and m.get("id") == rid for m in messages)
        return StreamEnd(answered=answered or rid is None or upstream.status >= 400)

    async def _events(
        self, upstream: aiohttp.ClientResponse, reply: Reply, watch: Watch | None, rid: Any
    ) -> StreamEnd:
        parser = SSEParser(self.route.config.tool_max_response_bytes)
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

    async def resume(
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
            upstream = await self.route.client.request("GET", target.url, headers=again)
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

    def cut(
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
                send = self.route.client.request("POST", target.url, data=dumps(notice), headers=out)
                async with send as answer:
                    await answer.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning(
                "could not send notifications/cancelled for request %r to MCP server %s: %s",
                rid,
                server.name,
                e,
            )

    # -- GET (the server's stream) and DELETE (end of a session) ---------------------------------

    async def stream(
        self,
        request: web.Request,
        server: MCPServerConfig,
        target: UpstreamTarget,
        run: RunRequest,
        headers: CIMultiDict[str],
    ) -> web.StreamResponse:
        """Relayed byte for byte (server → client requests and notifications, resumptions with
        `Last-Event-ID`); a run's GET stream ends at its deadline or cancel."""
        answer_headers = {"X-Run-Id": run.run_id} if not run.generated else {}
        started, state = time.time(), None
        try:
            if request.method == "GET" and not run.generated:
                state = await self.route.calls.touch_run(run, started)
            timeout = tool_clock(run, state, now=started).seconds
        except Rejection as rej:
            self.route.metrics.rejections.labels(rej.code or rej.type).inc()
            return http_refusal(rej, answer_headers)
        relayed = Relayed()
        async with self._relaying(run, relayed) as task:
            upstream: aiohttp.ClientResponse | None = None
            out: web.StreamResponse | None = None
            try:
                async with asyncio.timeout(timeout):
                    upstream = await self.route.client.request(request.method, target.url, headers=headers)
                    out = web.StreamResponse(
                        status=upstream.status, headers=response_headers(upstream.headers)
                    )
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
                    return http_refusal(self.unavailable(server, request.method, e), answer_headers)
            finally:
                if upstream is not None:
                    release_or_drop(upstream)
        if out is None:
            cut: Rejection = (
                RunCancelled(f"run {run.run_id} was cancelled; start a new run to continue")
                if relayed.cut_reason == "cancel"
                else DeadlineExceeded(f"run {run.run_id} reached its deadline; end the run")
            )
            return http_refusal(cut, answer_headers)
        try:
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return out
