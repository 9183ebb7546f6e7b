"""The trace step records the steps that end in one event-loop turn together (server/steps/trace.py):
each `done` returns only once its record is written, a group is one write, and a waiter that is
cancelled (shutdown) does not take its record — or anyone else's — with it. While the WAL has no
room (a failing `writev`: tests/support/disk.py) `done` waits with its held record, and a record
the WAL cannot keep is refused to the agent, not answered."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp.test_utils import make_mocked_request

from proxy.caps import parse_run_headers
from proxy.config import DEFAULT_UPSTREAMS, Config
from proxy.errors import LedgerUnavailable
from proxy.server.flow import Flow
from proxy.server.steps.trace import TraceStep
from proxy.spans.payloads import PayloadPolicy
from proxy.spans.recorder import WalRecorder
from proxy.spans.wal import WalWriter
from tests.support.disk import FillingDisk
from tests.support.wal import all_records, count_writevs


def passthrough_flow(config: Config, run_id: str) -> Flow:
    upstream = config.upstreams["openai"]
    request = make_mocked_request("GET", "/v1/models", headers={"X-Run-Id": run_id})
    flow = Flow(request, upstream, upstream.base.target(["v1", "models"], ""), adapter=None)
    flow.run = parse_run_headers(request.headers, config.caps)
    flow.status = flow.upstream_status = 200
    return flow


async def test_steps_ending_in_one_loop_turn_are_one_write(tmp_path: Path, monkeypatch) -> None:
    config = Config(upstreams=DEFAULT_UPSTREAMS)
    writer = WalWriter(tmp_path / "wal")
    trace = TraceStep(WalRecorder(writer, PayloadPolicy()))
    writes = count_writevs(monkeypatch)
    flows = [passthrough_flow(config, f"run-{i}") for i in range(12)]
    tasks = [asyncio.create_task(trace.done(flow)) for flow in flows]
    await asyncio.sleep(0)  # every task is now waiting for the turn's flush
    assert writes == [] and not any(t.done() for t in tasks)
    tasks[3].cancel()  # e.g. shutting down: its record is written all the same
    await asyncio.gather(*tasks, return_exceptions=True)
    assert len(writes) == 1 and writer.stats().appended_records == 12
    assert tasks[3].cancelled() and all(t.result() is None for i, t in enumerate(tasks) if i != 3)

    await trace.done(passthrough_flow(config, "alone"))  # an idle server: a group of one
    assert len(writes) == 2
    monkeypatch.undo()
    writer.close()
    runs = [s.run_id for r in all_records(tmp_path / "wal") for s in r.spans()]
    assert runs == [f"run-{i}" for i in range(12)] + ["alone"]


async def test_a_step_that_cannot_be_recorded_does_not_stop_the_others(tmp_path: Path, caplog) -> None:
    config = Config(upstreams=DEFAULT_UPSTREAMS)
    writer = WalWriter(tmp_path / "wal")
    trace = TraceStep(WalRecorder(writer, PayloadPolicy()))
    flows = [passthrough_flow(config, f"run-{i}") for i in range(3)]
    flows[1].body = None  # type: ignore[assignment]  # len(None): a bug in one record
    await asyncio.gather(*(trace.done(flow) for flow in flows))
    writer.close()
    runs = [s.run_id for r in all_records(tmp_path / "wal") for s in r.spans()]
    assert runs == ["run-0", "run-2"]
    assert "recording the step of run run-1 failed" in caplog.text


async def until(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Wait (bounded) for a condition the event loop brings about; not a timing assertion."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_a_step_is_answered_only_once_its_record_is_in_the_wal(tmp_path: Path, monkeypatch) -> None:
    """The disk full: every `done` waits with its held record (tried again and again, without
    room), and returns once space returns and the record is in the WAL — not before."""
    config = Config(upstreams=DEFAULT_UPSTREAMS)
    writer = WalWriter(tmp_path / "wal", hold_bytes=1 << 20, hold_s=60.0)
    trace = TraceStep(WalRecorder(writer, PayloadPolicy()))
    disk = FillingDisk(monkeypatch, room=0)
    flows = [passthrough_flow(config, f"run-{i}") for i in range(6)]
    tasks = [asyncio.create_task(trace.done(flow)) for flow in flows]
    refusal = passthrough_flow(config, "refused")  # never forwarded: its refusal does not wait
    refusal.upstream_status, refusal.status = 0, 402
    await asyncio.wait_for(trace.done(refusal), 20)
    assert refusal.unrecorded is None
    await until(lambda: disk.failed_writes >= 4)  # the first write, then retries on the timer
    assert not any(t.done() for t in tasks) and writer.stats().held_records == 7
    disk.free()
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert all(flow.unrecorded is None for flow in flows)
    assert writer.stats().held_records == 0 and writer.stats().dropped_records == 0
    writer.close()
    runs = [s.run_id for r in all_records(tmp_path / "wal") for s in r.spans()]
    assert runs == [f"run-{i}" for i in range(6)] + ["refused"]


async def test_a_step_the_wal_cannot_keep_is_refused_not_answered(tmp_path: Path, monkeypatch) -> None:
    """Past the hold (its time here; no hold at all below) the record is dropped and the call is
    refused: 503 ledger_unavailable, code ledger_disk_full — counted one per step."""
    config = Config(upstreams=DEFAULT_UPSTREAMS)
    FillingDisk(monkeypatch, room=0)
    for hold in ({"hold_bytes": 1 << 20, "hold_s": 0.1}, {}):
        writer = WalWriter(tmp_path / f"wal-{len(hold)}", **hold)  # type: ignore[arg-type]
        trace = TraceStep(WalRecorder(writer, PayloadPolicy()))
        flows = [passthrough_flow(config, f"run-{i}") for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(trace.done(flow) for flow in flows)), 20)
        for flow in flows:
            refused = flow.unrecorded
            assert isinstance(refused, LedgerUnavailable) and refused.code == "ledger_disk_full", hold
            assert refused.status == 503 and flow.run is not None and flow.run.run_id in refused.message
        assert writer.stats().dropped_records == 3 and writer.stats().held_records == 0
        # a call runcap refused itself, never forwarded (a cap, the ledger): that refusal stands,
        # and it is sent without waiting for room (its record held, then dropped: counted)
        refusal = passthrough_flow(config, "never-forwarded")
        refusal.upstream_status, refusal.status = 0, 402
        await asyncio.wait_for(trace.done(refusal), 20)
        assert refusal.unrecorded is None
        await until(lambda w=writer: w.stats().dropped_records == 4)
        writer.close()
