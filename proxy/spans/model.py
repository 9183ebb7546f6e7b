"""The records the request path produces: one `Span` per step event, one `RunSnapshot` per run
state change, and `Payload` bodies. Field names are the `runcap.spans` / `runcap.runs` column
names fixed in DESIGN.md; proxy/spans/records.py writes them to the WAL field by field, and the
shipper delivers them unchanged to every sink.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import NamedTuple

SPAN_KINDS = ("model", "tool", "tool_call", "tool_result", "approval")
OUTCOMES = (
    "ok",
    "error",
    "timeout",
    "cancelled",
    "budget_exceeded",
    "deadline_exceeded",
    "replayed",
    "unknown",
)
RUN_STATUSES = (
    "active",
    "completed",
    "budget_exceeded",
    "deadline_exceeded",
    "steps_exceeded",
    "tool_calls_exceeded",
    "cancelled",
    "repeats_exceeded",
    "ancestor_budget_exceeded",  # run trees: not terminal (a top-up of the ancestor lets it go on)
    "ancestor_deadline_exceeded",  # run trees: not terminal (an extension of the ancestor's deadline)
)


# Span ids need to be unique and random-looking (W3C/OpenTelemetry), not secret: a PRNG seeded
# from the OS, re-seeded in a forked child, instead of a getrandom() syscall per span.
_ids = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _ids.seed(secrets.randbits(128)))


def new_span_id() -> str:
    return f"{_ids.getrandbits(64) or 1:016x}"


# The runs of the last few thousand spans: a run's steps and the tool spans of one step hit it. Not
# more: every call without X-Run-Id is a run of its own that never hits, and 65,536 entries were
# 12 MB of the serving process's RSS once full (bench/README.md).
@functools.lru_cache(maxsize=4096)
def trace_id_for_run(run_id: str) -> str:
    """One OpenTelemetry trace per run tree: the trace id is derived from the root run's id, so
    every replica (and every restart) puts a run's spans, and its sub-agents', in the same trace
    without coordination (a run without a parent is its own root: one trace per run)."""
    return hashlib.sha256(b"runcap-trace:" + run_id.encode()).hexdigest()[:32]


class SpanEvent(NamedTuple):
    """Something that happened at one moment during a span (an approval asked for or decided, a
    policy's verdict): exported as an OTLP span event, kept in the `events` column of
    `runcap.spans`. A tuple, so the WAL line carries it as `[name, at, attributes]` and ClickHouse
    reads it as its `Tuple(name, at, attributes)` as is."""

    name: str
    at: datetime  # timezone-aware UTC
    attributes: dict[str, str]


@dataclass(slots=True)
class Span:
    run_id: str
    kind: str  # one of SPAN_KINDS
    step: int
    started_at: datetime  # timezone-aware UTC
    trace_id: str = ""
    span_id: str = field(default_factory=new_span_id)
    parent_span_id: str = ""
    duration_ms: float = 0.0
    ttft_ms: float | None = None
    task: str = ""
    provider: str = ""
    model: str = ""
    endpoint: str = ""
    status_code: int = 0
    outcome: str = "ok"  # one of OUTCOMES
    error: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    price_known: bool = True
    tool_name: str = ""
    tool_call_id: str = ""
    args_hash: str = ""
    result_hash: str = ""
    idempotency_key: str = ""
    request_hash: str = ""
    response_hash: str = ""
    attributes: dict[str, str] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)  # in time order
    # The run tree (issue 22): the run that spawned this span's run ('' for a root) and the tree's
    # root (a root's own id). Last (after `events`), so a WAL record of version 2 is read by
    # appending them.
    parent_run_id: str = ""
    root_run_id: str = ""

    def __post_init__(self) -> None:
        if not self.root_run_id:
            self.root_run_id = self.run_id
        if not self.trace_id:
            # a tree is one trace: a sub-agent's steps are in its root's trace
            self.trace_id = trace_id_for_run(self.root_run_id)


@dataclass(slots=True)
class RunSnapshot:
    """Latest state of a run, written on every step (queries take argMax by updated_at)."""

    run_id: str
    task: str
    started_at: datetime
    updated_at: datetime
    status: str  # one of RUN_STATUSES
    steps: int
    tool_calls: int
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal
    max_usd: Decimal | None
    max_tokens: int | None
    max_steps: int | None
    max_tool_calls: int | None
    deadline: datetime | None
    # The run tree, as on `Span` (a root: '' and its own id).
    parent_run_id: str = ""
    root_run_id: str = ""

    def __post_init__(self) -> None:
        if not self.root_run_id:
            self.root_run_id = self.run_id


@dataclass(slots=True)
class Payload:
    """A body to keep in the payload store under sha256(data)."""

    sha256: str
    data: bytes
    content_type: str = ""
