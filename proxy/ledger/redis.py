"""Redis ledger backend: one ledger shared by every runcap replica (`RUNCAP_REDIS_URL`).

Same interface and semantics as the SQLite backend, and the same rules: the decisions are made in
Python by `decide_step` / `apply_settlement` / `decide_tool_call` (base.py), never re-implemented
in Lua. Each operation is optimistic concurrency control:

  1. read the run (and, for a tool call, its idempotency record) — one round trip;
  2. decide in Python;
  3. write everything the decision changed with one Lua script that first checks that the run's
     version (a random token replaced on every write) and the record's state are still the ones
     read, and writes nothing otherwise — the caller then re-reads and decides again.

Why a compare-and-set script rather than WATCH/MULTI/EXEC: the same atomicity in two round trips
instead of four, without pinning a pooled connection for the duration of a WATCH. Each script
first checks whether the run already has the version it is about to write — its own write, sent
again — and then answers as if it had just done it: so the client may resend a command whose
connection broke (a pooled connection that died with a restarted Redis is replaced and the
command resent once) without a reservation written twice or a refund applied twice. The scripts
only compare strings and move values: no arithmetic happens in Lua, whose numbers are doubles —
nano-dollar amounts travel as JSON integers decoded by Python, so they never lose precision.

Keys (all under `prefix`, default `runcap:`; every key of a run, its records and its reservations
expires after `retention_s` without writes):

  run:{run_id}            hash  v = version token, s = RunState JSON
  res:{owner}             hash  reservation id → JSON (run, usd, tokens) — a live process's
  swept:{owner}           hash  the same, for reservations a sweep charged at their reserved
                                amount (kept so a live owner swept by mistake can take them back)
  owners                  set   every ledger instance that may own reservations or in-flight calls
  owner:{owner}           str   heartbeat, with a TTL; refreshed every `heartbeat_s`
  call:{n}:{run_id}:{key} hash  st = state, m = record JSON (without the body), b = body;
                                n = len(run_id), so no two (run, key) pairs share a key
  inflight:{owner}        set   members [run_id, key] (JSON) of the owner's in-flight calls
  unknown                 zset  [run_id, key] of unknown records, by time (reconcile's list)
  tcs                     zset  every record, by creation time (listing)
  record-keys             str   "2" (this key layout) once records under the old keys were moved

Upgrade: runcap 0.1 kept records under `tc:{run_id}:{key}`, where run `a` + key `b:c` and run
`a:b` + key `c` collided. The first recovery sweep of a replica (at start-up, before it serves)
moves every such record to its current key — the record names its own run and key, so the move
is exact and keeps its expiry — then sets `record-keys`. Stop the old version's replicas first:
records an old replica writes after the move are not seen by the new ones.

A process that dies stops refreshing its heartbeat; once it has expired, any replica's sweep
(`recover()`) settles its reservations at their reserved amount and turns its in-flight tool
calls `unknown` — each step a compare-and-set, so two sweeping replicas never charge twice.

Liveness across an outage. While Redis is down or frozen nobody can beat, and after a restart
(or a freeze longer than the TTL) every heartbeat is gone at once. So:
* every beat re-asserts the owner's heartbeat *and* its membership of `owners` (one round trip);
* a sweep settles an owner only once it has seen its heartbeat missing on two sweeps more than
  one TTL apart (`confirm_dead_s`): a live replica has beaten in between;
* a replica that finds itself swept anyway (a partition, a stall longer than the TTL: its beat
  re-added it to `owners`) re-asserts its in-flight reservations — each one moved back from
  `swept:{owner}` to `res:{owner}` with the recovery charge undone, atomically — and a settlement
  of a reservation still in `swept:` replaces the reserved amount charged by the actual usage.
Writes whose answer was lost (the connection failed after a script was sent) are "in doubt":
a reservation or an in-flight record of a call that was then refused is handed to the caller
(`drain_in_doubt`), which releases it once Redis answers again.
Cancels are published on `{prefix}cancel`; every replica's subscriber aborts its in-flight calls.
Production: enable persistence on the Redis server (AOF `appendfsync everysec` at least), or a
restart of Redis forgets budgets, spend and idempotency records.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.caps import RunCaps
from proxy.config import redact_url
from proxy.errors import Rejection
from proxy.ledger.base import (
    COMPLETED,
    DEFAULT_RETENTION_S,
    IN_FLIGHT,
    UNKNOWN,
    CapsChange,
    IdempotencyRecord,
    Ledger,
    RecordNotUnknown,
    RecoveredReservation,
    Reservation,
    RunState,
    Settlement,
    StepRequest,
    ToolCallRequest,
    ToolCallStart,
    apply_caps_change,
    apply_recovery,
    apply_settlement,
    apply_unrecovery,
    check_live,
    decide_step,
    decide_tool_call,
    merge_caps,
    new_run,
)

log = logging.getLogger("runcap.ledger")

# KEYS: run  ARGV: expected version, state, ttl ms, new version
_SAVE_RUN = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: run, res:{owner}  ARGV: expected version, state, ttl ms, new version, reservation id, JSON
_BEGIN_STEP = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[5], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""

# KEYS: run, res:{owner}, swept:{owner}  ARGV: expected version, state, ttl ms, new version,
#       reservation id
# -1: the reservation is gone (already settled) — never charge twice; -2: a sweep charged it at its
# reserved amount (its owner was thought dead): settle it out of swept:{owner} with `_MOVE_RES`.
_SETTLE = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if redis.call('HEXISTS', KEYS[2], ARGV[5]) == 0 then
  if redis.call('HEXISTS', KEYS[3], ARGV[5]) == 1 then return -2 end
  return -1
end
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[5])
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# Move one reservation between `from` and `to` (reservation hashes of one owner) with the run
# written — a sweep (res → swept), a settlement of a swept one (swept → nowhere: JSON ''), or a
# live owner taking one back (swept → res).
# KEYS: run, from, to  ARGV: expected version, state, ttl ms, new version, reservation id, JSON
# -1: the reservation is not in `from` (any more); 0: the run changed since it was read.
_MOVE_RES = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if redis.call('HEXISTS', KEYS[2], ARGV[5]) == 0 then return -1 end
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[5])
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[5], ARGV[6])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: run, tc, inflight:{record owner}, unknown, tcs
# ARGV: expected version, state, ttl ms, new version, expected tc state, new tc state ('' = leave),
#       record JSON, member, now
_BEGIN_TOOL = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
if (redis.call('HGET', KEYS[2], 'st') or '') ~= ARGV[5] then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[6] == 'in_flight' then
  redis.call('HSET', KEYS[2], 'st', 'in_flight', 'm', ARGV[7], 'b', '')
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('SADD', KEYS[3], ARGV[8])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  redis.call('ZADD', KEYS[5], ARGV[9], ARGV[8])
elseif ARGV[6] == 'unknown' then
  redis.call('HSET', KEYS[2], 'st', 'unknown', 'm', ARGV[7])
  redis.call('SREM', KEYS[3], ARGV[8])
  redis.call('ZADD', KEYS[4], ARGV[9], ARGV[8])
end
return 1
"""

# KEYS: tc, inflight:{record owner}, unknown, tcs
# ARGV: expected state, new state ('' = delete), record JSON, body, ttl ms, member, now
_SET_TOOL = """
if (redis.call('HGET', KEYS[1], 'st') or '') ~= ARGV[1] then return 0 end
redis.call('SREM', KEYS[2], ARGV[6])
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[3], ARGV[6])
  redis.call('ZREM', KEYS[4], ARGV[6])
  return 1
end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'm', ARGV[3], 'b', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if ARGV[2] == 'unknown' then
  redis.call('ZADD', KEYS[3], ARGV[7], ARGV[6])
else
  redis.call('ZREM', KEYS[3], ARGV[6])
end
return 1
"""

# KEYS: legacy record key, current record key  ARGV: the record JSON as read
# 1: moved; 2: the current key already holds the record (written since the upgrade; the older copy
# is dropped); 0: the legacy key changed or went since it was read (left alone).
_MOVE_LEGACY = """
if redis.call('HGET', KEYS[1], 'm') ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[1])
  return 2
end
redis.call('RENAME', KEYS[1], KEYS[2])
return 1
"""

_NO_RECORD = "call:-"  # the record key of a call without one (never written; real ones have n:)
_RECORD_KEYS_VERSION = b"2"
_RUN_CACHE = 10_000  # runs whose last-written version this process remembers


def _state_json(s: RunState) -> bytes:
    c = s.caps
    return orjson.dumps(
        [
            s.run_id, s.task, s.status, s.started_at, s.updated_at,
            c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls, c.deadline,
            s.spent_usd_nanos, s.input_tokens, s.output_tokens, s.steps, s.tool_calls_requested,
            s.tool_calls_executed, s.reserved_usd_nanos, s.reserved_tokens, s.final_reason, s.cancelled,
            s.operator_caps, s.context_baseline, s.upstream_failures,
        ]
    )  # fmt: skip


def _json_state(raw: bytes) -> RunState:
    r = orjson.loads(raw)
    return RunState(
        run_id=r[0], task=r[1], status=r[2], started_at=r[3], updated_at=r[4],
        caps=RunCaps(r[5], r[6], r[7], r[8], r[9]),
        spent_usd_nanos=r[10], input_tokens=r[11], output_tokens=r[12], steps=r[13],
        tool_calls_requested=r[14], tool_calls_executed=r[15], reserved_usd_nanos=r[16],
        reserved_tokens=r[17], final_reason=r[18], cancelled=r[19],
        operator_caps=r[20] if len(r) > 20 else "",  # written before operator top-ups existed
        context_baseline=r[21] if len(r) > 21 else 0,  # written before context growth existed
        upstream_failures=r[22] if len(r) > 22 else 0,  # written before failures were counted
    )  # fmt: skip


def _record_json(r: IdempotencyRecord) -> bytes:
    return orjson.dumps(
        {
            "run_id": r.run_id, "key": r.key, "tool": r.tool, "args_hash": r.args_hash, "state": r.state,
            "owner": r.owner, "created_at": r.created_at, "updated_at": r.updated_at, "step": r.step,
            "status": r.status, "headers": r.headers, "error": r.error,
            "method": r.method, "path": r.path, "op_hash": r.op_hash,
        }
    )  # fmt: skip


def _json_record(meta: bytes, body: bytes | None) -> IdempotencyRecord:
    return IdempotencyRecord(**orjson.loads(meta), body=body or b"")


def _member(run_id: str, key: str) -> bytes:
    # A JSON array: unambiguous whatever the strings hold (unlike joining them with a separator).
    return orjson.dumps([run_id, key])


def _glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class _Conflict(Exception):
    """The compare-and-set found the run or record changed since it was read: decide again."""


class RedisLedger(Ledger):
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "runcap:",
        retention_s: float = DEFAULT_RETENTION_S,
        heartbeat_s: float = 2.0,
        heartbeat_ttl_s: float = 10.0,
        confirm_dead_s: float | None = None,
        op_timeout_s: float = 5.0,
    ) -> None:
        """`confirm_dead_s`: how long an owner's heartbeat must have been seen missing before a
        sweep settles its reservations (default: the heartbeat TTL; see the module docstring).
        `op_timeout_s`: the socket timeout of each command."""
        self.url = url
        self.prefix = prefix
        self.retention_ms = int(retention_s * 1000)
        self.heartbeat_s = heartbeat_s
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self.confirm_dead_s = heartbeat_ttl_s if confirm_dead_s is None else confirm_dead_s
        self.owner = secrets.token_hex(8)
        self._r = aioredis.from_url(
            url,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            # Once, at once, on a new connection: pooled connections die with a restarted Redis
            # (safe for the scripts: see "compare-and-set" above; the rest is idempotent).
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
        )
        self._save_run = self._r.register_script(_SAVE_RUN)
        self._begin_step = self._r.register_script(_BEGIN_STEP)
        self._settle = self._r.register_script(_SETTLE)
        self._move_res = self._r.register_script(_MOVE_RES)
        self._begin_tool = self._r.register_script(_BEGIN_TOOL)
        self._set_tool = self._r.register_script(_SET_TOOL)
        self._move_legacy = self._r.register_script(_MOVE_LEGACY)
        self._record_keys_checked = False
        self._runs: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        # The in-flight records this instance wrote, to complete them without reading them back.
        self._mine: dict[tuple[str, str], IdempotencyRecord] = {}
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        # Reservations handed out and not settled yet: what to re-assert if this owner is swept.
        self._live: dict[str, Reservation] = {}
        self._in_doubt: list[Reservation | IdempotencyRecord] = []
        # Owners whose heartbeat a sweep found missing, and since when (loop-independent clock).
        self._missing_since: dict[str, float] = {}
        self._beat_failing = False

    # -- keys -----------------------------------------------------------------------------------

    def _k_run(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}"

    def _k_res(self, owner: str) -> str:
        return f"{self.prefix}res:{owner}"

    def _k_owner(self, owner: str) -> str:
        return f"{self.prefix}owner:{owner}"

    def _k_tc(self, run_id: str, key: str) -> str:
        # Length-prefixed: the run id's end is known, so `a` + `b:c` and `a:b` + `c` differ.
        return f"{self.prefix}call:{len(run_id)}:{run_id}:{key}"

    def _k_inflight(self, owner: str) -> str:
        return f"{self.prefix}inflight:{owner}"

    def _k_swept(self, owner: str) -> str:
        return f"{self.prefix}swept:{owner}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}cancel"

    # -- liveness -------------------------------------------------------------------------------

    async def _start(self) -> None:
        """Announce this owner (heartbeat first: a reservation must never be seen without it)."""
        if self._started:
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            await self._beat(first=True)
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())
            self._started = True

    async def _beat(self, first: bool = False) -> None:
        """Refresh the heartbeat and re-assert membership of `owners` (an outage may have lost
        either). Added back to `owners` after the first beat: a sweep took this owner for dead."""
        pipe = self._r.pipeline(transaction=False)
        pipe.set(self._k_owner(self.owner), os.getpid(), px=self.heartbeat_ttl_ms)
        pipe.sadd(f"{self.prefix}owners", self.owner)
        _, added = await pipe.execute()
        if added and not first:
            log.warning(
                "redis ledger: this replica (%s) was taken for dead and swept; re-registered, "
                "re-asserting its %d reservations in flight", self.owner, len(self._live),
            )  # fmt: skip
            await self._reassert()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._beat()
            except Exception as e:  # keep beating; a sweep waits for two misses a TTL apart
                if not self._beat_failing:
                    log.warning("redis ledger heartbeat failed (will keep trying): %s", e)
                self._beat_failing = True
            else:
                if self._beat_failing:
                    log.info("redis ledger heartbeat restored")
                self._beat_failing = False

    async def _reassert(self) -> int:
        """Take back this owner's live reservations that a sweep charged at their reserved
        amount: each moves from `swept:` back to `res:` with the charge undone."""
        taken = 0
        for res in list(self._live.values()):
            raw = await self._r.hget(self._k_swept(self.owner), res.id)
            if raw is None:
                continue
            _run, usd, tin, tout, _created = orjson.loads(raw)
            attempt = 0
            while True:
                version, state = await self._read_run(res.run_id)
                if state is None:
                    break
                apply_unrecovery(state, usd, tin, tout, time.time())
                new_version, data = secrets.token_hex(8), _state_json(state)
                ok = await self._move_res(
                    keys=[self._k_run(res.run_id), self._k_swept(self.owner), self._k_res(self.owner)],
                    args=[version, data, self.retention_ms, new_version, res.id, raw],
                )
                if ok == 1:
                    self._remember(res.run_id, new_version, data)
                    taken += 1
                if ok != 0:
                    break
                attempt += 1
                await self._retry(attempt)
        return taken

    async def _owner_alive(self, owner: str) -> bool:
        return owner == self.owner or bool(await self._r.exists(self._k_owner(owner)))

    # -- read / compare-and-set -----------------------------------------------------------------

    async def _read_run(self, run_id: str, cached: bool = False) -> tuple[str, RunState | None]:
        """The run and its version. `cached`: this process's last-written copy when it has one —
        a first attempt's guess, which the compare-and-set verifies (a stale guess costs one
        failed write and a fresh read; a right one saves a round trip)."""
        if cached:
            hit = self._runs.get(run_id)
            if hit is not None:
                return hit[0], _json_state(hit[1])
        v, s = await self._r.hmget(self._k_run(run_id), "v", "s")
        version = v.decode() if v else ""
        if s:
            self._remember(run_id, version, s)
        return version, (_json_state(s) if s else None)

    def _remember(self, run_id: str, version: str, state_json: bytes) -> None:
        runs = self._runs
        runs[run_id] = (version, state_json)
        runs.move_to_end(run_id)
        if len(runs) > _RUN_CACHE:
            runs.popitem(last=False)

    async def _cas_run(self, version: str, state: RunState) -> None:
        new_version, data = secrets.token_hex(8), _state_json(state)
        ok = await self._save_run(
            keys=[self._k_run(state.run_id)], args=[version, data, self.retention_ms, new_version]
        )
        if not ok:
            raise _Conflict
        self._remember(state.run_id, new_version, data)

    async def _retry(self, attempt: int) -> None:
        # Contention on one run (many concurrent calls): back off a little, with jitter.
        if attempt > 2:
            await asyncio.sleep(min(0.002 * attempt, 0.02) * random.random())
        if attempt > 10000:
            raise RuntimeError("redis ledger: too many concurrent updates of one run")

    # -- steps ----------------------------------------------------------------------------------

    async def begin_step(self, req: StepRequest) -> Reservation:
        await self._start()
        attempt = 0
        while True:
            version, state = await self._read_run(req.run_id, cached=attempt == 0)
            state = state or new_run(req.run_id, req.task, req.caps, req.now)
            try:
                res = decide_step(state, req)
            except Rejection:
                try:
                    await self._cas_run(version, state)
                except _Conflict:
                    attempt += 1
                    await self._retry(attempt)
                    continue
                raise
            new_version, data = secrets.token_hex(8), _state_json(state)
            try:
                ok = await self._begin_step(
                    keys=[self._k_run(req.run_id), self._k_res(self.owner)],
                    args=[
                        version, data, self.retention_ms, new_version, res.id,
                        orjson.dumps(
                            [res.run_id, res.usd_nanos, res.input_tokens, res.output_tokens, req.now]
                        ),
                    ],
                )  # fmt: skip
            except BaseException:  # also a cancel (timeout): the script may have run
                self._in_doubt.append(res)
                raise
            if ok:
                self._remember(req.run_id, new_version, data)
                self._live[res.id] = res
                return res
            attempt += 1
            await self._retry(attempt)

    async def settle(self, reservation: Reservation, settlement: Settlement, now: float) -> RunState:
        return await self._settle_reservation(reservation, settlement, now, quiet=False)

    async def release_reservation(self, reservation: Reservation) -> None:
        await self._settle_reservation(reservation, Settlement(no_answer=True), time.time(), quiet=True)

    async def _settle_reservation(
        self, reservation: Reservation, settlement: Settlement, now: float, *, quiet: bool
    ) -> RunState:
        attempt = 0
        swept = False  # a sweep charged it at its reserved amount: correct that charge
        while True:
            version, state = await self._read_run(reservation.run_id, cached=attempt == 0)
            if state is None:
                self._live.pop(reservation.id, None)
                raise KeyError(reservation.run_id)
            if swept:
                apply_unrecovery(
                    state, reservation.usd_nanos, reservation.input_tokens, reservation.output_tokens, now
                )
            apply_settlement(state, reservation, settlement, now)
            new_version, data = secrets.token_hex(8), _state_json(state)
            if swept:
                run_key, swept_key = self._k_run(reservation.run_id), self._k_swept(self.owner)
                ok = await self._move_res(
                    keys=[run_key, swept_key, self._k_res(self.owner)],
                    args=[version, data, self.retention_ms, new_version, reservation.id, ""],
                )
            else:
                ok = await self._settle(
                    keys=[
                        self._k_run(reservation.run_id), self._k_res(self.owner), self._k_swept(self.owner),
                    ],
                    args=[version, data, self.retention_ms, new_version, reservation.id],
                )  # fmt: skip
            if ok == 1:
                self._live.pop(reservation.id, None)
                self._remember(reservation.run_id, new_version, data)
                if swept:
                    log.warning(
                        "reservation %s of run %s had been charged at its reserved amount by a sweep "
                        "(this replica was taken for dead); now settled at its real usage",
                        reservation.id, reservation.run_id,
                    )  # fmt: skip
                return state
            if ok == -2:
                swept = True
                continue
            if ok == -1 and swept:
                swept = False  # taken back into res:{owner} meanwhile (`_reassert`): settle it there
                continue
            if ok == -1:
                self._live.pop(reservation.id, None)
                if not quiet:
                    log.warning(
                        "reservation %s of run %s was already settled", reservation.id, reservation.run_id
                    )
                _, current = await self._read_run(reservation.run_id)
                return current or state
            attempt += 1
            await self._retry(attempt)

    async def touch_run(self, run_id: str, task: str, caps: RunCaps, now: float) -> RunState:
        attempt = 0
        while True:
            version, state = await self._read_run(run_id, cached=attempt == 0)
            if state is None:
                state = new_run(run_id, task, caps, now)
            else:
                merge_caps(state, task, caps, now)
            rejection: Rejection | None = None
            try:
                check_live(state, now)
            except Rejection as rej:
                rejection = rej
            try:
                await self._cas_run(version, state)
            except _Conflict:
                attempt += 1
                await self._retry(attempt)
                continue
            if rejection is not None:
                raise rejection
            return state

    async def get_run(self, run_id: str) -> RunState | None:
        return (await self._read_run(run_id))[1]

    async def cancel(self, run_id: str, now: float) -> RunState | None:
        state = await self._update(run_id, now, cancel=True)
        await self._r.publish(self.cancel_channel, orjson.dumps([run_id, self.owner]))
        return state

    async def set_status(self, run_id: str, status: str, now: float) -> None:
        await self._update(run_id, now, status=status)

    async def set_caps(self, run_id: str, change: CapsChange, now: float) -> tuple[RunCaps, RunState] | None:
        attempt = 0
        while True:
            version, state = await self._read_run(run_id)
            if state is None:
                return None
            before = state.caps
            apply_caps_change(state, change, now)
            try:
                await self._cas_run(version, state)
                return before, state
            except _Conflict:
                attempt += 1
                await self._retry(attempt)

    async def _update(
        self, run_id: str, now: float, *, cancel: bool = False, status: str | None = None
    ) -> RunState:
        attempt = 0
        while True:
            version, state = await self._read_run(run_id, cached=attempt == 0)
            state = state or new_run(run_id, "", RunCaps(), now)
            if cancel:
                state.cancelled = True
                state.status = "cancelled"
            elif status and state.status != "cancelled":
                state.status = status
            state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest
            try:
                await self._cas_run(version, state)
                return state
            except _Conflict:
                attempt += 1
                await self._retry(attempt)

    def cancel_events(self) -> AsyncIterator[str]:
        return self._cancel_events()

    async def _cancel_events(self) -> AsyncIterator[str]:
        """Run ids cancelled through other ledger instances, as they are published (reconnects
        with backoff; a cancel missed while disconnected is caught by the caller's slow poll)."""
        backoff = 0.1
        while True:
            pubsub = self._r.pubsub()
            try:
                await pubsub.subscribe(self.cancel_channel)
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    try:
                        run_id, origin = orjson.loads(msg["data"])
                    except (orjson.JSONDecodeError, TypeError, ValueError):
                        log.warning(
                            "ignored a malformed message on %s: %r", self.cancel_channel, msg["data"][:200]
                        )
                        continue
                    if origin != self.owner:
                        yield run_id
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                log.warning("redis cancel subscription lost (%s); reconnecting", e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # -- recovery -------------------------------------------------------------------------------

    async def recover(self) -> list[RecoveredReservation]:
        await self._start()
        if not self._record_keys_checked:
            await self._move_legacy_records()  # before the sweep: it looks records up by key
            self._record_keys_checked = True
        recovered: list[RecoveredReservation] = []
        owners = {raw.decode() for raw in await self._r.smembers(f"{self.prefix}owners")}
        for owner in list(self._missing_since):
            if owner not in owners:
                del self._missing_since[owner]
        for owner in owners:
            if await self._owner_alive(owner):
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
            if not await self._r.exists(self._k_res(owner), self._k_inflight(owner)):
                await self._r.srem(f"{self.prefix}owners", owner)
        for r in recovered:
            log.warning(
                "run %s: settled reservation %s of a process that died at its reserved amount "
                "($%s, %d tokens) — the call's real usage is unknown",
                r.run_id, r.reservation_id, r.usd_nanos / 1e9, r.tokens,
            )  # fmt: skip
        await self._r.zremrangebyscore(f"{self.prefix}tcs", "-inf", time.time() - self.retention_ms / 1000)
        return recovered

    async def _move_legacy_records(self) -> int:
        """Move the records an older runcap wrote under `tc:{run_id}:{key}` to their current keys
        (see the module's docstring), once per store."""
        marker = f"{self.prefix}record-keys"
        if await self._r.get(marker) == _RECORD_KEYS_VERSION:
            return 0
        moved = 0
        batch: list[bytes] = []
        async for name in self._r.scan_iter(match=f"{_glob_escape(self.prefix)}tc:*", count=1000):
            batch.append(name)
            if len(batch) >= 500:
                moved += await self._move_legacy_batch(batch)
                batch = []
        moved += await self._move_legacy_batch(batch)
        await self._r.set(marker, _RECORD_KEYS_VERSION)
        if moved:
            log.info("moved %d idempotency records to their length-prefixed keys", moved)
        return moved

    async def _move_legacy_batch(self, names: list[bytes]) -> int:
        pipe = self._r.pipeline(transaction=False)
        for name in names:
            pipe.hget(name, "m")
        moved = 0
        for name, meta in zip(names, await pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(meta, bytes):
                continue  # expired meanwhile (or not a record)
            r = orjson.loads(meta)
            moved += await self._move_legacy(keys=[name, self._k_tc(r["run_id"], r["key"])], args=[meta]) == 1
        return moved

    async def _settle_owner(self, owner: str) -> list[RecoveredReservation]:
        out = []
        for rid_raw, raw in (await self._r.hgetall(self._k_res(owner))).items():
            rid = rid_raw.decode()
            run_id, usd, tin, tout, _created = orjson.loads(raw)
            attempt = 0
            while True:
                version, state = await self._read_run(run_id)
                if state is None:  # the run expired: drop the reservation
                    await self._r.hdel(self._k_res(owner), rid)
                    break
                apply_recovery(state, usd, tin, tout, time.time())
                # Kept in swept:{owner}: an owner taken for dead by mistake takes it back.
                ok = await self._move_res(
                    keys=[self._k_run(run_id), self._k_res(owner), self._k_swept(owner)],
                    args=[version, _state_json(state), self.retention_ms, secrets.token_hex(8), rid, raw],
                )
                if ok == 1:
                    out.append(RecoveredReservation(run_id, rid, usd, tin + tout))
                if ok != 0:
                    break  # done, or another replica's sweep got there first
                attempt += 1
                await self._retry(attempt)
        return out

    async def _unknown_owner(self, owner: str) -> None:
        for raw in await self._r.smembers(self._k_inflight(owner)):
            run_id, key = orjson.loads(raw)
            record = await self.get_tool_call(run_id, key)
            if record is None or record.state != IN_FLIGHT or record.owner != owner:
                await self._r.srem(self._k_inflight(owner), raw)
                continue
            record.state = UNKNOWN
            record.updated_at = time.time()
            record.error = "the runcap process executing it died"
            if await self._write_record(IN_FLIGHT, record):
                log.warning(
                    "run %s: tool call %s (%s) was in flight in a process that died; its outcome is "
                    "unknown until reconciled (runcap reconcile)", run_id, key, record.tool,
                )  # fmt: skip

    # -- tool calls -----------------------------------------------------------------------------

    async def begin_tool_call(self, req: ToolCallRequest) -> ToolCallStart:
        await self._start()
        tc_key = self._k_tc(req.run_id, req.key) if req.key is not None else self.prefix + _NO_RECORD
        attempt = 0
        while True:
            hit = self._runs.get(req.run_id) if attempt == 0 else None
            if hit is not None:
                # First attempt on a run this process wrote last: guess "no record yet" (a new
                # call, the common case); the compare-and-set checks both guesses.
                version, state, record, read_st = hit[0], _json_state(hit[1]), None, ""
            else:
                pipe = self._r.pipeline(transaction=False)
                pipe.hmget(self._k_run(req.run_id), "v", "s")
                pipe.hmget(tc_key, "st", "m", "b")
                (v, s), (st, meta, body) = await pipe.execute()
                version = v.decode() if v else ""
                state = _json_state(s) if s else new_run(req.run_id, req.task, req.caps, req.now)
                record = _json_record(meta, body) if meta else None
                read_st = st.decode() if st else ""
            alive = record is not None and record.state == IN_FLIGHT and await self._owner_alive(record.owner)
            rejection: Rejection | None = None
            start: ToolCallStart | None = None
            try:
                start = decide_tool_call(state, record, req, self.owner, alive)
            except Rejection as rej:
                rejection = rej
            written = None
            if start is not None and start.action == "execute" and start.record is not None:
                written = start.record
            elif record is not None and record.state != read_st:  # in flight → unknown
                written = record
            owner = written.owner if written is not None else self.owner
            new_version, data = secrets.token_hex(8), _state_json(state)
            new_call = written is not None and written.state == IN_FLIGHT and written.owner == self.owner
            try:
                ok = await self._begin_tool(
                    keys=[
                        self._k_run(req.run_id), tc_key, self._k_inflight(owner),
                        f"{self.prefix}unknown", f"{self.prefix}tcs",
                    ],
                    args=[
                        version, data, self.retention_ms, new_version, read_st,
                        written.state if written is not None else "",
                        _record_json(written) if written is not None else "",
                        _member(req.run_id, req.key or ""), req.now,
                    ],
                )  # fmt: skip
            except BaseException:  # also a cancel (timeout): the script may have run
                if new_call:
                    assert written is not None
                    self._in_doubt.append(written)
                raise
            if not ok:
                attempt += 1
                await self._retry(attempt)
                continue
            self._remember(req.run_id, new_version, data)
            if rejection is not None:
                raise rejection
            assert start is not None
            if start.record is not None and start.action == "execute":
                self._mine[(req.run_id, start.record.key)] = dataclasses.replace(start.record)
            return start

    async def _write_record(
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
            new_state, meta, body = record.state, _record_json(record), record.body
        return bool(
            await self._set_tool(
                keys=[
                    self._k_tc(run_id, key),
                    self._k_inflight(owner),
                    f"{self.prefix}unknown",
                    f"{self.prefix}tcs",
                ],
                args=[expected, new_state, meta, body, self.retention_ms, _member(run_id, key), time.time()],
            )
        )

    async def complete_tool_call(
        self, run_id: str, key: str, status: int, headers: dict[str, str], body: bytes, now: float
    ) -> None:
        record = self._mine.pop((run_id, key), None)  # a guess, checked by the compare-and-set
        while True:
            if record is None:
                record = await self.get_tool_call(run_id, key)
            if record is None:
                return
            expected = record.state
            record.state, record.status, record.headers, record.body = COMPLETED, status, headers, body
            record.updated_at, record.error = now, ""
            if await self._write_record(expected, record):
                return
            record = None

    async def mark_unknown(self, run_id: str, key: str, now: float, reason: str = "") -> None:
        record = self._mine.pop((run_id, key), None)
        while True:
            if record is None:
                record = await self.get_tool_call(run_id, key)
            if record is None or record.state != IN_FLIGHT:
                return
            record.state, record.updated_at, record.error = UNKNOWN, now, reason
            if await self._write_record(IN_FLIGHT, record):
                return
            record = None

    async def get_tool_call(self, run_id: str, key: str) -> IdempotencyRecord | None:
        meta, body = await self._r.hmget(self._k_tc(run_id, key), "m", "b")
        return _json_record(meta, body) if meta else None

    async def list_tool_calls(
        self, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[IdempotencyRecord]:
        index = f"{self.prefix}unknown" if state == UNKNOWN else f"{self.prefix}tcs"
        out: list[IdempotencyRecord] = []
        members = await self._r.zrange(index, 0, -1)
        for i in range(0, len(members), 500):  # fetched in batches of 500, one round trip each
            batch = [(raw, *orjson.loads(raw)) for raw in members[i : i + 500]]
            batch = [b for b in batch if run_id is None or b[1] == run_id]
            pipe = self._r.pipeline(transaction=False)
            for _, rid, key in batch:
                pipe.hmget(self._k_tc(rid, key), "m", "b")
            for (raw, _, _), (meta, body) in zip(batch, await pipe.execute(), strict=True):
                if meta is None:  # expired
                    await self._r.zrem(index, raw)
                    continue
                record = _json_record(meta, body)
                if state is None or record.state == state:
                    out.append(record)
            if len(out) >= limit:
                break
        out = out[:limit]
        out.sort(key=lambda r: r.created_at)
        return out

    async def resolve_tool_call(
        self,
        run_id: str,
        key: str,
        *,
        done: bool,
        now: float,
        status: int = 200,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        force: bool = False,
    ) -> IdempotencyRecord | None:
        self._mine.pop((run_id, key), None)
        while True:
            record = await self.get_tool_call(run_id, key)
            if record is None:
                return None
            if record.state != UNKNOWN and not force:
                raise RecordNotUnknown(record)
            before = dataclasses.replace(record)
            if done:
                record.state, record.status, record.headers, record.body = (
                    COMPLETED,
                    status,
                    headers or {},
                    body,
                )
                record.updated_at, record.error = now, ""
                if await self._write_record(before.state, record):
                    return before
                continue
            if await self._write_record(before.state, None, delete=(run_id, key, record.owner)):
                await self._refund_tool_call(run_id, now)
                return before

    async def _refund_tool_call(self, run_id: str, now: float) -> None:
        attempt = 0
        while True:
            version, state = await self._read_run(run_id, cached=attempt == 0)
            if state is None or state.tool_calls_executed == 0:
                return
            state.tool_calls_executed -= 1
            state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest
            try:
                await self._cas_run(version, state)
                return
            except _Conflict:
                attempt += 1
                await self._retry(attempt)

    # -- faults ---------------------------------------------------------------------------------

    def drain_in_doubt(self) -> list[Reservation | IdempotencyRecord]:
        taken, self._in_doubt = self._in_doubt, []
        return taken

    async def release_tool_call(self, record: IdempotencyRecord) -> None:
        current = await self.get_tool_call(record.run_id, record.key)
        if (
            current is None
            or current.state != IN_FLIGHT
            or current.owner != self.owner
            or current.created_at != record.created_at
        ):
            return  # never written, or another attempt's record by now: not ours to drop
        if await self._write_record(IN_FLIGHT, None, delete=(record.run_id, record.key, self.owner)):
            self._mine.pop((record.run_id, record.key), None)
            await self._refund_tool_call(record.run_id, time.time())

    @property
    def location(self) -> str:
        return redact_url(self.url)

    def failure_code(self, exc: BaseException) -> str | None:
        if isinstance(exc, RedisTimeoutError):
            return "ledger_timeout"
        if isinstance(exc, RedisConnectionError):
            # BusyLoadingError (a restarted Redis loading its data) is a ConnectionError too.
            return "ledger_unreachable"
        if isinstance(exc, RedisError):
            # MISCONF (cannot persist: disk full), READONLY, OOM... Redis refuses writes.
            text = str(exc)
            return "ledger_disk_full" if text.startswith("MISCONF") else "ledger_error"
        return super().failure_code(exc)

    # -- provider objects -----------------------------------------------------------------------

    def _k_objects(self, account: str) -> str:
        # One hash per provider account: object id → tenant (one key, so one slot on a cluster).
        return f"{self.prefix}objects:{len(account)}:{account}"

    async def claim_objects(self, account: str, object_ids: Sequence[str], tenant: str, now: float) -> None:
        pipe = self._r.pipeline(transaction=False)
        for oid in object_ids:
            pipe.hsetnx(self._k_objects(account), oid, tenant)  # the first claim wins
        await pipe.execute()

    async def object_owners(self, account: str, object_ids: Sequence[str]) -> dict[str, str]:
        ids = list(dict.fromkeys(object_ids))
        if not ids:
            return {}
        values = await self._r.hmget(self._k_objects(account), ids)
        return {oid: v.decode() for oid, v in zip(ids, values, strict=True) if v is not None}

    # -- lifecycle ------------------------------------------------------------------------------

    async def ping(self) -> None:
        """A write, as readiness needs: Redis may answer PING and still refuse writes."""
        await self._r.set(f"{self.prefix}probe:{self.owner}", time.time(), px=60_000)

    async def close(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        try:
            # A clean shutdown with nothing left: forget this owner (and stop its heartbeat at once
            # when nothing is in flight, so sweeps need not wait for the TTL).
            if self._started and not await self._r.exists(
                self._k_res(self.owner), self._k_inflight(self.owner)
            ):
                await self._r.srem(f"{self.prefix}owners", self.owner)
                await self._r.delete(self._k_owner(self.owner))
            elif self._started:
                await self._r.delete(self._k_owner(self.owner))  # leftovers: let a sweep take them
        except Exception as e:
            log.warning("redis ledger close: %s", e)
        await self._r.aclose()
