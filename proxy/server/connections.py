"""Connection hygiene: how long a client may take to send a request, and how many it may hold.

aiohttp closes idle keep-alive connections (`keepalive_timeout`) but gives a client all the time
it likes to send a request's headers and body: connections trickling a byte at a time stay open
for good, each holding a socket and a handler. `GuardedRequestHandler` — aiohttp's per-connection
protocol with three limits added — closes them:

* header deadline (`header_timeout_s`): armed when a connection opens, or when the first bytes of
  a next request arrive on an idle keep-alive connection; disarmed when the request's headers are
  parsed. Past it: `408 Request Timeout`, connection closed.
* body deadline (`body_timeout_s`): the whole body must have arrived this long after its headers
  (a total, not a per-read timeout, which a byte every few seconds would defeat). Past it: `408`
  when no answer has started, connection closed; the handler sees the client gone.
* connections per client address (`max_connections_per_client`, per worker process): one more
  is answered `503` with `Retry-After` and closed at once.

The deadlines are `loop.call_at` handles — no task per connection, and on the data path only a
counter comparison. A normal request pays nothing else.

This sits on aiohttp's server internals (the handler's parsed-message count and queue, the
server's handler arguments); tests/app/test_connection_limits.py pins the behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from proxy.config import ConnectionSettings
from proxy.errors import InvalidRequest
from proxy.server.request_body import DECODED

log = logging.getLogger("runcap.server")

_HEADER_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 44\r\n\r\nthe request's headers took too long to send\n"
)
_BODY_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 41\r\n\r\nthe request's body took too long to send\n"
)
_TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 51\r\n\r\n"
    b"too many open connections from this client address\n"
)


class ConnectionGuard:
    """One server's connection limits and what they did: open connections per client address,
    connections closed by reason (`header_timeout`, `body_timeout`, `too_many_connections`)."""

    def __init__(self, limits: ConnectionSettings) -> None:
        self.limits = limits
        self.by_client: Counter[str] = Counter()
        self.open = 0
        self.closed: Counter[str] = Counter()

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """What `loop.create_server` needs: aiohttp's handler for `server`, guarded."""

        def factory() -> asyncio.Protocol:
            return GuardedRequestHandler(server, guard=self, loop=server._loop, **server._kwargs)

        return factory

    def admit(self, client: str) -> bool:
        limit = self.limits.max_connections_per_client  # 0: no limit
        if limit and self.by_client[client] >= limit:
            self.closed["too_many_connections"] += 1
            return False
        self.by_client[client] += 1
        self.open += 1
        return True

    def release(self, client: str) -> None:
        self.open -= 1
        left = self.by_client[client] - 1
        if left > 0:
            self.by_client[client] = left
        else:
            del self.by_client[client]


class GuardedRequestHandler(RequestHandler):
    __slots__ = ("_body", "_body_timer", "_client", "_cut", "_guard", "_header_timer", "_refused")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._client: str | None = None
        self._refused = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None  # the body being received
        self._cut: str | None = None  # why this connection was closed by a deadline

    # -- connection -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else ""  # "" for a unix socket
        if not self._guard.admit(client):
            self._refused = True
            writable = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport
            writable.write(_TOO_MANY)
            writable.close()
            return
        self._client = client
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._cancel_timers()
        if self._client is not None:
            self._guard.release(self._client)
            self._client = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        parsed = self._request_count
        super().data_received(data)
        if self._upgraded:  # a WebSocket: no request framing any more
            self._cancel_timers()
            return
        if self._request_count != parsed:  # a request's headers are in
            self._disarm_header_deadline()
            payload = self._messages[-1][1] if self._messages else None
            if payload is None and self._current_request is not None:
                payload = self._current_request.content
            if payload is not None and not payload.is_eof():
                self._body = payload
                if self._body_timer is None:
                    self._body_timer = self._loop.call_later(
                        self._guard.limits.body_timeout_s, self._body_expired
                    )
            else:
                self._disarm_body_deadline()
        elif self._body is not None:
            if self._body.is_eof():
                self._disarm_body_deadline()
        elif data and self._header_timer is None:
            self._arm_header_deadline()  # the first bytes of a next request

    # -- deadlines ------------------------------------------------------------------------------

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._header_expired)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _disarm_body_deadline(self) -> None:
        self._body = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        self._disarm_header_deadline()
        self._disarm_body_deadline()

    def _header_expired(self) -> None:
        self._header_timer = None
        if self.transport is None:
            return
        if self._current_request is not None or self._messages:
            # Still answering a request (pipelining): the next one's clock starts after it.
            self._arm_header_deadline()
            return
        self._cut = "header_timeout"
        self._guard.closed["header_timeout"] += 1
        self.transport.write(_HEADER_TIMEOUT)
        self.force_close()

    def _body_expired(self) -> None:
        self._body_timer = None
        body, self._body = self._body, None
        if body is None or body.is_eof() or self.transport is None:
            return
        self._cut = "body_timeout"
        self._guard.closed["body_timeout"] += 1
        if not self._answer_started():
            self.transport.write(_BODY_TIMEOUT)
        self.force_close()

    def _answer_started(self) -> bool:
        request = self._current_request
        if request is None:
            return False
        writer = request.writer
        return bool(
            writer.output_size
            or getattr(writer, "_headers_buf", None)
            or getattr(writer, "_headers_written", True)
        )

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A body coding aiohttp's parser refuses before any route runs (`br` without Brotli
        installed): runcap's error shape naming Content-Encoding, not aiohttp's plain text."""
        if not isinstance(exc, ContentEncodingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        # The request here is aiohttp's placeholder: the coding is named by the parser's message.
        said = str(getattr(exc, "message", exc)).split(".")[0].strip()
        resp = InvalidRequest(
            f"Content-Encoding: not a coding runcap reads ({said}); it reads "
            f"{', '.join(sorted(DECODED))}, or none: send the body uncompressed or with one of those",
            param="Content-Encoding",
            status=415,
        ).response("openai")
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        if self._cut is not None:
            # The handler found the client gone because a deadline closed the connection: that
            # is counted (runcap_connections_closed), not an error worth a traceback.
            log.debug("connection closed by its %s: %s", self._cut, args[0] if args else "")
            return
        super().log_exception(*args, **kw)


class GuardedSockSite(web.SockSite):
    """`web.SockSite` whose connections get `GuardedRequestHandler`s."""

    __slots__ = ("_guard",)

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, guard: ConnectionGuard) -> None:
        super().__init__(runner, sock)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(server), sock=self._sock, backlog=self._backlog
        )


def run_app(
    app: web.Application,
    sock: socket.socket,
    guard: ConnectionGuard,
    *,
    keepalive_timeout_s: float,
    shutdown_timeout_s: float = 10.0,
) -> None:
    """Serve `app` on `sock` until SIGINT/SIGTERM, as `aiohttp.web.run_app` does (start-up and
    cleanup hooks, graceful shutdown), with guarded connections."""

    async def main() -> None:
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=True,
            shutdown_timeout=shutdown_timeout_s,
            keepalive_timeout=keepalive_timeout_s,
        )
        await runner.setup()
        try:
            await GuardedSockSite(runner, sock, guard).start()
            await asyncio.Event().wait()  # until a signal raises GracefulExit
        finally:
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)
        leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in leftovers:
            t.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
