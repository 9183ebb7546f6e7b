"""The ledger only where there is something to enforce, and cheap where there is.

* A model call with nothing to enforce (no run id, no cap from headers, `[caps]` or `[tasks]`)
  writes nothing to the ledger; its answer and headers are those of a one-step run.
* `[caps]` defaults make every call capped: each then has its run in the ledger.
* The SQLite ledger runs the request path's operations of one event-loop turn in one transaction:
  each still sees those before it, a failure of one does not fail the others, and a reservation
  committed for a caller that was gone by then is released, never left to hold budget.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from decimal import Decimal
from pathlib import Path

import aiohttp
import openai
import pytest

from proxy.caps import RunCaps
from proxy.errors import BudgetExceeded, RunCancelled
from proxy.ledger.base import Settlement
from proxy.ledger.guarded import GuardedLedger
from proxy.ledger.sqlite import SQLiteLedger
from tests.support.ledgers import USD, step

USER = [{"role": "user", "content": "hello"}]


def ledger_rows(data_dir: Path, table: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(data_dir / "ledger.sqlite3")
    try:
        return db.execute(f"SELECT * FROM {table}").fetchall()
    finally:
        db.close()


async def test_a_call_with_nothing_to_enforce_spends_no_ledger_write(runcap, upstream, tmp_path):  # type: ignore[no-untyped-def]
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=0)
    for stream in (False, True):
        raw = await c.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=USER, max_tokens=20, stream=stream
        )
        if stream:
            async for _ in raw.parse():
                pass
        run_id = raw.headers["x-run-id"]
        assert run_id.startswith("run_") and raw.headers["x-run-step"] == "1"
        assert "x-run-remaining-usd" not in raw.headers
        # Forwarded as the agent sent it: no output limit written, no tools touched.
        assert upstream.last.body["max_tokens"] == 20
    assert ledger_rows(tmp_path / "data", "runs") == []
    assert ledger_rows(tmp_path / "data", "reservations") == []
    async with aiohttp.ClientSession() as s, s.get(f"{runcap.url}/runs/{run_id}", headers=runcap.admin) as r:
        assert r.status == 404
    # A run id the agent chose is a run of the ledger, even without caps.
    raw = await c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER, extra_headers={"X-Run-Id": "chosen"}
    )
    run = await runcap.run("chosen")
    assert run["steps"] == 1 and run["status"] == "completed" and run["reserved_usd"] == "0.000000000"
    assert [row[0] for row in ledger_rows(tmp_path / "data", "runs")] == ["chosen"]


async def test_operator_default_caps_keep_every_call_in_the_ledger(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"caps": {"default_max_usd": 0.5}})
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    raw = await c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    run = await rc.run(raw.headers["x-run-id"])
    assert run["caps"]["max_usd"] == "0.500000000" and run["steps"] == 1
    assert run["reserved_usd"] == "0.000000000" and Decimal(run["cost_usd"]) > 0
    assert raw.headers["x-run-remaining-usd"] == run["remaining"]["max_usd"]


async def test_operations_of_one_turn_share_a_transaction_and_not_their_failures(tmp_path):  # type: ignore[no-untyped-def]
    led = SQLiteLedger(tmp_path / "ledger.sqlite3")
    try:
        cap = RunCaps(max_usd_nanos=3_000_000)  # room for 10 calls of 300 µ$
        first = await led.begin_step(step("gone", RunCaps(max_usd_nanos=USD)))
        led._db.execute("DELETE FROM runs WHERE run_id = 'gone'")  # purged under its reservation
        await led.cancel("stopped", time.time())
        results = await asyncio.gather(
            *(led.begin_step(step("c", cap)) for _ in range(12)),
            led.settle(first, Settlement(), time.time()),
            led.begin_step(step("stopped", RunCaps())),
            led.touch_run("t", "task", RunCaps(max_steps=3), time.time()),
            return_exceptions=True,
        )
        *reserves, settled, stopped, touched = results
        ok = [r for r in reserves if not isinstance(r, BaseException)]
        # Each saw those before it: exactly ten fit, the eleventh and twelfth were refused.
        assert len(ok) == 10 and all(isinstance(r, BudgetExceeded) for r in reserves[10:])
        assert [r.step for r in ok] == list(range(1, 11))
        # One operation's failure (its run is gone) and one's rejection did not undo the others.
        assert isinstance(settled, KeyError) and isinstance(stopped, RunCancelled)
        assert touched.caps.max_steps == 3
        run = await led.get_run("c")
        assert run.reserved_usd_nanos == 3_000_000 and run.steps == 10
        assert (await led.get_run("stopped")).status == "cancelled"
        # The failed settlement was rolled back: the reservation is still there to recover.
        held = led._db.execute("SELECT count(*) FROM reservations WHERE id = ?", (first.id,)).fetchone()
        assert held == (1,)
    finally:
        await led.close()


async def test_a_reservation_committed_for_a_caller_gone_meanwhile_is_released(tmp_path):  # type: ignore[no-untyped-def]
    """The caller is cancelled (its timeout, its client gone) after the batch committed its
    reservation but before it resumed: the reservation is released, not left holding budget."""
    led = GuardedLedger(SQLiteLedger(tmp_path / "ledger.sqlite3"))
    try:
        caps = RunCaps(max_usd_nanos=USD)
        for run_id in ("busy-1", "busy-2"):  # calls in flight: operations wait for the next batch
            await led.begin_step(step(run_id, caps))
        task = asyncio.create_task(led.begin_step(step("r", caps)))
        await asyncio.sleep(0)  # the task queues its operation
        await asyncio.sleep(0)  # the batch commits; the task is woken but has not run yet
        run = await led.backend.get_run("r")
        assert run is not None and run.reserved_usd_nanos > 0  # committed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert led.pending.count() == 1  # handed over for release
        assert await led.pending.flush()
        run = await led.backend.get_run("r")
        assert run.reserved_usd_nanos == 0 and run.spent_usd_nanos == 0
        # Cancelled while still queued: nothing is written at all.
        task = asyncio.create_task(led.begin_step(step("q", caps)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        assert await led.backend.get_run("q") is None and led.pending.count() == 0
    finally:
        await led.close()


async def test_checkpoints_run_off_the_event_loop(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The request path's connection never checkpoints (it was an fsync on the event loop when a
    commit crossed SQLite's 1,000-page mark); the checkpointer thread copies the WAL into the
    database file on its own connection, and the data is all there after a restart."""
    import proxy.ledger.sqlite.writer as sqlite_module

    monkeypatch.setattr(sqlite_module, "CHECKPOINT_INTERVAL_S", 0.05)
    path = tmp_path / "ledger.sqlite3"
    led = SQLiteLedger(path)
    try:
        assert led._db.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        for i in range(300):
            await led.begin_step(step(f"r{i}", RunCaps(max_usd_nanos=USD)))
        # The database file itself, read without its WAL: the thread copied the rows into it.
        copied = 0
        for _ in range(200):
            db = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
            try:
                copied = db.execute("SELECT count(*) FROM runs").fetchone()[0]
            except sqlite3.OperationalError:  # not even the schema copied yet
                copied = 0
            finally:
                db.close()
            if copied == 300:
                break
            await asyncio.sleep(0.05)
        assert copied == 300
    finally:
        await led.close()
    assert not led._checkpointer.is_alive()  # stopped with the ledger
    again = SQLiteLedger(path)
    try:
        assert (await again.get_run("r299")).steps == 1
    finally:
        await again.close()
