"""Which headers cross runcap, in each direction: one rule for model upstreams and tools.

Dropped on the way in: the connection-specific headers of RFC 9110 §7.6.1 — the fixed list and
every header the `Connection` header names — the ones aiohttp computes itself, runcap's own
`X-Run-*` (consumed here, never forwarded), and whatever the caller adds to `drop`. On the way
out: the same connection-specific headers and `Content-Encoding` (aiohttp has decompressed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
    }
)  # fmt: skip
# The agent's credentials: they go to model upstreams only (unless the upstream has a key of its
# own), never to tools or MCP servers unless that tool allow-lists the header.
AGENT_CREDENTIALS = ("authorization", "x-api-key", "api-key", "cookie", "proxy-authorization")
# The upstream may compress; aiohttp decompresses, so the agent gets identity bytes.
# Method overrides: a GET that an upstream reads as a POST would be a paid call runcap let pass
# as a free read.
# Content-Encoding: runcap reads the body decoded and forwards what it read (server/request_body.py).
_REQUEST_EXTRA = frozenset(
    {"accept-encoding", "x-http-method-override", "x-http-method", "x-method-override", "content-encoding"}
)
_RESPONSE_EXTRA = frozenset({"content-encoding"})


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    tokens: set[str] = set()
    for name, value in headers.items():
        if name.lower() == "connection":
            tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


def request_headers(headers: Mapping[str, str], drop: Iterable[str] = ()) -> CIMultiDict[str]:
    """The agent's headers to forward upstream."""
    skip = HOP_BY_HOP | _REQUEST_EXTRA | _connection_tokens(headers) | set(drop)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower not in skip and not lower.startswith("x-run-"):
            out.add(name, value)
    return out


def response_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The upstream's response headers to relay to the agent."""
    skip = HOP_BY_HOP | _RESPONSE_EXTRA | _connection_tokens(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in skip:
            out.add(name, value)
    return out
