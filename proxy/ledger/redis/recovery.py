"""Recovery sweeps of the Redis ledger: what dead owners left behind, and the records of older
layouts.

An owner is dead once its heartbeat (liveness.py) has been seen missing on two sweeps more than
`confirm_dead_s` apart (a live replica has beaten in between). Its reservations are then settled
at their reserved amount and kept in `swept:{owner}` (an owner taken for dead by mistake takes
them back), and its in-flight tool calls turn `unknown` — each step a compare-and-set, so two
sweeping replicas never charge twice.

Upgrade: runcap 0.1 kept records under `tc:{run_id}:{key}`, where run `a` + key `b:c` and run
`a:b` + key `c` collided. The first sweep of a replica (at start-up, before it serves) moves every
such record to its current key — the record names its own run and key, so the move is exact and
keeps its expiry — then sets `record-keys`. Stop the old version's replicas first: records an old
replica writes after the move are not seen by the new ones.
"""

from __future__ import annotations

import logging
import time

import orjson

from proxy.ledger.base import IN_FLIGHT, UNKNOWN, RecoveredReservation, apply_recovery, propagate, totals
from proxy.ledger.redis.codec import as_text
from proxy.ledger.redis.keys import RECORD_KEYS_VERSION
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
            if not await store.r.exists(keys.reservations(owner), keys.inflight(owner)):
                await store.r.srem(keys.owners, owner)
        log_recovered(recovered)
        await store.r.zremrangebyscore(keys.calls, "-inf", time.time() - store.retention_ms / 1000)
        return recovered

    async def move_legacy_records(self) -> int:
        """Move the records an older runcap wrote under `tc:{run_id}:{key}` to their current keys
        (see the module's docstring), once per store."""
        r, keys = self.store.r, self.store.keys
        if await r.get(keys.record_keys) == RECORD_KEYS_VERSION:
            return 0
        moved = 0
        batch: list[bytes] = []
        async for name in r.scan_iter(match=keys.legacy_call_pattern, count=1000):
            batch.append(name)
            if len(batch) >= LEGACY_BATCH:
                moved += await self._move_legacy_batch(batch)
                batch = []
        moved += await self._move_legacy_batch(batch)
        await r.set(keys.record_keys, RECORD_KEYS_VERSION)
        if moved:
            log.info("moved %d idempotency records to their length-prefixed keys", moved)
        return moved

    async def _move_legacy_batch(self, names: list[bytes]) -> int:
        store = self.store
        pipe = store.r.pipeline(transaction=False)
        for name in names:
            pipe.hget(name, "m")
        moved = 0
        for name, meta in zip(names, await pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(meta, bytes):
                continue  # expired meanwhile (or not a record)
            moved += await store.move_legacy_record(name, meta) == 1
        return moved

    async def _settle_owner(self, owner: str) -> list[RecoveredReservation]:
        store, keys = self.store, self.store.keys
        out = []
        for rid_raw, raw in (await store.r.hgetall(keys.reservations(owner))).items():
            rid = as_text(rid_raw)
            run_id, usd, tin, tout, _created = orjson.loads(raw)
            attempt = 0
            while True:
                version, state = await store.read_run(run_id)
                if state is None:  # the run expired: drop the reservation
                    await store.r.hdel(keys.reservations(owner), rid)
                    break
                # A run of a tree: its ancestors' subtree totals held the reservation too.
                chain = await store.read_runs(state.ancestors) if state.ancestors else []
                now, before = time.time(), totals(state)
                apply_recovery(state, usd, tin, tout, now)
                propagate(before, state, [st for _, st in chain], now)
                # Kept in swept:{owner}: an owner taken for dead by mistake takes it back.
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
        for raw in await store.r.smembers(store.keys.inflight(owner)):
            run_id, key = orjson.loads(raw)
            record = await store.get_record(run_id, key)
            if record is None or record.state != IN_FLIGHT or record.owner != owner:
                await store.r.srem(store.keys.inflight(owner), raw)
                continue
            record.state = UNKNOWN
            record.updated_at = time.time()
            record.error = DIED
            if await store.write_record(IN_FLIGHT, record):
                log_turned_unknown(run_id, key, record.tool)
