"""Where the answer to an agent's POST goes (proxy/mcp/relay.py and tools_call.py write to one of these).

`LiveReply` answers a one-message POST as the answer comes: a JSON body, or an SSE stream relayed
event by event, and runcap's own messages (a refusal, a replay) as JSON or as one more event.
`BatchReply` collects the answers to a batch's messages, answered together as one JSON array.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import Rejection
from proxy.mcp.wire import JSON, dumps, is_response, refusal, sse_event


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

    async def start_stream(self, status: int, headers: CIMultiDict[str], sse: bool = True) -> None:
        self.sse = sse
        self.stream = web.StreamResponse(status=status, headers=headers)
        await self._write(self.stream.prepare(self.request))

    async def event(self, raw: bytes, message: dict[str, Any] | None) -> None:
        assert self.stream is not None
        await self._write(self.stream.write(raw))

    def body(
        self, status: int, headers: CIMultiDict[str], data: bytes, messages: list[dict[str, Any]]
    ) -> None:
        self.final = web.Response(status=status, headers=headers, body=data)

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

    def body(
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
