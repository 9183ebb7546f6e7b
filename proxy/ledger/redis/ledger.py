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
instead of four, without pinning a pooled connection for the duration of a WATCH. The scripts
are idempotent when resent (scripts.py), so the client may resend a command whose connection
broke (a pooled connection that died with a restarted Redis is replaced and the command resent
once) without a reservation written twice or a refund applied twice.

The parts: keys.py (the key layout), codec.py (the values), scripts.py (the Lua), store.py (read
and compare-and-set), liveness.py (owners' heartbeats), recovery.py (sweeps of dead owners),
cancels.py (cancel pub/sub). This module is the `Ledger`: each operation reads, decides with
base.py's rules and writes.

Redis Cluster (`cluster=True`, `redis_cluster = true`): the same code on redis-py's asyncio
`RedisCluster`, given any node's URL. Every script's keys share one hash slot (keys.py: the tag of
the run tree's root), so EVALSHA is routed by its first key; cancels use sharded pub/sub
(cancels.py). A failover can lose writes the old master acknowledged; `wait_replicas = N`
(`redis_wait_replicas`) acknowledges a reservation or settlement only once N replicas have it
(`WAIT`, store.py's `Durability`), and refuses the call (503 `ledger_unavailable`, code
`ledger_replicas_behind`) when fewer did in time.

Faults. A settlement of a reservation a sweep charged at its reserved amount (this replica was
taken for dead) replaces that charge by the actual usage. Writes whose answer was lost (the
connection failed after a script was sent) are "in doubt": a reservation or an in-flight record
of a call that was then refused is handed to the caller (`drain_in_doubt`), which releases it once
Redis answers again.
Production: enable persistence on the Redis server (AOF `appendfsync everysec` at least), or a
restart of Redis forgets budgets, spend and idempotency records.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.caps import RunCaps
from proxy.config import redact_url
from proxy.errors import Rejection
from proxy.ledger import base
from proxy.ledger.redis.approvals import RedisApprovals
from proxy.ledger.redis.cancels import cancel_events, publish_cancel
from proxy.ledger.redis.codec import as_text
from proxy.ledger.redis.keys import RedisKeys
from proxy.ledger.redis.liveness import Liveness
from proxy.ledger.redis.recovery import Recovery
from proxy.ledger.redis.store import Chain, Conflict, Durability, RedisStore, ReplicasBehind, backoff
from proxy.ledger.redis.trees import TreeLocks

log = logging.getLogger("runcap.ledger")


class RedisLedger(base.Ledger):
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "runcap:",
        retention_s: float = base.DEFAULT_RETENTION_S,
        heartbeat_s: float = 2.0,
        heartbeat_ttl_s: float = 10.0,
        confirm_dead_s: float | None = None,
        op_timeout_s: float = 5.0,
        cluster: bool = False,
        wait_replicas: int = 0,
        wait_timeout_s: float | None = None,
    ) -> None:
        """`confirm_dead_s`: how long an owner's heartbeat must have been seen missing before a
        sweep settles its reservations (default: the heartbeat TTL; see recovery.py).
        `op_timeout_s`: the socket timeout of each command. `cluster`: `url` names a node of a
        Redis Cluster. `wait_replicas`: replicas that must have a reservation or settlement
        before it is acknowledged, waited for at most `wait_timeout_s` (default: half of
        `op_timeout_s`, so the refusal comes before the operation's own timeout)."""
        self.url = url
        self.prefix = prefix
        self.retention_ms = int(retention_s * 1000)
        self.heartbeat_s = heartbeat_s
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self.confirm_dead_s = heartbeat_ttl_s if confirm_dead_s is None else confirm_dead_s
        self.owner = secrets.token_hex(8)
        self.cluster = cluster
        self._r: aioredis.Redis | RedisCluster
        if cluster:
            # The cluster client retries a command on a connection error or a MOVED slot after
            # refreshing its map of the cluster (a failover): safe for the scripts, as above.
            self._r = RedisCluster.from_url(
                url, socket_timeout=op_timeout_s, socket_connect_timeout=op_timeout_s
            )
        else:
            self._r = aioredis.from_url(
                url,
                socket_timeout=op_timeout_s,
                socket_connect_timeout=op_timeout_s,
                # Once, at once, on a new connection: pooled connections die with a restarted
                # Redis (safe for the scripts: see "compare-and-set" above; the rest is idempotent).
                retry=Retry(NoBackoff(), 1),
                retry_on_error=[RedisConnectionError],
            )
        self.wait_replicas = wait_replicas
        durability = None
        if wait_replicas > 0:
            wait_ms = int(1000 * (op_timeout_s / 2 if wait_timeout_s is None else wait_timeout_s))
            durability = Durability(self._r, wait_replicas, max(wait_ms, 1))
        self._keys = RedisKeys(prefix)
        self._store = RedisStore(self._r, self._keys, self.retention_ms, self.owner, durability)
        self._approvals = RedisApprovals(self._r, prefix, self.retention_ms)
        self._liveness = Liveness(
            self._store, self.owner, heartbeat_s=heartbeat_s, heartbeat_ttl_ms=self.heartbeat_ttl_ms
        )
        self._recovery = Recovery(self._store, self._liveness, confirm_dead_s=self.confirm_dead_s)
        # The in-flight records this instance wrote, to complete them without reading them back.
        self._mine: dict[tuple[str, str], base.IdempotencyRecord] = {}
        self._in_doubt: list[base.Reservation | base.IdempotencyRecord] = []
        self._trees = TreeLocks()

    @property
    def cancel_channel(self) -> str:
        return self._keys.cancel_channel

    # Seams the fault and contract tests reach through (tests/test_ledger_*.py).

    def _k_run(self, run_id: str, root: str | None = None) -> str:
        return self._keys.run(run_id, root)

    def _k_res(self, owner: str, root: str) -> str:
        return self._keys.reservations(owner, root)

    def _k_owner(self, owner: str) -> str:
        return self._keys.heartbeat(owner)

    def _k_tc(self, run_id: str, key: str, root: str | None = None) -> str:
        return self._keys.call(run_id, key, root)

    async def _beat(self) -> None:
        await self._liveness.beat()

    @property
    def _heartbeat_task(self) -> asyncio.Task[None] | None:
        return self._liveness.task

    # -- run trees: a run and its ancestors, read together and written by one script ----------

    async def _place(
        self,
        stored: base.RunState | None,
        run_id: str,
        task: str,
        caps: RunCaps,
        parent: str,
        now: float,
        *,
        cached: bool,
    ) -> tuple[base.RunState, Chain]:
        """The run as read (`stored`), or new, placed in its tree (`base.open_run`), and its
        ancestors as read. A root reads nothing more."""
        if not parent and (stored is None or not stored.ancestors):
            return stored or base.new_run(run_id, task, caps, now), []
        store = self._store
        chain: Chain
        if parent and (stored is None or stored.parent_run_id != parent):
            named = await store.read_run(parent, cached=cached)  # its root: from its pointer
            up = named[1]
            chain = [named, *(await self._chain_of(up, cached=cached) if up else ())]
        else:
            assert stored is not None
            chain = await self._chain_of(stored, cached=cached)
        try:
            state = base.open_run(stored, [st for _, st in chain], run_id, task, caps, parent, now)
        except Rejection:
            if not cached:
                raise
            # Refused on this process's copies of the parent: decide again on what Redis holds.
            return await self._place(stored, run_id, task, caps, parent, now, cached=False)
        if state is not stored:
            self._trees.learn(state, [st for _, st in chain])  # a new child's tree
        if stored is None and state.root != run_id:
            # A new child: found by its id through a pointer to its tree (store.py), written
            # before its state is.
            await store.point(state)
        return state, chain

    async def _chain_of(self, state: base.RunState, *, cached: bool) -> Chain:
        """The run's ancestors as read (none for a root); their tree is learnt (`TreeLocks`)."""
        if not state.ancestors:
            return []
        chain = await self._store.read_runs(state.ancestors, state.root, cached=cached)
        self._trees.learn(state, [st for _, st in chain])
        return chain

    async def _open(
        self, run_id: str, task: str, caps: RunCaps, parent: str, now: float, *, cached: bool
    ) -> tuple[str, base.RunState, Chain]:
        version, stored = await self._store.read_run(run_id, cached=cached, index=True)
        state, chain = await self._place(stored, run_id, task, caps, parent, now, cached=cached)
        return version, state, chain

    # -- steps ----------------------------------------------------------------------------------

    async def begin_step(self, req: base.StepRequest) -> base.Reservation:
        async with self._trees.lock(req.run_id, req.parent_run_id):
            return await self._begin_step(req)

    async def _begin_step(self, req: base.StepRequest) -> base.Reservation:
        await self._liveness.start()
        attempt = 0
        while True:
            version, state, chain = await self._open(
                req.run_id, req.task, req.caps, req.parent_run_id, req.now, cached=attempt == 0
            )
            try:
                res = base.decide_step(state, req, [st for _, st in chain])
            except Rejection:
                try:
                    await self._store.cas_run(version, state, chain)
                except Conflict:
                    attempt += 1
                    await backoff(attempt)
                    continue
                raise
            try:
                ok = await self._store.add_reservation(version, state, res, self.owner, req.now, chain)
            except BaseException:  # also a cancel (timeout): the script may have run
                self._in_doubt.append(res)
                raise
            if ok:
                self._liveness.live[res.id] = res
                return res
            attempt += 1
            await backoff(attempt)

    async def settle(
        self, reservation: base.Reservation, settlement: base.Settlement, now: float
    ) -> base.RunState:
        return await self._settle_reservation(reservation, settlement, now, quiet=False)

    async def release_reservation(self, reservation: base.Reservation) -> None:
        await self._settle_reservation(reservation, base.Settlement(no_answer=True), time.time(), quiet=True)

    async def _settle_reservation(
        self, reservation: base.Reservation, settlement: base.Settlement, now: float, *, quiet: bool
    ) -> base.RunState:
        async with self._trees.lock(reservation.run_id):
            return await self._settle_in_tree(reservation, settlement, now, quiet=quiet)

    async def _settle_in_tree(
        self, reservation: base.Reservation, settlement: base.Settlement, now: float, *, quiet: bool
    ) -> base.RunState:
        attempt = 0
        swept = False  # a sweep charged it at its reserved amount: correct that charge
        while True:
            version, state = await self._store.read_run(reservation.run_id, cached=attempt == 0)
            if state is None:
                self._liveness.live.pop(reservation.id, None)
                raise KeyError(reservation.run_id)
            chain = await self._chain_of(state, cached=attempt == 0)
            before = base.totals(state)
            if swept:
                base.apply_unrecovery(
                    state, reservation.usd_nanos, reservation.input_tokens, reservation.output_tokens, now
                )
            base.apply_settlement(state, reservation, settlement, now)
            base.propagate(before, state, [st for _, st in chain], now)  # its ancestors take the change
            write = self._store.settle_swept if swept else self._store.settle_reservation
            ok = await write(version, state, reservation.id, self.owner, chain)
            if ok == 1:
                self._liveness.live.pop(reservation.id, None)
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
                self._liveness.live.pop(reservation.id, None)
                if not quiet:
                    log.warning(
                        "reservation %s of run %s was already settled", reservation.id, reservation.run_id
                    )
                _, current = await self._store.read_run(reservation.run_id)
                return current or state
            attempt += 1
            await backoff(attempt)

    async def touch_run(
        self, run_id: str, task: str, caps: RunCaps, now: float, parent: str = ""
    ) -> base.RunState:
        async with self._trees.lock(run_id, parent):
            return await self._touch_run(run_id, task, caps, now, parent)

    async def _touch_run(
        self, run_id: str, task: str, caps: RunCaps, now: float, parent: str
    ) -> base.RunState:
        attempt = 0
        while True:
            version, opened, chain = await self._open(run_id, task, caps, parent, now, cached=attempt == 0)
            state = base.touched_run(opened, run_id, task, caps, now)
            rejection: Rejection | None = None
            try:
                base.check_touched(state, [st for _, st in chain], now)
            except Rejection as rej:  # written too: the run's new status is part of the answer
                rejection = rej
            try:
                await self._store.cas_run(version, state, chain)
            except Conflict:
                attempt += 1
                await backoff(attempt)
                continue
            if rejection is not None:
                raise rejection
            return state

    async def get_run(self, run_id: str) -> base.RunState | None:
        state = (await self._store.read_run(run_id))[1]
        if state is not None and state.children:
            state.child_ids = await self._store.child_ids(state)
        return state

    async def cancel(self, run_id: str, now: float) -> base.RunState | None:
        state = await self._update(run_id, now, cancel=True)
        await publish_cancel(self._r, self.cancel_channel, run_id, self.owner, sharded=self.cluster)
        return state

    # -- approvals (approvals.py) ----------------------------------------------------------------

    async def open_approval(self, req: base.ApprovalRequest) -> tuple[base.Approval, bool]:
        return await self._approvals.open(req)

    async def get_approval(self, approval_id: str, now: float) -> base.Approval | None:
        return await self._approvals.get(approval_id, now)

    async def list_approvals(
        self, now: float, *, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[base.Approval]:
        return await self._approvals.listing(now, state, run_id, limit)

    async def decide_approval(
        self, approval_id: str, approve: bool, by: str, reason: str, now: float
    ) -> base.Approval | None:
        return await self._approvals.decide(approval_id, approve, by, reason, now)

    async def deny_pending_approvals(self, run_id: str, now: float) -> list[base.Approval]:
        return await self._approvals.deny_pending(run_id, now)

    async def set_status(self, run_id: str, status: str, now: float) -> None:
        await self._update(run_id, now, status=status)

    async def set_caps(
        self, run_id: str, change: base.CapsChange, now: float
    ) -> tuple[RunCaps, base.RunState] | None:
        before = RunCaps()

        def decide(state: base.RunState | None) -> base.RunState | None:
            nonlocal before
            if state is not None:
                before = state.caps
                base.apply_caps_change(state, change, now)
            return state

        state = await self._store.update_run(run_id, decide, cached=False)
        return None if state is None else (before, state)

    async def _update(
        self, run_id: str, now: float, *, cancel: bool = False, status: str | None = None
    ) -> base.RunState:
        def decide(state: base.RunState | None) -> base.RunState:
            state = state or base.new_run(run_id, "", RunCaps(), now)
            base.apply_status(state, now, cancel=cancel, status=status)
            return state

        written = await self._store.update_run(run_id, decide)
        assert written is not None
        return written

    # -- tool calls -----------------------------------------------------------------------------

    async def begin_tool_call(self, req: base.ToolCallRequest) -> base.ToolCallStart:
        async with self._trees.lock(req.run_id, req.parent_run_id):
            return await self._begin_tool_call(req)

    async def _begin_tool_call(self, req: base.ToolCallRequest) -> base.ToolCallStart:
        await self._liveness.start()
        attempt = 0
        while True:
            hit = self._store.cached_run(req.run_id) if attempt == 0 else None
            read: base.RunState | None
            if hit is not None:
                # First attempt on a run this process wrote last: guess "no record yet" (a new
                # call, the common case); the compare-and-set checks both guesses.
                (version, read), record, read_st = hit, None, ""
            else:
                version, read, record, read_st = await self._store.read_call(req.run_id, req.key)
            state, chain = await self._place(
                read, req.run_id, req.task, req.caps, req.parent_run_id, req.now, cached=attempt == 0
            )
            alive = (
                record is not None
                and record.state == base.IN_FLIGHT
                and await self._liveness.alive(record.owner)
            )
            rejection: Rejection | None = None
            start: base.ToolCallStart | None = None
            try:
                start = base.decide_tool_call(state, record, req, self.owner, alive, [st for _, st in chain])
            except Rejection as rej:
                rejection = rej
            written = None
            if start is not None and start.action == "execute" and start.record is not None:
                written = start.record
            elif record is not None and record.state != read_st:  # in flight → unknown
                written = record
            owner = written.owner if written is not None else self.owner
            new_call = written is not None and written.state == base.IN_FLIGHT and written.owner == self.owner
            try:
                ok = await self._store.start_call(
                    version, state, req.key, read_st, written, owner, req.now, chain
                )
            except BaseException:  # also a cancel (timeout): the script may have run
                if new_call:
                    assert written is not None
                    self._in_doubt.append(written)
                raise
            if not ok:
                attempt += 1
                await backoff(attempt)
                continue
            if rejection is not None:
                raise rejection
            assert start is not None
            if start.record is not None and start.action == "execute":
                self._mine[(req.run_id, start.record.key)] = dataclasses.replace(start.record)
            return start

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
            record.state, record.status, record.headers, record.body = base.COMPLETED, status, headers, body
            record.updated_at, record.error = now, ""
            if await self._store.write_record(expected, record):
                return
            record = None

    async def mark_unknown(self, run_id: str, key: str, now: float, reason: str = "") -> None:
        record = self._mine.pop((run_id, key), None)
        while True:
            if record is None:
                record = await self.get_tool_call(run_id, key)
            if record is None or record.state != base.IN_FLIGHT:
                return
            record.state, record.updated_at, record.error = base.UNKNOWN, now, reason
            if await self._store.write_record(base.IN_FLIGHT, record):
                return
            record = None

    async def get_tool_call(self, run_id: str, key: str) -> base.IdempotencyRecord | None:
        return await self._store.get_record(run_id, key)

    async def list_tool_calls(
        self, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[base.IdempotencyRecord]:
        return await self._store.list_records(state, run_id, limit)

    async def apply_verdict(
        self, run_id: str, key: str, verdict: base.Verdict
    ) -> base.IdempotencyRecord | None:
        self._mine.pop((run_id, key), None)
        while True:
            record = await self.get_tool_call(run_id, key)
            if record is None:
                return None
            if record.state != base.UNKNOWN and not verdict.force:
                raise base.RecordNotUnknown(record)
            before = dataclasses.replace(record)
            if verdict.done:
                record.state, record.status, record.headers, record.body = (
                    base.COMPLETED,
                    verdict.status,
                    verdict.headers or {},
                    verdict.body,
                )
                record.updated_at, record.error = verdict.now, ""
                if await self._store.write_record(before.state, record):
                    return before
                continue
            if await self._store.write_record(before.state, None, delete=(run_id, key, record.owner)):
                await self._refund_tool_call(run_id, verdict.now)
                return before

    async def _refund_tool_call(self, run_id: str, now: float) -> None:
        def decide(state: base.RunState | None, chain: list[base.RunState | None]) -> base.RunState | None:
            if state is None or state.tool_calls_executed == 0:
                return None
            before = base.totals(state)
            state.tool_calls_executed -= 1
            state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest
            base.propagate(before, state, chain, now)
            return state

        await self._store.update_tree(run_id, decide)

    # -- faults ---------------------------------------------------------------------------------

    def drain_in_doubt(self) -> list[base.Reservation | base.IdempotencyRecord]:
        taken, self._in_doubt = self._in_doubt, []
        return taken

    async def release_tool_call(self, record: base.IdempotencyRecord) -> None:
        current = await self.get_tool_call(record.run_id, record.key)
        if (
            current is None
            or current.state != base.IN_FLIGHT
            or current.owner != self.owner
            or current.created_at != record.created_at
        ):
            return  # never written, or another attempt's record by now: not ours to drop
        if await self._store.write_record(
            base.IN_FLIGHT, None, delete=(record.run_id, record.key, self.owner)
        ):
            self._mine.pop((record.run_id, record.key), None)
            await self._refund_tool_call(record.run_id, time.time())

    # -- recovery -------------------------------------------------------------------------------

    async def recover(self) -> list[base.RecoveredReservation]:
        await self._liveness.start()
        return await self._recovery.sweep()

    # -- cancels --------------------------------------------------------------------------------

    def cancel_events(self) -> AsyncIterator[str]:
        return cancel_events(self._r, self.cancel_channel, self.owner, sharded=self.cluster)

    @property
    def location(self) -> str:
        return redact_url(self.url)

    def failure_code(self, exc: BaseException) -> str | None:
        if isinstance(exc, ReplicasBehind):
            return "ledger_replicas_behind"
        if isinstance(exc, (RedisClusterException, ClusterDownError)):
            # No master serves the slot (a failover under way, the cluster's map out of date).
            return "ledger_unreachable"
        if isinstance(exc, RedisTimeoutError):
            return "ledger_timeout"
        if isinstance(exc, RedisConnectionError):
            # BusyLoadingError (a restarted Redis loading its data) is a ConnectionError too.
            return "ledger_unreachable"
        if isinstance(exc, RedisError):
            # MISCONF (cannot persist: disk full), READONLY, OOM... Redis refuses writes.
            text = str(exc)
            return "ledger_disk_full" if text.startswith("MISCONF") else "ledger_error"
        if _raised_in_redis_py(exc):
            # redis-py's cluster client can fail on its own state mid-failover (a node it dropped
            # from its map while a command was on its way: AttributeError, KeyError, IndexError):
            # the ledger is unavailable for the moment — 503, retried — not a bug of runcap's (500).
            return "ledger_unreachable"
        return super().failure_code(exc)

    # -- provider objects -----------------------------------------------------------------------

    async def claim_objects(self, account: str, object_ids: Sequence[str], tenant: str, now: float) -> None:
        pipe = self._r.pipeline(transaction=False)
        for oid in object_ids:
            pipe.hsetnx(self._keys.objects(account), oid, tenant)  # the first claim wins
        await pipe.execute()

    async def object_owners(self, account: str, object_ids: Sequence[str]) -> dict[str, str]:
        ids = list(dict.fromkeys(object_ids))
        if not ids:
            return {}
        values = await self._r.hmget(self._keys.objects(account), ids)
        return {oid: as_text(v) for oid, v in zip(ids, values, strict=True) if v is not None}

    # -- lifecycle ------------------------------------------------------------------------------

    async def ping(self) -> None:
        """A write, as readiness needs: Redis may answer PING and still refuse writes; with
        `wait_replicas`, acknowledged by that many replicas (or not ready: every reservation
        would be refused)."""
        probe = self._keys.probe(self.owner)
        if self._store.durability is not None:
            await self._store.durability.write(probe, "SET", probe, time.time(), "PX", 60_000)
            return
        await self._r.set(probe, time.time(), px=60_000)

    async def close(self) -> None:
        try:
            await self._liveness.stop()
        except Exception as e:
            log.warning("redis ledger close: %s", e)
        if self._store.durability is not None:
            await self._store.durability.close()
        await self._r.aclose()


def _raised_in_redis_py(exc: BaseException) -> bool:
    """The exception was raised in redis-py's own code (its innermost frame is in the package)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return isinstance(module, str) and (module == "redis" or module.startswith("redis."))
