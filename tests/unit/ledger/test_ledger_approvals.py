"""Approvals on both ledger backends (SQLite, Redis): one approval per exact call, a decision that
sticks, expiry, a cancel that denies what is pending, and instances sharing one store (a restart,
a second replica) seeing the same approvals."""

from __future__ import annotations

import time

import pytest

from proxy.ledger.base import (
    APPROVED,
    CANCELLED_BY,
    DENIED,
    EXPIRED,
    PENDING,
    ApprovalNotPending,
    ApprovalRequest,
)
from tests.support.ledgers import backends


def ask(run_id: str = "r", key: str = "k1", *, now: float | None = None, expires_at: float | None = None,
        **kw: str) -> ApprovalRequest:  # fmt: skip
    return ApprovalRequest(
        run_id, key, kw.get("tool", "refund"), kw.get("args_hash", "ah"), kw.get("tenant", ""),
        now or time.time(), expires_at, rule="large", rule_reason="refunds over 100 need a person",
    )  # fmt: skip


async def test_one_approval_per_call_decided_once(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    first, new = await led.open_approval(ask())
    assert new and first.state == PENDING and len(first.id) == 32
    again, new = await led.open_approval(ask())
    assert not new and again.id == first.id
    other, new = await led.open_approval(ask(key="k2"))
    assert new and other.id != first.id
    decided = await led.decide_approval(first.id, True, "alice", "checked the order", time.time())
    assert decided is not None and decided.state == APPROVED and decided.by == "alice"
    # the same call asks again: the decision sticks; the other call is still pending
    seen, new = await led.open_approval(ask())
    assert not new and seen.state == APPROVED and seen.reason == "checked the order"
    got = await led.get_approval(other.id, time.time())
    assert got is not None and got.state == PENDING
    with pytest.raises(ApprovalNotPending):
        await led.decide_approval(first.id, False, "bob", "too late", time.time())
    pending = await led.list_approvals(time.time(), state=PENDING)
    assert [a.id for a in pending] == [other.id]
    assert {a.id for a in await led.list_approvals(time.time())} == {first.id, other.id}
    assert await led.decide_approval("0" * 32, True, "x", "", time.time()) is None


async def test_a_second_instance_sees_and_decides(make_ledger):  # type: ignore[no-untyped-def]
    """A restart (a new instance on the same file) or a second replica (on the same Redis)."""
    a, b = make_ledger(), make_ledger()
    opened, _ = await a.open_approval(ask(tenant="acme"))
    listed = await b.list_approvals(time.time(), state=PENDING)
    assert [(x.id, x.tenant, x.rule) for x in listed] == [(opened.id, "acme", "large")]
    await b.decide_approval(opened.id, False, "bob", "wrong customer", time.time())
    got = await a.get_approval(opened.id, time.time())
    assert got is not None and (got.state, got.by, got.reason) == (DENIED, "bob", "wrong customer")


async def test_expiry_then_a_new_request(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    now = time.time()
    old, _ = await led.open_approval(ask(now=now, expires_at=now + 10))
    later = now + 11
    got = await led.get_approval(old.id, later)
    assert got is not None and got.state == EXPIRED
    assert await led.list_approvals(later, state=PENDING) == []
    with pytest.raises(ApprovalNotPending):
        await led.decide_approval(old.id, True, "alice", "", later)
    fresh, new = await led.open_approval(ask(now=later, expires_at=later + 10))
    assert new and fresh.id != old.id and fresh.state == PENDING
    assert [a.id for a in await led.list_approvals(later, state=PENDING)] == [fresh.id]


async def test_cancel_denies_pending_only(make_ledger):  # type: ignore[no-untyped-def]
    """What a cancel does to a run's approvals (the approvals desk calls it after `cancel`): the
    pending ones are denied, each returned once — a second cancel finds none to deny again."""
    led = make_ledger()
    held, _ = await led.open_approval(ask())
    done, _ = await led.open_approval(ask(key="k2"))
    elsewhere, _ = await led.open_approval(ask(run_id="r2"))
    await led.decide_approval(done.id, True, "alice", "", time.time())
    await led.cancel("r", time.time())
    denied = await led.deny_pending_approvals("r", time.time())
    assert [(a.id, a.state, a.by) for a in denied] == [(held.id, DENIED, CANCELLED_BY)]
    assert await led.deny_pending_approvals("r", time.time()) == []
    got = await led.get_approval(held.id, time.time())
    assert got is not None and got.state == DENIED and got.by == CANCELLED_BY
    kept = await led.get_approval(done.id, time.time())
    assert kept is not None and kept.state == APPROVED
    other = await led.get_approval(elsewhere.id, time.time())
    assert other is not None and other.state == PENDING
    assert [a.id for a in await led.list_approvals(time.time(), run_id="r")] == [held.id, done.id]


def test_redis_keys_of_a_runs_approvals_share_its_slot() -> None:
    """Redis Cluster: a script's keys must share a slot. Each write of an approval touches one key;
    the run's own keys (record, run index) carry the run id as hash tag; the global indexes are
    single keys written by commands of their own."""
    from redis.crc import key_slot

    from proxy.ledger.redis.approvals import ApprovalKeys

    keys = ApprovalKeys("runcap:")
    for run in ("r", "acme:ticket-4711", "a.b-c_d"):
        own = (keys.record(run, "k1"), keys.record(run, "k2"), keys.of_run(run))
        slots = {key_slot(k.encode()) for k in own}
        assert slots == {key_slot(run.encode())}, run
    assert keys.record("a", "b:c") != keys.record("a:b", "c")


@backends("sqlite")  # Redis: the approval keys expire after the retention (PX on every write)
async def test_sqlite_purges_approvals_with_the_retention(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger(retention_s=60)
    old, _ = await led.open_approval(ask())
    await led.decide_approval(old.id, True, "alice", "", time.time())
    kept, _ = await led.open_approval(ask(key="k2"))
    later = time.time() + 30
    assert led.purge(later) == 0
    await led.decide_approval(kept.id, False, "bob", "no", later)
    assert led.purge(time.time() + 61) == 1  # the first, decided more than 60 s before
    assert await led.get_approval(old.id, time.time()) is None
    assert await led.get_approval(kept.id, time.time()) is not None
