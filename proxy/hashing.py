"""Canonical JSON and the hashes DESIGN.md fixes: `args_hash`, `result_hash`, idempotency keys.

Shared by the `/tools` route (idempotency keys) and the span pipeline (span hashes), so a tool
call's `args_hash` in ClickHouse is the same whichever path saw it.

Canonical JSON: UTF-8, keys sorted, no insignificant whitespace, `ensure_ascii=False`, integral
floats written as integers — `{"b":1,"a":2.0}` and `{"a":2,"b":1}` serialise (and hash) the same.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


def _normalise(value: Any) -> Any:
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value):
            return int(value)
        return value
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value


def canonical_json(value: Any) -> bytes:
    """Raises ValueError for what has no canonical form: NaN/Infinity, or nesting deeper than
    Python's recursion limit (a parser may take 1,024 levels; this walk cannot)."""
    try:
        return json.dumps(
            _normalise(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except RecursionError:
        raise ValueError("nested too deep to canonicalise") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_json(raw: bytes | str) -> tuple[bool, Any]:
    """(True, value) when `raw` is JSON, else (False, None)."""
    try:
        return True, json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # too deep: not JSON runcap can read
        return False, None


def args_hash(raw: bytes | str) -> str:
    """sha256 hex of the canonical JSON of tool arguments; of the raw bytes when they do not parse."""
    ok, value = parse_json(raw)
    if ok:
        try:
            return _sha256(canonical_json(value))
        except ValueError:  # NaN / Infinity parsed by json.loads: not canonicalisable
            pass
    return _sha256(raw.encode("utf-8") if isinstance(raw, str) else raw)


def result_hash(body: bytes) -> str:
    """sha256 hex of the canonical JSON of a result; of its raw bytes when it is not JSON."""
    return args_hash(body)


def idempotency_key(run_id: str, tool: str, key_args: Any, operation_id: str | None) -> str:
    """The derived key of a side-effecting tool call (DESIGN.md "Idempotent tool calls")."""
    doc = {"run": run_id, "tool": tool, "args": key_args, "op": operation_id}
    return _sha256(canonical_json(doc))[:32]
