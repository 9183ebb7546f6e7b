"""The SQLite ledger's kept runs (proxy/ledger/sqlite/runrows.py): between transactions it keeps
the runs it wrote or read instead of reading them again — which is only right while each kept run
is the stored one. These tests replay random operations, with every way the file can change
behind the kept runs (another connection's commits, this connection's writes outside `RunRows`,
rollbacks whole and to a savepoint), and compare each kept run with the file at the start of
every transaction: that is when the ledger trusts them."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.caps import RunCaps
from proxy.errors import Rejection
from proxy.ledger import base
from proxy.ledger.base import RunState, Settlement
from proxy.ledger.repeats import Repeats
from proxy.ledger.sqlite import SQLiteLedger
from proxy.ledger.sqlite.schema import SCHEMA, load_run, save_run, stored_form, upgrade
from proxy.ledger.sqlite.writer import begin, commit, transaction
from tests.support.ledgers import step, tool

CENT = 10_000_000

# -- stored_form: a run as a read of its row builds it ---------------------------------------------

ints = st.integers(0, 2**40)
maybe_int = st.none() | st.integers(0, 2**40)
maybe_time = st.none() | st.floats(1e9, 2e9, allow_nan=False)


@st.composite
def run_states(draw: st.DrawFn) -> RunState:
    caps = RunCaps(
        draw(maybe_int), draw(maybe_int), draw(maybe_int), draw(maybe_int), draw(maybe_time),
        draw(st.none() | st.floats(0.1, 1e5)), draw(maybe_int), draw(st.none() | st.integers(1, 9)),
        draw(st.none() | st.integers(0, 5)), draw(st.none() | st.integers(0, 9)), draw(maybe_int),
        draw(maybe_int),
    )  # fmt: skip
    repeats = Repeats()
    if draw(st.booleans()):
        repeats = Repeats(
            {"c1": 2}, ["c1", "c1"], [0, 1, 0], {"r": 1}, draw(st.sampled_from(["", "cycle"])), 3
        )
    elif draw(st.booleans()):
        repeats = Repeats(periodic=[1, 0, 0])  # an empty window with counters left: stored as nothing
    ancestors = tuple(draw(st.lists(st.sampled_from(["a", "b", "c"]), max_size=3, unique=True)))
    return RunState(
        run_id="r", task=draw(st.sampled_from(["", "t"])),
        status=draw(st.sampled_from(["active", "cancelled"])),
        started_at=draw(st.floats(1e9, 2e9)), updated_at=draw(st.floats(1e9, 2e9)), caps=caps,
        spent_usd_nanos=draw(ints), input_tokens=draw(ints), output_tokens=draw(ints), steps=draw(ints),
        tool_calls_requested=draw(ints), tool_calls_executed=draw(ints), reserved_usd_nanos=draw(ints),
        reserved_tokens=draw(ints), final_reason=draw(st.none() | st.just("max_steps")),
        cancelled=draw(st.booleans()), operator_caps=draw(st.sampled_from(["", "max_usd_nanos"])),
        context_baseline=draw(ints), upstream_failures=draw(st.integers(0, 9)),
        parent_run_id=ancestors[0] if ancestors else "", root_run_id=ancestors[-1] if ancestors else "",
        repeats=repeats, ancestors=ancestors, children=draw(st.integers(0, 9)),
        child_ids=tuple(draw(st.lists(st.sampled_from(["x", "y"]), max_size=2, unique=True))),
        sub_spent_usd_nanos=draw(ints), sub_reserved_usd_nanos=draw(ints), sub_tokens=draw(ints),
        sub_reserved_tokens=draw(ints), sub_steps=draw(ints), sub_tool_calls=draw(ints),
        tree_deadline=draw(maybe_time),
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(run_states())
def test_stored_form_is_what_a_read_of_the_row_builds(state: RunState) -> None:
    """What `RunRows` keeps of a run it saved is what a read of the stored row builds: through a
    real SQLite table, the columns' affinities included."""
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.executescript(SCHEMA)
    upgrade(db)
    save_run(db, state)
    assert stored_form(state) == load_run(db, "r")


# -- kept runs against the file ----------------------------------------------------------------------

OPS = (
    "call", "call", "call", "tool", "touch", "child", "refused", "cancel", "top_up",
    "other_connection", "outside_write", "failed_batch", "purge",
)  # fmt: skip


async def _compare(led: SQLiteLedger) -> int:
    """At the start of a transaction (when the ledger trusts them), every kept run is the stored
    one; how many were compared."""
    runs, db = led._runs, led._db
    begin(db, runs)
    try:
        kept = dict(runs._kept)
        for run_id, state in kept.items():
            assert state == load_run(db, run_id), run_id
    finally:
        commit(db, runs)
    return len(kept)


async def _replay(path: Path, ops: list[tuple[str, int, int]]) -> int:
    led = SQLiteLedger(path)
    other = SQLiteLedger(path)  # another process's connection (a second worker, the CLI)
    ids = ["root", "kid", "grandkid", "solo"]
    parents = {"kid": "root", "grandkid": "kid"}
    caps = {
        "root": RunCaps(max_usd_nanos=40 * CENT),
        "kid": RunCaps(max_tokens=90_000),
        "grandkid": RunCaps(),
    }
    open_res: list[base.Reservation] = []
    compared = 0
    try:
        for run_id in ids:  # the tree, each run with a first call
            first = await led.begin_step(
                step(run_id, caps.get(run_id, RunCaps()), parent_run_id=parents.get(run_id, ""))
            )
            await led.settle(first, Settlement(cost_usd_nanos=first.usd_nanos // 4), time.time())
        compared += await _compare(led)
        for op, who, size in ops:
            run_id = ids[who % len(ids)]
            parent = parents.get(run_id, "")
            run_caps = caps.get(run_id, RunCaps(max_steps=30))
            try:
                if op == "refused":  # an ancestor's cap cut below what its subtree holds
                    await led.set_caps(ids[who % 2], {"max_usd_nanos": size * CENT // 100}, time.time())
                    run_id, parent, run_caps = "grandkid", "kid", caps["grandkid"]
                if op in ("call", "refused", "child"):
                    res = await led.begin_step(
                        step(run_id, run_caps, parent_run_id=parent, output=100 + size)
                    )
                    if size % 3:  # settle now, or leave it in flight for a later op
                        used = Settlement(
                            input_tokens=50, output_tokens=size, cost_usd_nanos=res.usd_nanos // 2
                        )
                        await led.settle(res, used, time.time())
                    else:
                        open_res.append(res)
                elif op == "tool":
                    await led.begin_tool_call(tool(run_id, f"k{size}", run_caps))
                elif op == "touch":
                    await led.touch_run(run_id, "t", run_caps, time.time(), parent)
                elif op == "cancel" and size % 4 == 0:
                    await led.cancel(run_id, time.time())
                elif op == "top_up":
                    await led.set_caps(run_id, {"max_usd_nanos": (50 + size) * CENT}, time.time())
                elif op == "other_connection":  # commits behind the kept runs
                    if open_res and size % 2:
                        res = open_res.pop()
                        await led.settle(res, Settlement(cost_usd_nanos=res.usd_nanos), time.time())
                    await other.set_caps(run_id, {"max_steps": 5 + size}, time.time())
                    if size % 5 == 0:
                        await other.cancel(run_id, time.time())
                elif op == "outside_write":  # this connection, not through RunRows
                    with transaction(led._db):
                        led._db.execute(
                            "UPDATE runs SET steps = steps + 1, status = 'x' WHERE run_id = ?", (run_id,)
                        )
                elif op == "failed_batch":  # two operations in one batch, the second fails
                    led._writes.open = 5  # (calls in flight: the next operations are batched)

                    def boom() -> None:
                        led._runs.save(base.new_run("doomed", "t", RunCaps(), time.time()))
                        raise RuntimeError("an operation failed after it wrote")

                    first = asyncio.ensure_future(
                        led.begin_step(step(run_id, run_caps, parent_run_id=parent))
                    )
                    second = asyncio.ensure_future(led._writes.run(boom))
                    done = await asyncio.gather(first, second, return_exceptions=True)
                    led._writes.open = 0
                    assert isinstance(done[1], RuntimeError)
                    if isinstance(done[0], base.Reservation):
                        open_res.append(done[0])
                elif op == "purge":
                    led.purge(time.time() + (0 if size % 2 else 10**9))
            except (Rejection, KeyError):
                pass  # a cap, a cancel, a run purged under its reservation: what matters is the books
            compared += await _compare(led)
        for res in open_res:
            try:
                await led.settle(res, Settlement(cost_usd_nanos=res.usd_nanos), time.time())
            except KeyError:
                pass
        compared += await _compare(led)
    finally:
        await other.close()
        await led.close()
    return compared


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7), st.integers(0, 30)), min_size=5, max_size=40)
)
def test_kept_runs_are_what_the_file_holds(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int, int]]
) -> None:
    path = tmp_path_factory.mktemp("rows") / "ledger.sqlite3"
    assert asyncio.run(_replay(path, ops)) >= 4  # the tree's runs at least were kept and compared


async def test_a_sub_run_reads_nothing_while_its_chain_is_kept(tmp_path: Path) -> None:
    """The point of it: a depth-3 run's next call reads no row (its own and its ancestors' are
    kept), and another connection's commit makes the next one read them all again."""
    led = SQLiteLedger(tmp_path / "ledger.sqlite3")
    other = SQLiteLedger(tmp_path / "ledger.sqlite3")
    caps = RunCaps(max_usd_nanos=10 * CENT)
    reads: list[str] = []
    led._db.set_trace_callback(lambda sql: reads.append(sql) if sql.startswith("SELECT") else None)
    try:
        parent = ""
        for run_id in ("a", "b", "c", "d"):
            res = await led.begin_step(step(run_id, caps, parent_run_id=parent))
            await led.settle(res, Settlement(cost_usd_nanos=1), time.time())
            parent = run_id
        reads.clear()
        res = await led.begin_step(step("d", caps))
        await led.settle(res, Settlement(cost_usd_nanos=1), time.time())
        assert [r for r in reads if "FROM runs" in r] == []
        await other.set_caps("b", {"max_usd_nanos": 20 * CENT}, time.time())
        res = await led.begin_step(step("d", caps))
        assert res.tree_left is not None
        assert len([r for r in reads if "FROM runs" in r]) == 2  # the run, then its three ancestors
    finally:
        await other.close()
        await led.close()
