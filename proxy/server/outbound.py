"""Every call runcap makes to another server leaves through here: model calls and pass-through
(forward.py), runcap's own model calls within a run (inner.py), tool calls (proxy/tools) and
every MCP request (proxy/mcp: the relay's POSTs, GET streams, DELETE and cancel notices in
`relay.py`, `tools/call` in `tools_call.py`, runcap's own `tools/list` in `listing.py`). What
holds for all of them holds because it is written once, here:

* **No redirect is followed.** `OutboundClient.request` is the only way to send, and it never
  follows one: a 3xx is the server's answer, relayed or recorded as such (a followed 307 would
  carry a tool's configured secret header, and the call's body, to another origin).
* **No cookie kept.** A `Set-Cookie` is relayed to the agent that got it; the pooled session stores
  none, so no run or tenant sends another's cookie.
* **No silent second send.** aiohttp resends a request whose pooled connection reset, when its
  method is "idempotent" (PUT, DELETE...). A side-effecting tool call is not, whatever its
  method: a resend is a second execution. Off.
* **One timeout arithmetic.** `OutboundClient.call` takes the run's deadline and the call's own
  limit (e.g. a tool's `timeout_s`) and bounds the whole exchange — sending, the answer's headers
  and everything read from it — by whichever comes first; a cut is a `CallTimedOut` that says
  which (`by_deadline`). `run_deadline` says what the deadline is, also for a request the ledger
  has not seen — a request without `X-Run-Id` is its own run, and the operator's `[caps]` /
  `[tasks]` timeout bounds it from its first byte. `deadline_headers` are the `X-Run-Deadline` /
  `X-Run-Remaining-Ms` a tool or MCP server is told. (`call_timeout` is the arithmetic itself;
  the tool gateways read it through `proxy/toolcall/clock.py`, because their calls outlive one
  `async with` — an MCP answer relayed as a stream, a `tools/call` whose bound is lifted once the
  answer is on record.)
* **One credential rule for model upstreams.** `model_headers`: the agent's headers minus
  runcap's own, and — when runcap has a key for the upstream — minus the agent's credentials,
  with the key in the header the upstream's wire format reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.client import _RequestContextManager
from multidict import CIMultiDict
from yarl import URL

from proxy.caps import RunRequest
from proxy.ledger.base import RunState
from proxy.server.headers import AGENT_CREDENTIALS, request_headers
from proxy.server.ops import iso


@dataclass(frozen=True, slots=True)
class CallTimeout:
    """How long one outbound call may take: `seconds` None = unbounded; `by_deadline` = the run's
    deadline is what bounds it (a cut is then the run's deadline, not the call's own limit)."""

    seconds: float | None
    by_deadline: bool


def call_timeout(
    deadline: float | None, limit_s: float | None = None, now: float | None = None
) -> CallTimeout:
    """The run's remaining time until `deadline`, or the call's own `limit_s` when that is shorter."""
    remaining = None if deadline is None else max(0.0, deadline - (time.time() if now is None else now))
    if limit_s is not None and (remaining is None or limit_s < remaining):
        return CallTimeout(limit_s, False)
    return CallTimeout(remaining, remaining is not None)


def run_deadline(run: RunRequest, state: RunState | None, started: float) -> float | None:
    """The deadline of `run` for a call that started at `started`: the ledger's (fixed when the run
    was first seen) when the call touched the ledger; else the request's own caps resolved from
    `started` — a generated run (no `X-Run-Id`) is its own run, so its operator timeout
    (`[caps] default_timeout_s` / ceiling, `[tasks."T"] timeout_s`) starts with it."""
    if state is not None:
        return state.deadline  # its own or, in a run tree, an ancestor's when earlier
    return run.caps.resolve_deadline(started).deadline


def deadline_headers(deadline: float | None, now: float | None = None) -> dict[str, str]:
    """`X-Run-Deadline` (RFC 3339, milliseconds, UTC) and `X-Run-Remaining-Ms` for a tool or an
    MCP server, so it can stop on time too; none when the run has no deadline."""
    if deadline is None:
        return {}
    left = max(0.0, deadline - (time.time() if now is None else now))
    return {"X-Run-Deadline": iso(deadline) or "", "X-Run-Remaining-Ms": str(int(left * 1000))}


class CallTimedOut(TimeoutError):
    """An outbound call cut at its bound: the run's deadline (`by_deadline`), else its own limit."""

    def __init__(self, by_deadline: bool) -> None:
        super().__init__("the run's deadline" if by_deadline else "the call's own time limit")
        self.by_deadline = by_deadline


def release_or_drop(upstream: aiohttp.ClientResponse) -> None:
    """Return a fully read connection to the pool; drop one cut mid-body, so the upstream (a
    model provider still generating, a tool still working) sees the disconnect."""
    if upstream.content.at_eof():
        upstream.release()
    else:
        upstream.close()


def model_headers(incoming: Mapping[str, str], flavor: str, api_key: str | None) -> CIMultiDict[str]:
    """The headers of a call to a model upstream: the agent's (`X-Run-*` and hop-by-hop dropped),
    its credentials replaced by `api_key` when runcap sends one (the tenant's or the upstream's
    key), in the header the wire format reads (Anthropic `x-api-key`, else a bearer token)."""
    out = request_headers(incoming, AGENT_CREDENTIALS if api_key else ())
    if api_key:
        if flavor == "anthropic":
            out["x-api-key"] = api_key
        else:
            out["Authorization"] = f"Bearer {api_key}"
    return out


class OutboundClient:
    """One connection pool to other servers, opened at start-up and closed at clean-up. Requests
    go out only through `request` (never following a redirect, never resent on their own)."""

    def __init__(
        self, *, keepalive_timeout_s: float, connect_timeout_s: float, dns_cache_s: int = 10
    ) -> None:
        self._keepalive_timeout_s = keepalive_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._dns_cache_s = dns_cache_s
        self._session: aiohttp.ClientSession | None = None

    def add_to(self, app: web.Application) -> None:
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)  # aiohttp runs clean-up handlers in order of addition

    async def _start(self, app: web.Application) -> None:
        await self.start()

    async def _stop(self, app: web.Application) -> None:
        await self.close()

    async def start(self) -> None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=self._keepalive_timeout_s, ttl_dns_cache=self._dns_cache_s
            ),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s),
            auto_decompress=True,
            # One session serves every run and tenant: a cookie an upstream sets is the agent's
            # (relayed in the answer), never runcap's to send on someone else's next call.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        # aiohttp's resend of a PUT/DELETE/GET whose pooled connection reset (RFC 9112 9.3.1) has no
        # public switch; a tool's DELETE may have executed before the reset.
        session._retry_connection = False
        self._session = session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @contextlib.asynccontextmanager
    async def call(
        self,
        method: str,
        url: str | URL,
        *,
        deadline: float | None,
        limit_s: float | None = None,
        headers: Any = None,
        data: bytes | None = None,
        now: float | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """`async with client.call(...) as upstream:` one call, bounded as a whole — sending, the
        answer's headers and whatever the block reads or relays of it — by the run's `deadline`
        (epoch seconds, None: none) or the call's own `limit_s`, whichever comes first; reaching
        it raises `CallTimedOut`. On leaving the block the connection is released when the answer
        was read to its end, else dropped (the upstream sees the disconnect)."""
        clock = call_timeout(deadline, limit_s, now)
        bound = asyncio.timeout(clock.seconds)
        try:
            async with bound:
                upstream = await self.request(method, url, headers=headers, data=data)
                try:
                    yield upstream
                finally:
                    release_or_drop(upstream)
        except TimeoutError:
            if bound.expired():
                raise CallTimedOut(clock.by_deadline) from None
            raise

    def request(
        self, method: str, url: str | URL, *, headers: Any = None, data: bytes | None = None
    ) -> _RequestContextManager:
        """Send one request (await it, or use it as `async with`); a 3xx comes back as the answer."""
        if self._session is None:
            raise RuntimeError("an outbound client is used before the application started")
        return self._session.request(method, url, headers=headers, data=data, allow_redirects=False)


class ResponseTooLarge(Exception):
    def __init__(self, size: int | None) -> None:
        super().__init__(size)
        self.size = size  # the declared Content-Length, when there was one


async def read_bounded(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole answer, or `ResponseTooLarge` as soon as it passes `limit` bytes: memory (and a
    tool's outcome record) stay bounded whatever an upstream or a tool sends."""
    declared = upstream.content_length
    if declared is not None and declared > limit:
        raise ResponseTooLarge(declared)
    if declared is not None and upstream.headers.get("Content-Encoding", "identity") == "identity":
        # aiohttp's parser ends the body at its Content-Length: one read, bounded by it (no loop
        # over chunks, no second copy). Not so for a compressed body: its Content-Length is the
        # compressed size, and what it decodes to is counted chunk by chunk below.
        return await upstream.read()
    data = bytearray()
    async for chunk in upstream.content.iter_any():
        data += chunk
        if len(data) > limit:
            raise ResponseTooLarge(None)
    return bytes(data)
