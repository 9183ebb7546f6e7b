"""SQLite ledger backend: the embedded default, one file under the data directory.

Each operation runs inside a `BEGIN IMMEDIATE` transaction (the write lock is taken up front, so
two processes — `serve --workers N` — cannot both read a run's remaining budget and both spend
it), synchronously on the event loop's thread: a transaction takes tens of microseconds, less
than a hand-off to a thread would cost. The request path's operations (`begin_step`, `settle`,
`touch_run`) are batched: those asked for during one turn of the event loop run one after another
in one transaction at the next turn (`_flush`), so under load one commit serves many calls; each
caller resumes only after COMMIT, so a reservation is durable before its call is forwarded.
(With fewer than `BATCH_FROM_OPEN` calls in flight, an operation is a transaction of its own.)
The other operations (tool calls, cancel, top-ups, recovery) are one transaction each.
WAL mode with `synchronous=NORMAL`: COMMIT returns once the transaction is written to the WAL
file (in the OS's page cache, not yet fsync'd — that happens at checkpoints), so a committed
transaction survives a `kill -9` of the process, however many follow; only an OS crash or a power
loss may lose the transactions committed since the last checkpoint (the file stays consistent:
it rolls back to an earlier state). `synchronous=FULL` would fsync the WAL at every commit.
Checkpoints (copying the WAL into the database file, and its fsync) never run on the event loop:
automatic checkpoints are off on the request path's connection, and a thread of each process
checkpoints every `CHECKPOINT_INTERVAL_S` on a connection of its own (`PASSIVE`: it never waits
for or blocks a writer). Before, the commit that crossed SQLite's 1,000-page mark checkpointed
inline — an fsync on the event loop, the tail of the capped calls' latency.

Reservations and in-flight tool calls are rows owned by the process that made them. Each process
holds an exclusive `flock` on its own owner file for as long as it lives; a reservation whose owner
file can be locked by someone else belongs to a dead process and is settled at its reserved amount,
and a tool call it left `in_flight` becomes `unknown` (it may or may not have reached the tool).

Faults: a full disk, an I/O error or a lock held too long fail the operation with
`sqlite3.OperationalError` (`failure_code` says which; the caller answers 503), and the transaction
is rolled back, so nothing is half-written and the next operation works once space returns. The
busy timeout is the ledger's operation timeout: the calls are synchronous, so it also bounds how
long the event loop can wait for another worker's lock. Readiness (`ping`) writes a probe row and
checks the free space of the file's disk.

Retention: idempotency records, and runs without reservations, not updated for
`ledger_retention_s` are deleted by the periodic recovery sweep.

Schema upgrades: `_SCHEMA` is the first release's; the columns added since (`_ADDED_COLUMNS`) are
added at open, to a new file as to an older one (`_upgrade`: idempotent, under the write lock so
two processes starting together do not both add them). Idempotency records are keyed by the
composite primary key (run_id, key): no two (run, key) pairs share a row, whatever they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from proxy.caps import RunCaps
from proxy.errors import Rejection
from proxy.ledger.base import (
    COMPLETED,
    DEFAULT_RETENTION_S,
    IN_FLIGHT,
    UNKNOWN,
    CapsChange,
    IdempotencyRecord,
    Ledger,
    RecordNotUnknown,
    RecoveredReservation,
    Reservation,
    RunState,
    Settlement,
    StepRequest,
    ToolCallRequest,
    ToolCallStart,
    apply_caps_change,
    apply_recovery,
    apply_settlement,
    apply_unrecovery,
    check_live,
    decide_step,
    decide_tool_call,
    merge_caps,
    new_run,
)

log = logging.getLogger("runcap.ledger")

CHECKPOINT_INTERVAL_S = 0.5


def _checkpoint_loop(db: sqlite3.Connection, closing: threading.Event) -> None:
    """Copy the WAL into the database file, off the event loop (see the module docstring). A
    failure (disk full, I/O) is logged and tried again: the WAL only grows meanwhile."""
    try:
        failing = False
        while not closing.wait(CHECKPOINT_INTERVAL_S):
            try:
                db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                failing = False
            except sqlite3.Error as e:
                if not failing:
                    log.warning("ledger checkpoint failed (retried every %.1f s): %s",
                                CHECKPOINT_INTERVAL_S, e)  # fmt: skip
                failing = True
    finally:
        db.close()

T = TypeVar("T")

# Request-path operations wait for the next turn's batched transaction only while at least this
# many of this process's calls are in flight (others may ask in the same turn); below, each is a
# transaction of its own at once, as cheap as a batch of one without the wait.
BATCH_FROM_OPEN = 2

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
-- tenants sharing one provider key (server/tenant_objects.py). Not purged: objects outlive runs.
CREATE TABLE IF NOT EXISTS provider_objects (
    account TEXT NOT NULL,
    object_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (account, object_id)
) WITHOUT ROWID;
"""

# Below this many free bytes on the ledger's disk runcap is not ready: SQLite needs room to grow
# its WAL, and a write that fits today's WAL by luck says nothing about the next one.
MIN_FREE_BYTES = 1 << 20

# Columns added since the first release — to a new file as to an older one (`_upgrade`). A row
# written before they were has method '' (IdempotencyRecord: its operation beyond the tool is not known).
_ADDED_COLUMNS = {
    "runs": (
        ("operator_caps", "TEXT NOT NULL DEFAULT ''"),
        ("context_baseline", "INTEGER NOT NULL DEFAULT 0"),
        ("upstream_failures", "INTEGER NOT NULL DEFAULT 0"),
    ),
    "tool_calls": (
        ("method", "TEXT NOT NULL DEFAULT ''"),
        ("path", "TEXT NOT NULL DEFAULT ''"),
        ("op_hash", "TEXT NOT NULL DEFAULT ''"),
    ),
}

_TOOL_COLUMNS = (
    "run_id, key, tool, args_hash, state, owner, created_at, updated_at, step, status, headers, body, error, "
    "method, path, op_hash"
)
_TOOL_UPSERT = f"INSERT OR REPLACE INTO tool_calls ({_TOOL_COLUMNS}) VALUES ({', '.join('?' * 16)})"


def _row_to_record(row: tuple) -> IdempotencyRecord:  # type: ignore[type-arg]
    return IdempotencyRecord(
        run_id=row[0], key=row[1], tool=row[2], args_hash=row[3], state=row[4], owner=row[5],
        created_at=row[6], updated_at=row[7], step=row[8], status=row[9], headers=json.loads(row[10]),
        body=bytes(row[11]), error=row[12], method=row[13], path=row[14], op_hash=row[15],
    )  # fmt: skip


def _record_to_row(r: IdempotencyRecord) -> tuple:  # type: ignore[type-arg]
    return (
        r.run_id, r.key, r.tool, r.args_hash, r.state, r.owner, r.created_at, r.updated_at, r.step,
        r.status, json.dumps(r.headers), r.body, r.error, r.method, r.path, r.op_hash,
    )  # fmt: skip


_COLUMNS = (
    "run_id, task, status, started_at, updated_at, max_usd, max_tokens, max_steps, max_tool_calls, "
    "deadline, spent_usd, input_tokens, output_tokens, steps, tool_calls_requested, "
    "tool_calls_executed, reserved_usd, reserved_tokens, final_reason, cancelled, operator_caps, "
    "context_baseline, upstream_failures"
)
_UPSERT = f"INSERT OR REPLACE INTO runs ({_COLUMNS}) VALUES ({', '.join('?' * 23)})"


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
        operator_caps=row[20],
        context_baseline=row[21],
        upstream_failures=row[22],
    )


def _state_to_row(s: RunState) -> tuple:  # type: ignore[type-arg]
    c = s.caps
    return (
        s.run_id, s.task, s.status, s.started_at, s.updated_at,
        c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls, c.deadline,
        s.spent_usd_nanos, s.input_tokens, s.output_tokens, s.steps, s.tool_calls_requested,
        s.tool_calls_executed, s.reserved_usd_nanos, s.reserved_tokens, s.final_reason, int(s.cancelled),
        s.operator_caps, s.context_baseline, s.upstream_failures,
    )  # fmt: skip


class SQLiteLedger(Ledger):
    name = "sqlite"
    # Each operation waits at most the busy timeout (the ledger's operation timeout), on the
    # event loop's thread: an asyncio timeout around it could only fire after the fact.
    bounds_its_own_wait = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        retention_s: float = DEFAULT_RETENTION_S,
        *,
        busy_timeout_s: float = 10.0,
    ) -> None:
        self.path = Path(path)
        self.retention_s = retention_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._owners_dir = self.path.parent / "ledger-owners"
        self._owners_dir.mkdir(exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        self._db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._upgrade()
        # Request-path operations waiting for the next batched transaction (`_flush`), and
        # reservations committed for callers that were gone by then (`drain_in_doubt`).
        self._batch: list[tuple[Callable[[], object], asyncio.Future[object]]] = []
        self._in_doubt: list[Reservation | IdempotencyRecord] = []
        self._flush_on: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on
        self._open = 0  # reservations this instance made and has not settled (calls in flight)
        self.owner = secrets.token_hex(8)
        self._owner_file = open(self._owners_dir / f"{self.owner}.lock", "w")
        fcntl.flock(self._owner_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Checkpoints: a connection of their own, opened here (a file that cannot be opened twice
        # fails now, not silently in the thread), used only by the thread — which holds no
        # reference to this ledger: one that is dropped without close() stops it too.
        checkpoints = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        checkpoints.execute("PRAGMA wal_autocheckpoint=0")
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread's job
        self._closing = threading.Event()
        self._checkpointer = threading.Thread(
            target=_checkpoint_loop, args=(checkpoints, self._closing), name="runcap-ledger-checkpoint",
            daemon=True,
        )  # fmt: skip
        self._checkpointer.start()
        weakref.finalize(self, self._closing.set)

    def _upgrade(self) -> None:
        """Add the columns a ledger file made by an older runcap lacks (idempotent)."""
        with self._transaction() as db:
            for table, columns in _ADDED_COLUMNS.items():
                have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
                for name, decl in columns:
                    if name not in have:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    # -- transactions -------------------------------------------------------------------------

    def _load(self, run_id: str) -> RunState | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return _row_to_state(row) if row else None

    def _save(self, state: RunState) -> None:
        self._db.execute(_UPSERT, _state_to_row(state))

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT. A `Rejection` commits too (the run's new status, or the
        record turned unknown, is part of the answer); any other error rolls back."""
        db = self._db
        if db.in_transaction:  # left open by a COMMIT that failed (disk full): never build on it
            _rollback(db)
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except Rejection:
            self._commit(db)
            raise
        except BaseException:
            _rollback(db)
            raise
        else:
            self._commit(db)

    @staticmethod
    def _commit(db: sqlite3.Connection) -> None:
        try:
            db.execute("COMMIT")
        except BaseException:
            _rollback(db)  # a failed COMMIT (disk full, I/O error) may leave the transaction open
            raise

    # -- the request path: batched transactions ------------------------------------------------
    #
    # `begin_step`, `settle` and `touch_run` are queued and run together, in one `BEGIN IMMEDIATE`
    # transaction, at the event loop's next turn (`_flush`): under concurrency one commit (one WAL
    # append, one lock) serves every call that asked during the same turn, and an idle server
    # pays one loop turn. Each operation still sees the effect of those before it (they run one
    # after another) and is isolated from their failures (a rejection keeps what it wrote, as a
    # transaction of its own would; any other error runs the batch again with a SAVEPOINT per
    # operation, so only that one fails); its caller learns the outcome only after COMMIT, so a
    # reservation is durable before its call is forwarded — the ceiling across `kill -9` holds
    # as before. A file error (full, I/O, locked past the busy timeout) fails the whole batch.

    async def begin_step(self, req: StepRequest) -> Reservation:
        res = await self._queued(lambda: self._begin_step(req), in_doubt=True)
        self._open += 1
        return res

    async def settle(self, reservation: Reservation, settlement: Settlement, now: float) -> RunState:
        self._open = max(0, self._open - 1)
        return await self._queued(lambda: self._settle(reservation, settlement, now))

    async def touch_run(self, run_id: str, task: str, caps: RunCaps, now: float) -> RunState:
        return await self._queued(lambda: self._touch_run(run_id, task, caps, now))

    async def _queued(self, op: Callable[[], T], *, in_doubt: bool = False) -> T:
        if not self._batch and self._open < BATCH_FROM_OPEN:
            # Hardly any call in flight here: no other operation is likely to join this turn's
            # batch, so a transaction of its own now is cheaper than waiting for the next turn.
            with self._transaction():
                return op()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._batch.append((op, fut))  # type: ignore[arg-type]
        if self._flush_on is not loop:  # (a loop that closed before its flush ran needs a new one)
            self._flush_on = loop
            loop.call_soon(self._flush)
        try:
            return await fut
        except asyncio.CancelledError:
            # Cancelled (a timeout, the request gone) while queued: `_flush` skips it. Cancelled
            # after its transaction committed: a reservation nobody will settle — released by the
            # caller (`drain_in_doubt`, the guarded ledger's pending releases).
            if fut.done() and not fut.cancelled() and fut.exception() is None and in_doubt:
                self._in_doubt.append(fut.result())  # type: ignore[arg-type]
                self._open += 1  # until its release settles it
            raise

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        self._flush_on = None
        # Not those cancelled meanwhile, nor any left by an event loop that is gone.
        ops = [(op, fut) for op, fut in batch if not fut.done() and not fut.get_loop().is_closed()]
        if not ops:
            return
        try:
            try:
                outcomes = self._run_batch(ops, isolate=False)
            except _OneFailed:
                # One operation failed after it may have written: the batch is rolled back and
                # run again with each operation in a savepoint of its own (rare: a bug, a run
                # purged under its reservation), so only that one fails.
                outcomes = self._run_batch(ops, isolate=True)
        except Exception as e:  # the file failed (full, I/O, locked): every operation did
            for _op, fut in ops:
                if not fut.done():
                    fut.set_exception(e)
            return
        for fut, value, exc in outcomes:
            if fut.done():
                continue
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

    def _run_batch(
        self, ops: list[tuple[Callable[[], object], asyncio.Future[object]]], *, isolate: bool
    ) -> list[tuple[asyncio.Future[object], object, BaseException | None]]:
        """One transaction for `ops`, in order. Returns each one's result or exception, once
        COMMIT succeeded; raises when the transaction failed (rolled back)."""
        db = self._db
        outcomes: list[tuple[asyncio.Future[object], object, BaseException | None]] = []
        if db.in_transaction:  # left open by a COMMIT that failed: never build on it
            _rollback(db)
        db.execute("BEGIN IMMEDIATE")
        try:
            for op, fut in ops:
                if isolate:
                    db.execute("SAVEPOINT op")
                try:
                    value = op()
                except Rejection as rej:  # its status change is part of the answer: kept
                    outcomes.append((fut, None, rej))
                except sqlite3.Error:
                    raise
                except Exception as e:
                    if not isolate:
                        if len(ops) > 1:
                            raise _OneFailed from e
                        raise
                    db.execute("ROLLBACK TO op")
                    outcomes.append((fut, None, e))
                else:
                    outcomes.append((fut, value, None))
                if isolate:
                    db.execute("RELEASE op")
        except BaseException:
            _rollback(db)
            raise
        self._commit(db)
        return outcomes

    def drain_in_doubt(self) -> list[Reservation | IdempotencyRecord]:
        out, self._in_doubt = self._in_doubt, []
        return out

    def _begin_step(self, req: StepRequest) -> Reservation:
        state = self._load(req.run_id) or new_run(req.run_id, req.task, req.caps, req.now)
        try:
            res = decide_step(state, req)
        finally:
            self._save(state)  # a rejection changed the run's status too
        self._db.execute(
            "INSERT INTO reservations (id, run_id, owner, usd, input_tokens, output_tokens, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (res.id, res.run_id, self.owner, res.usd_nanos, res.input_tokens, res.output_tokens, req.now),
        )
        return res

    def _settle(self, reservation: Reservation, settlement: Settlement, now: float) -> RunState:
        db = self._db
        gone = (
            db.execute(
                "DELETE FROM reservations WHERE owner = ? AND id = ?", (self.owner, reservation.id)
            ).rowcount
            == 0
        )
        state = self._load(reservation.run_id)
        if state is None:
            raise KeyError(reservation.run_id)
        swept = None
        if gone:
            swept = db.execute(
                "DELETE FROM swept_reservations WHERE owner = ? AND id = ? "
                "RETURNING usd, input_tokens, output_tokens",
                (self.owner, reservation.id),
            ).fetchone()
        if swept is not None:
            # A sweep charged it at its reserved amount (this process was thought dead): the
            # real usage replaces that charge — never charged twice, never left at the guess.
            apply_unrecovery(state, *swept, now)
            apply_settlement(state, reservation, settlement, now)
            self._save(state)
            log.warning(
                "reservation %s of run %s had been charged at its reserved amount by a sweep; "
                "now settled at its real usage", reservation.id, reservation.run_id,
            )  # fmt: skip
        elif gone:
            log.warning("reservation %s of run %s was already settled", reservation.id, reservation.run_id)
        else:
            apply_settlement(state, reservation, settlement, now)
            self._save(state)
        return state

    def _touch_run(self, run_id: str, task: str, caps: RunCaps, now: float) -> RunState:
        state = self._load(run_id)
        if state is None:
            state = new_run(run_id, task, caps, now)
        else:
            merge_caps(state, task, caps, now)
        try:
            check_live(state, now)
        finally:
            self._save(state)
        return state

    async def get_run(self, run_id: str) -> RunState | None:
        return self._load(run_id)

    async def cancel(self, run_id: str, now: float) -> RunState | None:
        return self._update(run_id, now, cancel=True)

    async def set_status(self, run_id: str, status: str, now: float) -> None:
        self._update(run_id, now, status=status)

    async def set_caps(self, run_id: str, change: CapsChange, now: float) -> tuple[RunCaps, RunState] | None:
        with self._transaction():
            state = self._load(run_id)
            if state is None:
                return None
            before = state.caps
            apply_caps_change(state, change, now)
            self._save(state)
            return before, state

    def _update(
        self, run_id: str, now: float, *, cancel: bool = False, status: str | None = None
    ) -> RunState:
        with self._transaction():
            state = self._load(run_id) or new_run(run_id, "", RunCaps(), now)
            if cancel:
                state.cancelled = True
                state.status = "cancelled"
            elif status and state.status != "cancelled":
                state.status = status
            state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest
            self._save(state)
            return state

    async def recover(self) -> list[RecoveredReservation]:
        owners = [
            r[0]
            for r in self._db.execute(
                "SELECT owner FROM reservations WHERE owner != ? UNION "
                "SELECT owner FROM tool_calls WHERE state = 'in_flight' AND owner != ?",
                (self.owner, self.owner),
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
        self.purge(time.time())
        return recovered

    def purge(self, now: float) -> int:
        """Delete idempotency records, idle runs and sweeps' records older than the retention."""
        cutoff = now - self.retention_s
        with self._transaction() as db:
            n = db.execute(
                "DELETE FROM tool_calls WHERE updated_at < ? AND state != 'in_flight'", (cutoff,)
            ).rowcount
            n += db.execute(
                "DELETE FROM runs WHERE updated_at < ? AND run_id NOT IN (SELECT run_id FROM reservations)",
                (cutoff,),
            ).rowcount
            n += db.execute("DELETE FROM swept_reservations WHERE swept_at < ?", (cutoff,)).rowcount
            return n

    def _settle_owner(self, owner: str) -> list[RecoveredReservation]:
        now = time.time()
        with self._transaction() as db:
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
            db.execute(
                "INSERT OR REPLACE INTO swept_reservations SELECT owner, id, run_id, usd, "
                "input_tokens, output_tokens, ? FROM reservations WHERE owner = ?",
                (now, owner),
            )
            db.execute("DELETE FROM reservations WHERE owner = ?", (owner,))
            for run_id, key, tool in db.execute(
                "UPDATE tool_calls SET state = 'unknown', updated_at = ?, "
                "error = 'the runcap process executing it died' "
                "WHERE owner = ? AND state = 'in_flight' RETURNING run_id, key, tool",
                (now, owner),
            ).fetchall():
                log.warning(
                    "run %s: tool call %s (%s) was in flight in a process that died; its outcome is "
                    "unknown until reconciled (runcap reconcile)", run_id, key, tool,
                )  # fmt: skip
            return out

    async def ping(self) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO probe (owner, at) VALUES (?, ?)", (self.owner, time.time()))
        st = os.statvfs(self.path.parent)
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_BYTES:
            raise OSError(
                errno.ENOSPC,
                f"{free} bytes free on the disk of {self.path.parent} (runcap needs {MIN_FREE_BYTES})",
            )

    @property
    def location(self) -> str:
        return str(self.path)

    def failure_code(self, exc: BaseException) -> str | None:
        if isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError:
            text = str(exc).lower()
            if "full" in text:  # "database or disk is full"
                return "ledger_disk_full"
            if "locked" in text or "busy" in text:
                return "ledger_timeout"
            if "unable to open" in text:
                return "ledger_unreachable"
            return "ledger_error"  # "disk I/O error", a damaged file...
        return super().failure_code(exc)

    # -- tool calls -----------------------------------------------------------------------------

    def _load_record(self, run_id: str, key: str) -> IdempotencyRecord | None:
        row = self._db.execute(
            f"SELECT {_TOOL_COLUMNS} FROM tool_calls WHERE run_id = ? AND key = ?", (run_id, key)
        ).fetchone()
        return _row_to_record(row) if row else None

    def _owner_alive(self, owner: str) -> bool:
        if owner == self.owner:
            return True
        try:
            fd = os.open(self._owners_dir / f"{owner}.lock", os.O_RDWR)
        except FileNotFoundError:
            return False  # removed by a recovery (or a clean shutdown with nothing in flight)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also releases the lock we may have taken
        return False

    async def begin_tool_call(self, req: ToolCallRequest) -> ToolCallStart:
        with self._transaction() as db:
            state = self._load(req.run_id) or new_run(req.run_id, req.task, req.caps, req.now)
            record = self._load_record(req.run_id, req.key) if req.key is not None else None
            alive = record is not None and record.state == IN_FLIGHT and self._owner_alive(record.owner)
            try:
                start = decide_tool_call(state, record, req, self.owner, alive)
            except Rejection:
                self._save(state)
                if record is not None:  # e.g. a dead owner's in-flight record, now unknown
                    db.execute(_TOOL_UPSERT, _record_to_row(record))
                raise
            self._save(state)
            if start.action == "execute" and start.record is not None:
                db.execute(_TOOL_UPSERT, _record_to_row(start.record))
            return start

    async def complete_tool_call(
        self, run_id: str, key: str, status: int, headers: dict[str, str], body: bytes, now: float
    ) -> None:
        self._db.execute(
            "UPDATE tool_calls SET state = ?, status = ?, headers = ?, body = ?, updated_at = ?, error = '' "
            "WHERE run_id = ? AND key = ?",
            (COMPLETED, status, json.dumps(headers), body, now, run_id, key),
        )

    async def mark_unknown(self, run_id: str, key: str, now: float, reason: str = "") -> None:
        self._db.execute(
            "UPDATE tool_calls SET state = ?, updated_at = ?, error = ? "
            "WHERE run_id = ? AND key = ? AND state = ?",
            (UNKNOWN, now, reason, run_id, key, IN_FLIGHT),
        )

    async def get_tool_call(self, run_id: str, key: str) -> IdempotencyRecord | None:
        return self._load_record(run_id, key)

    async def list_tool_calls(
        self, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[IdempotencyRecord]:
        where, args = [], []
        if state is not None:
            where.append("state = ?")
            args.append(state)
        if run_id is not None:
            where.append("run_id = ?")
            args.append(run_id)
        sql = f"SELECT {_TOOL_COLUMNS} FROM tool_calls"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._db.execute(sql + " ORDER BY created_at LIMIT ?", (*args, limit)).fetchall()
        return [_row_to_record(r) for r in rows]

    async def resolve_tool_call(
        self,
        run_id: str,
        key: str,
        *,
        done: bool,
        now: float,
        status: int = 200,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        force: bool = False,
    ) -> IdempotencyRecord | None:
        with self._transaction() as db:
            record = self._load_record(run_id, key)
            if record is None:
                return None
            if record.state != UNKNOWN and not force:
                raise RecordNotUnknown(record)
            if done:
                db.execute(
                    "UPDATE tool_calls SET state = ?, status = ?, headers = ?, body = ?, updated_at = ?, "
                    "error = '' WHERE run_id = ? AND key = ?",
                    (COMPLETED, status, json.dumps(headers or {}), body, now, run_id, key),
                )
            else:
                # It did not happen: the next attempt executes, and this one is not counted.
                db.execute("DELETE FROM tool_calls WHERE run_id = ? AND key = ?", (run_id, key))
                state = self._load(run_id)
                if state is not None and state.tool_calls_executed > 0:
                    state.tool_calls_executed -= 1
                    state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest
                    self._save(state)
            return record

    async def claim_objects(self, account: str, object_ids: Sequence[str], tenant: str, now: float) -> None:
        with self._transaction() as db:
            db.executemany(
                "INSERT OR IGNORE INTO provider_objects (account, object_id, tenant, created_at) "
                "VALUES (?, ?, ?, ?)",
                [(account, oid, tenant, now) for oid in object_ids],
            )

    async def object_owners(self, account: str, object_ids: Sequence[str]) -> dict[str, str]:
        owners: dict[str, str] = {}
        ids = list(dict.fromkeys(object_ids))
        for i in range(0, len(ids), 500):  # under SQLite's limit on bound parameters
            batch = ids[i : i + 500]
            rows = self._db.execute(
                "SELECT object_id, tenant FROM provider_objects WHERE account = ? AND object_id IN "
                f"({', '.join('?' * len(batch))})",
                (account, *batch),
            )
            owners.update(dict(rows.fetchall()))
        return owners

    async def close(self) -> None:
        if self._batch:
            self._flush()  # answer what is queued before the connection goes
        self._closing.set()
        await asyncio.to_thread(self._checkpointer.join, 5.0)  # a checkpoint's fsync may be under way
        with contextlib.suppress(sqlite3.Error):
            with self._transaction() as db:
                db.execute("DELETE FROM probe WHERE owner = ?", (self.owner,))
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
                db.execute(
                    "SELECT 1 FROM reservations WHERE owner = ? UNION ALL "
                    "SELECT 1 FROM tool_calls WHERE owner = ? AND state = 'in_flight' LIMIT 1",
                    (owner, owner),
                ).fetchone()
                is not None
            )
        finally:
            db.close()


class _OneFailed(Exception):
    """An operation of a batch failed with something other than a rejection or a file error."""


def _rollback(db: sqlite3.Connection) -> None:
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled it back itself
            db.execute("ROLLBACK")


def _try_lock(path: Path):  # type: ignore[no-untyped-def]
    """Lock a dead owner's file; None when its process still holds it."""
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f
