"""How the SQLite ledger writes: `BEGIN IMMEDIATE` transactions, the group commit of the request
path, and the WAL checkpointer thread.

Each operation runs inside a `BEGIN IMMEDIATE` transaction (the write lock is taken up front, so
two processes — `serve --workers N` — cannot both read a run's remaining budget and both spend
it), synchronously on the event loop's thread: a transaction takes tens of microseconds, less
than a hand-off to a thread would cost.

Group commit (`GroupCommit`). The request path's operations (`begin_step`, `settle`, `touch_run`)
are queued and run together, in one transaction, at the event loop's next turn (`flush`): under
concurrency one commit (one WAL append, one lock) serves every call that asked during the same
turn, and an idle server pays one loop turn. Each operation still sees the effect of those before
it (they run one after another) and is isolated from their failures (a rejection keeps what it
wrote, as a transaction of its own would; any other error runs the batch again with a SAVEPOINT
per operation, so only that one fails); its caller learns the outcome only after COMMIT, so a
reservation is durable before its call is forwarded — the ceiling across `kill -9` holds as
before. A file error (full, I/O, locked past the busy timeout) fails the whole batch. With fewer
than `BATCH_FROM_OPEN` calls in flight, an operation is a transaction of its own at once.

Checkpoints (`Checkpointer`: copying the WAL into the database file, and its fsync) never run on
the event loop: automatic checkpoints are off on the request path's connection, and a thread of
each process checkpoints every `CHECKPOINT_INTERVAL_S` on a connection of its own (`PASSIVE`: it
never waits for or blocks a writer). Before, the commit that crossed SQLite's 1,000-page mark
checkpointed inline — an fsync on the event loop, the tail of the capped calls' latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from proxy.errors import Rejection
from proxy.ledger.base import IdempotencyRecord, Reservation

log = logging.getLogger("runcap.ledger")

CHECKPOINT_INTERVAL_S = 0.5

# Request-path operations wait for the next turn's batched transaction only while at least this
# many of this process's calls are in flight (others may ask in the same turn); below, each is a
# transaction of its own at once, as cheap as a batch of one without the wait.
BATCH_FROM_OPEN = 2

T = TypeVar("T")
_Op = tuple[Callable[[], object], "asyncio.Future[Any]"]


class Hooks(Protocol):
    """What follows a transaction's life (runrows.py: the rows kept between transactions)."""

    def begin(self) -> None:
        """The write lock is held; nothing is read yet."""

    def committed(self) -> None: ...

    def rolled_back(self) -> None:
        """The transaction, or part of it (a savepoint), was undone, or its COMMIT failed."""


class _NoHooks:
    def begin(self) -> None:
        pass

    def committed(self) -> None:
        pass

    def rolled_back(self) -> None:
        pass


NO_HOOKS: Hooks = _NoHooks()


def rollback(db: sqlite3.Connection, hooks: Hooks = NO_HOOKS) -> None:
    hooks.rolled_back()
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled it back itself
            db.execute("ROLLBACK")


def commit(db: sqlite3.Connection, hooks: Hooks = NO_HOOKS) -> None:
    try:
        db.execute("COMMIT")
    except BaseException:
        rollback(db, hooks)  # a failed COMMIT (disk full, I/O error) may leave the transaction open
        raise
    hooks.committed()


def begin(db: sqlite3.Connection, hooks: Hooks = NO_HOOKS) -> None:
    if db.in_transaction:  # left open by a COMMIT that failed (disk full): never build on it
        rollback(db, hooks)
    db.execute("BEGIN IMMEDIATE")
    try:
        hooks.begin()
    except BaseException:
        rollback(db, hooks)
        raise


@contextlib.contextmanager
def transaction(db: sqlite3.Connection, hooks: Hooks = NO_HOOKS) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT. A `Rejection` commits too (the run's new status, or the
    record turned unknown, is part of the answer); any other error rolls back. `hooks` learn
    each step (a transaction whose writes to `runs` do not all go through `hooks`' `RunRows`
    must not pass them: runrows.py)."""
    begin(db, hooks)
    try:
        yield db
    except Rejection:
        commit(db, hooks)
        raise
    except BaseException:
        rollback(db, hooks)
        raise
    else:
        commit(db, hooks)


class _OneFailed(Exception):
    """An operation of a batch failed with something other than a rejection or a file error."""


class GroupCommit:
    """The request path's operations, batched into one transaction per event-loop turn."""

    def __init__(self, db: sqlite3.Connection, hooks: Hooks = NO_HOOKS) -> None:
        self._db = db
        self._hooks = hooks
        # Operations waiting for the next batched transaction (`flush`), and reservations
        # committed for callers that were gone by then (`drain_in_doubt`).
        self._batch: list[_Op] = []
        self._in_doubt: list[Reservation | IdempotencyRecord] = []
        self._flush_on: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on
        self.open = 0  # reservations this instance made and has not settled (calls in flight)

    @property
    def pending(self) -> bool:
        return bool(self._batch)

    async def run(self, op: Callable[[], T], *, in_doubt: bool = False) -> T:
        """`op()` inside a transaction, at once or in the next turn's batch. `in_doubt`: its
        result is a reservation, handed to `drain_in_doubt` if its caller is gone by then."""
        if not self._batch and self.open < BATCH_FROM_OPEN:
            # Hardly any call in flight here: no other operation is likely to join this turn's
            # batch, so a transaction of its own now is cheaper than waiting for the next turn.
            with transaction(self._db, self._hooks):
                return op()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._batch.append((op, fut))
        if self._flush_on is not loop:  # (a loop that closed before its flush ran needs a new one)
            self._flush_on = loop
            loop.call_soon(self.flush)
        try:
            return await fut
        except asyncio.CancelledError:
            # Cancelled (a timeout, the request gone) while queued: `flush` skips it. Cancelled
            # after its transaction committed: a reservation nobody will settle — released by the
            # caller (`drain_in_doubt`, the guarded ledger's pending releases).
            if fut.done() and not fut.cancelled() and fut.exception() is None and in_doubt:
                result: Any = fut.result()
                self._in_doubt.append(result)
                self.open += 1  # until its release settles it
            raise

    def drain_in_doubt(self) -> list[Reservation | IdempotencyRecord]:
        out, self._in_doubt = self._in_doubt, []
        return out

    def flush(self) -> None:
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
        self, ops: list[_Op], *, isolate: bool
    ) -> list[tuple[asyncio.Future[Any], object, BaseException | None]]:
        """One transaction for `ops`, in order. Returns each one's result or exception, once
        COMMIT succeeded; raises when the transaction failed (rolled back)."""
        db, hooks = self._db, self._hooks
        outcomes: list[tuple[asyncio.Future[Any], object, BaseException | None]] = []
        begin(db, hooks)
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
                    hooks.rolled_back()
                    outcomes.append((fut, None, e))
                else:
                    outcomes.append((fut, value, None))
                if isolate:
                    db.execute("RELEASE op")
        except BaseException:
            rollback(db, hooks)
            raise
        commit(db, hooks)
        return outcomes


def _checkpoint_loop(db: sqlite3.Connection, closing: threading.Event) -> None:
    """Copy the WAL into the database file, off the event loop. A failure (disk full, I/O) is
    logged and tried again: the WAL only grows meanwhile."""
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


class Checkpointer:
    """The thread that checkpoints one ledger file. Its connection is opened here (a file that
    cannot be opened twice fails now, not silently in the thread) and used only by the thread —
    which holds no reference to the ledger: `closing.set` can be the ledger's finalizer, so one
    that is dropped without close() stops it too."""

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float) -> None:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s)
        db.execute("PRAGMA wal_autocheckpoint=0")
        self.closing = threading.Event()
        self._thread = threading.Thread(
            target=_checkpoint_loop, args=(db, self.closing), name="runcap-ledger-checkpoint", daemon=True
        )
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def stop(self) -> None:
        self.closing.set()
        await asyncio.to_thread(self._thread.join, 5.0)  # a checkpoint's fsync may be under way
