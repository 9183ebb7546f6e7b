"""A `tools/call` outcome as runcap records and replays it (the rule is toolcall/outcome.py's).

The server's JSON-RPC response is the outcome, a result as much as an error: the result is
recorded as the server sent it (application/json), an error under `MCP_ERROR_TYPE`; a replay
gives back the same JSON under the repeat's own request id, a result marked
`_meta["runcap/replay"] = true`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from proxy.hashing import canonical_json, parse_json
from proxy.ledger.base import IdempotencyRecord
from proxy.mcp.wire import JSON, dumps, json_object, result_message

# The content type an MCP error outcome is recorded under (a result is application/json).
MCP_ERROR_TYPE = "application/vnd.runcap.mcp-error+json"


@dataclass(slots=True, frozen=True)
class Outcome:
    """The server's response to a `tools/call`, as recorded against the call's key."""

    body: bytes  # the result, or the error, as the server sent it
    headers: dict[str, str]  # the record's content type
    result_hash: str  # sha256 of its canonical JSON
    error: str | None  # the span's error when it is an error (a JSON-RPC one, or `isError`)


def outcome_of(message: dict[str, Any]) -> Outcome:
    error: str | None = None
    if "result" in message:
        result = message["result"]
        data = dumps(result)
        if isinstance(result, dict) and result.get("isError") is True:
            error = _text(result)[:500]
        recorded = {"content-type": JSON}
    else:
        failure = json_object(message.get("error"))
        data = dumps(failure)
        error = str(failure.get("message", ""))[:500]
        recorded = {"content-type": MCP_ERROR_TYPE}
    outcome = message.get("result", message.get("error"))
    try:
        canonical = canonical_json(outcome)
    except ValueError:  # no canonical form (nested too deep): the bytes as relayed
        canonical = dumps(outcome)
    return Outcome(data, recorded, hashlib.sha256(canonical).hexdigest(), error)


def replayed(record: IdempotencyRecord, rid: Any) -> dict[str, Any]:
    """The recorded outcome as the answer to request `rid`."""
    if record.headers.get("content-type", "").startswith(MCP_ERROR_TYPE):
        ok, error = parse_json(record.body)
        return {"jsonrpc": "2.0", "id": rid, "error": error if ok else {"code": -32603, "message": "error"}}
    ok, result = parse_json(record.body)
    if not ok or not isinstance(result, dict):
        # An operator's outcome in plain text (`runcap reconcile --done --body ...`).
        result = {"content": [{"type": "text", "text": record.body.decode("utf-8", "replace")}]}
    meta = json_object(result.get("_meta"))
    return result_message(rid, {**result, "_meta": {**meta, "runcap/replay": True}})


def _text(result: dict[str, Any]) -> str:
    """The text parts of a result's content, for a span's error."""
    content = result.get("content")
    if not isinstance(content, list):
        return ""
    return " ".join(c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text")
