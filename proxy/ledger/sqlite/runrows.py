"""The runs this process last wrote or read, kept between its transactions: the SQLite ledger's
reads of a run (and, for a sub-run, of each of its ancestors) on every call.

Every call of a run reads its row, decides with base.py's rules and writes it back; a sub-run's
call reads and updates its ancestors' rows too. On SQLite a read costs as much as a write (the
row's 32 values handed to Python and decoded: ~9 µs for a run, ~20 µs for a run and three
ancestors), and what it reads is, most of the time, what this process wrote a moment before.
`RunRows` keeps each run as a read of its row would build it (`schema.stored_form` of what was
written, or `row_to_state` of what was read), and hands out copies.

When a kept run is the stored one:

* **Another connection committed** (a second `serve` worker, the CLI, `runcap reconcile`):
  SQLite's `PRAGMA data_version` changes then, and only then. It is read once per transaction,
  under the write lock (`BEGIN IMMEDIATE`: no other connection can commit between the check and
  the transaction's reads); when it moved, every run is forgotten.
* **This connection wrote runs without `RunRows`** (a recovery sweep, retention; a later change
  that forgets to come here): `total_changes` (the rows this connection changed) is noted when a
  transaction that kept `RunRows` up to date commits, and checked when the next one begins; when
  it moved in between, every run is forgotten. A write elsewhere costs the next call a read from
  the file, never a wrong run.
* **A write goes through here**: `save` keeps the run as saved; `add_change` and `set_statuses`
  do to the kept runs what their UPDATE does to the stored rows.
* **A transaction rolls back** (whole, or to a savepoint: `GroupCommit`'s isolation), or its
  COMMIT fails: every run is forgotten — what was kept meanwhile may hold what was undone.

So the runs kept are the committed ones, or this transaction's own view
(`test_kept_runs_are_what_the_file_holds` replays random operations and compares). Bounded:
beyond `RUNS_KEPT` runs, all are forgotten. Outside a transaction (`get_run`, listings) the
ledger reads the file.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from proxy.ledger.base import RunState, Totals, add_to_subtrees, change, copy_state
from proxy.ledger.sqlite.schema import (
    COLUMNS,
    UPSERT,
    add_change,
    load_run,
    row_to_state,
    save_run,
    save_statuses,
    state_to_row,
    stored_form,
)

# ~1 KB a run: 4,096 runs (~4 MB) cover the runs with calls in flight of a busy process; beyond,
# all are forgotten at the next transaction (and read again as needed).
RUNS_KEPT = 4096


class RunRows:
    """Runs as committed (or as this transaction wrote them), for the transactions of one
    connection. `begin` / `committed` / `rolled_back` are the transactions' hooks (writer.py)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self._kept: dict[str, RunState] = {}  # never handed out: copies are
        self._data_version: int | None = None
        self._changes = -1  # `total_changes` when a transaction that kept the runs committed

    # -- the transactions' hooks -----------------------------------------------------------------

    def begin(self) -> None:
        """Under the write lock, before the transaction's first read: forget every run if another
        connection committed, or this one wrote elsewhere, since the last commit here."""
        db = self._db
        version = db.execute("PRAGMA data_version").fetchone()[0]
        if version != self._data_version or db.total_changes != self._changes or len(self._kept) > RUNS_KEPT:
            self._kept.clear()
            self._data_version = version

    def committed(self) -> None:
        self._changes = self._db.total_changes

    def rolled_back(self) -> None:
        self._kept.clear()

    # -- reads: inside a transaction -------------------------------------------------------------

    def load(self, run_id: str) -> RunState | None:
        state = self._kept.get(run_id)
        if state is None:
            state = load_run(self._db, run_id)
            if state is None:
                return None
            self._kept[run_id] = state
        return copy_state(state)

    def load_many(self, run_ids: Sequence[str]) -> list[RunState | None]:
        """Each of `run_ids` (None for one that is not stored: it expired), those not kept read in
        one statement."""
        kept = self._kept
        missing = [r for r in run_ids if r not in kept]
        if missing:
            rows = self._db.execute(
                f"SELECT {COLUMNS} FROM runs WHERE run_id IN ({', '.join('?' * len(missing))})", missing
            ).fetchall()
            for row in rows:
                kept[row[0]] = row_to_state(row)
        out: list[RunState | None] = []
        for run_id in run_ids:
            state = kept.get(run_id)
            out.append(None if state is None else copy_state(state))
        return out

    # -- writes: the statement, and the same change to the runs kept -----------------------------

    def save(self, state: RunState) -> None:
        save_run(self._db, state)
        self._kept[state.run_id] = stored_form(state)

    def save_many(self, states: Sequence[RunState]) -> None:
        self._db.executemany(UPSERT, [state_to_row(s) for s in states])
        for s in states:
            self._kept[s.run_id] = stored_form(s)

    def save_changed(self, state: RunState, before: Totals, now: float) -> None:
        """`schema.save_run_changed`: the run, and what changed in its totals since `before`
        added to its ancestors'."""
        self.save(state)
        self.add_change(state.ancestors, change(before, state), now)

    def add_change(self, ancestors: Sequence[str], delta: Totals | None, now: float) -> None:
        """`schema.add_change`: `delta` added to each ancestor's subtree totals and its
        `updated_at` moved to `now`, in the file and in the runs kept (one that expired is in
        neither)."""
        if delta is None or not ancestors:
            return
        add_change(self._db, ancestors, delta, now)
        add_to_subtrees((self._kept.get(run_id) for run_id in ancestors), delta, now)

    def set_statuses(self, states: Sequence[RunState | None]) -> None:
        """`schema.save_statuses`: the status of each of `states`, in the file and in the runs kept."""
        save_statuses(self._db, states)
        for s in states:
            if s is not None:
                node = self._kept.get(s.run_id)
                if node is not None:
                    node.status = s.status
