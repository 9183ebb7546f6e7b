"""The MCP wire format as runcap reads and writes it: JSON-RPC 2.0 messages in POST bodies, SSE
events in answers, and runcap's own refusals as JSON-RPC errors.

Refusals (DESIGN.md "MCP servers"): -32040 run_budget_exceeded, -32041 run_deadline_exceeded,
-32042 run_cancelled, -32043 idempotency_outcome_unknown, -32044 tool denied; and, beyond the
DESIGN list, -32045 ledger_unavailable (retry later: the one refusal worth retrying) and -32046
idempotency_key_reused. `error.data` is `{"type", "code", "message"}` as in runcap's HTTP
rejections. Anything else runcap refuses maps to
the JSON-RPC codes (-32600 invalid request, -32603 internal error), with the same `data`.

SSE (the WHATWG event-stream format): events end at a blank line; lines end with CRLF, LF or CR.
`SSEParser` keeps each event's raw bytes, so an event runcap only looks at is relayed unchanged.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.bounds import INT64_MIN, UINT64_MAX
from proxy.errors import Rejection

JSON = "application/json"
EVENT_STREAM = "text/event-stream"

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# JSON-RPC errors a server answers before it executes anything: the call did not happen.
PRE_EXECUTION_ERRORS = frozenset({PARSE_ERROR, INVALID_REQUEST, -32601, INVALID_PARAMS})

ERROR_CODES = {
    "run_budget_exceeded": -32040,
    "run_deadline_exceeded": -32041,
    "run_cancelled": -32042,
    "idempotency_outcome_unknown": -32043,
    "tool_denied": -32044,
    "ledger_unavailable": -32045,
    "idempotency_key_reused": -32046,
    "tool_call_denied": -32044,  # (a rule's denial is answered as a result: `denied_result`)
    "approval_unavailable": -32044,
    "approval_required": -32047,  # `defer`: error.data.approval_id (proxy/toolcall/approvals.py)
    "invalid_request": INVALID_REQUEST,
}


class ToolDenied(Rejection):
    """A tool the operator hid with `deny`: not listed, and refused when called anyway — or one the
    server's tools/list does not have (code `unknown_tool`): never forwarded."""

    status = 403
    type = "tool_denied"
    code = "denied"
    param = "params.name"


class InvalidMessage(Exception):
    """The body is not JSON-RPC runcap can route."""


def parse_messages(body: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The JSON-RPC messages of a POST body, and whether they came as a batch (an array: removed
    from the protocol in revision 2025-06-18, handled message by message when it arrives)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidMessage(f"the body is not JSON: {e}") from None
    batch = isinstance(value, list)
    messages = value if batch else [value]
    if not messages:
        raise InvalidMessage("an empty batch")
    for m in messages:
        if not isinstance(m, dict) or m.get("jsonrpc") != "2.0":
            raise InvalidMessage('every message must be a JSON-RPC 2.0 object ("jsonrpc": "2.0")')
    return messages, batch


# Bounds of what runcap reads from an agent's JSON-RPC message (proxy/bounds.py): the id is echoed,
# recorded and put on spans; the method and tool name are span columns and metric labels.
MAX_ID_CHARS = 1024
MAX_NAME_CHARS = 256


def check_agent_message(message: dict[str, Any]) -> None:
    """An agent's message within runcap's bounds, else `InvalidMessage` naming the field: `id` a
    string of at most 1024 characters or a 64-bit integer, `method` and `params.name` at most 256
    characters, `params._meta["runcap/operation_id"]` at most 256."""
    rid = message.get("id")
    if isinstance(rid, bool) or not (rid is None or isinstance(rid, (str, int, float))):
        raise InvalidMessage("id: a string or an integer (JSON-RPC)")
    if isinstance(rid, str) and len(rid) > MAX_ID_CHARS:
        raise InvalidMessage(f"id: {len(rid)} characters, beyond the {MAX_ID_CHARS} runcap accepts")
    if isinstance(rid, int) and not INT64_MIN <= rid <= UINT64_MAX:
        raise InvalidMessage(f"id: beyond a 64-bit integer ({INT64_MIN} to {UINT64_MAX})")
    # orjson reads integers beyond 64 bits as floats: an integral float is an id up to 2**53.
    if isinstance(rid, float) and (not math.isfinite(rid) or not rid.is_integer() or abs(rid) > 2**53):
        raise InvalidMessage("id: a string or an integer (JSON-RPC) of at most 64 bits, not a fraction")
    method = message.get("method")
    if method is not None and not (isinstance(method, str) and len(method) <= MAX_NAME_CHARS):
        raise InvalidMessage(f"method: a string of at most {MAX_NAME_CHARS} characters")
    params = message.get("params")
    if not isinstance(params, dict):
        return
    name = params.get("name")
    if isinstance(name, str) and len(name) > MAX_NAME_CHARS:
        raise InvalidMessage(
            f"params.name: {len(name)} characters, beyond the {MAX_NAME_CHARS} runcap accepts"
        )
    meta = params.get("_meta")
    operation = meta.get("runcap/operation_id") if isinstance(meta, dict) else None
    if isinstance(operation, str) and len(operation) > MAX_NAME_CHARS:
        raise InvalidMessage(
            f'params._meta["runcap/operation_id"]: beyond the {MAX_NAME_CHARS} characters runcap accepts'
        )


def is_request(message: dict[str, Any]) -> bool:
    return "method" in message and "id" in message and message["id"] is not None


def is_response(message: dict[str, Any]) -> bool:
    return "method" not in message and ("result" in message or "error" in message)


def error_message(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def refusal(request_id: Any, rej: Rejection) -> dict[str, Any]:
    """runcap's rejection as the JSON-RPC error an MCP client reads."""
    code = ERROR_CODES.get(rej.type, INTERNAL_ERROR)
    data = {"type": rej.type, "code": rej.code, "message": rej.message}
    approval_id = getattr(rej, "approval_id", None)  # approval_required: the approval to wait for
    if approval_id is not None:
        data["approval_id"] = approval_id
    if rej.run is not None:  # a run tree's cap: the run whose cap binds
        data["run"] = rej.run
    return error_message(request_id, code, rej.message, data)


def result_message(request_id: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def denied_result(request_id: Any, rej: Rejection) -> dict[str, Any]:
    """A tool rule's denial as a `tools/call` result with `isError: true`: the reason is text the
    model reads (MCP's tool execution error), `_meta["runcap/refusal"]` the refusal as data."""
    refused = {"type": rej.type, "code": rej.code, "message": rej.message, "rule": rej.param}
    result = {
        "content": [{"type": "text", "text": rej.message}],
        "isError": True,
        "_meta": {"runcap/refusal": refused},
    }
    return result_message(request_id, result)


def dumps(message: Any) -> bytes:
    return orjson.dumps(message)


def json_object(value: Any) -> dict[str, Any]:
    """`value` when it is a JSON object, else an empty one (an absent or malformed `params`)."""
    return value if isinstance(value, dict) else {}


def sse_event(message: dict[str, Any], event_id: str | None = None) -> bytes:
    """One `message` event carrying `message`."""
    head = f"id: {event_id}\r\n" if event_id else ""
    return f"{head}event: message\r\ndata: ".encode() + orjson.dumps(message) + b"\r\n\r\n"


@dataclass(slots=True)
class SSEEvent:
    raw: bytes  # exactly as received (relayed unchanged unless replaced)
    event: str = "message"
    data: str | None = None  # None: no data line (a comment or a keep-alive)
    id: str | None = None
    retry: int | None = None

    def message(self) -> dict[str, Any] | None:
        """The JSON-RPC message this event carries, if it is one."""
        if self.event != "message" or not self.data:
            return None
        try:
            value = orjson.loads(self.data)
        except orjson.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None


class EventTooLarge(Exception):
    pass


_EOL = re.compile(rb"\r\n|\r|\n")


class SSEParser:
    """Incremental: `feed` the bytes as they arrive, get the events completed so far."""

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._buf = b""
        self._after_cr = False
        self._raw = bytearray()
        self._event: str | None = None
        self._data: list[str] | None = None
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._after_cr and chunk.startswith(b"\n"):
            # The LF of a CRLF split across chunks: its line already ended at the CR (the byte
            # still goes out, with what follows).
            self._raw += b"\n"
            chunk = chunk[1:]
        self._after_cr = False
        self._buf += chunk
        events: list[SSEEvent] = []
        pos = 0
        buf = self._buf
        while True:
            m = _EOL.search(buf, pos)
            if m is None:
                break  # an incomplete line
            if m.group() == b"\r" and m.end() == len(buf):
                self._after_cr = True  # a line ends here, and an LF may start the next chunk
            line = buf[pos : m.start()]
            self._raw += buf[pos : m.end()]
            pos = m.end()
            if not line:
                if self._raw.strip():  # (stray blank lines go out with the next event)
                    events.append(self._complete())
                continue
            self._field(line)
        self._buf = buf[pos:]
        if len(self._buf) + len(self._raw) > self.max_event_bytes:
            raise EventTooLarge(len(self._buf) + len(self._raw))
        return events

    def _field(self, line: bytes) -> None:
        if line.startswith(b":"):
            return  # a comment (keep-alive): kept in the raw bytes only
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        text = value.decode("utf-8", "replace")
        if name == b"data":
            if self._data is None:
                self._data = []
            self._data.append(text)
        elif name == b"event":
            self._event = text
        elif name == b"id":
            self._id = text
        elif name == b"retry" and text.isdigit():
            self._retry = int(text)

    def _complete(self) -> SSEEvent:
        event = SSEEvent(
            raw=bytes(self._raw),
            event=self._event or "message",
            data="\n".join(self._data) if self._data is not None else None,
            id=self._id,
            retry=self._retry,
        )
        self._raw.clear()
        self._event = self._data = self._id = self._retry = None
        return event
