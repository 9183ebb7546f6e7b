"""What a tool call's outcome is, once runcap has tried to send it — one rule for `/tools/{name}`
(proxy/tools/gateway.py) and MCP `tools/call` (proxy/mcp/), so that at-most-once does not depend on
which wire a call came on.

Once the request's bytes may have reached the server, the outcome is:

* **the server's answer** — recorded against the call's idempotency key and replayed to every
  repeat. On `/tools` that is any HTTP answer: a 2xx, a 3xx (never followed: server/outbound.py),
  a 502 from a proxy in front of the tool, a 504 without a body. On MCP it is the JSON-RPC
  response to the request: a result, or an error whatever its code (a server may have executed
  before it failed; its word that it did not is not proof).
* **`unknown`** — there is no answer runcap can record: the call was cut (deadline, cancel, the
  tool's own timeout, a shutdown), the connection reset after the request went out, or what came
  back cannot be read as the answer (MCP: an HTTP error without the JSON-RPC response, an
  unparseable body, a stream that ended before the response). Repeats get 409 / -32043 until an
  operator reconciles the call (`runcap reconcile`).

Only a call that provably never left is **released** (its intent deleted, not counted, so the
next attempt executes): no connection was made (`never_left`: refused, DNS failure, TLS
handshake, connect timeout), or runcap refused it itself before sending. One answer of the MCP
transport is taken at its word too: HTTP 404 to a request that carried an `Mcp-Session-Id`, the
specification's "this session does not exist", which the server must give before dispatching
anything and which tells the client to start a new session and send again (`session_refused`).

Both gateways read an answer with `proxy.server.outbound.read_bounded` (an answer larger than
`tool_max_response_bytes` is refused while it is read), as the model path does with
`max_answer_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp


def never_left(error: BaseException) -> bool:
    """The call failed before a connection to the server existed, so no byte of it was sent.
    (A reset, a payload error, a disconnect or a read timeout come after: the server may have
    the request.)"""
    return isinstance(error, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def session_refused(status: int, sent_headers: Mapping[str, str]) -> bool:
    """MCP Streamable HTTP: the server answered 404 to a request in a session it does not have
    (terminated or expired) — refused before dispatch; the client starts a new session."""
    return status == 404 and bool(sent_headers.get("Mcp-Session-Id"))
