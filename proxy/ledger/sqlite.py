"""SQLite ledger backend: the embedded default, one file under the data directory.

Each operation is one `BEGIN IMMEDIATE` transaction (the write lock is taken up front, so two
processes — `serve --workers N` — cannot both read a run's remaining budget and both spend it).
WAL mode with `synchronous=NORMAL`: a committed transaction survives a `kill -9` of the process
(it is in the WAL file before COMMIT returns); only an OS crash may lose the last commits.

Reservations are rows owned by the process that made them. Each process holds an exclusive
`flock` on its own owner file for as long as it lives; a reservation whose owner file can be
locked by someone else belongs to a dead process and is settled at its reserved amount.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import sqlite3
import time
from pathlib import Path

from proxy.caps import RunCaps
from proxy.errors import Rejection
from proxy.ledger.base import (
    Ledger,
    RecoveredReservation,
    Reservation,
    RunState,
    Settlement,
    StepRequest,
    apply_recovery,
    apply_settlement,
    check_live,
    decide_step,
    merge_caps,
    new_run,
)

log = logging.getLogger("runcap.ledger")

_SCHEMA = """
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
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    usd INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    created_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS reservations_owner ON reservations(owner);
"""

_COLUMNS = (
    "run_id, task, status, started_at, updated_at, max_usd, max_tokens, max_steps, max_tool_calls, "
    "deadline, spent_usd, input_tokens, output_tokens, steps, tool_calls_requested, "
    "tool_calls_executed, reserved_usd, reserved_tokens, final_reason, cancelled"
)
_UPSERT = f"INSERT OR REPLACE INTO runs ({_COLUMNS}) VALUES ({', '.join('?' * 20)})"


def _row_to_state(row: tuple) -> RunState:  # type: ignore[type-arg]
    return RunState(
        run_id=row[0],
        task=row[1],
        status=row[2],
        started_at=row[3],
        updated_at=row[4],
        caps=RunCaps(row[5], row[6], row[7], row[8], row[9]),
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
    )


def _state_to_row(s: RunState) -> tuple:  # type: ignore[type-arg]
    c = s.caps
    return (
        s.run_id, s.task, s.status, s.started_at, s.updated_at,
        c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls, c.deadline,
        s.spent_usd_nanos, s.input_tokens, s.output_tokens, s.steps, s.tool_calls_requested,
        s.tool_calls_executed, s.reserved_usd_nanos, s.reserved_tokens, s.final_reason, int(s.cancelled),
    )  # fmt: skip


class SQLiteLedger(Ledger):
    name = "sqlite"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._owners_dir = self.path.parent / "ledger-owners"
        self._owners_dir.mkdir(exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.owner = secrets.token_hex(8)
        self._owner_file = open(self._owners_dir / f"{self.owner}.lock", "w")
        fcntl.flock(self._owner_file, fcntl.LOCK_EX | fcntl.LOCK_NB)

    # -- transactions -------------------------------------------------------------------------

    def _load(self, run_id: str) -> RunState | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return _row_to_state(row) if row else None

    def _save(self, state: RunState) -> None:
        self._db.execute(_UPSERT, _state_to_row(state))

    def begin_step(self, req: StepRequest) -> Reservation:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            state = self._load(req.run_id) or new_run(req.run_id, req.task, req.caps, req.now)
            try:
                res = decide_step(state, req)
            except Rejection:
                self._save(state)
                db.execute("COMMIT")
                raise
            self._save(state)
            db.execute(
                "INSERT INTO reservations (id, run_id, owner, usd, input_tokens, output_tokens, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (res.id, res.run_id, self.owner, res.usd_nanos, res.input_tokens, res.output_tokens, req.now),
            )
            db.execute("COMMIT")
            return res
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def settle(self, reservation: Reservation, settlement: Settlement, now: float) -> RunState:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            gone = db.execute("DELETE FROM reservations WHERE id = ?", (reservation.id,)).rowcount == 0
            state = self._load(reservation.run_id)
            if state is None:
                raise KeyError(reservation.run_id)
            if gone:
                # Already settled by recovery (this process was thought dead): never charge twice.
                log.warning(
                    "reservation %s of run %s was already settled", reservation.id, reservation.run_id
                )
            else:
                apply_settlement(state, reservation, settlement, now)
                self._save(state)
            db.execute("COMMIT")
            return state
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def touch_run(self, run_id: str, task: str, caps: RunCaps, now: float) -> RunState:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            state = self._load(run_id)
            if state is None:
                state = new_run(run_id, task, caps, now)
            else:
                merge_caps(state, task, caps, now)
            try:
                check_live(state, now)
            finally:
                self._save(state)
                db.execute("COMMIT")
            return state
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def get_run(self, run_id: str) -> RunState | None:
        return self._load(run_id)

    def cancel(self, run_id: str, now: float) -> RunState | None:
        return self._update(run_id, now, cancel=True)

    def set_status(self, run_id: str, status: str, now: float) -> None:
        self._update(run_id, now, status=status)

    def _update(
        self, run_id: str, now: float, *, cancel: bool = False, status: str | None = None
    ) -> RunState:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            state = self._load(run_id) or new_run(run_id, "", RunCaps(), now)
            if cancel:
                state.cancelled = True
                state.status = "cancelled"
            elif status and state.status != "cancelled":
                state.status = status
            state.updated_at = now
            self._save(state)
            db.execute("COMMIT")
            return state
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def recover(self) -> list[RecoveredReservation]:
        owners = [
            r[0]
            for r in self._db.execute(
                "SELECT DISTINCT owner FROM reservations WHERE owner != ?", (self.owner,)
            )
        ]
        recovered: list[RecoveredReservation] = []
        for owner in owners:
            lock_path = self._owners_dir / f"{owner}.lock"
            lock = _try_lock(lock_path)
            if lock is None:
                continue  # its process is alive
            try:
                recovered += self._settle_owner(owner)
            finally:
                lock.close()
                lock_path.unlink(missing_ok=True)
        for r in recovered:
            log.warning(
                "run %s: settled reservation %s of a process that died at its reserved amount "
                "($%s, %d tokens) — the call's real usage is unknown",
                r.run_id, r.reservation_id, r.usd_nanos / 1e9, r.tokens,
            )  # fmt: skip
        return recovered

    def _settle_owner(self, owner: str) -> list[RecoveredReservation]:
        db = self._db
        now = time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            rows = db.execute(
                "SELECT id, run_id, usd, input_tokens, output_tokens FROM reservations WHERE owner = ?",
                (owner,),
            ).fetchall()
            out = []
            for rid, run_id, usd, tin, tout in rows:
                state = self._load(run_id)
                if state is not None:
                    apply_recovery(state, usd, tin, tout, now)
                    self._save(state)
                out.append(RecoveredReservation(run_id, rid, usd, tin + tout))
            db.execute("DELETE FROM reservations WHERE owner = ?", (owner,))
            db.execute("COMMIT")
            return out
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def ping(self) -> None:
        self._db.execute("SELECT 1").fetchone()

    def close(self) -> None:
        self._db.close()
        lock_path = Path(self._owner_file.name)
        self._owner_file.close()
        # Our reservations were all settled if we shut down cleanly; if not, keep the file so the
        # next process sees an unlocked owner file and recovers them.
        if not self._has_reservations(lock_path.stem):
            lock_path.unlink(missing_ok=True)

    def _has_reservations(self, owner: str) -> bool:
        db = sqlite3.connect(self.path)
        try:
            return (
                db.execute("SELECT 1 FROM reservations WHERE owner = ? LIMIT 1", (owner,)).fetchone()
                is not None
            )
        finally:
            db.close()


def _try_lock(path: Path):  # type: ignore[no-untyped-def]
    """Lock a dead owner's file; None when its process still holds it."""
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f
