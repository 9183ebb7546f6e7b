"""Liveness of the Redis ledger's owners: each ledger instance (one per runcap process) is an owner
of reservations and in-flight tool calls, and proves it is alive by a heartbeat key with a TTL.

A process that dies stops refreshing its heartbeat; once it has expired, any replica's sweep
(recovery.py) settles what it owned. Liveness across an outage: while Redis is down or frozen
nobody can beat, and after a restart (or a freeze longer than the TTL) every heartbeat is gone at
once. So every beat re-asserts the owner's heartbeat *and* its membership of `owners` (one round
trip); and a replica that finds itself swept anyway (a partition, a stall longer than the TTL:
its beat re-added it to `owners`) re-asserts its in-flight reservations — each one moved back
from `swept:` to `res:` (of its tree, keys.py) with the recovery charge undone, atomically — and
indexes its trees again (the sweep may have pruned them from `tags:<owner>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import orjson

from proxy.ledger.base import Reservation, apply_unrecovery, propagate, totals
from proxy.ledger.redis.store import RedisStore, backoff

log = logging.getLogger("runcap.ledger")


class Liveness:
    """This owner's heartbeat, and the reservations it would re-assert if swept."""

    def __init__(self, store: RedisStore, owner: str, *, heartbeat_s: float, heartbeat_ttl_ms: int) -> None:
        self.store = store
        self.owner = owner
        self.heartbeat_s = heartbeat_s
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        # Reservations handed out and not settled yet: what to re-assert if this owner is swept.
        self.live: dict[str, Reservation] = {}
        self.task: asyncio.Task[None] | None = None
        self.started = False
        self._start_lock: asyncio.Lock | None = None
        self._beat_failing = False

    async def start(self) -> None:
        """Announce this owner (heartbeat first: a reservation must never be seen without it)."""
        if self.started:
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.started:
                return
            await self.beat(first=True)
            self.task = asyncio.create_task(self._heartbeat_loop())
            self.started = True

    async def beat(self, first: bool = False) -> None:
        """Refresh the heartbeat and re-assert membership of `owners` (an outage may have lost
        either). Added back to `owners` after the first beat: a sweep took this owner for dead."""
        keys = self.store.keys
        pipe = self.store.r.pipeline(transaction=False)
        pipe.set(keys.heartbeat(self.owner), os.getpid(), px=self.heartbeat_ttl_ms)
        pipe.sadd(keys.owners, self.owner)
        # Its tag index lives while it does, and a retention after (what it indexes expires too).
        pipe.pexpire(keys.owner_tags(self.owner), self.store.retention_ms)
        _, added, _ = await pipe.execute()
        if added and not first:
            self.store.forget_indexed()
            log.warning(
                "redis ledger: this replica (%s) was taken for dead and swept; re-registered, "
                "re-asserting its %d reservations in flight", self.owner, len(self.live),
            )  # fmt: skip
            await self.reassert()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.beat()
            except Exception as e:  # keep beating; a sweep waits for two misses a TTL apart
                if not self._beat_failing:
                    log.warning("redis ledger heartbeat failed (will keep trying): %s", e)
                self._beat_failing = True
            else:
                if self._beat_failing:
                    log.info("redis ledger heartbeat restored")
                self._beat_failing = False

    async def reassert(self) -> int:
        """Take back this owner's live reservations that a sweep charged at their reserved
        amount: each moves from `swept:` back to `res:` with the charge undone."""
        store, keys = self.store, self.store.keys
        taken = 0
        for res in list(self.live.values()):
            root = res.state.root
            store.learn_root(res.run_id, root)
            await store.index(root)
            raw = await store.r.hget(keys.swept(self.owner, root), res.id)
            if raw is None:
                continue
            _run, usd, tin, tout, _created = orjson.loads(raw)
            attempt = 0
            while True:
                version, state = await store.read_run(res.run_id)
                if state is None:
                    break
                chain = await store.read_runs(state.ancestors, state.root) if state.ancestors else []
                now, before = time.time(), totals(state)
                apply_unrecovery(state, usd, tin, tout, now)
                propagate(before, state, [st for _, st in chain], now)
                ok = await store.take_back_reservation(version, state, res.id, self.owner, raw, chain)
                if ok == 1:
                    taken += 1
                if ok != 0:
                    break
                attempt += 1
                await backoff(attempt)
        return taken

    async def alive(self, owner: str) -> bool:
        return owner == self.owner or bool(await self.store.r.exists(self.store.keys.heartbeat(owner)))

    async def stop(self) -> None:
        """Stop beating, then leave: a clean shutdown with nothing left forgets this owner (and
        drops its heartbeat at once, so sweeps need not wait for the TTL); with leftovers only the
        heartbeat goes, and a sweep takes them."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if not self.started:
            return
        r, keys = self.store.r, self.store.keys
        if not await self.store.owner_holds(self.owner, prune=True):
            await r.srem(keys.owners, self.owner)
            await r.delete(keys.owner_tags(self.owner))
        await r.delete(keys.heartbeat(self.owner))
