"""The SQLite ledger's approvals (DESIGN.md "Tool policies and approvals"): one table, one row per
approval asked for a call; the rules are base.py's (`open_approval`, `decide_approval`,
`deny_for_cancel`), applied inside the ledger's write transaction.

A call (run_id, key) may have several rows over time — an expired one and the new one asked after
it — so the call's approval is its newest row (`approvals_call` index, newest first).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from proxy.ledger import base

SCHEMA = """
CREATE TABLE IF NOT EXISTS approvals (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    key TEXT NOT NULL,
    tool TEXT NOT NULL,
    args_hash TEXT NOT NULL,
    tenant TEXT NOT NULL,
    state TEXT NOT NULL,
    requested_at REAL NOT NULL,
    expires_at REAL,
    decided_at REAL,
    by TEXT NOT NULL,
    reason TEXT NOT NULL,
    rule TEXT NOT NULL,
    rule_reason TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    step INTEGER NOT NULL
) WITHOUT ROWID;
-- The call's approval (its newest row), and the pending list (`runcap approvals`).
CREATE INDEX IF NOT EXISTS approvals_call ON approvals(run_id, key, requested_at);
CREATE INDEX IF NOT EXISTS approvals_state ON approvals(state, requested_at);
"""

COLUMNS = (
    "id, run_id, key, tool, args_hash, tenant, state, requested_at, expires_at, decided_at, by, reason, "
    "rule, rule_reason, request_hash, step"
)
_UPSERT = f"INSERT OR REPLACE INTO approvals ({COLUMNS}) VALUES ({', '.join('?' * 16)})"


def _row(row: tuple[Any, ...]) -> base.Approval:
    return base.Approval(*row)


def _save(db: sqlite3.Connection, a: base.Approval) -> None:
    db.execute(_UPSERT, tuple(a.as_json().values()))


def _of_call(db: sqlite3.Connection, run_id: str, key: str) -> base.Approval | None:
    row = db.execute(
        f"SELECT {COLUMNS} FROM approvals WHERE run_id = ? AND key = ? ORDER BY requested_at DESC LIMIT 1",
        (run_id, key),
    ).fetchone()
    return _row(row) if row else None


def _by_id(db: sqlite3.Connection, approval_id: str) -> base.Approval | None:
    row = db.execute(f"SELECT {COLUMNS} FROM approvals WHERE id = ?", (approval_id,)).fetchone()
    return _row(row) if row else None


def open_approval(db: sqlite3.Connection, req: base.ApprovalRequest) -> tuple[base.Approval, bool]:
    """Inside a write transaction."""
    existing = _of_call(db, req.run_id, req.key)
    approval, new = base.open_approval(existing, req)
    if existing is not None and existing.state == base.EXPIRED:
        _save(db, existing)
    if new:
        _save(db, approval)
    return approval, new


def get_approval(db: sqlite3.Connection, approval_id: str, now: float) -> base.Approval | None:
    approval = _by_id(db, approval_id)
    if approval is not None:
        base.expire_if_due(approval, now)  # as read; written by the next write of it
    return approval


def list_approvals(
    db: sqlite3.Connection, now: float, state: str | None, run_id: str | None, limit: int
) -> list[base.Approval]:
    where, args = [], []
    if state == base.PENDING or state == base.EXPIRED:
        where.append("state IN (?, ?)")  # a pending row may be expired by now (and the reverse: none)
        args += [base.PENDING, base.EXPIRED]
    elif state is not None:
        where.append("state = ?")
        args.append(state)
    if run_id is not None:
        where.append("run_id = ?")
        args.append(run_id)
    sql = f"SELECT {COLUMNS} FROM approvals" + (" WHERE " + " AND ".join(where) if where else "")
    out = []
    for row in db.execute(sql + " ORDER BY requested_at", args):
        approval = _row(row)
        base.expire_if_due(approval, now)
        if state is None or approval.state == state:
            out.append(approval)
        if len(out) >= limit:
            break
    return out


def decide_approval(
    db: sqlite3.Connection, approval_id: str, approve: bool, by: str, reason: str, now: float
) -> base.Approval | None:
    """Inside a write transaction."""
    approval = _by_id(db, approval_id)
    if approval is None:
        return None
    try:
        base.decide_approval(approval, approve, by, reason, now)
    finally:
        _save(db, approval)  # an expiry found on the way is written too
    return approval


def deny_pending(db: sqlite3.Connection, run_id: str, now: float) -> list[base.Approval]:
    """Inside a write transaction."""
    rows = db.execute(
        f"SELECT {COLUMNS} FROM approvals WHERE run_id = ? AND state = ?", (run_id, base.PENDING)
    ).fetchall()
    denied = []
    for row in rows:
        approval = _row(row)
        if base.deny_for_cancel(approval, now):
            denied.append(approval)
        _save(db, approval)
    return denied


def purge(db: sqlite3.Connection, cutoff: float) -> int:
    """Approvals decided (or, never decided, asked) before `cutoff`: the ledger's retention, as
    Redis lets their keys expire."""
    sql = "DELETE FROM approvals WHERE COALESCE(decided_at, requested_at) < ?"
    return db.execute(sql, (cutoff,)).rowcount
