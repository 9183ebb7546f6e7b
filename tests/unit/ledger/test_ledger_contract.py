"""One contract for every ledger backend: SQLite (embedded) and Redis (shared) must behave the
same — caps, reservations, concurrency, deadline, cancel, recovery, idempotency records (bound to
their operation, one per (run, key) pair), expiry, upgrades of an older ledger."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import secrets
import sqlite3
import string
import time
from pathlib import Path

import orjson
import pytest

from proxy.caps import RunCaps
from proxy.errors import (
    BudgetExceeded,
    DeadlineExceeded,
    IdempotencyKeyReused,
    OutcomeUnknown,
    RunCancelled,
)
from proxy.ledger.base import (
    COMPLETED,
    IN_FLIGHT,
    UNKNOWN,
    Ledger,
    RecordNotUnknown,
    Settlement,
    begin_unledgered_step,
    nothing_to_enforce,
    settle_unledgered,
)
from proxy.ledger.redis import RedisLedger
from tests.support.ledgers import USD, backends, die, step, tool
from tests.support.redis_server import wait_subscribed


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


async def test_the_output_limit_is_clamped_to_what_each_cap_affords(make_ledger):  # type: ignore[no-untyped-def]
    """The worst case must fit what is left: the output limit is lowered to exactly what the cap
    affords after the input bound and what calls in flight reserved, and says it was clamped."""
    led = make_ledger()
    # Tokens: 1,000 cap - 100 input = 900 affordable; the client asked for 4,000.
    res = await led.begin_step(step("tok", RunCaps(max_tokens=1000), output=4000))
    assert (res.output_limit, res.output_tokens, res.clamped, res.tokens) == (900, 900, True, 1000)
    assert (await led.get_run("tok")).reserved_tokens == 1000
    await led.settle(res, Settlement(input_tokens=100, output_tokens=300), time.time())
    # 600 left - 100 input = 500; no client limit: the model's 4,096 is clamped.
    res = await led.begin_step(step("tok", RunCaps(max_tokens=1000), output=None))
    assert (res.output_limit, res.output_tokens, res.clamped) == (500, 500, True)
    # Dollars: $0.001 cap - 100 input tokens at $1/M ($0.0001) = $0.0009 = 450 output tokens at $2/M.
    res = await led.begin_step(step("usd", RunCaps(max_usd_nanos=1_000_000), output=4000))
    assert (res.output_limit, res.output_tokens, res.clamped, res.usd_nanos) == (450, 450, True, 1_000_000)
    # A second call in flight gets only what the first left: $0 → refused; after settling the
    # first at 100 output tokens ($0.0003 spent), 700,000 nanos are left: 300 output tokens.
    with pytest.raises(BudgetExceeded):
        await led.begin_step(step("usd", RunCaps(max_usd_nanos=1_000_000), output=4000))
    settled = Settlement(input_tokens=100, output_tokens=100, cost_usd_nanos=300_000)
    await led.settle(res, settled, time.time())
    res = await led.begin_step(step("usd", RunCaps(max_usd_nanos=1_000_000), output=4000))
    assert (res.output_limit, res.clamped) == (300, True)
    # Both caps: the tighter one decides.
    both = RunCaps(max_usd_nanos=1_000_000, max_tokens=300)
    res = await led.begin_step(step("both", both, output=4000))
    assert (res.output_limit, res.clamped) == (200, True)
    # A request that fits is not touched.
    res = await led.begin_step(step("fits", RunCaps(max_tokens=1000, max_usd_nanos=USD), output=100))
    assert (res.output_limit, res.output_tokens, res.clamped) == (None, 100, False)


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


@backends("redis", "redis-cluster")  # SQLite has no push: runcap polls the cancel flags of runs in flight
async def test_cancel_is_pushed_to_other_redis_instances(make_ledger, request):  # type: ignore[no-untyped-def]
    a, b = make_ledger(), make_ledger()
    events = b.cancel_events()
    got = asyncio.create_task(events.__anext__())
    cluster = make_ledger.backend == "redis-cluster"  # sharded pub/sub on the channel's master
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    await wait_subscribed(server.url, b.cancel_channel, 1, sharded=cluster)
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
    # The late settlement of a process taken for dead replaces the sweep's estimate: never twice.
    await a.settle(res, Settlement(cost_usd_nanos=1), time.time())
    assert (await b.get_run("rec")).spent_usd_nanos == 1


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

    assert build_config({}).ledger.ledger_retention_s == 7 * 24 * 3600
    assert build_config({"ledger_retention_s": 3600}).ledger.ledger_retention_s == 3600
    for bad in (0, -5, "soon", 0.5):
        with pytest.raises(ConfigError, match=r"^ledger_retention_s"):
            build_config({"ledger_retention_s": bad})


# -- idempotency records are bound to their operation -------------------------------------------

# The same key, another operation: another tool, method, path (sub-path or query), or arguments
# (what the key is derived from, or — when the caller fingerprints nothing — the whole body).
REUSED = "idempotency_key_reused"
OTHER_OPERATIONS = {
    "tool": {"name": "charge"},
    "method+path": {"method": "DELETE", "path": "accounts/42"},  # the reproduced report
    "method": {"method": "PUT"},
    "path": {"path": "accounts/42"},
    "query": {"path": "?account=42"},
    "args": {"op_hash": "op-other", "args_hash": "ah-other"},
    "args, no fingerprint": {"op_hash": "", "args_hash": "ah-other"},
}


async def _record_in(state: str, a: Ledger, b: Ledger, run_id: str, key: str) -> None:
    """Leave a record of `tool(run_id, key)` in `state` ("in_flight, dead owner": `a` died)."""
    await a.begin_tool_call(tool(run_id, key))
    if state == COMPLETED:
        await a.complete_tool_call(run_id, key, 201, {"content-type": "text/plain"}, b"first", time.time())
    elif state == UNKNOWN:
        await a.mark_unknown(run_id, key, time.time(), "cut")
    elif state == "in_flight, dead owner":
        await die(a)


@pytest.mark.parametrize("state", [COMPLETED, IN_FLIGHT, "in_flight, dead owner", UNKNOWN])
async def test_key_reused_for_another_operation_is_refused(make_ledger, state):  # type: ignore[no-untyped-def]
    a, b = make_ledger(), make_ledger()
    await _record_in(state, a, b, "reuse", "K1")
    before = await b.get_tool_call("reuse", "K1")
    for what, other in OTHER_OPERATIONS.items():
        with pytest.raises(IdempotencyKeyReused) as e:
            await b.begin_tool_call(tool("reuse", "K1", **other))
        rej = e.value
        assert (rej.status, rej.type, rej.code) == (422, REUSED, REUSED), what
        assert "'K1'" in rej.message and "POST /tools/refund" in rej.message, rej.message
        assert "new Idempotency-Key" in rej.message, rej.message
        # Never executed, never counted, the record untouched.
        assert await b.get_tool_call("reuse", "K1") == before, what
        assert (await b.get_run("reuse")).tool_calls_executed == 1, what
    with pytest.raises(IdempotencyKeyReused) as e:
        await b.begin_tool_call(tool("reuse", "K1", method="DELETE", path="accounts/42"))
    assert "DELETE /tools/refund/accounts/42" in e.value.message
    # The original operation still gets what it got before.
    if state == COMPLETED:
        again = await b.begin_tool_call(tool("reuse", "K1"))
        assert again.action == "replay" and again.record.body == b"first"
    elif state == IN_FLIGHT:
        assert (await b.begin_tool_call(tool("reuse", "K1"))).action == "wait"
    else:
        with pytest.raises(OutcomeUnknown):
            await b.begin_tool_call(tool("reuse", "K1"))


async def test_same_operation_replays(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    op = {"method": "DELETE", "path": "accounts/42?force=1", "args_hash": "ah1", "op_hash": "op1"}
    first = await led.begin_tool_call(tool("same", "K", **op))
    assert first.action == "execute"
    rec = first.record
    assert (rec.tool, rec.method, rec.path, rec.args_hash, rec.op_hash) == ("refund", *op.values())
    await led.complete_tool_call("same", "K", 200, {}, b"deleted", time.time())
    stored = await led.get_tool_call("same", "K")
    assert (stored.method, stored.path, stored.args_hash, stored.op_hash) == tuple(op.values())
    # Identical; a free-text field reworded (other body, same identifying arguments); a caller
    # that fingerprints nothing but sends the same body: all the same operation.
    for variant in (op, {**op, "args_hash": "ah-reworded"}, {**op, "op_hash": ""}):
        again = await led.begin_tool_call(tool("same", "K", **variant))
        assert again.action == "replay" and again.record.body == b"deleted", variant
    assert (await led.get_run("same")).tool_calls_executed == 1


# -- one record per (run, key) pair --------------------------------------------------------------

# Pairs that a ledger key joining run and key with ":" (`tc:{run_id}:{key}`) would mix up.
AMBIGUOUS_PAIRS = [
    ("a", "b:c"), ("a:b", "c"),
    ("a:", "b"), ("a", ":b"),
    ("x", "1:y:z"), ("x:1", "y:z"), ("x:1:y", "z"),
    ("3", "abc:k"), ("abc", "k"), ("3:abc", "k"),  # a numeric run id looks like a length
    ("1", "1:1"), ("1:1", "1"), ("1", "1:1:1"),
]  # fmt: skip


async def _each_pair_has_its_own_record(led: Ledger, pairs: list[tuple[str, str]]) -> None:
    for run_id, key in pairs:
        start = await led.begin_tool_call(tool(run_id, key))
        assert start.action == "execute", (run_id, key)
        await led.complete_tool_call(run_id, key, 200, {}, repr((run_id, key)).encode(), time.time())
    for run_id, key in pairs:
        record = await led.get_tool_call(run_id, key)
        assert record is not None and (record.run_id, record.key) == (run_id, key)
        assert record.body == repr((run_id, key)).encode()
        replay = await led.begin_tool_call(tool(run_id, key))
        assert replay.action == "replay" and replay.record.body == repr((run_id, key)).encode()
    listed = await led.list_tool_calls(limit=10 * len(pairs))
    assert sorted((r.run_id, r.key) for r in listed) == sorted(pairs)


async def test_run_and_key_never_share_a_record(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await _each_pair_has_its_own_record(led, AMBIGUOUS_PAIRS)
    assert sorted(r.key for r in await led.list_tool_calls(run_id="a")) == [":b", "b:c"]
    # A cut call of one pair is unknown for that pair only.
    await led.begin_tool_call(tool("p", "q:r"))
    await led.mark_unknown("p", "q:r", time.time(), "cut")
    assert (await led.begin_tool_call(tool("p:q", "r"))).action == "execute"
    assert [(r.run_id, r.key) for r in await led.list_tool_calls(UNKNOWN)] == [("p", "q:r")]


RUN_CHARS = string.ascii_letters + string.digits + "._:-"
KEY_CHARS = string.printable.strip() + " éß→😀"  # no control characters


def _random_pairs(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Distinct (run id, key) pairs, `n` random ones plus, for each of those, the pairs made by
    moving the run/key boundary to another ":" — the ones a joined key confuses."""
    pairs: set[tuple[str, str]] = set()
    for _ in range(n):
        # Colons and digits are over-represented: they make the ambiguous splits.
        run_id = "".join(rng.choices(RUN_CHARS + ":::111", k=rng.randint(1, rng.choice((4, 128)))))
        key = "".join(rng.choices(KEY_CHARS + ":::111", k=rng.randint(1, rng.choice((6, 256)))))
        pairs.add((run_id, key))
        joined = f"{run_id}:{key}"
        for i, c in enumerate(joined):
            run2, key2 = joined[:i], joined[i + 1 :]
            if c == ":" and 1 <= len(run2) <= 128 and 1 <= len(key2) <= 256 and set(run2) <= set(RUN_CHARS):
                pairs.add((run2, key2))
    return sorted(pairs)


async def test_random_runs_and_keys_never_share_a_record(make_ledger):  # type: ignore[no-untyped-def]
    """Property (a seeded, bounded generator): distinct (run id, key) pairs — run ids of 1-128
    `[A-Za-z0-9._:-]`, keys of 1-256 printable characters — never share a record."""
    pairs = _random_pairs(random.Random(20260501), 100)
    assert len(pairs) > 200 and sum(":" in run_id for run_id, _ in pairs) > 100
    await _each_pair_has_its_own_record(make_ledger(), pairs)


def test_redis_record_keys_are_distinct_for_distinct_pairs() -> None:
    led = RedisLedger("redis://127.0.0.1:1/0", prefix="p:")  # builds keys; never connects
    for seed in range(20):
        pairs = _random_pairs(random.Random(seed), 200)
        assert len({led._k_tc(r, k) for r, k in pairs}) == len(pairs)
    assert len({led._k_tc(r, k) for r, k in AMBIGUOUS_PAIRS}) == len(AMBIGUOUS_PAIRS)


# -- upgrades: records written by an older runcap ------------------------------------------------

# runcap 0.1's table, before records stored their operation.
_OLD_TOOL_CALLS = """
CREATE TABLE tool_calls (
    run_id TEXT NOT NULL, key TEXT NOT NULL, tool TEXT NOT NULL, args_hash TEXT NOT NULL,
    state TEXT NOT NULL, owner TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    step INTEGER NOT NULL, status INTEGER, headers TEXT NOT NULL, body BLOB NOT NULL,
    error TEXT NOT NULL, PRIMARY KEY (run_id, key)
);
"""


async def _write_old_records(make_ledger, tmp_path: Path, records: list[tuple[str, str, bytes]]) -> Ledger:  # type: ignore[no-untyped-def]
    """A ledger holding completed `refund` records (run, key, body) as runcap 0.1 wrote them (on
    SQLite or a single Redis: its scripts were cross-slot, it never ran on a cluster)."""
    assert make_ledger.backend in ("sqlite", "redis"), make_ledger.backend
    now = time.time()
    if make_ledger.backend == "sqlite":
        db = sqlite3.connect(tmp_path / "ledger.sqlite3")
        db.executescript(_OLD_TOOL_CALLS)
        for run_id, key, body in records:
            db.execute(
                "INSERT INTO tool_calls VALUES (?, ?, 'refund', 'ah-old', 'completed', 'gone', ?, ?, 0, 200, "
                "'{}', ?, '')",
                (run_id, key, now, now, body),
            )
        db.commit()
        db.close()
        return make_ledger()
    led = make_ledger()
    assert isinstance(led, RedisLedger)
    for run_id, key, body in records:
        meta = orjson.dumps(
            {"run_id": run_id, "key": key, "tool": "refund", "args_hash": "ah-old", "state": "completed",
             "owner": "gone", "created_at": now, "updated_at": now, "step": 0, "status": 200,
             "headers": {}, "error": ""}
        )  # fmt: skip
        old_key = f"{led.prefix}tc:{run_id}:{key}"
        await led._r.hset(old_key, mapping={"st": "completed", "m": meta, "b": body})
        await led._r.pexpire(old_key, 3_600_000)
        await led._r.zadd(f"{led.prefix}tcs", {orjson.dumps([run_id, key]): now})
    return led


@backends("sqlite", "redis")  # older layouts ran on a single Redis only (their scripts were cross-slot)
async def test_records_of_an_older_ledger_are_found_and_bound_by_tool(make_ledger, tmp_path):  # type: ignore[no-untyped-def]
    # The last of each colliding pair is the one runcap 0.1 kept; both keep their own identity.
    old = [("old", "k", b"old-k"), ("u:v", "w", b"u:v+w")]
    led = await _write_old_records(make_ledger, tmp_path, old)
    await led.recover()  # start-up (Redis: moves the records to their current keys)
    record = await led.get_tool_call("old", "k")
    assert record is not None and record.body == b"old-k"
    assert (record.method, record.path, record.op_hash) == ("", "", "")
    assert (await led.get_tool_call("u:v", "w")).body == b"u:v+w"
    assert await led.get_tool_call("u", "v:w") is None
    assert (await led.begin_tool_call(tool("u", "v:w"))).action == "execute"
    # Its operation beyond the tool is not known: the same tool replays, another is refused.
    replay = await led.begin_tool_call(tool("old", "k", args_hash="ah-new", op_hash="op-new"))
    assert replay.action == "replay" and replay.record.body == b"old-k"
    with pytest.raises(IdempotencyKeyReused) as e:
        await led.begin_tool_call(tool("old", "k", name="charge"))
    assert "a call to tool 'refund'" in e.value.message
    listed = {(r.run_id, r.key) for r in await led.list_tool_calls()}
    assert listed == {("old", "k"), ("u:v", "w"), ("u", "v:w")}
    if isinstance(led, RedisLedger):
        assert 0 < await led._r.pttl(led._k_tc("old", "k")) <= 3_600_000  # its expiry moved with it
        assert not await led._r.keys(f"{led.prefix}tc:*")
    else:
        led2 = make_ledger()  # opening an upgraded file again changes nothing
        assert (await led2.get_tool_call("old", "k")).body == b"old-k"


@backends("redis")  # SQLite's key (run_id, key) did not change; no older layout ran on a cluster
async def test_moving_old_redis_records_keeps_a_newer_record(make_ledger, tmp_path):  # type: ignore[no-untyped-def]
    led = await _write_old_records(make_ledger, tmp_path, [("n", "k", b"before the upgrade")])
    # The call was made again after the upgrade, before the move: its record is the newer one.
    await led.begin_tool_call(tool("n", "k"))
    await led.complete_tool_call("n", "k", 200, {}, b"after the upgrade", time.time())
    await led.recover()
    assert (await led.get_tool_call("n", "k")).body == b"after the upgrade"
    assert not await led._r.keys(f"{led.prefix}tc:*")
    assert await led._r.get(f"{led.prefix}record-keys") == b"2"


async def test_a_call_with_nothing_to_enforce_is_decided_as_the_ledger_would(make_ledger):  # type: ignore[no-untyped-def]
    """A generated run with no cap is decided and settled in memory (no ledger transaction); the
    run state that reaches its span and `runcap.runs` is the one the ledger computes for the
    same call — step, status, counters, reservation released."""
    led = make_ledger()
    now = time.time()
    for settlement, embeddings in (
        (Settlement(input_tokens=90, output_tokens=10, cost_usd_nanos=110_000, finished=True), False),
        (Settlement(input_tokens=5, output_tokens=7, cost_usd_nanos=1, tool_calls_requested=2), False),
        (Settlement(run_status="cancelled"), False),
        (Settlement(input_tokens=40, cost_usd_nanos=4_000), True),
    ):
        run_id = f"run_{secrets.token_hex(12)}"
        req = step(run_id, RunCaps(), now=now, counts_as_step=not embeddings)
        assert nothing_to_enforce(True, req.caps)
        local = begin_unledgered_step(req)
        ledgered = await led.begin_step(req)
        assert not local.ledgered and ledgered.ledgered
        # The same reservation in every field but its id and where it lives.
        assert dataclasses.replace(local, id=ledgered.id, ledgered=True) == ledgered
        after = settle_unledgered(local, settlement, now + 1)
        assert after == await led.settle(ledgered, settlement, now + 1) == await led.get_run(run_id)
        assert after.reserved_usd_nanos == 0 and after.steps == (0 if embeddings else 1)
    # Anything to enforce — a cap of any kind, or a run id the agent chose — goes to the ledger.
    for caps in (
        RunCaps(max_usd_nanos=USD), RunCaps(max_tokens=1), RunCaps(max_steps=1), RunCaps(max_tool_calls=1),
        RunCaps(deadline=now + 60), RunCaps(timeout_s=60),
    ):  # fmt: skip
        assert not nothing_to_enforce(True, caps)
    assert not nothing_to_enforce(False, RunCaps())
