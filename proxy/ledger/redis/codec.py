"""The Redis ledger's values: a run and an idempotency record as the JSON its keys hold.

A run is a JSON array (positional: compact, and the scripts never look inside); fields added
since the first release are appended, and a run written before them reads with their defaults.
A record is a JSON object without its body, which is kept in a field of its own (`b`).
"""

from __future__ import annotations

import orjson

from proxy.caps import stored_caps
from proxy.ledger.base import IdempotencyRecord, RunState, load_tree_values, tree_values
from proxy.ledger.repeats import Repeats


def state_json(s: RunState) -> bytes:
    c = s.caps
    return orjson.dumps(
        [
            s.run_id, s.task, s.status, s.started_at, s.updated_at,
            c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls, c.deadline,
            s.spent_usd_nanos, s.input_tokens, s.output_tokens, s.steps, s.tool_calls_requested,
            s.tool_calls_executed, s.reserved_usd_nanos, s.reserved_tokens, s.final_reason, s.cancelled,
            s.operator_caps, s.context_baseline, s.upstream_failures, c.max_repeats, s.repeats.to_json(),
            *tree_values(s),
        ]
    )  # fmt: skip


def json_state(raw: bytes | str) -> RunState:
    r = orjson.loads(raw)
    state = RunState(
        run_id=r[0], task=r[1], status=r[2], started_at=r[3], updated_at=r[4],
        caps=stored_caps(r[5], r[6], r[7], r[8], r[9], None, None, r[23] if len(r) > 23 else None),
        spent_usd_nanos=r[10], input_tokens=r[11], output_tokens=r[12], steps=r[13],
        tool_calls_requested=r[14], tool_calls_executed=r[15], reserved_usd_nanos=r[16],
        reserved_tokens=r[17], final_reason=r[18], cancelled=r[19],
        operator_caps=r[20] if len(r) > 20 else "",  # written before operator top-ups existed
        context_baseline=r[21] if len(r) > 21 else 0,  # written before context growth existed
        upstream_failures=r[22] if len(r) > 22 else 0,  # written before failures were counted
        repeats=Repeats.from_json(r[24] if len(r) > 24 else ""),  # written before X-Run-Max-Repeats
    )  # fmt: skip
    if len(r) > 25:  # a run of a tree (a run written before trees existed reads as a root)
        load_tree_values(state, r[25:])
    return state


def record_json(r: IdempotencyRecord) -> bytes:
    return orjson.dumps(
        {
            "run_id": r.run_id, "key": r.key, "tool": r.tool, "args_hash": r.args_hash, "state": r.state,
            "owner": r.owner, "created_at": r.created_at, "updated_at": r.updated_at, "step": r.step,
            "status": r.status, "headers": r.headers, "error": r.error,
            "method": r.method, "path": r.path, "op_hash": r.op_hash,
        }
    )  # fmt: skip


def json_record(meta: bytes | str, body: bytes | str | None) -> IdempotencyRecord:
    return IdempotencyRecord(**orjson.loads(meta), body=as_bytes(body) if body else b"")


# The client answers bytes (`decode_responses` is off); its types say `bytes | str`.


def as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
