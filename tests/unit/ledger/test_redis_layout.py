"""The Redis ledger's key layout (proxy/ledger/redis/keys.py) on a real redis-server: every
script's keys in one hash slot (what Redis Cluster requires), a child run found by its id alone,
the keys of layout 2 moved once at start, and acknowledged writes (`redis_wait_replicas`)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import orjson
import pytest
from redis.crc import key_slot

from proxy.caps import RunCaps
from proxy.errors import LedgerUnavailable
from proxy.ledger.base import COMPLETED, IN_FLIGHT, UNKNOWN, IdempotencyRecord, RunState, Settlement
from proxy.ledger.guarded import GuardedLedger
from proxy.ledger.redis import RedisLedger
from proxy.ledger.redis.codec import record_json, state_json
from proxy.ledger.redis.store import ReplicasBehind
from tests.support.ledgers import USD, step, tool
from tests.support.redis_server import RedisServer


class RecordedScript:
    """A registered script that notes the key list of every call, then runs the real script."""

    def __init__(self, name: str, script: Any, seen: list[tuple[str, list[str]]]) -> None:
        self.name, self.inner, self.seen = name, script, seen
        self.sha, self.script = script.sha, script.script

    async def __call__(self, keys: list[str], args: list[Any] | None = None, client: Any = None) -> Any:
        self.seen.append((self.name, list(keys)))
        return await self.inner(keys=keys, args=args, client=client)


def record_scripts(led: RedisLedger) -> list[tuple[str, list[str]]]:
    seen: list[tuple[str, list[str]]] = []
    scripts = led._store.scripts
    for name, script in list(vars(scripts).items()):
        setattr(scripts, name, RecordedScript(name, script, seen))
    return seen


@pytest.fixture
async def ledgers(redis_server: RedisServer) -> AsyncIterator[Any]:
    prefix = f"t{secrets.token_hex(4)}:"
    opened: list[RedisLedger] = []

    def make(**kw: Any) -> RedisLedger:
        led = RedisLedger(redis_server.url, prefix=prefix, heartbeat_ttl_s=5, confirm_dead_s=0, **kw)
        opened.append(led)
        return led

    yield make
    for led in opened:
        await led.close()


async def kill(led: RedisLedger) -> None:
    """As if the process owning `led` died: its heartbeat stops and expires."""
    assert led._heartbeat_task is not None
    led._heartbeat_task.cancel()
    await led._r.delete(led._k_owner(led.owner))


def record(run_id: str, key: str, state: str, owner: str, now: float) -> IdempotencyRecord:
    return IdempotencyRecord(
        run_id=run_id, key=key, tool="refund", args_hash="ah", state=state, owner=owner,
        created_at=now, updated_at=now, step=0, status=200 if state == COMPLETED else None,
    )  # fmt: skip


async def write_layout_2(led: RedisLedger, dead_owner: str, now: float) -> str:
    """Keys as runcap wrote them before run trees (layout 2, no hash tags): run `r2` with one
    reservation of `dead_owner` and three records (completed, unknown, in flight of the dead
    owner), plus a runcap 0.1 record (`tc:`) of run `r1`. Returns the reservation id."""
    r, p = led._r, led.prefix
    state = RunState("r2", task="t", started_at=now, updated_at=now, caps=RunCaps(max_usd_nanos=USD))
    state.steps, state.reserved_usd_nanos, state.reserved_tokens = 1, 300_000, 200
    await r.hset(f"{p}run:r2", mapping={"v": "old-version", "s": state_json(state)})
    await r.pexpire(f"{p}run:r2", 3_600_000)
    rid = "res-from-layout-2"
    await r.hset(f"{p}res:{dead_owner}", rid, orjson.dumps(["r2", 300_000, 100, 100, now]))
    await r.sadd(f"{p}owners", dead_owner)
    for key, st in (("done", COMPLETED), ("cut", UNKNOWN), ("flying", IN_FLIGHT)):
        rec = record("r2", key, st, dead_owner, now)
        await r.hset(
            f"{p}call:2:r2:{key}", mapping={"st": st, "m": record_json(rec), "b": b"body-" + key.encode()}
        )
        await r.zadd(f"{p}tcs", {orjson.dumps(["r2", key]): now})
    await r.zadd(f"{p}unknown", {orjson.dumps(["r2", "cut"]): now})
    await r.sadd(f"{p}inflight:{dead_owner}", orjson.dumps(["r2", "flying"]))
    old = record("r1", "k", COMPLETED, "gone", now)
    await r.hset(f"{p}tc:r1:k", mapping={"st": COMPLETED, "m": record_json(old), "b": b"from 0.1"})
    await r.zadd(f"{p}tcs", {orjson.dumps(["r1", "k"]): now})
    return rid


async def old_keys(led: RedisLedger) -> list[bytes]:
    p = led.prefix
    found: list[bytes] = []
    for pattern in ("run:[^{]*", "call:[^{]*", "res:[^{]*", "swept:[^{]*", "inflight:[^{]*", "tc:*"):
        found += [k async for k in led._r.scan_iter(match=p + pattern)]
    return found + [k for k in (p + "unknown", p + "tcs") if await led._r.exists(k)]  # type: ignore[misc]


async def test_layout_2_keys_are_moved_once_and_a_dead_owner_of_then_is_swept(ledgers) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    led = ledgers()
    rid = await write_layout_2(led, "deadbeefdeadbeef", now)
    recovered = await led.recover()  # start-up: the moves, then the sweep (the owner is dead)
    assert [(r.run_id, r.reservation_id, r.usd_nanos) for r in recovered] == [("r2", rid, 300_000)]
    run = await led.get_run("r2")
    assert run is not None and run.reserved_usd_nanos == 0 and run.spent_usd_nanos == 300_000
    assert (await led.get_tool_call("r2", "done")).body == b"body-done"
    assert (await led.get_tool_call("r1", "k")).body == b"from 0.1"
    assert (await led.get_tool_call("r2", "flying")).state == UNKNOWN  # its owner is dead
    listed = {(r.run_id, r.key, r.state) for r in await led.list_tool_calls()}
    assert listed == {
        ("r2", "done", COMPLETED),
        ("r2", "cut", UNKNOWN),
        ("r2", "flying", UNKNOWN),
        ("r1", "k", COMPLETED),
    }
    assert {(r.run_id, r.key) for r in await led.list_tool_calls(UNKNOWN)} == {
        ("r2", "cut"),
        ("r2", "flying"),
    }
    assert await old_keys(led) == []
    assert await led._r.get(led.prefix + "layout") == b"3"
    # Once: a second replica starting later moves nothing, and the run goes on under its tag.
    other = ledgers()
    assert await other._recovery.move_layout_2() == 0
    res = await other.begin_step(step("r2", RunCaps(max_usd_nanos=USD)))
    await other.settle(res, Settlement(cost_usd_nanos=5), time.time())
    assert (await led.get_run("r2")).spent_usd_nanos == 300_005


async def test_a_run_written_since_the_upgrade_wins_over_its_layout_2_copy(ledgers) -> None:  # type: ignore[no-untyped-def]
    led = ledgers()
    await write_layout_2(led, "deadbeefdeadbeef", time.time())
    res = await led.begin_step(step("r2", RunCaps(max_usd_nanos=USD)))  # a new replica, before the move
    await led.settle(res, Settlement(cost_usd_nanos=7), time.time())
    await led.recover()
    run = await led.get_run("r2")
    assert run.spent_usd_nanos == 7 + 300_000  # the newer run, then the dead owner's sweep
    assert await old_keys(led) == []


async def test_every_script_touches_one_slot(ledgers) -> None:  # type: ignore[no-untyped-def]
    """What Redis Cluster requires of a script: all its keys in one hash slot (redis-py's
    `key_slot`, the cluster's CRC16) — but the start-up moves of an older layout, which only
    ever ran on a single Redis. Every script runs here at least once: start-up moves,
    reservations, settlements, sweeps, take-backs, tool calls, and a child run of a tree."""
    a, b = ledgers(), ledgers()
    seen = record_scripts(a)
    seen_b = record_scripts(b)
    await write_layout_2(a, "deadbeefdeadbeef", time.time())
    await a.recover()  # move_legacy, move_key; the dead owner's sweep (move_res)
    await a.touch_run("plain", "", RunCaps(), time.time())  # save_run
    res = await a.begin_step(step("root", RunCaps(max_usd_nanos=USD)))  # begin_step
    await a.settle(res, Settlement(cost_usd_nanos=1), time.time())  # settle
    start = await a.begin_tool_call(tool("root", "k1"))  # begin_tool
    assert start.action == "execute"
    await a.complete_tool_call("root", "k1", 200, {}, b"ok", time.time())  # set_tool
    await a.mark_unknown("root", "nothing", time.time())
    # A child of `root`: its state under the root's tag, found by its id through its pointer.
    child = RunState("child", parent_run_id="root", root_run_id="root", started_at=time.time())
    await a._store.point(child)
    await a._store.cas_run("", child)
    res = await a.begin_step(step("child", RunCaps(max_usd_nanos=USD)))
    assert (await b.get_run("child")).steps == 1
    await b.begin_tool_call(tool("child", "k2"))
    # A child made by the ledger (X-Run-Parent): it and its parent written by one script.
    kid = await a.begin_step(replace(step("kid", RunCaps(max_usd_nanos=USD)), parent_run_id="root"))  # chain
    await a.settle(kid, Settlement(cost_usd_nanos=1), time.time())
    assert (await b.get_run("kid")).root == "root" and (await b.get_run("root")).sub_spent_usd_nanos == 1
    # Swept while alive (taken for dead), then taken back, then settled out of `swept:`.
    res2 = await a.begin_step(step("root", RunCaps(max_usd_nanos=USD)))
    await a._r.delete(a._k_owner(a.owner))
    await b.recover()
    await a._liveness.beat()  # re-registers: takes its reservations back (move_res)
    await kill(a)
    await b.recover()
    await a.settle(res, Settlement(cost_usd_nanos=2), time.time())  # settle → -2 → move_res
    await a.settle(res2, Settlement(cost_usd_nanos=3), time.time())
    calls = seen + seen_b
    assert {name for name, _ in calls} == set(vars(a._store.scripts))
    for name, keys in calls:
        if name in ("move_legacy", "move_key"):
            continue  # an older layout's key to its new name: a single Redis only (keys.py)
        assert len({key_slot(k.encode()) for k in keys}) == 1, (name, keys)
    child_keys = [keys for name, keys in seen if name == "begin_step" and keys[0].endswith(":child")]
    assert child_keys and all("{root}" in k for k in child_keys[0])


async def test_a_reservation_waits_for_its_replica(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`redis_wait_replicas = 1`: acknowledged once the replica has it (WAIT); with the replica
    frozen, refused as 503 `ledger_replicas_behind` naming the setting — never forwarded."""
    primary = RedisServer().start()
    replica = RedisServer(extra=("--replicaof", "127.0.0.1", str(primary.port))).start()
    # WAIT's timeout: long enough for a replica that keeps up on a loaded machine (at 0.2 s the
    # first acknowledged write once fell short under the suite's load), short enough for the
    # frozen replica's three refusals below.
    led = RedisLedger(primary.url, prefix="w:", wait_replicas=1, wait_timeout_s=1.0)
    guarded = GuardedLedger(led, timeout_s=2.0)
    try:
        # Until the replica acknowledges writes (readiness's own probe: a write and its WAIT) —
        # INFO's `state=online` comes before the replica's first acknowledgement, by up to a
        # WAIT timeout on a loaded machine.
        for _ in range(500):
            try:
                await led.ping()
                break
            except ReplicasBehind:
                await asyncio.sleep(0.02)
        res = await guarded.begin_step(step("w", RunCaps(max_usd_nanos=USD)))
        assert (await guarded.settle(res, Settlement(cost_usd_nanos=9), time.time())).spent_usd_nanos == 9
        await led.ping()  # ready: the replica keeps up
        replica.freeze()
        with pytest.raises(ReplicasBehind, match="redis_wait_replicas"):
            await led.begin_step(step("w", RunCaps(max_usd_nanos=USD)))
        with pytest.raises(ReplicasBehind):  # readiness says so too
            await led.ping()
        with pytest.raises(LedgerUnavailable) as e:
            await guarded.begin_step(step("w", RunCaps(max_usd_nanos=USD)))
        assert e.value.code == "ledger_replicas_behind" and "redis_wait_replicas" in e.value.message
        replica.thaw()  # acknowledged again (the backend: the guard remembers this task's failure)
        res = await led.begin_step(step("w", RunCaps(max_usd_nanos=USD)))
        await led.settle(res, Settlement(cost_usd_nanos=1), time.time())
    finally:
        await guarded.close()
        replica.stop()
        primary.stop()


def test_cluster_settings_are_validated() -> None:
    from proxy.config import ConfigError, build_config

    ledger = build_config({"redis_url": "redis://127.0.0.1:7000", "redis_cluster": True}).ledger
    assert ledger.redis_cluster and ledger.redis_wait_replicas == 0
    env = {"RUNCAP_REDIS_URL": "redis://127.0.0.1:7000", "RUNCAP_REDIS_CLUSTER": "1"}
    assert build_config({}, env=env).ledger.redis_cluster
    for raw, env, message in (
        ({"redis_cluster": True}, {}, r"^redis_cluster: .*`redis_url` is not set"),
        ({"redis_wait_replicas": 1}, {}, r"^redis_wait_replicas: .*`redis_url` is not set"),
        ({"redis_url": "unix:///tmp/r.sock", "redis_cluster": True}, {}, r"^redis_cluster: .*over TCP"),
        ({"redis_url": "redis://h:1", "redis_wait_replicas": -1}, {}, r"^redis_wait_replicas: "),
        ({"redis_url": "redis://h:1"}, {"RUNCAP_REDIS_CLUSTER": "maybe"}, r"^RUNCAP_REDIS_CLUSTER: "),
    ):
        with pytest.raises(ConfigError, match=message):
            build_config(raw, env=env)


def test_a_prefix_may_not_hold_a_hash_tag() -> None:
    with pytest.raises(ValueError, match="prefix"):
        RedisLedger("redis://127.0.0.1:1/0", prefix="{mine}:")


def test_a_cluster_without_a_master_for_the_slot_is_an_unavailable_ledger() -> None:
    """A failover under way: the cluster client's errors are `ledger_unreachable` (a 503 with a
    retry hint), not a bug's bare 500."""
    from redis.exceptions import ClusterDownError, SlotNotCoveredError

    led = RedisLedger("redis://127.0.0.1:1/0", prefix="p:")  # never connects
    assert (
        led.failure_code(SlotNotCoveredError('Slot "5315" is not covered by the cluster.'))
        == "ledger_unreachable"
    )
    assert led.failure_code(ClusterDownError("CLUSTERDOWN The cluster is down")) == "ledger_unreachable"
    assert led.failure_code(ReplicasBehind("short")) == "ledger_replicas_behind"


def test_an_error_inside_redis_py_is_an_unavailable_ledger_and_one_of_runcaps_is_a_bug() -> None:
    """redis-py's cluster client can fail on its own state mid-failover (an AttributeError from a
    node it dropped): `ledger_unreachable` (503, retried). The same error raised in runcap's own
    code stays a bug (None: a 500)."""
    from redis.crc import key_slot

    led = RedisLedger("redis://127.0.0.1:1/0", prefix="p:")  # never connects
    with pytest.raises(AttributeError) as inside:
        key_slot(None)  # type: ignore[arg-type]
    assert led.failure_code(inside.value) == "ledger_unreachable"
    with pytest.raises(AttributeError) as ours:
        None.missing  # type: ignore[attr-defined]  # noqa: B018
    assert led.failure_code(ours.value) is None


async def test_a_slot_map_reload_keeps_the_clients_other_calls_are_using(redis_cluster) -> None:  # type: ignore[no-untyped-def]
    """`redis_wait_replicas` on a cluster: a reload of the slot map (after MOVED, READONLY or a
    dead node) runs while other calls open clients of their slots' nodes and send on them. It
    closes only the clients of nodes the new map no longer names. Before, it closed every client
    while iterating the dict the other calls were adding to — "dictionary changed size during
    iteration" in a failover under load (a CI failure) — and cut the pipelines of healthy nodes."""
    from redis.asyncio.cluster import RedisCluster

    from proxy.ledger.redis.store import Durability

    r = RedisCluster.from_url(redis_cluster.url)
    await r.initialize()
    d = Durability(r, replicas=1, timeout_ms=2000)
    # One key on each master (they hash to different slots; three masters own them all).
    keys: dict[str, str] = {}
    for i in range(200):
        node = r.get_node_from_key(f"k{i}")
        keys.setdefault(f"{node.host}:{node.port}", f"k{i}")
    assert len(keys) == 3
    first, *others = keys.values()
    try:
        await d.write(first, "SET", first, "1")  # a client with an open connection: its close awaits
        kept = d._nodes[next(iter(keys))]
        d._client_for(first, ("127.0.0.1", 1))  # a client of a node the map does not name (a dead one)
        results = await asyncio.gather(
            d._refresh(), *(d.write(k, "SET", k, str(n)) for n in range(5) for k in keys.values())
        )
        assert results[1:] == [True] * 15
        assert set(d._nodes) == set(keys)  # a client per live node the calls used, the dead one gone
        assert d._nodes[next(iter(keys))] is kept  # ... the one in use before the reload kept
        assert await d.write(others[0], "SET", others[0], "x")
    finally:
        await d.close()
        await r.aclose()
