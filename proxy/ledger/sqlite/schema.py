"""The SQLite ledger's schema: the tables (DDL), their upgrades, and the mapping between rows and
base.py's data classes (`RunState`, `IdempotencyRecord`).

Schema upgrades: `SCHEMA` is the first release's; the columns added since (`ADDED_COLUMNS`) are
added at open, to a new file as to an older one (`upgrade`: idempotent, run under the write lock so
two processes starting together do not both add them). Idempotency records are keyed by the
composite primary key (run_id, key): no two (run, key) pairs share a row, whatever they hold.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from proxy.caps import RunCaps
from proxy.ledger.base import IdempotencyRecord, RunState, load_tree_values, tree_values
from proxy.ledger.repeats import Repeats

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    max_usd INTEGER, max_tokens INTEGER, max_steps INTEGER, max_tool_calls INTEGER, deadline REAL,
    spent_usd INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    steps INTEGER NOT NULL, tool_calls_requested INTEGER NOT NULL, tool_calls_executed INTEGER NOT NULL,
    reserved_usd INTEGER NOT NULL, reserved_tokens INTEGER NOT NULL,
    final_reason TEXT, cancelled INTEGER NOT NULL
) WITHOUT ROWID;
-- Clustered by owner: recovery reads one owner's rows, and a call's insert and delete touch one
-- b-tree page (no secondary index) — fewer WAL pages per commit on the hot path.
CREATE TABLE IF NOT EXISTS reservations (
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    usd INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (owner, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tool_calls (
    run_id TEXT NOT NULL,
    key TEXT NOT NULL,
    tool TEXT NOT NULL,
    args_hash TEXT NOT NULL,
    state TEXT NOT NULL,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    step INTEGER NOT NULL,
    status INTEGER,
    headers TEXT NOT NULL,
    body BLOB NOT NULL,
    error TEXT NOT NULL,
    PRIMARY KEY (run_id, key)
);
CREATE INDEX IF NOT EXISTS tool_calls_state ON tool_calls(state, updated_at);
-- Reservations a sweep charged at their reserved amount (their owner looked dead): when the owner
-- settles one after all, its real usage replaces that charge (`settle`). Purged with retention.
CREATE TABLE IF NOT EXISTS swept_reservations (
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    usd INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    swept_at REAL NOT NULL,
    PRIMARY KEY (owner, id)
) WITHOUT ROWID;
-- One row per live process, rewritten by each readiness check: proves the file takes writes.
CREATE TABLE IF NOT EXISTS probe (owner TEXT PRIMARY KEY, at REAL NOT NULL) WITHOUT ROWID;
-- Provider objects (files, stored responses, batches...) and the tenant that created each, for
-- tenants sharing one provider key (server/steps/tenant_objects.py). Not purged: objects outlive runs.
CREATE TABLE IF NOT EXISTS provider_objects (
    account TEXT NOT NULL,
    object_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (account, object_id)
) WITHOUT ROWID;
"""

# Columns added since the first release — to a new file as to an older one (`upgrade`). A row
# written before they were has method '' (IdempotencyRecord: its operation beyond the tool is not known).
ADDED_COLUMNS = {
    "runs": (
        ("operator_caps", "TEXT NOT NULL DEFAULT ''"),
        ("context_baseline", "INTEGER NOT NULL DEFAULT 0"),
        ("upstream_failures", "INTEGER NOT NULL DEFAULT 0"),
        ("max_repeats", "INTEGER"),
        ("repeats", "TEXT NOT NULL DEFAULT ''"),
        # Run trees (issue 22), one JSON array ('' for a run in no tree: a row written before reads
        # as a root, and a root pays one empty column, not fourteen): see `_tree_json`.
        ("tree", "TEXT NOT NULL DEFAULT ''"),
    ),
    "tool_calls": (
        ("method", "TEXT NOT NULL DEFAULT ''"),
        ("path", "TEXT NOT NULL DEFAULT ''"),
        ("op_hash", "TEXT NOT NULL DEFAULT ''"),
    ),
}

TOOL_COLUMNS = (
    "run_id, key, tool, args_hash, state, owner, created_at, updated_at, step, status, headers, body, error, "
    "method, path, op_hash"
)
TOOL_UPSERT = f"INSERT OR REPLACE INTO tool_calls ({TOOL_COLUMNS}) VALUES ({', '.join('?' * 16)})"


def row_to_record(row: tuple[Any, ...]) -> IdempotencyRecord:
    return IdempotencyRecord(
        run_id=row[0], key=row[1], tool=row[2], args_hash=row[3], state=row[4], owner=row[5],
        created_at=row[6], updated_at=row[7], step=row[8], status=row[9], headers=json.loads(row[10]),
        body=bytes(row[11]), error=row[12], method=row[13], path=row[14], op_hash=row[15],
    )  # fmt: skip


def record_to_row(r: IdempotencyRecord) -> tuple[Any, ...]:
    return (
        r.run_id, r.key, r.tool, r.args_hash, r.state, r.owner, r.created_at, r.updated_at, r.step,
        r.status, json.dumps(r.headers), r.body, r.error, r.method, r.path, r.op_hash,
    )  # fmt: skip


COLUMNS = (
    "run_id, task, status, started_at, updated_at, max_usd, max_tokens, max_steps, max_tool_calls, "
    "deadline, spent_usd, input_tokens, output_tokens, steps, tool_calls_requested, "
    "tool_calls_executed, reserved_usd, reserved_tokens, final_reason, cancelled, operator_caps, "
    "context_baseline, upstream_failures, max_repeats, repeats, tree"
)
UPSERT = f"INSERT OR REPLACE INTO runs ({COLUMNS}) VALUES ({', '.join('?' * 26)})"


def row_to_state(row: tuple[Any, ...]) -> RunState:
    state = RunState(
        run_id=row[0],
        task=row[1],
        status=row[2],
        started_at=row[3],
        updated_at=row[4],
        caps=RunCaps(row[5], row[6], row[7], row[8], row[9], max_repeats=row[23]),
        spent_usd_nanos=row[10],
        input_tokens=row[11],
        output_tokens=row[12],
        steps=row[13],
        tool_calls_requested=row[14],
        tool_calls_executed=row[15],
        reserved_usd_nanos=row[16],
        reserved_tokens=row[17],
        final_reason=row[18],
        cancelled=bool(row[19]),
        operator_caps=row[20],
        context_baseline=row[21],
        upstream_failures=row[22],
        repeats=Repeats.from_json(row[24]),
    )
    if row[25]:
        _load_tree(state, row[25])
    return state


def state_to_row(s: RunState) -> tuple[Any, ...]:
    c = s.caps
    return (
        s.run_id, s.task, s.status, s.started_at, s.updated_at,
        c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls, c.deadline,
        s.spent_usd_nanos, s.input_tokens, s.output_tokens, s.steps, s.tool_calls_requested,
        s.tool_calls_executed, s.reserved_usd_nanos, s.reserved_tokens, s.final_reason, int(s.cancelled),
        s.operator_caps, s.context_baseline, s.upstream_failures, c.max_repeats, s.repeats.to_json(),
        _tree_json(s),
    )  # fmt: skip


def _tree_json(s: RunState) -> str:
    """A run tree's fields as one JSON array; '' for a run in no tree (and without tree caps)."""
    values = tree_values(s)
    return json.dumps(values) if values else ""


def _load_tree(state: RunState, raw: str) -> None:
    load_tree_values(state, json.loads(raw))


def load_runs(db: sqlite3.Connection, run_ids: Sequence[str]) -> list[RunState | None]:
    """Several runs (a run's ancestors) in one statement, in the order asked."""
    if not run_ids:
        return []
    rows = db.execute(
        f"SELECT {COLUMNS} FROM runs WHERE run_id IN ({', '.join('?' * len(run_ids))})", tuple(run_ids)
    ).fetchall()
    found = {row[0]: row_to_state(row) for row in rows}
    return [found.get(run_id) for run_id in run_ids]


def save_runs(db: sqlite3.Connection, states: Sequence[RunState | None]) -> None:
    db.executemany(UPSERT, [state_to_row(s) for s in states if s is not None])


def upgrade(db: sqlite3.Connection) -> None:
    """Add the columns a ledger file made by an older runcap lacks (idempotent; call it inside a
    write transaction)."""
    for table, columns in ADDED_COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for name, decl in columns:
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")


def load_run(db: sqlite3.Connection, run_id: str) -> RunState | None:
    row = db.execute(f"SELECT {COLUMNS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return row_to_state(row) if row else None


def save_run(db: sqlite3.Connection, state: RunState) -> None:
    db.execute(UPSERT, state_to_row(state))


def load_record(db: sqlite3.Connection, run_id: str, key: str) -> IdempotencyRecord | None:
    row = db.execute(
        f"SELECT {TOOL_COLUMNS} FROM tool_calls WHERE run_id = ? AND key = ?", (run_id, key)
    ).fetchone()
    return row_to_record(row) if row else None


def save_record(db: sqlite3.Connection, record: IdempotencyRecord) -> None:
    db.execute(TOOL_UPSERT, record_to_row(record))
