"""One contract for every ledger backend: SQLite (embedded) and Redis (shared) must behave the
same — caps, reservations, concurrency, deadline, cancel, recovery, idempotency records, expiry."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from proxy.caps import RunCaps
from proxy.errors import BudgetExceeded, DeadlineExceeded, OutcomeUnknown, RunCancelled
from proxy.ledger.base import (
    COMPLETED,
    IN_FLIGHT,
    UNKNOWN,
    Ledger,
    RecordNotUnknown,
    Settlement,
    StepRequest,
    ToolCallRequest,
)
from proxy.ledger.redis import RedisLedger
from proxy.ledger.sqlite import SQLiteLedger

USD = 1_000_000_000


def step(
    run_id: str, caps: RunCaps, *, input_tokens: int = 100, output: int | None = 100, **kw: Any
) -> StepRequest:
    return StepRequest(
        run_id=run_id, task="t", caps=caps, now=kw.pop("now", time.time()), model="m",
        input_tokens_bound=input_tokens, client_output_limit=output, model_output_bound=4096,
        min_output_tokens=16, input_usd_per_mtok=Decimal(1), output_usd_per_mtok=Decimal(2), **kw,
    )  # fmt: skip


def tool(
    run_id: str, key: str | None, caps: RunCaps | None = None, now: float | None = None
) -> ToolCallRequest:
    return ToolCallRequest(run_id, "t", caps or RunCaps(), now or time.time(), "refund", key, "ah")


@pytest.fixture(params=["sqlite", "redis"])
async def make_ledger(request, tmp_path: Path) -> AsyncIterator[Callable[..., Ledger]]:  # type: ignore[no-untyped-def]
    """make_ledger(**opts) → a ledger instance; every instance of one test shares one store."""
    opened: list[Ledger] = []
    prefix = f"t{secrets.token_hex(4)}:"

    def make(retention_s: float = 3600.0) -> Ledger:
        if request.param == "sqlite":
            ledger: Ledger = SQLiteLedger(tmp_path / "ledger.sqlite3", retention_s=retention_s)
        else:
            server = request.getfixturevalue("redis_server")
            ledger = RedisLedger(server.url, prefix=prefix, retention_s=retention_s, heartbeat_ttl_s=5)
        opened.append(ledger)
        return ledger

    make.backend = request.param  # type: ignore[attr-defined]
    yield make
    for ledger in opened:
        try:
            await ledger.close()
        except Exception:
            pass


async def die(ledger: Ledger) -> None:
    """Simulate kill -9 of the process owning `ledger`: its liveness signal disappears."""
    if isinstance(ledger, SQLiteLedger):
        ledger._owner_file.close()  # the flock goes with the process
    else:
        assert isinstance(ledger, RedisLedger)
        assert ledger._heartbeat_task is not None
        ledger._heartbeat_task.cancel()
        await ledger._r.delete(ledger._k_owner(ledger.owner))  # as if its TTL ran out


async def test_caps_only_lower(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    res = await led.begin_step(step("r", RunCaps(max_usd_nanos=USD, max_steps=10)))
    assert res.state.caps.max_steps == 10
    await led.settle(res, Settlement(), time.time())
    res = await led.begin_step(step("r", RunCaps(max_usd_nanos=2 * USD, max_steps=5)))
    assert res.state.caps.max_steps == 5 and res.state.caps.max_usd_nanos == USD
    await led.settle(res, Settlement(), time.time())
    res = await led.begin_step(step("r", RunCaps(max_steps=50)))
    assert res.state.caps.max_steps == 5 and res.state.caps.max_usd_nanos == USD
    assert (await led.get_run("r")).caps.max_steps == 5


async def test_reserve_settle_arithmetic(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    res = await led.begin_step(step("r", RunCaps(max_usd_nanos=USD, max_tokens=10_000)))
    # 100 input at $1/M + 100 output at $2/M = 300 micro-dollars
    assert res.usd_nanos == 300_000 and res.tokens == 200
    run = await led.get_run("r")
    assert run.reserved_usd_nanos == 300_000 and run.reserved_tokens == 200 and run.steps == 1
    state = await led.settle(
        res, Settlement(input_tokens=90, output_tokens=10, cost_usd_nanos=110_000), time.time()
    )
    assert state.reserved_usd_nanos == 0 and state.reserved_tokens == 0
    assert state.spent_usd_nanos == 110_000 and state.tokens_used == 100
    run = await led.get_run("r")
    assert run.spent_usd_nanos == 110_000 and run.input_tokens == 90 and run.output_tokens == 10
    # Large amounts stay exact (no float on the way).
    big = RunCaps(max_usd_nanos=999_999_999 * USD + 1)
    res = await led.begin_step(step("big", big))
    state = await led.settle(res, Settlement(cost_usd_nanos=123_456_789_123_456_789), time.time())
    assert (await led.get_run("big")).spent_usd_nanos == 123_456_789_123_456_789
    assert (await led.get_run("big")).caps.max_usd_nanos == 999_999_999 * USD + 1


async def test_concurrent_reservations_never_overshoot(make_ledger):  # type: ignore[no-untyped-def]
    leds = [make_ledger(), make_ledger()]  # two instances on one store (two processes / replicas)
    cap = RunCaps(max_usd_nanos=3_000_000)  # room for 10 calls of 300 µ$
    results = await asyncio.gather(
        *(leds[i % 2].begin_step(step("c", cap)) for i in range(40)), return_exceptions=True
    )
    owners = {id(r): leds[i % 2] for i, r in enumerate(results)}
    ok = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, BudgetExceeded)]
    assert len(ok) + len(refused) == 40
    assert sum(r.usd_nanos for r in ok) <= 3_000_000
    run = await leds[0].get_run("c")
    assert run.reserved_usd_nanos == sum(r.usd_nanos for r in ok) <= 3_000_000
    assert len({r.id for r in ok}) == len(ok)
    for r in ok:
        await owners[id(r)].settle(r, Settlement(cost_usd_nanos=r.usd_nanos), time.time())
    run = await leds[1].get_run("c")
    assert run.reserved_usd_nanos == 0 and run.spent_usd_nanos <= 3_000_000


async def test_final_step_then_refused(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    caps = RunCaps(max_steps=2)
    r1 = await led.begin_step(step("f", caps))
    assert not r1.final_step
    await led.settle(r1, Settlement(), time.time())
    r2 = await led.begin_step(step("f", caps))
    assert r2.final_step
    state = await led.settle(r2, Settlement(), time.time())
    assert state.status == "steps_exceeded"
    with pytest.raises(BudgetExceeded) as e:
        await led.begin_step(step("f", caps))
    assert e.value.code == "max_steps"


async def test_deadline(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    now = time.time()
    caps = RunCaps(deadline=now + 0.5)
    res = await led.begin_step(step("d", caps, now=now))
    await led.settle(res, Settlement(), now)
    with pytest.raises(DeadlineExceeded):
        await led.begin_step(step("d", caps, now=now + 1))
    with pytest.raises(DeadlineExceeded):
        await led.touch_run("d", "", RunCaps(), now + 1)
    with pytest.raises(DeadlineExceeded):
        await led.begin_tool_call(tool("d", None, now=now + 1))
    assert (await led.get_run("d")).status == "deadline_exceeded"


async def test_cancel_visible_to_every_instance(make_ledger):  # type: ignore[no-untyped-def]
    a, b = make_ledger(), make_ledger()
    res = await a.begin_step(step("x", RunCaps()))
    state = await b.cancel("x", time.time())
    assert state.cancelled and state.status == "cancelled"
    for call in (
        lambda: a.begin_step(step("x", RunCaps())),
        lambda: a.touch_run("x", "", RunCaps(), time.time()),
        lambda: a.begin_tool_call(tool("x", "k1")),
    ):
        with pytest.raises(RunCancelled):
            await call()
    await a.settle(res, Settlement(run_status="cancelled"), time.time())
    run = await a.get_run("x")
    assert run.status == "cancelled" and run.reserved_usd_nanos == 0
    # A cancel that races the first request still wins.
    await b.cancel("never-seen", time.time())
    with pytest.raises(RunCancelled):
        await a.begin_step(step("never-seen", RunCaps()))


async def test_cancel_is_pushed_to_other_redis_instances(make_ledger):  # type: ignore[no-untyped-def]
    if make_ledger.backend != "redis":
        pytest.skip("SQLite has no push: runcap polls the cancel flags of runs in flight")
    a, b = make_ledger(), make_ledger()
    events = b.cancel_events()
    got = asyncio.create_task(events.__anext__())
    await asyncio.sleep(0.2)  # subscribed
    await a.cancel("pushed", time.time())
    assert await asyncio.wait_for(got, 5) == "pushed"
    await events.aclose()


async def test_recovery_of_a_dead_owner(make_ledger):  # type: ignore[no-untyped-def]
    a, b = make_ledger(), make_ledger()
    res = await a.begin_step(step("rec", RunCaps(max_usd_nanos=USD)))
    await a.begin_tool_call(tool("rec", "k-dead"))
    assert await b.recover() == []  # a is alive: nothing to do
    assert (await b.get_tool_call("rec", "k-dead")).state == IN_FLIGHT
    await die(a)
    recovered = await b.recover()
    assert [(r.run_id, r.reservation_id, r.usd_nanos) for r in recovered] == [("rec", res.id, res.usd_nanos)]
    run = await b.get_run("rec")
    assert run.reserved_usd_nanos == 0 and run.spent_usd_nanos == res.usd_nanos
    assert run.output_tokens == res.output_tokens
    assert (await b.get_tool_call("rec", "k-dead")).state == UNKNOWN
    assert await b.recover() == []  # never twice
    # The dead process's own late settlement does not charge again.
    await a.settle(res, Settlement(cost_usd_nanos=1), time.time())
    assert (await b.get_run("rec")).spent_usd_nanos == res.usd_nanos


async def test_idempotency_lifecycle(make_ledger):  # type: ignore[no-untyped-def]
    a, b = make_ledger(), make_ledger()
    first = await a.begin_tool_call(tool("i", "k"))
    assert first.action == "execute" and first.record is not None and first.record.state == IN_FLIGHT
    assert first.state.tool_calls_executed == 1
    assert (await b.begin_tool_call(tool("i", "k"))).action == "wait"  # other live owner
    assert (await a.begin_tool_call(tool("i", "k"))).action == "wait"
    await a.complete_tool_call("i", "k", 201, {"content-type": "application/json"}, b'{"ok":1}', time.time())
    again = await b.begin_tool_call(tool("i", "k"))
    assert again.action == "replay"
    rec = again.record
    assert (rec.state, rec.status, rec.headers, rec.body) == (
        COMPLETED,
        201,
        {"content-type": "application/json"},
        b'{"ok":1}',
    )
    assert again.state.tool_calls_executed == 1  # a replay is not another execution
    # Namespaced by run: the same key in another run is a new call.
    assert (await b.begin_tool_call(tool("i2", "k"))).action == "execute"
    # A call without side effects has no record but counts.
    plain = await a.begin_tool_call(tool("i", None))
    assert plain.action == "execute" and plain.record is None and plain.state.tool_calls_executed == 2

    # Cut in flight → unknown → 409 until reconciled.
    await a.begin_tool_call(tool("i", "cut"))
    await a.mark_unknown("i", "cut", time.time(), "cancelled")
    with pytest.raises(OutcomeUnknown):
        await b.begin_tool_call(tool("i", "cut"))
    listed = await b.list_tool_calls(UNKNOWN)
    assert [(r.run_id, r.key, r.tool, r.args_hash, r.error) for r in listed] == [
        ("i", "cut", "refund", "ah", "cancelled")
    ]
    with pytest.raises(RecordNotUnknown):
        await b.resolve_tool_call("i", "k", done=False, now=time.time())
    assert await b.resolve_tool_call("i", "nope", done=True, now=time.time()) is None
    await b.resolve_tool_call("i", "cut", done=True, now=time.time(), status=200, body=b"done-by-hand")
    replay = await a.begin_tool_call(tool("i", "cut"))
    assert replay.action == "replay" and replay.record.body == b"done-by-hand" and replay.record.status == 200
    assert await b.list_tool_calls(UNKNOWN) == []

    await a.begin_tool_call(tool("i", "cut2"))
    await a.mark_unknown("i", "cut2", time.time(), "timeout")
    executed = (await a.get_run("i")).tool_calls_executed
    await b.resolve_tool_call("i", "cut2", done=False, now=time.time())
    assert await a.get_tool_call("i", "cut2") is None
    assert (await a.get_run("i")).tool_calls_executed == executed - 1  # it did not happen
    assert (await a.begin_tool_call(tool("i", "cut2"))).action == "execute"
    # mark_unknown never downgrades a completed record.
    await a.complete_tool_call("i", "cut2", 200, {}, b"x", time.time())
    await a.mark_unknown("i", "cut2", time.time(), "late")
    assert (await a.get_tool_call("i", "cut2")).state == COMPLETED
    assert {r.key for r in await a.list_tool_calls(run_id="i")} == {"k", "cut", "cut2"}


async def test_dead_owner_in_flight_becomes_unknown_on_repeat(make_ledger):  # type: ignore[no-untyped-def]
    a, b = make_ledger(), make_ledger()
    await a.begin_tool_call(tool("dd", "k"))
    await die(a)
    with pytest.raises(OutcomeUnknown):
        await b.begin_tool_call(tool("dd", "k"))
    assert (await b.get_tool_call("dd", "k")).state == UNKNOWN


async def test_tool_call_cap(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    caps = RunCaps(max_tool_calls=2)
    assert (await led.begin_tool_call(tool("tc", "a", caps))).action == "execute"
    assert (await led.begin_tool_call(tool("tc", None, caps))).action == "execute"
    with pytest.raises(BudgetExceeded) as e:
        await led.begin_tool_call(tool("tc", "b", caps))
    assert e.value.code == "max_tool_calls" and e.value.status == 402
    assert await led.get_tool_call("tc", "b") is None
    run = await led.get_run("tc")
    assert run.tool_calls == 2 and run.status == "tool_calls_exceeded"
    # Replays of completed calls still answer.
    await led.complete_tool_call("tc", "a", 200, {}, b"r", time.time())
    assert (await led.begin_tool_call(tool("tc", "a", caps))).action == "replay"


async def test_concurrent_duplicates_execute_once(make_ledger):  # type: ignore[no-untyped-def]
    a, b = make_ledger(), make_ledger()
    starts = await asyncio.gather(
        *((a if i % 2 else b).begin_tool_call(tool("cc", "same")) for i in range(30))
    )
    assert sum(s.action == "execute" for s in starts) == 1
    assert sum(s.action == "wait" for s in starts) == 29
    assert (await a.get_run("cc")).tool_calls_executed == 1


async def test_retention(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger(retention_s=1.0)
    await led.begin_tool_call(tool("old", "k"))
    await led.complete_tool_call("old", "k", 200, {}, b"x", time.time())
    if isinstance(led, RedisLedger):
        ttl = await led._r.pttl(led._k_tc("old", "k"))
        assert 0 < ttl <= 1000
        assert 0 < await led._r.pttl(led._k_run("old")) <= 1000
        await asyncio.sleep(1.3)
    else:
        await asyncio.sleep(1.1)
        await led.recover()  # the periodic sweep purges
    assert await led.get_tool_call("old", "k") is None
    assert await led.get_run("old") is None
    assert await led.list_tool_calls() == []


def test_retention_setting_is_validated() -> None:
    from proxy.config import ConfigError, build_config

    assert build_config({}).ledger_retention_s == 7 * 24 * 3600
    assert build_config({"ledger_retention_s": 3600}).ledger_retention_s == 3600
    for bad in (0, -5, "soon", 0.5):
        with pytest.raises(ConfigError, match=r"^ledger_retention_s"):
            build_config({"ledger_retention_s": bad})
