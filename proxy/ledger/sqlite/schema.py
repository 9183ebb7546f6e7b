"""The SQLite ledger's schema: the tables (DDL), their upgrades, and the mapping between rows and
base.py's data classes (`RunState`, `IdempotencyRecord`).

Schema upgrades: `SCHEMA` is the first release's; the columns added since (`ADDED_COLUMNS`) are
added at open, to a new file as to an older one (`upgrade`: idempotent, run under the write lock so
two processes starting together do not both add them). Idempotency records are keyed by the
composite primary key (run_id, key): no two (run, key) pairs share a row, whatever they hold.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from proxy.caps import stored_caps
from proxy.ledger.base import (
    CHILD_IDS_KEPT,
    SUB_TOTALS,
    IdempotencyRecord,
    RunState,
    Totals,
    change,
    copy_state,
)
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
-- A run tree's children, by parent, in the order they were created (`GET /runs`' ids): written
-- once per child, apart from the parent's row that every call of its subtree updates.
CREATE TABLE IF NOT EXISTS run_children (
    parent TEXT NOT NULL,
    child TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (parent, child)
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

# A run's subtree totals (`base.SUB_TOTALS`, in `base.Totals`' order), each a column (see `tree` below).
SUB_COLUMNS = (
    "sub_usd", "sub_reserved_usd", "sub_tokens", "sub_reserved_tokens", "sub_steps", "sub_tool_calls"
)  # fmt: skip

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
        # as a root, and a root pays one empty column, not fourteen): see `_tree_columns`.
        ("tree", "TEXT NOT NULL DEFAULT ''"),
        # ... but for the subtree totals (`base.SUB_TOTALS` of that array), which every call of a
        # descendant changes: in columns of their own, so that one narrow UPDATE adds a call's
        # change to all its ancestors (`save_run_changed`) without reading or re-encoding them.
        *((name, "INTEGER NOT NULL DEFAULT 0") for name in SUB_COLUMNS),
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
    "context_baseline, upstream_failures, max_repeats, repeats, tree, " + ", ".join(SUB_COLUMNS)
)
UPSERT = f"INSERT OR REPLACE INTO runs ({COLUMNS}) VALUES ({', '.join('?' * 32)})"


# A run's `tree` column parsed (`_parse_tree`): parent, root, ancestors, children count and tree
# caps — `tree_values` less the subtree totals. A run's tree fields hardly change (a new child, an
# operator's tree cap) while every call of the run, and of each of its descendants, reads and
# writes them: each distinct text is parsed, and each distinct tuple encoded, once.
_TreeFields = tuple[str, str, tuple[str, ...], int, int | None, int | None, int | None, int | None]
_NO_TREE_FIELDS: _TreeFields = ("", "", (), 0, None, None, None, None)
TREES_KEPT = 4096


@functools.lru_cache(maxsize=TREES_KEPT)
def _parse_tree(raw: str) -> _TreeFields:
    t = json.loads(raw)
    return (t[0], t[1], tuple(t[2]), t[3], t[4], t[5], t[6], t[7])


@functools.lru_cache(maxsize=TREES_KEPT)
def _encode_tree(fields: _TreeFields) -> str:
    parent, root, ancestors, *rest = fields
    return json.dumps([parent, root, list(ancestors), *rest])


def row_to_state(row: tuple[Any, ...]) -> RunState:
    parent, root, ancestors, children, depth, fan_out, tree_steps, tree_calls = (
        _parse_tree(row[25]) if row[25] else _NO_TREE_FIELDS
    )
    caps = stored_caps(
        row[5], row[6], row[7], row[8], row[9], None, None, row[23], depth, fan_out, tree_steps, tree_calls
    )
    return RunState(
        run_id=row[0],
        task=row[1],
        status=row[2],
        started_at=row[3],
        updated_at=row[4],
        caps=caps,
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
        parent_run_id=parent,
        root_run_id=root,
        ancestors=ancestors,
        children=children,
        sub_spent_usd_nanos=row[26],
        sub_reserved_usd_nanos=row[27],
        sub_tokens=row[28],
        sub_reserved_tokens=row[29],
        sub_steps=row[30],
        sub_tool_calls=row[31],
    )


def state_to_row(s: RunState) -> tuple[Any, ...]:
    c = s.caps
    return (
        s.run_id, s.task, s.status, s.started_at, s.updated_at,
        c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls, c.deadline,
        s.spent_usd_nanos, s.input_tokens, s.output_tokens, s.steps, s.tool_calls_requested,
        s.tool_calls_executed, s.reserved_usd_nanos, s.reserved_tokens, s.final_reason, int(s.cancelled),
        s.operator_caps, s.context_baseline, s.upstream_failures, c.max_repeats, s.repeats.to_json(),
        _tree_column(s),
        s.sub_spent_usd_nanos, s.sub_reserved_usd_nanos, s.sub_tokens, s.sub_reserved_tokens, s.sub_steps,
        s.sub_tool_calls,
    )  # fmt: skip


def stored_form(s: RunState) -> RunState:
    """A copy of `s` as a read of the row it is saved as builds it — `row_to_state(state_to_row(s))`
    without the round trip through SQLite (runrows.py keeps it): the caps the row stores (no
    `timeout_s`, resolved into `deadline` when the run was created, nor the per-step
    `max_context_tokens`), no `child_ids` (`get_run` reads them) nor `tree_deadline` (never
    stored). The window of repeats is shared: the rules copy it before they change it.
    `test_stored_form_is_what_a_read_of_the_row_builds` pins the two together."""
    c = s.caps
    out = copy_state(s)
    out.caps = stored_caps(
        c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls, c.deadline, None, None,
        c.max_repeats, c.max_depth, c.max_children, c.max_tree_steps, c.max_tree_tool_calls,
    )  # fmt: skip
    out.cancelled = bool(s.cancelled)
    out.child_ids = ()
    out.tree_deadline = None
    if not s.repeats:
        out.repeats = Repeats()  # an empty window is stored as nothing
    return out


def _tree_column(s: RunState) -> str:
    """A run's `tree` column: the JSON array of `tree_values` without the subtree totals (which
    have columns of their own); '' for a run in no tree and without tree caps (`tree_values`)."""
    c = s.caps
    fields = (
        s.parent_run_id, s.root_run_id, s.ancestors, s.children,
        c.max_depth, c.max_children, c.max_tree_steps, c.max_tree_tool_calls,
    )  # fmt: skip
    if fields == _NO_TREE_FIELDS:
        return ""  # the subtree totals of a run without children are 0: its columns hold them
    return _encode_tree(fields)


@functools.cache
def _add_to_ancestors(n: int) -> str:
    """The statement adding a change to `n` ancestors (made once per depth)."""
    added = ", ".join(f"{name} = {name} + ?" for name in SUB_COLUMNS)
    return f"UPDATE runs SET {added}, updated_at = MAX(updated_at, ?) WHERE run_id IN ({', '.join('?' * n)})"


def save_statuses(db: sqlite3.Connection, states: Sequence[RunState | None]) -> None:
    """The status of each of `states` (a refusal names the ancestor whose cap binds)."""
    db.executemany(
        "UPDATE runs SET status = ? WHERE run_id = ?", [(s.status, s.run_id) for s in states if s is not None]
    )


def save_run_changed(db: sqlite3.Connection, state: RunState, before: Totals, now: float) -> None:
    """The run, and what changed in its totals since `before` added to its ancestors'."""
    save_run(db, state)
    add_change(db, state.ancestors, change(before, state), now)


def add_change(db: sqlite3.Connection, ancestors: Sequence[str], delta: Totals | None, now: float) -> None:
    """`delta` added to each of `ancestors`' subtree totals, and their `updated_at` moved to `now` —
    `base.propagate` as one narrow statement, the ancestors neither read nor re-encoded (one that
    expired has no row: nothing to add to, as in `propagate`)."""
    if delta is not None and ancestors:
        db.execute(_add_to_ancestors(len(ancestors)), (*delta, now, *ancestors))


def upgrade(db: sqlite3.Connection) -> None:
    """Add the columns a ledger file made by an older runcap lacks (idempotent; call it inside a
    write transaction)."""
    for table, columns in ADDED_COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for name, decl in columns:
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
        if table == "runs" and SUB_COLUMNS[0] not in have:
            _move_sub_totals(db)


def _move_sub_totals(db: sqlite3.Connection) -> None:
    """Rows written while the subtree totals were in the `tree` array: moved to their columns."""
    rows = db.execute("SELECT run_id, tree FROM runs WHERE tree != ''").fetchall()
    for run_id, raw in rows:
        t = json.loads(raw)
        subs = t[SUB_TOTALS]
        del t[SUB_TOTALS]
        db.execute(
            f"UPDATE runs SET tree = ?, {', '.join(f'{n} = ?' for n in SUB_COLUMNS)} WHERE run_id = ?",
            (json.dumps(t), *subs, run_id),
        )


def add_child(db: sqlite3.Connection, child: RunState) -> None:
    """A new child, indexed under its parent."""
    db.execute(
        "INSERT OR IGNORE INTO run_children (parent, child, created_at) VALUES (?, ?, ?)",
        (child.parent_run_id, child.run_id, child.started_at),
    )


def child_ids(db: sqlite3.Connection, parent: str) -> tuple[str, ...]:
    """The first `CHILD_IDS_KEPT` children of `parent`, oldest first."""
    rows = db.execute(
        "SELECT child FROM run_children WHERE parent = ? ORDER BY created_at, child LIMIT ?",
        (parent, CHILD_IDS_KEPT),
    ).fetchall()
    return tuple(r[0] for r in rows)


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
