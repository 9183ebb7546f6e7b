"""Recovery sweeps of the SQLite ledger: the rows dead owners left (liveness.py says which owners
are dead), and retention.

A dead owner's reservations are settled at their reserved amount (base.py's `apply_recovery`) and
kept in `swept_reservations` (an owner taken for dead by mistake settles them at their real usage
after all); the tool calls it left `in_flight` become `unknown` (they may or may not have reached
the tool). Retention: idempotency records, and runs without reservations, not updated for
`ledger_retention_s` are deleted (`purge`), with the sweeps' records of the same age.

Each function runs in the caller's transaction, on its connection.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from proxy.ledger.base import RecoveredReservation, apply_recovery, totals
from proxy.ledger.sqlite.schema import load_run, save_run_changed
from proxy.ledger.sweep import DIED, log_turned_unknown


def other_owners(db: sqlite3.Connection, owner: str) -> list[str]:
    """The owners other than `owner` with reservations or in-flight tool calls."""
    return [
        r[0]
        for r in db.execute(
            "SELECT owner FROM reservations WHERE owner != ? UNION "
            "SELECT owner FROM tool_calls WHERE state = 'in_flight' AND owner != ?",
            (owner, owner),
        )
    ]


def settle_owner(db: sqlite3.Connection, owner: str, now: float) -> list[RecoveredReservation]:
    """Settle a dead owner's reservations at their reserved amount and turn its in-flight tool
    calls unknown."""
    rows = db.execute(
        "SELECT id, run_id, usd, input_tokens, output_tokens FROM reservations WHERE owner = ?",
        (owner,),
    ).fetchall()
    out = []
    for rid, run_id, usd, tin, tout in rows:
        state = load_run(db, run_id)
        if state is not None:
            # What the reservation held in its ancestors' subtree totals moves there too.
            before = totals(state)
            apply_recovery(state, usd, tin, tout, now)
            save_run_changed(db, state, before, now)
        out.append(RecoveredReservation(run_id, rid, usd, tin + tout))
    db.execute(
        "INSERT OR REPLACE INTO swept_reservations SELECT owner, id, run_id, usd, "
        "input_tokens, output_tokens, ? FROM reservations WHERE owner = ?",
        (now, owner),
    )
    db.execute("DELETE FROM reservations WHERE owner = ?", (owner,))
    for run_id, key, tool in db.execute(
        "UPDATE tool_calls SET state = 'unknown', updated_at = ?, error = ? "
        "WHERE owner = ? AND state = 'in_flight' RETURNING run_id, key, tool",
        (now, DIED, owner),
    ).fetchall():
        log_turned_unknown(run_id, key, tool)
    return out


def purge(db: sqlite3.Connection, cutoff: float) -> int:
    """Delete idempotency records, idle runs and sweeps' records not updated since `cutoff`."""
    n = db.execute("DELETE FROM tool_calls WHERE updated_at < ? AND state != 'in_flight'", (cutoff,)).rowcount
    n += db.execute(
        "DELETE FROM runs WHERE updated_at < ? AND run_id NOT IN (SELECT run_id FROM reservations)",
        (cutoff,),
    ).rowcount
    n += db.execute("DELETE FROM swept_reservations WHERE swept_at < ?", (cutoff,)).rowcount
    db.execute("DELETE FROM run_children WHERE parent NOT IN (SELECT run_id FROM runs)")
    return n


def has_leftovers(path: Path, owner: str) -> bool:
    """Whether `owner` left reservations or in-flight tool calls in the file at `path` (read on a
    connection of its own: the ledger's may be closed)."""
    db = sqlite3.connect(path)
    try:
        return (
            db.execute(
                "SELECT 1 FROM reservations WHERE owner = ? UNION ALL "
                "SELECT 1 FROM tool_calls WHERE owner = ? AND state = 'in_flight' LIMIT 1",
                (owner, owner),
            ).fetchone()
            is not None
        )
    finally:
        db.close()
