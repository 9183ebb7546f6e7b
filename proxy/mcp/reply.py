"""Where the answer to an agent's POST goes (proxy/mcp/relay.py and tools_call.py write to one of these).

`LiveReply` answers a one-message POST as the answer comes: a JSON body, or an SSE stream relayed
event by event, and runcap's own messages (a refusal, a replay) as JSON or as one more event.
`BatchReply` collects the answers to a batch's messages, answered together as one JSON array.

Whether an answer is an SSE stream is decided here, and once: by the server's answer (its
`Content-Type`), or earlier by runcap (`LiveReply.open_events`: a `tools/call` held for a person
answers at once with a stream, so keep-alives can go first). After `open_events` the reply is an
event stream whatever the server answers: its events are relayed as they come, a JSON answer's
messages become events, and an HTTP answer without the response (the status can no longer be
sent) becomes a JSON-RPC error event — the relay writes to it as to any other reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import Rejection, UpstreamUnavailable
from proxy.mcp.wire import EVENT_STREAM, JSON, dumps, is_response, refusal, sse_event


class LiveReply:
    """The answer to a one-message POST, written as it comes: a JSON body, or an SSE stream
    relayed event by event. An agent that goes away does not stop the call (the spec: a
    disconnection is not a cancellation); what it would have read is dropped."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.stream: web.StreamResponse | None = None
        self.sse = False  # the stream is an event stream (a JSON body relayed as it comes is not)
        self.final: web.StreamResponse | None = None
        self.gone = False
        self.opened = False  # runcap began the answer as an event stream (`open_events`)
        self._opened_for: Any = None  # the id of the request whose answer it is

    def accepts_events(self) -> bool:
        """The agent takes an SSE answer: its `Accept` names `text/event-stream` (or anything)."""
        accept = self.request.headers.get("Accept", "")
        kinds = {part.partition(";")[0].strip().lower() for part in accept.split(",")}
        return bool(kinds & {EVENT_STREAM, "text/*", "*/*"})

    async def open_events(self, request_id: Any, headers: dict[str, str]) -> None:
        """Answer the request `request_id` with an SSE stream from now on (200, before the server
        has answered): whatever is written after this is one of its events."""
        if self.stream is not None:
            return
        out = CIMultiDict(headers)
        out["Content-Type"] = EVENT_STREAM
        out["Cache-Control"] = "no-cache"
        await self.start_stream(200, out)
        self.opened, self._opened_for = True, request_id

    async def comment(self, text: str) -> None:
        """An SSE comment line: read by no client, and bytes on the wire that reset its read timeout."""
        if self.stream is not None and self.sse:
            await self.event(f": {text}\r\n\r\n".encode(), None)

    async def start_stream(self, status: int, headers: CIMultiDict[str], sse: bool = True) -> None:
        if self.opened:
            return  # the stream runcap opened carries the server's events
        self.sse = sse
        self.stream = web.StreamResponse(status=status, headers=headers)
        await self._write(self.stream.prepare(self.request))

    async def event(self, raw: bytes, message: dict[str, Any] | None) -> None:
        assert self.stream is not None
        await self._write(self.stream.write(raw))

    async def body(
        self, status: int, headers: CIMultiDict[str], data: bytes, messages: list[dict[str, Any]]
    ) -> None:
        if not self.opened:
            self.final = web.Response(status=status, headers=headers, body=data)
            return
        for m in messages:
            await self.event(sse_event(m), m)
        if not any(is_response(m) and m.get("id") == self._opened_for for m in messages) and status >= 300:
            # The server's HTTP answer has no response, and its status cannot be sent any more.
            why = UpstreamUnavailable(
                f"the MCP server answered HTTP {status} without a JSON-RPC response (runcap had begun "
                "this answer as an event stream while the call waited for a person's approval, so the "
                "status comes as this error); the call may or may not have taken effect"
                + ("; the session is gone: start a new one" if status == 404 else "")
            )
            await self.message(refusal(self._opened_for, why), {})

    async def message(self, message: dict[str, Any], headers: dict[str, str]) -> None:
        """A message runcap made (a refusal, a replay, a timeout's result)."""
        if self.stream is not None:
            if self.sse:  # (a body cut midway just ends: there is no place for a message in it)
                await self.event(sse_event(message), message)
        else:
            self.final = web.Response(
                status=200, body=dumps(message), headers={**headers, "Content-Type": JSON}
            )

    def refuse(self, rej: Rejection, headers: dict[str, str]) -> None:
        """An HTTP-level refusal (a notification or response runcap could not deliver)."""
        if self.stream is None:
            self.final = http_refusal(rej, headers)

    async def _write(self, pending: Awaitable[Any]) -> None:
        if self.gone:
            if asyncio.iscoroutine(pending):
                pending.close()
            return
        try:
            await pending
        except (ConnectionError, RuntimeError):
            self.gone = True

    async def response(self) -> web.StreamResponse:
        if self.stream is not None:
            await self._write(self.stream.write_eof())
            return self.stream
        return self.final or web.Response(status=202)


class BatchReply:
    """The answers to a batch (a JSON array of messages, handled one by one): the responses are
    collected and answered as one JSON array."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.headers: dict[str, str] = {}
        self.stream = None

    async def start_stream(self, status: int, headers: CIMultiDict[str], sse: bool = True) -> None:
        self._keep(headers)

    async def event(self, raw: bytes, message: dict[str, Any] | None) -> None:
        if message is not None and is_response(message):
            self.messages.append(message)

    async def body(
        self, status: int, headers: CIMultiDict[str], data: bytes, messages: list[dict[str, Any]]
    ) -> None:
        self._keep(headers)
        self.messages.extend(m for m in messages if is_response(m))

    async def message(self, message: dict[str, Any], headers: dict[str, str]) -> None:
        self.messages.append(message)

    def refuse(self, rej: Rejection, headers: dict[str, str]) -> None:
        pass

    def _keep(self, headers: CIMultiDict[str]) -> None:
        session = headers.get("Mcp-Session-Id")
        if session:
            self.headers["Mcp-Session-Id"] = session


Reply = LiveReply | BatchReply


def http_refusal(rej: Rejection, headers: dict[str, str] | None = None) -> web.Response:
    """A refusal of the HTTP request itself: its status, and the JSON-RPC error (id null)."""
    return web.Response(
        status=rej.status,
        body=dumps(refusal(None, rej)),
        headers={"x-should-retry": "false", **rej.headers, **(headers or {}), "Content-Type": JSON},
    )
