"""No web page can drive a runcap: the `Host` and `Origin` checks against DNS rebinding.

A runcap on a developer's machine holds provider keys and answers on 127.0.0.1. A web page cannot
reach it by its own origin, but it can rebind its DNS name to 127.0.0.1: the browser then sends
the page's requests there with `Host: evil.example` (and, for POSTs, `Origin: https://evil.example`),
and reads the answers as same-origin. Jupyter and Ollama refuse both; so does runcap, before any
route runs:

* `Host` must name this runcap: a loopback name (`localhost`, `*.localhost`, 127.0.0.0/8, ::1),
  the listen address, or one of `[local] allowed_hosts` ("*" turns the check off — a deployment
  reached through its own gateway). The port is not compared: a rebinding attack changes the name.
* `Origin`, when present (browsers send it; SDKs and agents do not), must be one of `[local]
  allowed_origins` ("*" = any). `Origin: null` (sandboxed frames, file pages) is refused too.

Refusals are 403 in the shape of the route's clients: OpenAI's or Anthropic's error, and on
`/mcp/...` a JSON-RPC error without an id, as the MCP transport specification asks of servers.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.config import LocalSettings
from proxy.errors import Rejection
from proxy.mcp.wire import dumps, error_message

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_WILDCARD_LISTEN = frozenset({"0.0.0.0", "::", ""})
# The JSON-RPC error code the MCP SDKs answer a refused Origin/Host with.
_MCP_FORBIDDEN = -32000
# How many distinct `Host` values `LocalTrust` remembers the verdict of (clients send one or two;
# a flood of distinct ones is only judged again, not remembered).
_HOST_VERDICTS = 256


class Forbidden(Rejection):
    status = 403
    type = "forbidden"


def host_name(host: str) -> str:
    """The name in a `Host` header, without its port, lower-case (`[::1]:8787` → `::1`)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def is_loopback(name: str) -> bool:
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True  # RFC 6761: browsers resolve *.localhost to loopback themselves
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class LocalTrust:
    """The aiohttp middleware that checks `Host` and `Origin` on every request."""

    def __init__(self, local: LocalSettings, listen_host: str) -> None:
        hosts = set(local.allowed_hosts)
        self.any_host = "*" in hosts
        listen = listen_host.lower()
        if listen not in _WILDCARD_LISTEN:
            hosts.add(host_name(listen if ":" not in listen else f"[{listen}]"))
        self.hosts = frozenset(hosts - {"*"})
        self.any_origin = "*" in local.allowed_origins
        self.origins = frozenset(local.allowed_origins) - {"*"}
        # Host header → allowed: judged once per value (an ipaddress parse per request was ~1 %
        # of a request's CPU).
        self._host_verdicts: dict[str, bool] = {}

    def host_allowed(self, host: str) -> bool:
        verdict = self._host_verdicts.get(host)
        if verdict is None:
            name = host_name(host)
            verdict = is_loopback(name) or name in self.hosts
            if len(self._host_verdicts) < _HOST_VERDICTS:
                self._host_verdicts[host] = verdict
        return verdict

    def refusal(self, request: web.Request) -> Forbidden | None:
        if not self.any_host:
            given = request.headers.getall("Host", [])
            if len(given) > 1:
                return Forbidden("Host: sent more than once", code="host_not_allowed", param="Host")
            if given and not self.host_allowed(given[0]):
                return Forbidden(
                    f"Host: {given[0][:100]!r} is not a name this runcap answers to (loopback names, the "
                    "listen address, and [local] allowed_hosts); a web page that rebinds its DNS name "
                    "to this machine is refused. Add the name to [local] allowed_hosts if it is yours",
                    code="host_not_allowed",
                    param="Host",
                )
        origins = request.headers.getall("Origin", [])
        if origins and not self.any_origin:
            origin = origins[0].strip().lower().rstrip("/")
            if len(origins) > 1 or origin not in self.origins:
                return Forbidden(
                    f"Origin: {origins[0][:100]!r} is not allowed: runcap refuses requests from web pages "
                    "unless the operator lists their origin in [local] allowed_origins",
                    code="origin_not_allowed",
                    param="Origin",
                )
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        rej = self.refusal(request)
        if rej is None:
            return await handler(request)
        path = request.path
        if path.startswith("/mcp/") or (path.startswith("/r/") and "/mcp/" in path):
            body = dumps(
                error_message(None, _MCP_FORBIDDEN, rej.message, {"type": rej.type, "code": rej.code})
            )
            return web.Response(
                status=403, body=body, content_type="application/json", headers={"x-should-retry": "false"}
            )
        return rej.response(_flavor(path))


def _flavor(path: str) -> str:
    if path.startswith("/anthropic/") or path.startswith("/v1/messages") or "/anthropic/" in path:
        return "anthropic"
    return "openai"
