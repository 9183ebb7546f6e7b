"""SQLite ledger backend: the embedded default, one file under the data directory.

This module is the `Ledger`: each operation reads, decides with base.py's rules and writes,
inside one `BEGIN IMMEDIATE` transaction, synchronously on the event loop's thread. The parts:
writer.py (transactions, the request path's group commit, the WAL checkpointer thread),
schema.py (tables, upgrades, rows ↔ data classes), runrows.py (the runs this process wrote or
read, kept between transactions while the file has not changed behind them), liveness.py (owner
files) and recovery.py (sweeps of dead owners' rows, retention).

WAL mode with `synchronous=NORMAL`: COMMIT returns once the transaction is written to the WAL
file (in the OS's page cache, not yet fsync'd — that happens at checkpoints), so a committed
transaction survives a `kill -9` of the process, however many follow; only an OS crash or a power
loss may lose the transactions committed since the last checkpoint (the file stays consistent:
it rolls back to an earlier state). `synchronous=FULL` would fsync the WAL at every commit.

Faults: a full disk, an I/O error or a lock held too long fail the operation with
`sqlite3.OperationalError` (`failure_code` says which; the caller answers 503), and the transaction
is rolled back, so nothing is half-written and the next operation works once space returns. The
busy timeout is the ledger's operation timeout: the calls are synchronous, so it also bounds how
long the event loop can wait for another worker's lock. Readiness (`ping`) writes a probe row and
checks the free space of the file's disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import sqlite3
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from proxy.caps import RunCaps
from proxy.errors import Rejection
from proxy.ledger import base
from proxy.ledger.sqlite import approvals, recovery
from proxy.ledger.sqlite.liveness import OwnerFiles
from proxy.ledger.sqlite.runrows import RunRows
from proxy.ledger.sqlite.schema import (
    SCHEMA,
    TOOL_COLUMNS,
    add_child,
    child_ids,
    load_record,
    load_run,
    row_to_record,
    save_record,
    upgrade,
)
from proxy.ledger.sqlite.writer import Checkpointer, GroupCommit, transaction
from proxy.ledger.sweep import log_recovered

log = logging.getLogger("runcap.ledger")

# Below this many free bytes on the ledger's disk runcap is not ready: SQLite needs room to grow
# its WAL, and a write that fits today's WAL by luck says nothing about the next one.
MIN_FREE_BYTES = 1 << 20


class SQLiteLedger(base.Ledger):
    name = "sqlite"
    # Each operation waits at most the busy timeout (the ledger's operation timeout), on the
    # event loop's thread: an asyncio timeout around it could only fire after the fact.
    bounds_its_own_wait = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        retention_s: float = base.DEFAULT_RETENTION_S,
        *,
        busy_timeout_s: float = 10.0,
    ) -> None:
        self.path = Path(path)
        self.retention_s = retention_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        self._db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._db.executescript(approvals.SCHEMA)
        with transaction(self._db) as db:  # under the write lock: see schema.py
            upgrade(db)
        # The runs rows this process wrote or read, kept between its transactions (runrows.py):
        # every transaction that reads or writes runs through `self._runs` passes it as hooks.
        self._runs = RunRows(self._db)
        self._writes = GroupCommit(self._db, self._runs)
        self.owner = secrets.token_hex(8)
        self._owners = OwnerFiles(self.path.parent / "ledger-owners", self.owner)
        self._owner_file = self._owners.own_file
        self._checkpointer = Checkpointer(self.path, busy_timeout_s=busy_timeout_s)
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread's job
        weakref.finalize(self, self._checkpointer.closing.set)

    # -- the request path: batched transactions (writer.py) ------------------------------------

    async def begin_step(self, req: base.StepRequest) -> base.Reservation:
        res = await self._writes.run(lambda: self._begin_step(req), in_doubt=True)
        self._writes.open += 1
        return res

    async def settle(
        self, reservation: base.Reservation, settlement: base.Settlement, now: float
    ) -> base.RunState:
        self._writes.open = max(0, self._writes.open - 1)
        return await self._writes.run(lambda: self._settle(reservation, settlement, now))

    async def touch_run(
        self, run_id: str, task: str, caps: RunCaps, now: float, parent: str = ""
    ) -> base.RunState:
        return await self._writes.run(lambda: self._touch_run(run_id, task, caps, now, parent))

    def drain_in_doubt(self) -> list[base.Reservation | base.IdempotencyRecord]:
        return self._writes.drain_in_doubt()

    # -- run trees: a run and its ancestors, read and written in the same transaction ----------
    #
    # A call of a sub-run reads its run and its ancestors (kept rows, most often: runrows.py), and
    # writes its own row and, for its ancestors, only the change of its totals (`add_change`: one
    # narrow UPDATE) and a refusal's statuses. A new child's first call writes its parent whole
    # (the parent counts it).

    def _open(
        self, run_id: str, task: str, caps: RunCaps, parent: str, now: float
    ) -> tuple[base.RunState, list[base.RunState | None], bool]:
        """The run (new or stored, placed in its tree: `base.open_run`), its ancestors, and
        whether the chain is written in full (a new child: its parent counts it)."""
        runs = self._runs
        state = runs.load(run_id)
        if parent and (state is None or state.parent_run_id != parent):
            named = runs.load(parent)
            chain = [named, *(runs.load_many(named.ancestors) if named and named.ancestors else ())]
            child = base.open_run(state, chain, run_id, task, caps, parent, now)
            return child, chain, True
        if state is None:
            return base.new_run(run_id, task, caps, now), [], False  # a root: one row
        return state, runs.load_many(state.ancestors) if state.ancestors else [], False

    def _save_chain(
        self,
        state: base.RunState,
        chain: Sequence[base.RunState | None],
        before: base.Totals,
        now: float,
        *,
        whole: bool = False,
        refused: bool = False,
    ) -> None:
        """The run, and what the call changed in its ancestors: the change of the run's totals
        since `before` added to theirs (what `base.propagate` did to `chain`, which is not
        written) and, when the call was `refused`, their statuses (the ancestor whose cap binds).
        `whole`: the run is a new child, and its parent (`chain[0]`) is written whole (it counts
        its child) with the child indexed under it."""
        runs, narrow = self._runs, chain
        if whole and chain:
            assert chain[0] is not None  # (open_run refuses a parent that is not stored)
            runs.save_many([state, chain[0]])
            add_child(self._db, state)
            runs.add_change(state.ancestors[1:], base.change(before, state), now)
            narrow = chain[1:]
        else:
            runs.save_changed(state, before, now)
        if refused:
            runs.set_statuses(narrow)

    def _begin_step(self, req: base.StepRequest) -> base.Reservation:
        state, chain, whole = self._open(req.run_id, req.task, req.caps, req.parent_run_id, req.now)
        before = base.totals(state)
        try:
            res = base.decide_step(state, req, chain)
        except Rejection:
            self._save_chain(state, chain, before, req.now, whole=whole, refused=True)
            raise
        self._save_chain(state, chain, before, req.now, whole=whole)
        self._db.execute(
            "INSERT INTO reservations (id, run_id, owner, usd, input_tokens, output_tokens, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (res.id, res.run_id, self.owner, res.usd_nanos, res.input_tokens, res.output_tokens, req.now),
        )
        return res

    def _settle(
        self, reservation: base.Reservation, settlement: base.Settlement, now: float
    ) -> base.RunState:
        db = self._db
        gone = (
            db.execute(
                "DELETE FROM reservations WHERE owner = ? AND id = ?", (self.owner, reservation.id)
            ).rowcount
            == 0
        )
        # A settlement changes its ancestors only by its totals: they are not read.
        state = self._runs.load(reservation.run_id)
        if state is None:
            raise KeyError(reservation.run_id)
        before = base.totals(state)
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
            usd, tin, tout = swept
            base.apply_unrecovery(state, usd, tin, tout, now)
            base.apply_settlement(state, reservation, settlement, now)
            self._save_chain(state, (), before, now)
            log.warning(
                "reservation %s of run %s had been charged at its reserved amount by a sweep; "
                "now settled at its real usage", reservation.id, reservation.run_id,
            )  # fmt: skip
        elif gone:
            log.warning("reservation %s of run %s was already settled", reservation.id, reservation.run_id)
        else:
            base.apply_settlement(state, reservation, settlement, now)
            self._save_chain(state, (), before, now)
        return state

    def _touch_run(self, run_id: str, task: str, caps: RunCaps, now: float, parent: str) -> base.RunState:
        state, chain, whole = self._open(run_id, task, caps, parent, now)
        before = base.totals(state)
        state = base.touched_run(state, run_id, task, caps, now)
        try:
            base.check_touched(state, chain, now)
        except Rejection:
            self._save_chain(state, chain, before, now, whole=whole, refused=True)
            raise
        self._save_chain(state, chain, before, now, whole=whole)  # a new child counted in its parent too
        return state

    async def get_run(self, run_id: str) -> base.RunState | None:
        state = load_run(self._db, run_id)
        if state is not None and state.children:
            state.child_ids = child_ids(self._db, run_id)
        return state

    async def cancel(self, run_id: str, now: float) -> base.RunState | None:
        return self._update(run_id, now, cancel=True)

    async def set_status(self, run_id: str, status: str, now: float) -> None:
        self._update(run_id, now, status=status)

    async def set_caps(
        self, run_id: str, change: base.CapsChange, now: float
    ) -> tuple[RunCaps, base.RunState] | None:
        with transaction(self._db, self._runs):
            state = self._runs.load(run_id)
            if state is None:
                return None
            before = state.caps
            base.apply_caps_change(state, change, now)
            self._runs.save(state)
            return before, state

    def _update(
        self, run_id: str, now: float, *, cancel: bool = False, status: str | None = None
    ) -> base.RunState:
        with transaction(self._db, self._runs):
            state = self._runs.load(run_id) or base.new_run(run_id, "", RunCaps(), now)
            base.apply_status(state, now, cancel=cancel, status=status)
            self._runs.save(state)
            return state

    # -- recovery (recovery.py) ------------------------------------------------------------------

    async def recover(self) -> list[base.RecoveredReservation]:
        recovered: list[base.RecoveredReservation] = []
        for owner in recovery.other_owners(self._db, self.owner):
            with self._owners.holding_dead(owner) as dead:
                if not dead:
                    continue  # its process is alive
                with transaction(self._db) as db:
                    recovered += recovery.settle_owner(db, owner, time.time())
        log_recovered(recovered)
        self.purge(time.time())
        return recovered

    def purge(self, now: float) -> int:
        """Delete idempotency records, idle runs, sweeps' records and approvals older than the retention."""
        with transaction(self._db) as db:
            cutoff = now - self.retention_s
            return recovery.purge(db, cutoff) + approvals.purge(db, cutoff)

    async def ping(self) -> None:
        with transaction(self._db, self._runs) as db:  # (no runs written: the rows kept stay)
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

    async def begin_tool_call(self, req: base.ToolCallRequest) -> base.ToolCallStart:
        with transaction(self._db, self._runs) as db:
            state, chain, whole = self._open(req.run_id, req.task, req.caps, req.parent_run_id, req.now)
            before = base.totals(state)
            record = load_record(self._db, req.run_id, req.key) if req.key is not None else None
            alive = record is not None and record.state == base.IN_FLIGHT and self._owners.alive(record.owner)
            try:
                start = base.decide_tool_call(state, record, req, self.owner, alive, chain)
            except Rejection:
                self._save_chain(state, chain, before, req.now, whole=whole, refused=True)
                if record is not None:  # e.g. a dead owner's in-flight record, now unknown
                    save_record(db, record)
                raise
            self._save_chain(state, chain, before, req.now, whole=whole)
            if start.action == "execute" and start.record is not None:
                save_record(db, start.record)
            return start

    async def complete_tool_call(
        self, run_id: str, key: str, status: int, headers: dict[str, str], body: bytes, now: float
    ) -> None:
        self._db.execute(
            "UPDATE tool_calls SET state = ?, status = ?, headers = ?, body = ?, updated_at = ?, error = '' "
            "WHERE run_id = ? AND key = ?",
            (base.COMPLETED, status, json.dumps(headers), body, now, run_id, key),
        )

    async def mark_unknown(self, run_id: str, key: str, now: float, reason: str = "") -> None:
        self._db.execute(
            "UPDATE tool_calls SET state = ?, updated_at = ?, error = ? "
            "WHERE run_id = ? AND key = ? AND state = ?",
            (base.UNKNOWN, now, reason, run_id, key, base.IN_FLIGHT),
        )

    async def get_tool_call(self, run_id: str, key: str) -> base.IdempotencyRecord | None:
        return load_record(self._db, run_id, key)

    async def list_tool_calls(
        self, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[base.IdempotencyRecord]:
        where, args = [], []
        if state is not None:
            where.append("state = ?")
            args.append(state)
        if run_id is not None:
            where.append("run_id = ?")
            args.append(run_id)
        sql = f"SELECT {TOOL_COLUMNS} FROM tool_calls"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._db.execute(sql + " ORDER BY created_at LIMIT ?", (*args, limit)).fetchall()
        return [row_to_record(r) for r in rows]

    async def apply_verdict(
        self, run_id: str, key: str, verdict: base.Verdict
    ) -> base.IdempotencyRecord | None:
        with transaction(self._db, self._runs) as db:
            record = load_record(self._db, run_id, key)
            if record is None:
                return None
            if record.state != base.UNKNOWN and not verdict.force:
                raise base.RecordNotUnknown(record)
            if verdict.done:
                db.execute(
                    "UPDATE tool_calls SET state = ?, status = ?, headers = ?, body = ?, updated_at = ?, "
                    "error = '' WHERE run_id = ? AND key = ?",
                    (
                        base.COMPLETED,
                        verdict.status,
                        json.dumps(verdict.headers or {}),
                        verdict.body,
                        verdict.now,
                        run_id,
                        key,
                    ),
                )
            else:
                # It did not happen: the next attempt executes, and this one is not counted.
                db.execute("DELETE FROM tool_calls WHERE run_id = ? AND key = ?", (run_id, key))
                state = self._runs.load(run_id)
                if state is not None and state.tool_calls_executed > 0:
                    before = base.totals(state)
                    state.tool_calls_executed -= 1
                    # argMax(updated_at) picks the newest
                    state.updated_at = max(state.updated_at, verdict.now)
                    self._save_chain(state, (), before, verdict.now)
            return record

    async def claim_objects(self, account: str, object_ids: Sequence[str], tenant: str, now: float) -> None:
        with transaction(self._db, self._runs) as db:  # (no runs written: the rows kept stay)
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

    # -- approvals (approvals.py) ----------------------------------------------------------------

    async def open_approval(self, req: base.ApprovalRequest) -> tuple[base.Approval, bool]:
        with transaction(self._db) as db:
            return approvals.open_approval(db, req)

    async def get_approval(self, approval_id: str, now: float) -> base.Approval | None:
        return approvals.get_approval(self._db, approval_id, now)

    async def list_approvals(
        self, now: float, *, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[base.Approval]:
        return approvals.list_approvals(self._db, now, state, run_id, limit)

    async def decide_approval(
        self, approval_id: str, approve: bool, by: str, reason: str, now: float
    ) -> base.Approval | None:
        with transaction(self._db) as db:
            return approvals.decide_approval(db, approval_id, approve, by, reason, now)

    async def deny_pending_approvals(self, run_id: str, now: float) -> list[base.Approval]:
        with transaction(self._db) as db:
            return approvals.deny_pending(db, run_id, now)

    async def close(self) -> None:
        if self._writes.pending:
            self._writes.flush()  # answer what is queued before the connection goes
        await self._checkpointer.stop()
        with contextlib.suppress(sqlite3.Error):
            with transaction(self._db) as db:
                db.execute("DELETE FROM probe WHERE owner = ?", (self.owner,))
        self._db.close()
        # Our reservations were all settled if we shut down cleanly; if not, keep the owner file
        # so the next process sees it unlocked and recovers them.
        self._owners.release(leftovers=recovery.has_leftovers(self.path, self.owner))
