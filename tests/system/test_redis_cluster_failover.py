"""A Redis Cluster master killed -9 under load (issue 22): 3 masters + 3 replicas of real
`redis-server` processes on loopback, two ledger instances (two runcap replicas) reserving and
settling against one capped run; mid-load the master that owns the run's slot is killed and the
cluster promotes its replica.

* `redis_wait_replicas = 1`: every acknowledged reservation and settlement is on the promoted
  replica; calls are refused (`ReplicasBehind`) while the promoted master has no replica, until
  the killed node, restarted, has rejoined as its replica — no overshoot (acknowledged spend ≤
  the cap), no lost settlement (the run's spend is exactly what was acknowledged), books close
  (nothing left reserved).
* `redis_wait_replicas = 0`: the same load, measured — what the failover lost is printed (the
  README quotes it); the test asserts only that the books are readable and bounded.

The load is bounded in calls; calls that fail while the slot has no (replicated) master wait for
the cluster to be whole again (a signal: `wait_promoted`, then `wait_ok`), and their
reservations left in doubt are released after, as the guarded ledger's pending writes would.

Liveness: every phase has a bound of its own (`LOAD_BOUND_S`, `FAILOVER_BOUND_S`, `CLEANUP_BOUND_S`)
and nothing blocks the event loop, so a bound that runs out fails the test with what it saw
instead of hanging it: the node's kill and restart run in a thread, and a call retried after the
failover is paced (`RETRY_PAUSE_S`) and bounded in tries (`RETRIES`). Before, a retry whose ledger
call failed at once (no I/O) and whose `await promoted.wait()` returned at once (already set) never
yielded: the loop spun, no `wait_for` could fire, and the test hung past pytest-timeout.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from redis.exceptions import RedisError

from proxy.caps import RunCaps
from proxy.errors import BudgetExceeded
from proxy.ledger.base import Reservation, RunState, Settlement
from proxy.ledger.redis import RedisLedger
from proxy.ledger.redis.cancels import publish_cancel
from tests.support.ledgers import step
from tests.support.redis_server import RedisClusterServers, wait_subscribed

PER_CALL = 300_000  # nano-dollars each step of tests.support.ledgers reserves (and is charged)
CAP = 60 * PER_CALL
WORKERS = 8
CALLS_PER_WORKER = 12  # 96 calls in all, beyond the cap's 60: the cap is reached
KILL_AFTER = 20  # acknowledged reservations before the master dies
# Liveness bounds only (a failover's detection and the restarted node's sync take longer on a
# loaded machine): what the tests judge is the books.
LOAD_BOUND_S = 300  # the workers' calls, failover included
FAILOVER_BOUND_S = 120  # kill, promotion, restart, the cluster whole again
CLEANUP_BOUND_S = 60  # in-doubt reservations released, the run read, the ledgers closed
RETRIES = 300  # tries of one call after the failover (then: fail, naming the last error)
RETRY_PAUSE_S = 0.05  # between two of those tries: the loop runs, the cluster client refreshes


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    """A cluster of its own: this test kills one of its masters."""
    c = RedisClusterServers(node_timeout_ms=1000).start()
    yield c
    c.stop()


@dataclass
class Books:
    acknowledged: int  # nano-dollars of settlements the ledger acknowledged
    spent: int  # the run's spend as the ledger has it after the failover
    reserved: int  # what the run still holds reserved at the end
    errors: int  # calls refused while the slot had no master (or WAIT fell short)


async def load_with_failover(cluster: RedisClusterServers, wait_replicas: int) -> Books:
    prefix = f"fo{secrets.token_hex(3)}:"
    leds = [
        RedisLedger(
            cluster.url,
            prefix=prefix,
            cluster=True,
            wait_replicas=wait_replicas,
            op_timeout_s=2.0,
            heartbeat_ttl_s=60,
            confirm_dead_s=600,
        )
        for _ in range(2)
    ]
    run_id = "failover"
    master = cluster.master_of(leds[0]._k_run(run_id))
    replica = cluster.replicas_of(master)[0]
    caps = RunCaps(max_usd_nanos=CAP)
    acknowledged, errors = 0, 0
    reserved_ok = 0
    killed, promoted = asyncio.Event(), asyncio.Event()
    in_doubt: list[tuple[RedisLedger, Reservation]] = []

    async def failover() -> None:
        await killed.wait()
        await asyncio.to_thread(cluster.kill9, master)  # (blocking calls: off the event loop)
        await asyncio.to_thread(cluster.wait_promoted, replica)
        # The promoted master has no replica left: with `redis_wait_replicas = 1` every write is
        # refused until one rejoins — the dead master, restarted empty, syncs as its replica.
        await asyncio.to_thread(master.start)
        await asyncio.to_thread(cluster.wait_ok)
        promoted.set()

    def unavailable(led: RedisLedger, e: Exception) -> None:
        """What the guarded ledger answers as 503 (`failure_code`: redis-py's errors, and its own
        code failing mid-failover, e.g. an AttributeError on a connection it dropped) is retried;
        anything else is a bug, raised."""
        if led.failure_code(e) is None:
            raise e

    async def after_failover(e: Exception, tries: int) -> None:
        """A ledger error: only once the master is dead; wait for the cluster to be whole, then
        pace the next try (a try that fails at once must not spin the event loop)."""
        assert killed.is_set(), f"a ledger error before the failover: {e!r}"
        assert tries < RETRIES, f"still failing after {RETRIES} tries since the failover: {e!r}"
        await promoted.wait()
        await asyncio.sleep(RETRY_PAUSE_S)

    async def settle(led: RedisLedger, res: Reservation) -> None:
        nonlocal acknowledged
        for tries in range(RETRIES + 1):  # retried until taken, as the guarded ledger's pending writes
            try:
                await led.settle(
                    res, Settlement(input_tokens=100, output_tokens=100, cost_usd_nanos=PER_CALL), time.time()
                )
                acknowledged += PER_CALL
                return
            except Exception as e:
                unavailable(led, e)
                await after_failover(e, tries)

    async def worker(led: RedisLedger) -> None:
        nonlocal errors, reserved_ok
        for _ in range(CALLS_PER_WORKER):
            try:
                res = await led.begin_step(step(run_id, caps))
            except BudgetExceeded:
                return
            except Exception as e:
                unavailable(led, e)
                errors += 1
                await after_failover(e, 0)
                continue
            reserved_ok += 1
            if reserved_ok == KILL_AFTER:
                killed.set()
            await settle(led, res)

    async def books() -> RunState | None:
        for led in leds:  # reservations whose answer was lost: released (a no-answer settlement)
            for item in led.drain_in_doubt():
                if isinstance(item, Reservation):
                    in_doubt.append((led, item))
        for led, res in in_doubt:
            try:
                await led.release_reservation(res)
            except KeyError:
                pass  # the run itself was lost
        return await leds[0].get_run(run_id)

    task = asyncio.create_task(failover())
    try:
        await asyncio.wait_for(asyncio.gather(*(worker(leds[i % 2]) for i in range(WORKERS))), LOAD_BOUND_S)
        killed.set()
        await asyncio.wait_for(task, FAILOVER_BOUND_S)
        state = await asyncio.wait_for(books(), CLEANUP_BOUND_S)
    finally:
        task.cancel()
        closing = asyncio.gather(*(led.close() for led in leds), return_exceptions=True)
        await asyncio.wait_for(closing, CLEANUP_BOUND_S)
    assert state is not None
    return Books(acknowledged, state.spent_usd_nanos, state.reserved_usd_nanos, errors)


async def test_with_wait_a_failover_loses_no_reservation_and_no_settlement(cluster) -> None:  # type: ignore[no-untyped-def]
    books = await load_with_failover(cluster, wait_replicas=1)
    print(f"redis_wait_replicas=1: {books}")
    assert books.acknowledged <= CAP  # no overshoot
    assert books.spent == books.acknowledged  # no lost settlement, none twice
    assert books.reserved == 0  # books close
    assert books.acknowledged >= CAP // 2  # the load went on after the failover


async def test_without_wait_what_a_failover_loses_is_measured(cluster) -> None:  # type: ignore[no-untyped-def]
    books = await load_with_failover(cluster, wait_replicas=0)
    lost = books.acknowledged - books.spent
    print(
        f"redis_wait_replicas=0: {books}; settlements lost: {lost / PER_CALL:g} calls "
        f"(${lost / 1e9:.4f}), reservations left held: {books.reserved / PER_CALL:g}"
    )
    assert 0 <= books.spent <= books.acknowledged + PER_CALL * WORKERS


# -- a redirection after a hand-over --------------------------------------------------------


async def test_with_wait_a_write_follows_the_moved_answer_of_a_slot_handed_over(  # type: ignore[no-untyped-def]
    cluster, monkeypatch
) -> None:
    """`redis_wait_replicas` sends each script with its WAIT to the slot's node on a client of its
    own. After a `CLUSTER FAILOVER` the old master answers `MOVED slot host:port`: the write must
    go where that names, even while the slot map it reloads is still the old one (here: the reload
    made a no-op) — before, the redirection was not recognised at all (redis-py's `MovedError`
    reads `slot host:port`, without the word MOVED) and every call failed until something else
    reloaded the map."""
    led = RedisLedger(
        cluster.url, prefix=f"mv{secrets.token_hex(3)}:", cluster=True, wait_replicas=1,
        op_timeout_s=2.0, heartbeat_ttl_s=60, confirm_dead_s=600,
    )  # fmt: skip
    run_id = "moved"
    used = Settlement(input_tokens=100, output_tokens=100, cost_usd_nanos=PER_CALL)
    caps = RunCaps(max_usd_nanos=CAP)
    try:
        await led.settle(await led.begin_step(step(run_id, caps)), used, time.time())
        master = cluster.master_of(led._k_run(run_id))
        replica = cluster.replicas_of(master)[0]
        cluster.hand_over(replica)
        await asyncio.to_thread(cluster.wait_promoted, replica)
        await asyncio.to_thread(cluster.wait_ok)

        async def stale(self: object, *args: object, **kwargs: object) -> None:
            return None  # the slot map stays the one from before the hand-over

        monkeypatch.setattr(type(led._r.nodes_manager), "initialize", stale)
        await led.settle(await led.begin_step(step(run_id, caps)), used, time.time())
        state = await led.get_run(run_id)
        assert state is not None
        assert (state.spent_usd_nanos, state.reserved_usd_nanos) == (2 * PER_CALL, 0)
    finally:
        await led.close()


# -- a replica behind when its master dies -----------------------------------------------------


@pytest.fixture
def slow_cluster() -> Iterator[RedisClusterServers]:
    """A cluster whose nodes are taken for failed after 5 s: a replica frozen for a second is
    still a valid candidate for promotion, only behind its master."""
    c = RedisClusterServers(node_timeout_ms=5000).start()
    yield c
    c.stop()


BEHIND = 5  # calls made while the replica is frozen


async def failover_to_a_replica_behind(cluster: RedisClusterServers, wait_replicas: int) -> Books:
    """10 calls, the replica frozen and its link cut, `BEHIND` more, the master killed, the
    (stale) replica thawed and promoted: what only the dead master had acknowledged is what a
    failover loses."""
    led = RedisLedger(
        cluster.url, prefix=f"lag{secrets.token_hex(3)}:", cluster=True, wait_replicas=wait_replicas,
        wait_timeout_s=0.2, op_timeout_s=2.0, heartbeat_ttl_s=60, confirm_dead_s=600,
    )  # fmt: skip
    run_id = "behind"
    master = cluster.master_of(led._k_run(run_id))
    replica = cluster.replicas_of(master)[0]
    caps, used = (
        RunCaps(max_usd_nanos=CAP),
        Settlement(input_tokens=100, output_tokens=100, cost_usd_nanos=PER_CALL),
    )
    acknowledged = errors = 0
    try:
        for _ in range(10):
            await led.settle(await led.begin_step(step(run_id, caps)), used, time.time())
            acknowledged += PER_CALL
        replica.freeze()
        try:
            cluster.cut_replication(master)  # what follows stays on the master alone
            for _ in range(BEHIND):
                try:
                    res = await led.begin_step(step(run_id, caps))
                    await led.settle(res, used, time.time())
                    acknowledged += PER_CALL
                except RedisError:
                    errors += 1
            cluster.kill9(master)
        finally:
            replica.thaw()
        await asyncio.to_thread(cluster.wait_promoted, replica, 60)
        master.start()  # back, empty, as the promoted master's replica (WAIT needs one)
        await asyncio.to_thread(cluster.wait_ok)
        for item in led.drain_in_doubt():  # written on the dead master only, if at all
            if isinstance(item, Reservation):
                await led.release_reservation(item)
        state = await led.get_run(run_id)
    finally:
        await led.close()
    assert state is not None
    return Books(acknowledged, state.spent_usd_nanos, state.reserved_usd_nanos, errors)


async def test_a_replica_behind_promoted_loses_only_what_wait_refused(slow_cluster) -> None:  # type: ignore[no-untyped-def]
    books = await failover_to_a_replica_behind(slow_cluster, wait_replicas=1)
    print(f"replica behind, redis_wait_replicas=1: {books}")
    assert books.errors == BEHIND  # refused (503 ledger_replicas_behind), never forwarded
    assert books.spent == books.acknowledged == 10 * PER_CALL and books.reserved == 0


async def test_a_replica_behind_promoted_loses_what_the_master_alone_acknowledged(slow_cluster) -> None:  # type: ignore[no-untyped-def]
    books = await failover_to_a_replica_behind(slow_cluster, wait_replicas=0)
    lost = books.acknowledged - books.spent
    print(f"replica behind, redis_wait_replicas=0: {books}; settlements lost: {lost // PER_CALL} calls")
    assert books.errors == 0 and books.acknowledged == (10 + BEHIND) * PER_CALL
    assert lost == BEHIND * PER_CALL  # acknowledged, then gone with the master: spend under-counted


# -- the cancel subscription across a failover -------------------------------------------------


async def test_the_cancel_subscription_survives_its_node_turning_replica(cluster) -> None:  # type: ignore[no-untyped-def]
    """The master that owns the cancel channel's slot hands it to its replica (`CLUSTER FAILOVER`)
    and tells its sharded subscribers `sunsubscribe`: the listener subscribes again on the new
    owner — a cancel published after is delivered — and never spins (redis-py answers at once
    when no node holds the subscription: that loop starved the event loop, the ticker below and
    every bound of the test with it)."""
    listening, sending = (
        RedisLedger(cluster.url, prefix="cx:", cluster=True, op_timeout_s=2.0) for _ in range(2)
    )
    channel = listening.cancel_channel
    master = cluster.master_of(channel)
    replica = cluster.replicas_of(master)[0]
    events = listening.cancel_events()
    ticks = 0

    async def ticker() -> None:  # runs only while the event loop is not starved
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    async def next_cancel() -> str:
        return await anext(events)

    tick = first = second = asyncio.create_task(ticker())
    try:
        first = asyncio.create_task(next_cancel())
        await wait_subscribed(cluster.url, channel, 1, sharded=True)
        await publish_cancel(sending._r, channel, "before", sending.owner, sharded=True)
        assert await asyncio.wait_for(first, 10) == "before"
        second = asyncio.create_task(next_cancel())
        cluster.hand_over(replica)
        await asyncio.to_thread(cluster.wait_promoted, replica)
        await asyncio.to_thread(cluster.wait_ok)
        before = ticks
        await wait_subscribed(cluster.url, channel, 1, sharded=True, timeout=30)  # on the new owner
        assert ticks > before  # the loop ran meanwhile
        await publish_cancel(sending._r, channel, "after", sending.owner, sharded=True)
        assert await asyncio.wait_for(second, 10) == "after"
    finally:
        for task in (tick, first, second):
            task.cancel()
        await asyncio.gather(tick, first, second, return_exceptions=True)
        await events.aclose()  # type: ignore[attr-defined]
        for led in (listening, sending):
            await led.close()
