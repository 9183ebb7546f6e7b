"""The Redis ledger's approvals (DESIGN.md "Tool policies and approvals"): the rules are base.py's
(`open_approval`, `decide_approval`, `deny_for_cancel`); this module stores them, safe on Redis
Cluster: every write of an approval is one single-key compare-and-set script, and each index is
its own key, updated by a separate command after it. Key names are built in `ApprovalKeys` only.

  approval:{<run id>}:<key>    str   the call's approval, JSON (the newest: an expired one is
                                     replaced by the request after it)
  approvals:{<run id>}         set   the keys of the run's calls that asked (a cancel denies them)
  approval-id:<id>             str   JSON [run id, key]: where approval <id> lives
  approvals-pending            zset  ids of pending approvals, by request time (`runcap approvals`)
  approvals-all                zset  every id, by request time (`runcap approvals --all`)

The run's keys carry its id as hash tag, so they share its slot; the global indexes are written
after the record (a crash between the two leaves a record its index lacks: the next request of
the call, or its decision, writes the index again). Every key expires after the retention.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from proxy.ledger import base
from proxy.ledger.redis.codec import as_bytes, as_text
from proxy.ledger.redis.store import Client

# KEYS: record  ARGV: expected JSON ('' = none), new JSON, ttl ms. 1 written, 0 changed meanwhile.
_CAS = """
local now = redis.call('GET', KEYS[1]) or ''
if now == ARGV[2] then return 1 end  -- done: a retried send
if now ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""


@dataclass(frozen=True, slots=True)
class ApprovalKeys:
    prefix: str = "runcap:"

    def record(self, run_id: str, key: str) -> str:
        return f"{self.prefix}approval:{{{run_id}}}:{key}"

    def of_run(self, run_id: str) -> str:
        return f"{self.prefix}approvals:{{{run_id}}}"

    def by_id(self, approval_id: str) -> str:
        return f"{self.prefix}approval-id:{approval_id}"

    @property
    def pending(self) -> str:
        return f"{self.prefix}approvals-pending"

    @property
    def all(self) -> str:
        return f"{self.prefix}approvals-all"


def _dump(a: base.Approval) -> bytes:
    return orjson.dumps(a.as_json())


def _load(raw: bytes | str) -> base.Approval:
    return base.Approval(**orjson.loads(raw))


class RedisApprovals:
    def __init__(self, r: Client, prefix: str, retention_ms: int) -> None:
        self.r = r
        self.keys = ApprovalKeys(prefix)
        self.retention_ms = retention_ms
        self._cas = r.register_script(_CAS)

    async def _read(self, run_id: str, key: str) -> bytes | None:
        raw = await self.r.get(self.keys.record(run_id, key))
        return as_bytes(raw) if raw else None

    async def _write(self, old: bytes | None, new: base.Approval) -> bool:
        k = self.keys.record(new.run_id, new.key)
        return bool(await self._cas(keys=[k], args=[old or b"", _dump(new), self.retention_ms]))

    async def _index(self, a: base.Approval) -> None:
        """The indexes of `a`, each its own key (separate commands: cluster-safe)."""
        ttl = self.retention_ms
        pipe = self.r.pipeline(transaction=False)
        pipe.sadd(self.keys.of_run(a.run_id), a.key)
        pipe.pexpire(self.keys.of_run(a.run_id), ttl)
        pipe.set(self.keys.by_id(a.id), orjson.dumps([a.run_id, a.key]), px=ttl)
        pipe.zadd(self.keys.all, {a.id: a.requested_at})
        if a.state == base.PENDING:
            pipe.zadd(self.keys.pending, {a.id: a.requested_at})
        else:
            pipe.zrem(self.keys.pending, a.id)
        await pipe.execute()

    async def open(self, req: base.ApprovalRequest) -> tuple[base.Approval, bool]:
        while True:
            raw = await self._read(req.run_id, req.key)
            existing = _load(raw) if raw else None
            approval, new = base.open_approval(existing, req)
            if not new:
                return approval, False
            if await self._write(raw, approval):
                if existing is not None:
                    await self.r.zrem(self.keys.pending, existing.id)  # expired
                await self._index(approval)
                return approval, True

    async def _locate(self, approval_id: str) -> tuple[bytes | None, base.Approval | None]:
        where = await self.r.get(self.keys.by_id(approval_id))
        if not where:
            return None, None
        run_id, key = orjson.loads(where)
        raw = await self._read(run_id, key)
        if raw is None:
            return None, None
        approval = _load(raw)
        if approval.id != approval_id:
            return None, None  # replaced by a newer request of the call: this one had expired
        return raw, approval

    async def get(self, approval_id: str, now: float) -> base.Approval | None:
        _, approval = await self._locate(approval_id)
        if approval is not None:
            base.expire_if_due(approval, now)
        return approval

    async def listing(
        self, now: float, state: str | None, run_id: str | None, limit: int
    ) -> list[base.Approval]:
        found: list[base.Approval] = []
        if run_id is not None:
            keys = sorted(as_text(k) for k in await self.r.smembers(self.keys.of_run(run_id)))
            raws = await self.r.mget([self.keys.record(run_id, k) for k in keys]) if keys else []
            found = [_load(r) for r in raws if r]
        else:
            index = self.keys.pending if state == base.PENDING else self.keys.all
            ids = [as_text(i) for i in await self.r.zrange(index, 0, -1)]  # type: ignore[arg-type]
            for approval_id in ids:
                approval = await self.get(approval_id, now)
                if approval is None:
                    await self.r.zrem(index, approval_id)  # its record expired with the retention
                    continue
                found.append(approval)
        out = []
        for approval in sorted(found, key=lambda a: a.requested_at):
            base.expire_if_due(approval, now)
            if state is None or approval.state == state:
                out.append(approval)
        return out[:limit]

    async def decide(
        self, approval_id: str, approve: bool, by: str, reason: str, now: float
    ) -> base.Approval | None:
        while True:
            raw, approval = await self._locate(approval_id)
            if approval is None:
                return None
            try:
                base.decide_approval(approval, approve, by, reason, now)
            except base.ApprovalNotPending:
                await self.r.zrem(self.keys.pending, approval_id)
                raise
            if await self._write(raw, approval):
                await self._index(approval)
                return approval

    async def deny_pending(self, run_id: str, now: float) -> list[base.Approval]:
        denied = []
        for key in await self.r.smembers(self.keys.of_run(run_id)):
            while True:
                raw = await self._read(run_id, as_text(key))
                if raw is None:
                    break
                approval = _load(raw)
                if not base.deny_for_cancel(approval, now):
                    break
                if await self._write(raw, approval):
                    await self._index(approval)
                    denied.append(approval)
                    break
        return denied
