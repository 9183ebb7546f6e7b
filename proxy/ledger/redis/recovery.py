"""Recovery sweeps of the Redis ledger: what dead owners left behind, and the keys of older
layouts.

An owner is dead once its heartbeat (liveness.py) has been seen missing on two sweeps more than
`confirm_dead_s` apart (a live replica has beaten in between). Its reservations are then settled
at their reserved amount and kept in `swept:{<root>}:<owner>` (an owner taken for dead by mistake
takes them back), and its in-flight tool calls turn `unknown` — each step a compare-and-set, so
two sweeping replicas never charge twice. The trees an owner may hold something under are in its
tag index (`tags:<owner>`, keys.py), written before the scripts that leave anything there.

Upgrades, once per store, by the first sweep of a replica (at start-up, before it serves); stop
the old version's replicas first: what an old replica writes after the move is not seen by the
new ones. Both moves are exact (a record names its own run and key; a reservation its run) and
keep each key's expiry; a key written under the new name since the upgrade is the newer one and
wins.

* runcap 0.1 kept records under `tc:<run>:<key>`, where run `a` + key `b:c` and run `a:b` + key
  `c` collided: moved to their current keys, then `record-keys` is set.
* layout 2 (before run trees) kept every key without a hash tag (keys.py): each run moves to its
  own tag (every run of layout 2 is a root), each record to its run's, each reservation, swept
  reservation and in-flight member to its run's tree of the same owner, the global `unknown` and
  `tcs` indexes to one per tree; every tree is indexed; then `layout` is set. Layout 2 only ran on
  a single Redis (its scripts were cross-slot), where the moves' RENAMEs work.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import orjson

from proxy.ledger.base import IN_FLIGHT, UNKNOWN, RecoveredReservation, apply_recovery, propagate, totals
from proxy.ledger.redis.codec import as_text
from proxy.ledger.redis.keys import LAYOUT_VERSION, RECORD_KEYS_VERSION
from proxy.ledger.redis.liveness import Liveness
from proxy.ledger.redis.store import RedisStore, backoff
from proxy.ledger.sweep import DIED, log_recovered, log_turned_unknown

log = logging.getLogger("runcap.ledger")

LEGACY_BATCH = 500  # legacy records moved per round trip


class Recovery:
    """The sweeps one ledger instance runs (`RedisLedger.recover`)."""

    def __init__(self, store: RedisStore, liveness: Liveness, *, confirm_dead_s: float) -> None:
        self.store = store
        self.liveness = liveness
        self.confirm_dead_s = confirm_dead_s
        # Owners whose heartbeat a sweep found missing, and since when (loop-independent clock).
        self._missing_since: dict[str, float] = {}
        self._record_keys_checked = False

    async def sweep(self) -> list[RecoveredReservation]:
        store, keys = self.store, self.store.keys
        if not self._record_keys_checked:
            await self.move_legacy_records()  # before the sweep: it looks records up by key
            await self.move_layout_2()
            self._record_keys_checked = True
        recovered: list[RecoveredReservation] = []
        owners = {as_text(raw) for raw in await store.r.smembers(keys.owners)}
        for owner in list(self._missing_since):
            if owner not in owners:
                del self._missing_since[owner]
        for owner in owners:
            if await self.liveness.alive(owner):
                self._missing_since.pop(owner, None)
                continue
            # Dead only when seen missing on two sweeps more than `confirm_dead_s` apart: after
            # an outage every heartbeat is missing at once, and a live owner beats again soon.
            first = self._missing_since.setdefault(owner, time.monotonic())
            if time.monotonic() - first < self.confirm_dead_s:
                continue
            del self._missing_since[owner]
            recovered += await self._settle_owner(owner)
            await self._unknown_owner(owner)
            if not await store.owner_holds(owner, prune=True):
                await store.r.srem(keys.owners, owner)
        log_recovered(recovered)
        # Trees no process indexed for a retention (their records and reservations expired).
        await store.r.zremrangebyscore(keys.tags, "-inf", time.time() - store.retention_ms / 1000)
        return recovered

    async def move_legacy_records(self) -> int:
        """Move the records runcap 0.1 wrote under `tc:<run>:<key>` to their current keys
        (see the module's docstring), once per store."""
        r, keys = self.store.r, self.store.keys
        if await r.get(keys.record_keys) == RECORD_KEYS_VERSION:
            return 0
        moved = await self._move_records(keys.legacy_call_pattern)
        await r.set(keys.record_keys, RECORD_KEYS_VERSION)
        if moved:
            log.info("moved %d idempotency records to their length-prefixed keys", moved)
        return moved

    async def _move_records(self, pattern: str) -> int:
        moved = 0
        batch: list[bytes] = []
        async for name in self.store.r.scan_iter(match=pattern, count=1000):
            batch.append(name)
            if len(batch) >= LEGACY_BATCH:
                moved += await self._move_record_batch(batch)
                batch = []
        return moved + await self._move_record_batch(batch)

    async def _move_record_batch(self, names: list[bytes]) -> int:
        store = self.store
        pipe = store.r.pipeline(transaction=False)
        for name in names:
            pipe.hget(name, "m")
        moved = 0
        for name, meta in zip(names, await pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(meta, bytes):
                continue  # expired meanwhile (or not a record)
            moved += await store.move_record(name, meta) == 1
        return moved

    async def move_layout_2(self) -> int:
        """Move layout 2's keys to their tree's hash tag (see the module's docstring), once per
        store. Returns how many keys (runs, records, reservation hashes, indexes) were moved."""
        store = self.store
        r, keys = store.r, store.keys
        if await r.get(keys.layout) == LAYOUT_VERSION:
            return 0
        moved, roots = 0, set()
        run_prefix = len(keys.v2_run(""))
        async for name in r.scan_iter(match=keys.v2_pattern("run"), count=1000):
            run_id = as_text(name)[run_prefix:]
            moved += await store.scripts.move_key(keys=[name, keys.run(run_id)]) == 1
        moved += await self._move_records(keys.v2_pattern("call"))
        owners: dict[str, set[str]] = defaultdict(set)  # owner → the trees it holds something in
        for kind in ("res", "swept"):
            owner_at = len(keys.v2_owner_key(kind, ""))
            async for name in r.scan_iter(match=keys.v2_pattern(kind), count=1000):
                owner = as_text(name)[owner_at:]
                ttl = await r.pttl(name)
                for rid, entry in (await r.hgetall(name)).items():
                    run_id = orjson.loads(entry)[0]
                    target = keys.reservations(owner, run_id) if kind == "res" else keys.swept(owner, run_id)
                    await r.hsetnx(target, rid, entry)
                    await r.pexpire(target, ttl if ttl > 0 else store.retention_ms)
                    owners[owner].add(run_id)
                await r.delete(name)
                moved += 1
        owner_at = len(keys.v2_owner_key("inflight", ""))
        async for name in r.scan_iter(match=keys.v2_pattern("inflight"), count=1000):
            owner = as_text(name)[owner_at:]
            for raw in await r.smembers(name):
                run_id = orjson.loads(raw)[0]
                await r.sadd(keys.inflight(owner, run_id), raw)
                await r.pexpire(keys.inflight(owner, run_id), store.retention_ms)
                owners[owner].add(run_id)
            await r.delete(name)
            moved += 1
        for owner, owned in owners.items():
            await r.sadd(keys.owner_tags(owner), *owned)
            roots |= owned
        for kind in ("unknown", "tcs"):
            name = keys.v2_index(kind)
            members: list[tuple[bytes, float]] = await r.zrange(name, 0, -1, withscores=True)  # type: ignore[assignment]
            for raw, score in members:
                run_id = orjson.loads(raw)[0]
                target = keys.unknown(run_id) if kind == "unknown" else keys.calls(run_id)
                await r.zadd(target, {raw: score}, nx=True)
                await r.pexpire(target, store.retention_ms)
                roots.add(run_id)
            moved += await r.delete(name)
        if roots:
            await r.zadd(keys.tags, dict.fromkeys(roots, time.time()))
        await r.set(keys.layout, LAYOUT_VERSION)
        if moved:
            log.info("moved %d ledger keys to the run-tree layout (hash tag of each root run)", moved)
        return moved

    async def _settle_owner(self, owner: str) -> list[RecoveredReservation]:
        store, keys = self.store, self.store.keys
        out = []
        for root in await store.owner_tags(owner):
            for rid_raw, raw in (await store.r.hgetall(keys.reservations(owner, root))).items():
                rid = as_text(rid_raw)
                run_id, usd, tin, tout, _created = orjson.loads(raw)
                store.learn_root(run_id, root)
                attempt = 0
                while True:
                    version, state = await store.read_run(run_id)
                    if state is None:  # the run expired: drop the reservation
                        await store.r.hdel(keys.reservations(owner, root), rid)
                        break
                    # A run of a tree: its ancestors' subtree totals held the reservation too.
                    chain = await store.read_runs(state.ancestors, state.root) if state.ancestors else []
                    now, before = time.time(), totals(state)
                    apply_recovery(state, usd, tin, tout, now)
                    propagate(before, state, [st for _, st in chain], now)
                    # Kept in swept:{<root>}:<owner>: an owner taken for dead by mistake takes it back.
                    ok = await store.sweep_reservation(version, state, rid, owner, raw, chain)
                    if ok == 1:
                        out.append(RecoveredReservation(run_id, rid, usd, tin + tout))
                    if ok != 0:
                        break  # done, or another replica's sweep got there first
                    attempt += 1
                    await backoff(attempt)
        return out

    async def _unknown_owner(self, owner: str) -> None:
        store = self.store
        for root in await store.owner_tags(owner):
            inflight = store.keys.inflight(owner, root)
            for raw in await store.r.smembers(inflight):
                run_id, key = orjson.loads(raw)
                store.learn_root(run_id, root)
                record = await store.get_record(run_id, key)
                if record is None or record.state != IN_FLIGHT or record.owner != owner:
                    await store.r.srem(inflight, raw)
                    continue
                record.state = UNKNOWN
                record.updated_at = time.time()
                record.error = DIED
                if await store.write_record(IN_FLIGHT, record):
                    log_turned_unknown(run_id, key, record.tool)
