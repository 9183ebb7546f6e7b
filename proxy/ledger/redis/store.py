"""The Redis ledger's storage primitives, shared by its operations (ledger.py), liveness and
recovery: read a run with its version, compare-and-set it, compare-and-set one idempotency
record, list the records. No rule lives here: what to write is decided by the caller (base.py's
rules); this module only knows where things are (keys.py), how they are encoded (codec.py) and
which script writes them (scripts.py).

Optimistic concurrency: a write names the version it read; when the run moved meanwhile the
script writes nothing, and the caller reads again and decides again (`backoff` between tries).
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import orjson
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from proxy.ledger.base import UNKNOWN, IdempotencyRecord, Reservation, RunState
from proxy.ledger.redis.codec import as_bytes, as_text, json_record, json_state, record_json, state_json
from proxy.ledger.redis.keys import RedisKeys, member
from proxy.ledger.redis.scripts import Scripts

RUN_CACHE = 10_000  # runs whose last-written version this process remembers
LIST_BATCH = 500  # records fetched per round trip when listing


# A run's ancestors as read: (version, state) each, parent first; state None for one that expired.
Chain = Sequence[tuple[str, RunState | None]]


class Conflict(Exception):
    """The compare-and-set found the run or record changed since it was read: decide again."""


def new_version() -> str:
    """A run's version token: random, replaced on every write."""
    return secrets.token_hex(8)


async def backoff(attempt: int) -> None:
    """Between two tries of one operation. Contention on one run (many concurrent calls): back
    off a little, with jitter."""
    if attempt > 2:
        await asyncio.sleep(min(0.002 * attempt, 0.02) * random.random())
    if attempt > 10000:
        raise RuntimeError("redis ledger: too many concurrent updates of one run")


class RedisStore:
    """Runs and records in one Redis namespace, with this process's cache of the runs it wrote."""

    def __init__(self, r: aioredis.Redis, keys: RedisKeys, retention_ms: int) -> None:
        self.r = r
        self.keys = keys
        self.scripts = Scripts(r)
        self.retention_ms = retention_ms
        self._runs: OrderedDict[str, tuple[str, bytes]] = OrderedDict()

    # -- runs -----------------------------------------------------------------------------------

    def cached_run(self, run_id: str) -> tuple[str, RunState] | None:
        """This process's last-written copy of the run and its version, if it has one: a first
        attempt's guess, which the compare-and-set verifies (a stale guess costs one failed write
        and a fresh read; a right one saves a round trip)."""
        hit = self._runs.get(run_id)
        return (hit[0], json_state(hit[1])) if hit is not None else None

    async def read_run(self, run_id: str, cached: bool = False) -> tuple[str, RunState | None]:
        """The run and its version ("" and None when there is none). `cached`: `cached_run`'s
        guess when there is one."""
        if cached:
            hit = self.cached_run(run_id)
            if hit is not None:
                return hit
        v, s = await self.r.hmget(self.keys.run(run_id), ["v", "s"])
        version = as_text(v) if v else ""
        if not s:
            return version, None
        data = as_bytes(s)
        self.remember(run_id, version, data)
        return version, json_state(data)

    async def read_runs(
        self, run_ids: Sequence[str], cached: bool = False
    ) -> list[tuple[str, RunState | None]]:
        """Several runs (a run's ancestors) and their versions, in one round trip (none when
        `cached` and this process wrote each last)."""
        out: list[tuple[str, RunState | None]] = []
        missing: list[int] = []
        for i, run_id in enumerate(run_ids):
            hit = self.cached_run(run_id) if cached else None
            out.append(hit if hit is not None else ("", None))
            if hit is None:
                missing.append(i)
        if missing:
            pipe = self.r.pipeline(transaction=False)
            for i in missing:
                pipe.hmget(self.keys.run(run_ids[i]), ["v", "s"])
            for i, (v, s) in zip(missing, await pipe.execute(), strict=True):
                version = as_text(v) if v else ""
                if s:
                    data = as_bytes(s)
                    self.remember(run_ids[i], version, data)
                    out[i] = (version, json_state(data))
                else:
                    out[i] = (version, None)
        return out

    async def write_chain(
        self, mode: str, version: str, state: RunState, chain: Chain, keys: list[str], args: list[str | bytes]
    ) -> int:
        """`mode`'s single-run script (scripts.py `_CHAIN`) over the run and its ancestors (those
        that still exist): every state written only if none moved since it was read."""
        runs = [(version, state), *((v, st) for v, st in chain if st is not None)]
        argv: list[str | bytes | int] = [mode, len(runs), self.retention_ms]
        written = []
        for v, st in runs:
            after, data = new_version(), state_json(st)
            argv += [v, data, after]
            written.append((st.run_id, after, data))
        ok = int(
            await self.scripts.chain(
                keys=[*self.keys.chain([st.run_id for _, st in runs]), *keys], args=[*argv, *args]
            )
        )
        if ok == 1:
            for run_id, after, data in written:
                self.remember(run_id, after, data)
        return ok

    def remember(self, run_id: str, version: str, state_json: bytes) -> None:
        runs = self._runs
        runs[run_id] = (version, state_json)
        runs.move_to_end(run_id)
        if len(runs) > RUN_CACHE:
            runs.popitem(last=False)

    async def cas_run(self, version: str, state: RunState, chain: Chain = ()) -> None:
        """Write `state` (and its ancestors' in `chain`) if the run still has `version` (and they
        theirs); `Conflict` otherwise."""
        if chain:
            if not await self.write_chain("save", version, state, chain, [], []):
                raise Conflict
            return
        version_after, data = new_version(), state_json(state)
        ok = await self.scripts.save_run(
            keys=[self.keys.run(state.run_id)], args=[version, data, self.retention_ms, version_after]
        )
        if not ok:
            raise Conflict
        self.remember(state.run_id, version_after, data)

    async def update_tree(
        self,
        run_id: str,
        decide: Callable[[RunState | None, list[RunState | None]], RunState | None],
        *,
        cached: bool = True,
    ) -> RunState | None:
        """`update_run` for a change that its ancestors take too (`propagate`): `decide` gets the
        run and its ancestors' states, and the run and each ancestor are written together."""
        attempt = 0
        while True:
            version, state = await self.read_run(run_id, cached=cached and attempt == 0)
            chain = await self.read_runs(state.ancestors, cached=cached and attempt == 0) if state else []
            state = decide(state, [st for _, st in chain])
            if state is None:
                return None
            try:
                await self.cas_run(version, state, chain)
                return state
            except Conflict:
                attempt += 1
                await backoff(attempt)

    async def update_run(
        self, run_id: str, decide: Callable[[RunState | None], RunState | None], *, cached: bool = True
    ) -> RunState | None:
        """Read the run, `decide` (base.py's rules: it gets the run as read, None when there is
        none, and returns the state to write, or None to write nothing), compare-and-set; again
        from a fresh read while the run moves under it. Returns what was written."""
        attempt = 0
        while True:
            version, state = await self.read_run(run_id, cached=cached and attempt == 0)
            state = decide(state)
            if state is None:
                return None
            try:
                await self.cas_run(version, state)
                return state
            except Conflict:
                attempt += 1
                await backoff(attempt)

    # -- reservations (the run written with them, if it still has `version`) --------------------

    async def add_reservation(
        self, version: str, state: RunState, res: Reservation, owner: str, now: float, chain: Chain = ()
    ) -> bool:
        """The run (and its ancestors in `chain`) and `res` in `res:{owner}` (made at `now`)."""
        k, version_after, data = self.keys, new_version(), state_json(state)
        entry = orjson.dumps([res.run_id, res.usd_nanos, res.input_tokens, res.output_tokens, now])
        if chain:
            return bool(
                await self.write_chain(
                    "begin", version, state, chain, [k.reservations(owner)], [res.id, entry]
                )
            )
        ok = await self.scripts.begin_step(
            keys=[k.run(state.run_id), k.reservations(owner)],
            args=[version, data, self.retention_ms, version_after, res.id, entry],
        )
        if ok:
            self.remember(state.run_id, version_after, data)
        return bool(ok)

    async def settle_reservation(
        self, version: str, state: RunState, reservation_id: str, owner: str, chain: Chain = ()
    ) -> int:
        """The run, with the reservation dropped from `res:{owner}`. 1: done; 0: the run moved;
        -1: the reservation is gone (settled already); -2: a sweep charged it (`settle_swept`).
        `chain`: the run's ancestors, written with it (every method below takes it too)."""
        k = self.keys
        if chain:
            return await self.write_chain(
                "settle", version, state, chain, [k.reservations(owner), k.swept(owner)], [reservation_id]
            )
        keys = [k.run(state.run_id), k.reservations(owner), k.swept(owner)]
        return await self._write_reservation(self.scripts.settle, keys, version, state, reservation_id)

    async def settle_swept(
        self, version: str, state: RunState, reservation_id: str, owner: str, chain: Chain = ()
    ) -> int:
        """The run, with the reservation dropped from `swept:{owner}`. -1: not there (any more)."""
        return await self._move(
            version, state, reservation_id, self.keys.swept(owner), self.keys.reservations(owner), "", chain
        )

    async def sweep_reservation(
        self, version: str, state: RunState, reservation_id: str, owner: str, entry: bytes | str,
        chain: Chain = (),
    ) -> int:  # fmt: skip
        """The run, with the reservation moved from `res:{owner}` to `swept:{owner}`."""
        return await self._move(
            version,
            state,
            reservation_id,
            self.keys.reservations(owner),
            self.keys.swept(owner),
            entry,
            chain,
        )

    async def take_back_reservation(
        self, version: str, state: RunState, reservation_id: str, owner: str, entry: bytes | str,
        chain: Chain = (),
    ) -> int:  # fmt: skip
        """The run, with the reservation moved back from `swept:{owner}` to `res:{owner}`."""
        return await self._move(
            version,
            state,
            reservation_id,
            self.keys.swept(owner),
            self.keys.reservations(owner),
            entry,
            chain,
        )

    async def _move(
        self,
        version: str,
        state: RunState,
        reservation_id: str,
        source: str,
        target: str,
        entry: bytes | str,
        chain: Chain = (),
    ) -> int:
        """The run, with the reservation moved from `source` to `target` (dropped: `entry` "")."""
        if chain:
            return await self.write_chain(
                "move", version, state, chain, [source, target], [reservation_id, entry]
            )
        keys = [self.keys.run(state.run_id), source, target]
        return await self._write_reservation(
            self.scripts.move_res, keys, version, state, reservation_id, entry
        )

    async def _write_reservation(
        self, script: AsyncScript, keys: list[str], version: str, state: RunState, *args: str | bytes
    ) -> int:
        version_after, data = new_version(), state_json(state)
        ok = int(await script(keys=keys, args=[version, data, self.retention_ms, version_after, *args]))
        if ok == 1:
            self.remember(state.run_id, version_after, data)
        return ok

    # -- a tool call's start --------------------------------------------------------------------

    async def read_call(
        self, run_id: str, key: str | None
    ) -> tuple[str, RunState | None, IdempotencyRecord | None, str]:
        """The run, its version, the call's record and the record's state ("" when none), in one
        round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(self.keys.run(run_id), ["v", "s"])
        pipe.hmget(self._call_key(run_id, key), ["st", "m", "b"])
        (v, s), (st, meta, body) = await pipe.execute()
        return (
            v.decode() if v else "",
            json_state(s) if s else None,
            json_record(meta, body) if meta else None,
            st.decode() if st else "",
        )

    async def start_call(
        self,
        version: str,
        state: RunState,
        key: str | None,
        read_st: str,
        written: IdempotencyRecord | None,
        owner: str,
        now: float,
        chain: Chain = (),
    ) -> bool:
        """The run, and the call's record if the decision changed it (`written`: a new in-flight
        record of `owner`, or one turned unknown), if the record's state is still `read_st`."""
        k, run_id, version_after, data = self.keys, state.run_id, new_version(), state_json(state)
        if chain:
            return bool(
                await self.write_chain(
                    "tool", version, state, chain,
                    [self._call_key(run_id, key), k.inflight(owner), k.unknown, k.calls],
                    [
                        read_st, written.state if written is not None else "",
                        record_json(written) if written is not None else "", member(run_id, key or ""),
                        str(now),
                    ],
                )
            )  # fmt: skip
        ok = await self.scripts.begin_tool(
            keys=[k.run(run_id), self._call_key(run_id, key), k.inflight(owner), k.unknown, k.calls],
            args=[
                version, data, self.retention_ms, version_after, read_st,
                written.state if written is not None else "",
                record_json(written) if written is not None else "",
                member(run_id, key or ""), now,
            ],
        )  # fmt: skip
        if ok:
            self.remember(run_id, version_after, data)
        return bool(ok)

    def _call_key(self, run_id: str, key: str | None) -> str:
        return self.keys.call(run_id, key) if key is not None else self.keys.no_call

    # -- idempotency records --------------------------------------------------------------------

    async def get_record(self, run_id: str, key: str) -> IdempotencyRecord | None:
        meta, body = await self.r.hmget(self.keys.call(run_id, key), ["m", "b"])
        return json_record(meta, body) if meta else None

    async def write_record(
        self, expected: str, record: IdempotencyRecord | None, *, delete: tuple[str, str, str] | None = None
    ) -> bool:
        """Compare-and-set one record: `record` written if its stored state is still `expected`
        (or, with `delete=(run_id, key, owner)`, the record deleted)."""
        if delete is not None:
            run_id, key, owner = delete
            new_state, meta, body = "", b"", b""
        else:
            assert record is not None
            run_id, key, owner = record.run_id, record.key, record.owner
            new_state, meta, body = record.state, record_json(record), record.body
        k = self.keys
        return bool(
            await self.scripts.set_tool(
                keys=[k.call(run_id, key), k.inflight(owner), k.unknown, k.calls],
                args=[expected, new_state, meta, body, self.retention_ms, member(run_id, key), time.time()],
            )
        )

    async def move_legacy_record(self, name: bytes, meta: bytes) -> int:
        """Move the record runcap 0.1 wrote under `name` (its JSON `meta` as read) to its current
        key. 1: moved; 2: the current key held a newer copy (the old one is dropped); 0: the old
        key changed or went since it was read (left alone)."""
        r = orjson.loads(meta)
        return int(
            await self.scripts.move_legacy(keys=[name, self.keys.call(r["run_id"], r["key"])], args=[meta])
        )

    async def list_records(
        self, state: str | None, run_id: str | None, limit: int
    ) -> list[IdempotencyRecord]:
        """The records in `state` and of `run_id` (None: any), oldest first; members of the index
        read whose record expired are dropped from it."""
        index = self.keys.unknown if state == UNKNOWN else self.keys.calls
        out: list[IdempotencyRecord] = []
        members = [m for m in await self.r.zrange(index, 0, -1) if isinstance(m, bytes)]  # (all are)
        for i in range(0, len(members), LIST_BATCH):  # one round trip per batch
            batch = [(raw, *orjson.loads(raw)) for raw in members[i : i + LIST_BATCH]]
            batch = [b for b in batch if run_id is None or b[1] == run_id]
            pipe = self.r.pipeline(transaction=False)
            for _, rid, key in batch:
                pipe.hmget(self.keys.call(rid, key), ["m", "b"])
            for (raw, _, _), (meta, body) in zip(batch, await pipe.execute(), strict=True):
                if meta is None:  # expired
                    await self.r.zrem(index, raw)
                    continue
                record = json_record(meta, body)
                if state is None or record.state == state:
                    out.append(record)
            if len(out) >= limit:
                break
        out = out[:limit]
        out.sort(key=lambda r: r.created_at)
        return out
