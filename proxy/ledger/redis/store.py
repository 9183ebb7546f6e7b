"""The Redis ledger's storage primitives, shared by its operations (ledger.py), liveness and
recovery: read a run with its version, compare-and-set it, compare-and-set one idempotency
record, list the records. No rule lives here: what to write is decided by the caller (base.py's
rules); this module only knows where things are (keys.py), how they are encoded (codec.py) and
which script writes them (scripts.py).

Optimistic concurrency: a write names the version it read; when the run moved meanwhile the
script writes nothing, and the caller reads again and decides again (`backoff` between tries).

Every script's key list is built here, all under one tree's hash tag (keys.py), so every script
runs on a Redis Cluster (`test_every_script_touches_one_slot`). A run is found by its id alone:
its root is remembered once seen, else read with the run (`run:{<run>}:<run>` holds a root's
state, or a child's pointer to its root). Before the first script that leaves something of this
owner under a tag, the tag is indexed (`tags:<owner>`, `tags`: single-key commands, sent in the
same round trip as the run's read when they can be), so recovery and listings find it.

Acknowledged writes (`redis_wait_replicas = N`, `Durability`): a reservation or settlement script
is followed by `WAIT N timeout` on the same connection; fewer replicas → `ReplicasBehind`, which
the ledger turns into a 503 `ledger_unavailable` (code `ledger_replicas_behind`) and the write
into one in doubt (released or retried like any other).
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import AskError, MovedError, NoScriptError, ReadOnlyError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.ledger.base import CHILD_IDS_KEPT, UNKNOWN, IdempotencyRecord, Reservation, RunState
from proxy.ledger.redis.codec import as_bytes, as_text, json_record, json_state, record_json, state_json
from proxy.ledger.redis.keys import RedisKeys, member
from proxy.ledger.redis.scripts import Scripts

RUN_CACHE = 10_000  # runs whose last-written version this process remembers
LIST_BATCH = 500  # records fetched per round trip when listing
ROOT_CACHE = 100_000  # run ids whose root this process remembers

Client = aioredis.Redis | RedisCluster
ScriptArgs = list[str | bytes | int | float]
# A run's ancestors as read: (version, state) each, parent first; state None for one that expired.
Chain = Sequence[tuple[str, RunState | None]]


class ReplicasBehind(RedisError):
    """`WAIT` returned fewer replicas than `redis_wait_replicas` asks for: the write is on the
    master only, and a failover now may lose it."""


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


def _remember_at(done: dict[str, float], root: str, at: float) -> None:
    """A bounded memory of indexed roots (a forgotten one is only indexed again)."""
    done.pop(root, None)
    done[root] = at
    if len(done) > ROOT_CACHE:
        del done[next(iter(done))]


class Durability:
    """`WAIT N timeout` after a script, on the connection that sent it (WAIT counts the replicas
    that have this connection's writes): one pipeline of EVALSHA + WAIT, on the single Redis or
    on the cluster node that owns the script's slot (its own client: a cluster client would
    broadcast a keyless WAIT to every node)."""

    def __init__(self, r: Client, replicas: int, timeout_ms: int) -> None:
        self.r = r
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self._nodes: dict[str, aioredis.Redis] = {}

    def _client_for(self, key: str, at: tuple[str, int] | None = None) -> aioredis.Redis:
        """The single Redis, or a client of the node that owns `key`'s slot — or of the node `at`
        that a redirection named."""
        if not isinstance(self.r, RedisCluster):
            return self.r
        if at is None:
            node = self.r.get_node_from_key(key)
            if node is None:
                raise RedisConnectionError(f"no cluster node owns the slot of {key!r}")
            at = (node.host, int(node.port))
        name = f"{at[0]}:{at[1]}"
        client = self._nodes.get(name)
        if client is None:
            kwargs = self.r.get_connection_kwargs()
            client = aioredis.Redis(
                host=at[0], port=at[1], password=kwargs.get("password"),
                username=kwargs.get("username"), ssl=bool(kwargs.get("ssl")),
                socket_timeout=kwargs.get("socket_timeout"),
                socket_connect_timeout=kwargs.get("socket_connect_timeout"),
            )  # fmt: skip
            self._nodes[name] = client
        return client

    async def run(self, script: AsyncScript, keys: list[str], args: ScriptArgs) -> object:
        """The script, acknowledged."""
        return await self._acknowledged(keys[0], ("EVALSHA", script.sha, len(keys), *keys, *args), script)

    async def write(self, key: str, *command: str | bytes | int | float) -> object:
        """One command on `key`, acknowledged (readiness's probe: replicas that keep up)."""
        return await self._acknowledged(key, command, None)

    async def _acknowledged(
        self, key: str, command: tuple[str | bytes | int | float, ...], script: AsyncScript | None
    ) -> object:
        # A cluster redirects as its protocol says: `MOVED slot host:port` names the slot's owner
        # after a failover or a resharding (the command follows it; the slot map is reloaded for
        # the next ones), `ASK` the node importing the slot for this one command (sent after
        # `ASKING`), `READONLY` a node that has become a replica (the map is reloaded).
        at: tuple[str, int] | None = None
        asking = False
        for attempt in range(4):
            client = self._client_for(key, at)
            pipe = client.pipeline(transaction=False)
            if asking:
                pipe.execute_command("ASKING")
            pipe.execute_command(*command)
            pipe.wait(self.replicas, self.timeout_ms)
            last = attempt == 3 or not isinstance(self.r, RedisCluster)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except RedisConnectionError:
                if last:
                    raise
                await self._refresh()  # the node died: its replica is (being) promoted
                at, asking = None, False
                continue
            result, acked = replies[-2], replies[-1]
            if isinstance(result, NoScriptError) and script is not None and attempt < 3:
                await client.script_load(script.script)  # a promoted replica, a restarted node
                continue
            if isinstance(result, MovedError) and not last:
                await self._refresh()
                at, asking = result.node_addr, False
                continue
            if isinstance(result, AskError) and not last:
                at, asking = result.node_addr, True
                continue
            if isinstance(result, ReadOnlyError) and not last:
                await self._refresh()
                at, asking = None, False
                continue
            if isinstance(result, Exception):
                raise result
            if isinstance(acked, Exception) or int(acked) < self.replicas:
                raise ReplicasBehind(
                    f"the write reached {acked} of the {self.replicas} replicas `redis_wait_replicas` "
                    f"asks for within {self.timeout_ms} ms"
                )
            return result
        raise ReplicasBehind("the cluster's slot owner kept moving")  # pragma: no cover

    async def _refresh(self) -> None:
        """Reload the slot map (redis-py runs one reload for the calls that ask at once) and close
        the clients of nodes it no longer names; the clients of live nodes stay, other calls'
        pipelines may be on them."""
        assert isinstance(self.r, RedisCluster)
        await self.r.nodes_manager.initialize()
        live = {f"{node.host}:{node.port}" for node in self.r.get_nodes()}
        # Taken out of the dict before the first await: other calls add clients while these close
        # (iterating it across the awaits raised "dictionary changed size during iteration").
        gone = [self._nodes.pop(name) for name in list(self._nodes) if name not in live]
        for client in gone:
            await client.aclose()

    async def close(self) -> None:
        clients, self._nodes = list(self._nodes.values()), {}
        for client in clients:
            await client.aclose()


class RedisStore:
    """Runs and records in one Redis namespace, with this process's cache of the runs it wrote
    and of the roots it has seen and indexed."""

    def __init__(
        self,
        r: Client,
        keys: RedisKeys,
        retention_ms: int,
        owner: str = "",
        durability: Durability | None = None,
    ) -> None:
        self.r = r
        self.keys = keys
        self.scripts = Scripts(r)
        self.retention_ms = retention_ms
        self.owner = owner
        self.durability = durability
        self._runs: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._roots: OrderedDict[str, str] = OrderedDict()
        # Roots this owner indexed in `tags:<owner>` (before a reservation or a record) and in
        # `tags` (before a record: listings), and when: again after a tenth of the retention (the
        # `tags` score keeps a tree from being trimmed) or after a sweep took this owner.
        self._indexed: dict[str, float] = {}
        self._listed: dict[str, float] = {}

    # -- roots and the tag index ----------------------------------------------------------------

    def root_known(self, run_id: str) -> str | None:
        return self._roots.get(run_id)

    def learn_root(self, run_id: str, root: str) -> None:
        roots = self._roots
        roots[run_id] = root
        roots.move_to_end(run_id)
        if len(roots) > ROOT_CACHE:
            roots.popitem(last=False)

    async def root_of(self, run_id: str) -> str:
        """The root of `run_id`'s tree (the run itself when it has no pointer)."""
        known = self._roots.get(run_id)
        if known is not None:
            return known
        if run_id in self._runs:  # written or read by this process: a child's root would be known
            return run_id
        p = await self.r.hget(self.keys.run(run_id), "p")
        root = as_text(p) if p else run_id
        self.learn_root(run_id, root)
        return root

    async def point(self, child: RunState) -> None:
        """A new child's pointer to its root at `run:{<run>}:<run>` (single-key: it is in another
        slot than the tree), and its place among its parent's children (`kids:`). Written once,
        before the child's state (both idempotent: a retried creation adds nothing)."""
        run_id, root, k = child.run_id, child.root, self.keys
        if root == run_id:
            return
        kids = k.children(child.parent_run_id, root)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(k.run(run_id), "p", root)
        pipe.pexpire(k.run(run_id), self.retention_ms)
        pipe.zadd(kids, {run_id: child.started_at}, nx=True)
        pipe.pexpire(kids, self.retention_ms)
        await pipe.execute()
        self.learn_root(run_id, root)

    async def child_ids(self, state: RunState) -> tuple[str, ...]:
        """The first `CHILD_IDS_KEPT` children of the run, oldest first."""
        kids = await self.r.zrange(self.keys.children(state.run_id, state.root), 0, CHILD_IDS_KEPT - 1)
        return tuple(as_text(kid) for kid in kids if isinstance(kid, bytes | str))

    def _stale(self, done: dict[str, float], root: str) -> bool:
        at = done.get(root)
        return at is None or time.time() - at > self.retention_ms / 10_000

    def _needs_index(self, root: str, listed: bool = False) -> bool:
        return self._stale(self._indexed, root) or (listed and self._stale(self._listed, root))

    def _queue_index(self, pipe: Any, root: str, listed: bool = False) -> None:
        now = time.time()
        if self._stale(self._indexed, root):
            pipe.sadd(self.keys.owner_tags(self.owner), root)
            _remember_at(self._indexed, root, now)  # (a failed send forgets it: see `index`)
        if listed and self._stale(self._listed, root):
            pipe.zadd(self.keys.tags, {root: now})
            _remember_at(self._listed, root, now)

    async def index(self, root: str, *, listed: bool = False) -> None:
        """`root` in this owner's tag index (and, `listed`: the global one, for listings of
        records), unless done already."""
        if not self._needs_index(root, listed):
            return
        pipe = self.r.pipeline(transaction=False)
        self._queue_index(pipe, root, listed)
        try:
            await pipe.execute()
        except BaseException:
            self.forget_index(root)
            raise

    def forget_index(self, root: str) -> None:
        self._indexed.pop(root, None)
        self._listed.pop(root, None)

    def forget_indexed(self) -> None:
        """A sweep took this owner for dead (and may have dropped its tags): index again."""
        self._indexed.clear()
        self._listed.clear()

    async def owner_tags(self, owner: str) -> list[str]:
        return sorted(as_text(t) for t in await self.r.smembers(self.keys.owner_tags(owner)))

    async def owner_holds(self, owner: str, *, prune: bool = False) -> bool:
        """Whether `owner` still has reservations or in-flight calls under any of its tags;
        `prune`: drop the tags it holds nothing under (a dead owner's: it writes no more; the
        reservations a sweep kept in `swept:` are looked up by their live owner, who knows the
        root)."""
        k, holds = self.keys, False
        roots = await self.owner_tags(owner)
        for i in range(0, len(roots), LIST_BATCH):  # one round trip per batch of trees
            batch = roots[i : i + LIST_BATCH]
            pipe = self.r.pipeline(transaction=False)
            for root in batch:
                pipe.exists(k.reservations(owner, root))
                pipe.exists(k.inflight(owner, root))
            found = await pipe.execute()
            empty = [root for j, root in enumerate(batch) if not (found[2 * j] or found[2 * j + 1])]
            holds = holds or len(empty) < len(batch)
            if prune and empty:
                await self.r.srem(k.owner_tags(owner), *empty)
        return holds

    async def _script(self, script: AsyncScript, keys: list[str], args: ScriptArgs) -> object:
        """A script that writes what a reservation or settlement decided: acknowledged by
        `WAIT` when the ledger asks for replicas."""
        if self.durability is not None:
            return await self.durability.run(script, keys, args)
        return await script(keys=keys, args=args)

    # -- runs -----------------------------------------------------------------------------------

    def cached_run(self, run_id: str) -> tuple[str, RunState] | None:
        """This process's last-written copy of the run and its version, if it has one: a first
        attempt's guess, which the compare-and-set verifies (a stale guess costs one failed write
        and a fresh read; a right one saves a round trip)."""
        hit = self._runs.get(run_id)
        if hit is None:
            return None
        return hit[0], self._placed(json_state(hit[1]), self._roots.get(run_id, run_id))

    async def read_run(
        self, run_id: str, cached: bool = False, *, index: bool = False
    ) -> tuple[str, RunState | None]:
        """The run and its version ("" and None when there is none). `cached`: `cached_run`'s
        guess when there is one. `index`: the caller is about to write a reservation under the
        run's tree (its tag is indexed first, in the read's round trip when the root is known or
        the run is a root)."""
        if cached:
            hit = self.cached_run(run_id)
            if hit is not None:
                if index:
                    await self.index(hit[1].root, listed=True)
                return hit
        root = self._roots.get(run_id, run_id)
        # The index write rides on the read's round trip (listed too: the run's first tool call
        # after its first step then needs no round trip of its own).
        if index and self._needs_index(root, listed=True):
            pipe = self.r.pipeline(transaction=False)
            pipe.hmget(self.keys.run(run_id, root), ["v", "s", "p"])
            self._queue_index(pipe, root, listed=True)
            try:
                (v, s, p), *_ = await pipe.execute()
            except BaseException:
                self.forget_index(root)
                raise
        else:
            v, s, p = await self.r.hmget(self.keys.run(run_id, root), ["v", "s", "p"])
        if p and not s:  # a child's pointer: its state is under its root's tag
            root = as_text(p)
            self.learn_root(run_id, root)
            if index:
                await self.index(root, listed=True)
            v, s, _ = await self.r.hmget(self.keys.run(run_id, root), ["v", "s", "p"])
        version = as_text(v) if v else ""
        if not s:
            return version, None
        data = as_bytes(s)
        self.remember(run_id, version, data)
        return version, self._placed(json_state(data), root)

    @staticmethod
    def _placed(state: RunState, root: str) -> RunState:
        """The state as read under `root`'s tag: where it was found is its root."""
        if root != state.run_id and not state.root_run_id:
            state.root_run_id = root
        return state

    async def read_runs(
        self, run_ids: Sequence[str], root: str, cached: bool = False
    ) -> list[tuple[str, RunState | None]]:
        """Several runs of `root`'s tree (a run's ancestors) and their versions, in one round trip
        (none when `cached` and this process wrote each last)."""
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
                pipe.hmget(self.keys.run(run_ids[i], root), ["v", "s"])
            for i, (v, s) in zip(missing, await pipe.execute(), strict=True):
                version = as_text(v) if v else ""
                if s:
                    data = as_bytes(s)
                    self.remember(run_ids[i], version, data)
                    self.learn_root(run_ids[i], root)
                    out[i] = (version, self._placed(json_state(data), root))
                else:
                    out[i] = (version, None)
        return out

    async def write_chain(
        self, mode: str, version: str, state: RunState, chain: Chain, keys: list[str], args: ScriptArgs
    ) -> int:
        """`mode`'s single-run script (scripts.py `_CHAIN`) over the run and its ancestors (those
        that still exist), all under the root's tag: every state written only if none moved since
        it was read. A reservation's or settlement's write is acknowledged as theirs are."""
        runs = [(version, state), *((v, st) for v, st in chain if st is not None)]
        argv: ScriptArgs = [mode, len(runs), self.retention_ms]
        written = []
        for v, st in runs:
            after, data = new_version(), state_json(st)
            argv += [v, data, after]
            written.append((st.run_id, after, data))
        all_keys = [*self.keys.chain([(st.run_id, state.root) for _, st in runs]), *keys]
        if mode in ("begin", "settle", "move"):
            ok = int(await self._script(self.scripts.chain, all_keys, [*argv, *args]))  # type: ignore[call-overload]
        else:
            ok = int(await self.scripts.chain(keys=all_keys, args=[*argv, *args]))
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
            keys=[self.keys.run(state.run_id, state.root)],
            args=[version, data, self.retention_ms, version_after],
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
            chain = (
                await self.read_runs(state.ancestors, state.root, cached=cached and attempt == 0)
                if state is not None and state.ancestors
                else []
            )
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
        """The run (and its ancestors in `chain`) and `res` in `res:{<root>}:<owner>` (made at
        `now`)."""
        k, root, version_after, data = self.keys, state.root, new_version(), state_json(state)
        await self.index(root, listed=True)  # (done by the read already, unless the root moved)
        entry = orjson.dumps([res.run_id, res.usd_nanos, res.input_tokens, res.output_tokens, now])
        if chain:
            return bool(
                await self.write_chain(
                    "begin", version, state, chain, [k.reservations(owner, root)], [res.id, entry]
                )
            )
        ok = await self._script(
            self.scripts.begin_step,
            [k.run(state.run_id, root), k.reservations(owner, root)],
            [version, data, self.retention_ms, version_after, res.id, entry],
        )
        if ok:
            self.remember(state.run_id, version_after, data)
        return bool(ok)

    async def settle_reservation(
        self, version: str, state: RunState, reservation_id: str, owner: str, chain: Chain = ()
    ) -> int:
        """The run, with the reservation dropped from `res:`. 1: done; 0: the run moved;
        -1: the reservation is gone (settled already); -2: a sweep charged it (`settle_swept`).
        `chain`: the run's ancestors, written with it (every method below takes it too)."""
        k, root = self.keys, state.root
        if chain:
            return await self.write_chain(
                "settle", version, state, chain, [k.reservations(owner, root), k.swept(owner, root)],
                [reservation_id],
            )  # fmt: skip
        keys = [k.run(state.run_id, root), k.reservations(owner, root), k.swept(owner, root)]
        return await self._write_reservation(self.scripts.settle, keys, version, state, reservation_id)

    async def settle_swept(
        self, version: str, state: RunState, reservation_id: str, owner: str, chain: Chain = ()
    ) -> int:
        """The run, with the reservation dropped from `swept:`. -1: not there (any more)."""
        k, root = self.keys, state.root
        return await self._move(
            version, state, reservation_id, k.swept(owner, root), k.reservations(owner, root), "", chain
        )

    async def sweep_reservation(
        self, version: str, state: RunState, reservation_id: str, owner: str, entry: bytes | str,
        chain: Chain = (),
    ) -> int:  # fmt: skip
        """The run, with the reservation moved from `res:` to `swept:` (of `owner`, its tree)."""
        k, root = self.keys, state.root
        return await self._move(
            version, state, reservation_id, k.reservations(owner, root), k.swept(owner, root), entry, chain
        )

    async def take_back_reservation(
        self, version: str, state: RunState, reservation_id: str, owner: str, entry: bytes | str,
        chain: Chain = (),
    ) -> int:  # fmt: skip
        """The run, with the reservation moved back from `swept:` to `res:`."""
        k, root = self.keys, state.root
        return await self._move(
            version, state, reservation_id, k.swept(owner, root), k.reservations(owner, root), entry, chain
        )

    async def _move(
        self, version: str, state: RunState, reservation_id: str, source: str, target: str,
        entry: bytes | str, chain: Chain = (),
    ) -> int:  # fmt: skip
        """The run, with the reservation moved from `source` to `target` (dropped: `entry` "")."""
        if chain:
            return await self.write_chain(
                "move", version, state, chain, [source, target], [reservation_id, entry]
            )
        keys = [self.keys.run(state.run_id, state.root), source, target]
        return await self._write_reservation(
            self.scripts.move_res, keys, version, state, reservation_id, entry
        )

    async def _write_reservation(
        self, script: AsyncScript, keys: list[str], version: str, state: RunState, *args: str | bytes
    ) -> int:
        version_after, data = new_version(), state_json(state)
        ok = int(await self._script(script, keys, [version, data, self.retention_ms, version_after, *args]))  # type: ignore[call-overload]
        if ok == 1:
            self.remember(state.run_id, version_after, data)
        return ok

    # -- a tool call's start --------------------------------------------------------------------

    async def read_call(
        self, run_id: str, key: str | None
    ) -> tuple[str, RunState | None, IdempotencyRecord | None, str]:
        """The run, its version, the call's record and the record's state ("" when none), in one
        round trip (two for a child whose root this process has not seen yet)."""
        root = self._roots.get(run_id, run_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(self.keys.run(run_id, root), ["v", "s", "p"])
        pipe.hmget(self._call_key(run_id, key, root), ["st", "m", "b"])
        indexing = self._needs_index(root, listed=True)  # as `read_run`: before the script
        if indexing:
            self._queue_index(pipe, root, listed=True)
        try:
            (v, s, p), (st, meta, body), *_ = await pipe.execute()
        except BaseException:
            if indexing:
                self.forget_index(root)
            raise
        if p and not s:
            root = as_text(p)
            self.learn_root(run_id, root)
            pipe = self.r.pipeline(transaction=False)
            pipe.hmget(self.keys.run(run_id, root), ["v", "s", "p"])
            pipe.hmget(self._call_key(run_id, key, root), ["st", "m", "b"])
            (v, s, p), (st, meta, body) = await pipe.execute()
        return (
            v.decode() if v else "",
            self._placed(json_state(s), root) if s else None,
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
        k, run_id, root = self.keys, state.run_id, state.root
        version_after, data = new_version(), state_json(state)
        if written is not None and owner == self.owner:
            await self.index(root, listed=True)
        if chain:
            return bool(
                await self.write_chain(
                    "tool", version, state, chain,
                    [
                        self._call_key(run_id, key, root), k.inflight(owner, root), k.unknown(root),
                        k.calls(root),
                    ],
                    [
                        read_st, written.state if written is not None else "",
                        record_json(written) if written is not None else "", member(run_id, key or ""),
                        str(now),
                    ],
                )
            )  # fmt: skip
        ok = await self.scripts.begin_tool(
            keys=[
                k.run(run_id, root), self._call_key(run_id, key, root), k.inflight(owner, root),
                k.unknown(root), k.calls(root),
            ],
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

    def _call_key(self, run_id: str, key: str | None, root: str) -> str:
        return self.keys.call(run_id, key, root) if key is not None else self.keys.no_call(root)

    # -- idempotency records --------------------------------------------------------------------

    async def get_record(self, run_id: str, key: str) -> IdempotencyRecord | None:
        root = self._roots.get(run_id, run_id if run_id in self._runs else None)
        if root is None:  # the pointer and a root's record in one round trip
            pipe = self.r.pipeline(transaction=False)
            pipe.hget(self.keys.run(run_id), "p")
            pipe.hmget(self.keys.call(run_id, key), ["m", "b"])
            p, (meta, body) = await pipe.execute()
            if not p:
                return json_record(meta, body) if meta else None
            root = as_text(p)
            self.learn_root(run_id, root)
        meta, body = await self.r.hmget(self.keys.call(run_id, key, root), ["m", "b"])
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
        k, root = self.keys, await self.root_of(run_id)
        return bool(
            await self.scripts.set_tool(
                keys=[k.call(run_id, key, root), k.inflight(owner, root), k.unknown(root), k.calls(root)],
                args=[expected, new_state, meta, body, self.retention_ms, member(run_id, key), time.time()],
            )
        )

    async def move_record(self, source: str | bytes, meta: bytes) -> int:
        """Move a record an older layout wrote under `source` (its JSON `meta` as read) to its
        current key (an old record's run is a root). 1: moved; 2: the current key held a newer
        copy (the old one is dropped); 0: the old key changed or went since it was read."""
        r = orjson.loads(meta)
        target = self.keys.call(r["run_id"], r["key"])
        return int(await self.scripts.move_legacy(keys=[source, target], args=[meta]))

    async def tags(self) -> list[str]:
        return [as_text(t) for t in await self.r.zrange(self.keys.tags, 0, -1) if isinstance(t, bytes)]

    async def list_records(
        self, state: str | None, run_id: str | None, limit: int
    ) -> list[IdempotencyRecord]:
        """The records in `state` and of `run_id` (None: any), oldest first; members of the index
        read whose record expired are dropped from it."""
        keys = self.keys
        roots = [await self.root_of(run_id)] if run_id is not None else await self.tags()
        indexes = [(root, keys.unknown(root) if state == UNKNOWN else keys.calls(root)) for root in roots]
        found: list[tuple[float, str, str, bytes]] = []  # (time, root, index, member)
        for i in range(0, len(indexes), LIST_BATCH):  # one round trip per batch of trees
            pipe = self.r.pipeline(transaction=False)
            for _, index in indexes[i : i + LIST_BATCH]:
                pipe.zrange(index, 0, -1, withscores=True)
            for (root, index), members in zip(indexes[i : i + LIST_BATCH], await pipe.execute(), strict=True):
                found += [(score, root, index, raw) for raw, score in members]
        found.sort(key=lambda f: f[0])
        out: list[IdempotencyRecord] = []
        for i in range(0, len(found), LIST_BATCH):  # one round trip per batch
            chunk = found[i : i + LIST_BATCH]
            batch = [(root, index, raw, *orjson.loads(raw)) for _, root, index, raw in chunk]
            batch = [b for b in batch if run_id is None or b[3] == run_id]
            pipe = self.r.pipeline(transaction=False)
            for root, _, _, rid, key in batch:
                pipe.hmget(keys.call(rid, key, root), ["m", "b"])
            for (_, index, raw, _, _), (meta, body) in zip(batch, await pipe.execute(), strict=True):
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
