"""Run trees (issue 22) on both ledger backends: a run names its parent, the parent's caps bound
its whole subtree in one atomic operation, cancel and deadline reach down the tree, a top-up of
an ancestor lets its stopped descendants go on, recovery settles the whole chain."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from dataclasses import fields, replace

import orjson
import pytest

from proxy.caps import RunCaps
from proxy.errors import BudgetExceeded, DeadlineExceeded, InvalidRequest, RunCancelled
from proxy.ledger.base import (
    ANCESTOR_STOPPED,
    SUB_TOTALS,
    Ledger,
    Reservation,
    RunState,
    Settlement,
    copy_state,
    propagate,
    totals,
    tree_left_after,
    tree_values,
)
from proxy.ledger.redis.codec import json_state, state_json
from proxy.ledger.sqlite.schema import SUB_COLUMNS, row_to_state, state_to_row
from tests.support.ledgers import USD, backends, die, step, tool

CENT = USD // 100
# A call of `step(..., input_tokens=BIG, output=BIG)`: $0.01 of input + up to $0.02 of output.
BIG = 10_000


def full(res: Reservation) -> Settlement:
    """The call used its whole worst case."""
    return Settlement(
        input_tokens=res.input_tokens, output_tokens=res.output_tokens, cost_usd_nanos=res.usd_nanos
    )


async def run(led: Ledger, run_id: str) -> RunState:
    state = await led.get_run(run_id)
    assert state is not None, run_id
    return state


NO_CAPS = RunCaps()


async def call(led: Ledger, run_id: str, caps: RunCaps = NO_CAPS, parent: str = "", **kw) -> RunState:  # type: ignore[no-untyped-def]
    """One whole call: reserve, settle at the worst case."""
    res = await led.begin_step(step(run_id, caps, parent_run_id=parent, **kw))
    return await led.settle(res, full(res), time.time())


async def test_a_child_is_linked_to_its_parent_and_root(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "root")
    child = await call(led, "kid", parent="root")
    grandchild = await call(led, "grandkid", parent="kid")
    assert (child.parent_run_id, child.root_run_id, child.ancestors) == ("root", "root", ("root",))
    assert (grandchild.parent_run_id, grandchild.root) == ("kid", "root")
    assert grandchild.ancestors == ("kid", "root")
    root = await run(led, "root")
    assert root.root == "root" and root.parent_run_id == "" and root.children == 1
    assert root.child_ids == ("kid",)
    # The descendants' spend is in the ancestors' subtree totals, exactly.
    assert root.sub_spent_usd_nanos == child.spent_usd_nanos + grandchild.spent_usd_nanos
    assert (await run(led, "kid")).sub_spent_usd_nanos == grandchild.spent_usd_nanos
    assert root.sub_steps == 2 and root.sub_reserved_usd_nanos == 0
    # A later call without X-Run-Parent is the same child (and counts once).
    again = await call(led, "kid")
    assert again.parent_run_id == "root" and (await run(led, "root")).children == 1


async def test_a_parent_that_is_unknown_ended_or_a_cycle_is_a_named_400(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()

    async def refused(run_id: str, parent: str, **kw) -> InvalidRequest:  # type: ignore[no-untyped-def]
        with pytest.raises(InvalidRequest) as e:
            await led.begin_step(step(run_id, RunCaps(), parent_run_id=parent, **kw))
        assert e.value.param == "X-Run-Parent" and e.value.status == 400
        return e.value

    assert (await refused("orphan", "nobody")).code == "parent_unknown"
    assert await led.get_run("orphan") is None  # nothing was created
    await call(led, "p")
    await call(led, "c", parent="p")
    await call(led, "other")
    # The parent is fixed when the child is created.
    assert (await refused("c", "other")).code == "parent_changed"
    assert (await refused("other", "c")).code == "parent_changed"  # a root stays a root
    # p naming its own descendant: a cycle.
    assert (await refused("p", "c")).code == "parent_cycle"
    # A cancelled parent, and one past its deadline, start no child.
    await led.cancel("other", time.time())
    assert (await refused("c2", "other")).code == "parent_ended"
    await call(led, "brief", RunCaps(timeout_s=5))
    assert (await refused("c3", "brief", now=time.time() + 10)).code == "parent_ended"
    # ... nor does a live parent whose ancestor was cancelled.
    await led.cancel("p", time.time())
    error = await refused("c4", "c")
    assert error.code == "parent_ended" and "'p'" in error.message


async def test_depth_and_fan_out_are_caps(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "r", RunCaps(max_depth=2))
    await call(led, "r.1", parent="r", caps=RunCaps(max_depth=5, max_children=2))  # may not raise r's
    await call(led, "r.1.1", parent="r.1")
    with pytest.raises(BudgetExceeded) as e:  # three levels below r: the tightest ancestor wins
        await call(led, "r.1.1.1", parent="r.1.1")
    assert (e.value.code, e.value.run, e.value.status) == ("max_depth", "r", 402)
    await call(led, "r.1.2", parent="r.1")
    with pytest.raises(BudgetExceeded) as e:
        await call(led, "r.1.3", parent="r.1")
    assert (e.value.code, e.value.run) == ("max_children", "r.1")
    assert await led.get_run("r.1.3") is None and (await run(led, "r.1")).children == 2


@pytest.mark.parametrize("cap", ["max_depth", "max_children"])
async def test_a_zero_depth_or_fan_out_cap_is_kept_and_refuses_every_child(make_ledger, cap):  # type: ignore[no-untyped-def]
    # 0 is a cap ("no sub-runs"), not its absence: a run whose only tree field it is keeps it.
    led = make_ledger()
    await call(led, "r", RunCaps(**{cap: 0}))
    assert getattr((await run(led, "r")).caps, cap) == 0
    with pytest.raises(BudgetExceeded) as e:
        await call(led, "r.1", parent="r")
    assert (e.value.code, e.value.run) == (cap, "r")
    assert await led.get_run("r.1") is None


async def test_a_runs_own_tree_caps_bound_it_before_it_has_children(make_ledger):  # type: ignore[no-untyped-def]
    # "this run and all its descendants together": the run itself counts from its first call.
    led = make_ledger()
    caps = RunCaps(max_tree_steps=2, max_tree_tool_calls=1)
    assert not (await led.begin_step(step("r", caps))).final_step
    final = await led.begin_step(step("r", caps))
    assert final.final_step  # its tree's last step: answer-only
    with pytest.raises(BudgetExceeded) as e:
        await led.begin_step(step("r", caps))
    assert e.value.code == "max_tree_steps"
    assert (await led.begin_tool_call(tool("r", "k1", caps))).action == "execute"
    with pytest.raises(BudgetExceeded) as e:
        await led.begin_tool_call(tool("r", "k2", caps))
    assert e.value.code == "max_tree_tool_calls"
    z = RunCaps(max_tree_steps=0)
    with pytest.raises(BudgetExceeded) as e:  # a zero cap: not even one
        await led.begin_step(step("z", z))
    assert e.value.code == "max_tree_steps" and (await run(led, "z")).caps.max_tree_steps == 0


async def test_an_ancestors_cap_bounds_a_child_and_is_named(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "p", RunCaps(max_usd_nanos=5 * CENT), input_tokens=1000, output=1000)  # $0.003
    first = await led.begin_step(step("c", RunCaps(), parent_run_id="p", input_tokens=BIG, output=3 * BIG))
    # Clamped to what the parent has left: $0.047 - $0.01 of input → 18 500 output tokens.
    assert first.output_limit == 18_500 and first.clamped
    with pytest.raises(BudgetExceeded) as e:  # the parent's budget is held by the call in flight
        await led.begin_step(step("c", RunCaps(), input_tokens=BIG, output=BIG))
    assert (e.value.code, e.value.run) == ("max_usd", "p")
    assert "run p" in e.value.message and orjson.loads(e.value.body("openai"))["error"]["run"] == "p"
    assert (await run(led, "c")).status == ANCESTOR_STOPPED
    assert (await run(led, "p")).status == "budget_exceeded"
    # The call gets no answer: its reservation goes back to the tree.
    await led.settle(first, Settlement(no_answer=True), time.time())
    parent = await run(led, "p")
    assert parent.sub_reserved_usd_nanos == 0 and parent.sub_reserved_tokens == 0


async def test_what_the_tree_leaves_a_child_is_its_tightest_caps_remainder(make_ledger):  # type: ignore[no-untyped-def]
    """`Reservation.tree_left` (X-Run-Remaining-* of a child's call): after the reservation, what
    the tightest of the child's and its ancestors' dollar and token caps leaves; after the
    settlement (`tree_left_after`), the reservation replaced by what the call used."""
    led = make_ledger()
    await call(led, "p", RunCaps(max_usd_nanos=5 * CENT, max_tokens=50_000), input_tokens=1000, output=1000)
    await call(led, "q", parent="p", caps=RunCaps(max_usd_nanos=4 * CENT), input_tokens=1000, output=1000)
    p = await run(led, "p")
    p_usd, p_tokens = 5 * CENT - p.tree_usd_nanos, 50_000 - p.tree_tokens  # $0.044, 46 000
    q = await run(led, "q")
    q_usd = 4 * CENT - q.tree_usd_nanos  # $0.037: tighter than the parent's
    res = await led.begin_step(
        step("c", RunCaps(max_usd_nanos=USD), parent_run_id="q", input_tokens=1000, output=500)
    )
    assert res.tree_left == (q_usd - res.usd_nanos, p_tokens - res.tokens)  # q's dollars, p's tokens
    used = Settlement(input_tokens=1000, output_tokens=100, cost_usd_nanos=1_200_000)
    assert tree_left_after(res, used) == (q_usd - 1_200_000, p_tokens - 1100)
    await led.settle(res, used, time.time())
    assert (5 * CENT - (await run(led, "p")).tree_usd_nanos) == p_usd - 1_200_000
    # The child's next call: what it has used itself counts too.
    again = await led.begin_step(step("c", RunCaps(), input_tokens=1000, output=500))
    assert again.tree_left == (q_usd - 1_200_000 - again.usd_nanos, p_tokens - 1100 - again.tokens)
    await led.settle(again, Settlement(no_answer=True), time.time())
    # No dollar or token cap anywhere in the tree: nothing to show.
    await call(led, "free")
    loose = await led.begin_step(step("f", RunCaps(), parent_run_id="free"))
    assert loose.tree_left == (None, None) and tree_left_after(loose, used) == (None, None)
    await led.settle(loose, used, time.time())
    # Its own cap tighter than any ancestor's: its own remainder.
    own = await led.begin_step(step("d", RunCaps(max_usd_nanos=CENT // 2), parent_run_id="q", output=100))
    assert own.tree_left is not None and own.tree_left[0] == CENT // 2 - own.usd_nanos
    assert tree_left_after(own, Settlement(no_answer=True)) == (CENT // 2, own.tree_left[1] + own.tokens)
    await led.settle(own, Settlement(no_answer=True), time.time())
    # A root has no tree to show, and nothing is computed for it.
    root = await led.begin_step(step("solo", RunCaps(max_usd_nanos=USD)))
    assert root.tree_left is None and tree_left_after(root, used) is None
    await led.settle(root, used, time.time())
    # Never below zero, whatever the call used.
    huge = Settlement(cost_usd_nanos=10**12, output_tokens=10**9)
    assert tree_left_after(replace(res, tree_left=(10, 10)), huge) == (0, 0)


async def test_a_top_up_of_the_parent_lets_its_stopped_child_continue(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "p", RunCaps(max_usd_nanos=3 * CENT), input_tokens=BIG, output=BIG)  # all spent
    with pytest.raises(BudgetExceeded) as e:
        await call(led, "c", parent="p", input_tokens=BIG, output=BIG)
    assert e.value.run == "p"
    assert (await run(led, "c")).status == ANCESTOR_STOPPED  # not terminal by itself
    changed = await led.set_caps("p", {"max_usd_nanos": 10 * CENT}, time.time())
    assert changed is not None and changed[1].status == "active"
    child = await call(led, "c", input_tokens=BIG, output=BIG)
    assert child.status == "active" and child.spent_usd_nanos == 3 * CENT


async def test_a_child_may_lower_never_raise_what_an_ancestor_allows(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "p", RunCaps(max_tokens=50_000), input_tokens=100, output=100)
    # The child asks for more than the parent has: the parent's cap binds.
    res = await led.begin_step(
        step("c", RunCaps(max_tokens=10**9), parent_run_id="p", input_tokens=BIG, output=10**6)
    )
    assert res.input_tokens + res.output_tokens == 50_000 - 200
    await led.settle(res, Settlement(no_answer=True), time.time())
    # Its own lower cap binds below the parent's.
    res = await led.begin_step(
        step("c2", RunCaps(max_tokens=12_000), parent_run_id="p", input_tokens=BIG, output=10**6)
    )
    assert res.output_tokens == 2_000


async def test_tree_steps_and_tool_calls(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "p", RunCaps(max_tree_steps=3, max_tree_tool_calls=2))
    await call(led, "c", parent="p")
    final = await led.begin_step(step("c", RunCaps()))  # the tree's last step: answer-only
    assert final.final_step
    await led.settle(final, Settlement(), time.time())
    with pytest.raises(BudgetExceeded) as e:
        await call(led, "c2", parent="p")
    assert (e.value.code, e.value.run) == ("max_tree_steps", "p")
    assert (await led.begin_tool_call(tool("c", "k1"))).action == "execute"
    assert (await led.begin_tool_call(tool("c", None))).action == "execute"
    with pytest.raises(BudgetExceeded) as e:
        await led.begin_tool_call(tool("c", "k3"))
    assert (e.value.code, e.value.run) == ("max_tree_tool_calls", "p")
    assert (await run(led, "p")).sub_tool_calls == 2


async def test_a_top_up_of_the_parents_tree_caps_lets_its_subtree_continue(make_ledger):  # type: ignore[no-untyped-def]
    """The refusal of a tree cap tells the operator to top up the ancestor: that works for the
    subtree's caps too (steps, tool calls, children, depth), and the stopped runs go on."""
    led = make_ledger()
    await call(led, "p", RunCaps(max_tree_steps=2, max_tree_tool_calls=1, max_children=1, max_depth=1))
    await call(led, "c", parent="p")  # the tree's last step (answer-only)
    with pytest.raises(BudgetExceeded) as e:
        await call(led, "c")
    assert (e.value.code, e.value.run) == ("max_tree_steps", "p") and "top up run p" in e.value.message
    assert (await led.begin_tool_call(tool("c", "k1"))).action == "execute"
    with pytest.raises(BudgetExceeded) as e:
        await led.begin_tool_call(tool("c", "k2"))
    assert e.value.code == "max_tree_tool_calls"
    with pytest.raises(BudgetExceeded) as e:  # a second child, and a grandchild: beyond the caps
        await call(led, "c2", parent="p")
    with pytest.raises(BudgetExceeded):
        await call(led, "g", parent="c")
    change = {"max_tree_steps": 10, "max_tree_tool_calls": 5, "max_children": 3, "max_depth": 2}
    changed = await led.set_caps("p", change, time.time())
    assert changed is not None
    before, after = changed
    assert (before.max_tree_steps, after.caps.max_tree_steps, after.status) == (2, 10, "active")
    assert (after.caps.max_children, after.caps.max_depth, after.caps.max_tree_tool_calls) == (3, 2, 5)
    assert (await call(led, "c")).status == "active"
    assert (await led.begin_tool_call(tool("c", "k2"))).action == "execute"
    assert (await call(led, "c2", parent="p")).parent_run_id == "p"
    assert (await call(led, "g", parent="c")).ancestors == ("c", "p")
    # A child whose own cap forced its final step stays stopped, whatever room the tree has.
    await call(led, "own", RunCaps(max_steps=1), parent="p")
    with pytest.raises(BudgetExceeded) as e:
        await call(led, "own")
    assert e.value.code == "max_steps" and (await run(led, "own")).status == "steps_exceeded"
    assert "already had its answer-only final step" in e.value.message  # its own, not the tree's
    # Kept across restarts of the ledger (stored), and not raised again by a child's headers.
    p = await run(led, "p")
    assert (p.caps.max_tree_steps, p.caps.max_children) == (10, 3)
    await call(led, "p", RunCaps(max_tree_steps=1000))
    assert (await run(led, "p")).caps.max_tree_steps == 10


async def test_a_child_stopped_by_its_trees_tool_calls_goes_on_after_a_top_up(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "p", RunCaps(max_tree_tool_calls=1))
    await call(led, "c", parent="p")
    assert (await led.begin_tool_call(tool("c", "k1"))).action == "execute"  # the tree's last one
    final = await led.begin_step(step("c", RunCaps()))
    assert final.final_step  # answer-only: no tool calls left in the tree
    await led.settle(final, Settlement(), time.time())
    with pytest.raises(BudgetExceeded):
        await call(led, "c")
    await led.set_caps("p", {"max_tree_tool_calls": 3}, time.time())
    after = await led.begin_step(step("c", RunCaps()))
    assert not after.final_step  # room for tool calls again: a full step
    assert after.state.status == (await run(led, "c")).status == "active"  # while the call is in flight
    await led.settle(after, Settlement(), time.time())
    assert (await run(led, "c")).status == "active"


async def test_cancel_and_deadline_reach_down_the_tree(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "p", RunCaps(timeout_s=60))
    await call(led, "c", parent="p")
    await call(led, "g", parent="c")
    # A child stores its own deadline (none); the parent's binds each of its calls.
    assert (await run(led, "c")).caps.deadline is None
    res = await led.begin_step(step("g", RunCaps()))
    assert res.state.deadline == (await run(led, "p")).caps.deadline
    await led.settle(res, Settlement(), time.time())
    # An operator brings the parent's deadline forward: its descendants end with it.
    await led.set_caps("p", {"deadline": time.time() + 5}, time.time())
    with pytest.raises(DeadlineExceeded) as d:
        await call(led, "g", now=time.time() + 10)
    assert "ancestor p" in d.value.message
    assert (await run(led, "g")).status == "ancestor_deadline_exceeded"
    await led.cancel("c", time.time())
    for rid in ("g",):
        with pytest.raises(RunCancelled) as e:
            await call(led, rid)
        assert "ancestor c" in e.value.message
        with pytest.raises(RunCancelled):
            await led.touch_run(rid, "t", RunCaps(), time.time())
        with pytest.raises(RunCancelled):
            await led.begin_tool_call(tool(rid, "k"))
    assert (await run(led, "g")).status == "cancelled"
    await call(led, "p")  # the parent of the cancelled run goes on


async def test_an_extension_of_an_ancestors_deadline_reaches_its_descendants(make_ledger):  # type: ignore[no-untyped-def]
    """A descendant is bound by its ancestors' deadlines as they stand at each of its calls: the
    earliest binds its calls' timeouts and X-Run-Remaining-Ms, a passed one refuses every kind of
    call with a status that is not terminal, and an operator's extension of that ancestor lets
    it go on (a copy of the parent's deadline taken when the child was created would not)."""
    led = make_ledger()
    t0 = time.time()
    await call(led, "p", RunCaps(deadline=t0 + 30))
    await call(led, "c", RunCaps(deadline=t0 + 3600), parent="p")
    await call(led, "g", parent="c")
    res = await led.begin_step(step("g", RunCaps()))
    assert res.state.caps.deadline is None and res.state.deadline == t0 + 30
    assert res.state.remaining(t0)["ms"] == pytest.approx(30_000)
    assert res.state.deadline_status == "ancestor_deadline_exceeded"
    settled = await led.settle(res, Settlement(), time.time())
    assert settled.deadline == t0 + 30  # the settled state too (its run headers, its span)
    touched = await led.touch_run("g", "t", RunCaps(), time.time())
    assert touched.deadline == t0 + 30
    tool_start = await led.begin_tool_call(tool("g", "k0"))
    assert tool_start.state.deadline == t0 + 30
    # Past the parent's deadline: every kind of call of each descendant is refused.
    late = t0 + 60
    for rid in ("c", "g"):
        with pytest.raises(DeadlineExceeded) as d:
            await led.begin_step(step(rid, RunCaps(), now=late))
        assert "ancestor p passed its deadline" in d.value.message
        with pytest.raises(DeadlineExceeded):
            await led.touch_run(rid, "t", RunCaps(), late)
        with pytest.raises(DeadlineExceeded):
            await led.begin_tool_call(tool(rid, "k1", now=late))
        assert (await run(led, rid)).status == "ancestor_deadline_exceeded"
    # The operator extends the parent: the descendants go on, bound by the new deadline.
    await led.set_caps("p", {"deadline": t0 + 600}, t0 + 59)
    for rid, bound in (("c", t0 + 600), ("g", t0 + 600)):
        res = await led.begin_step(step(rid, RunCaps(), now=late))
        assert res.state.deadline == bound and res.state.status == "active"
        await led.settle(res, Settlement(), late)
        assert (await led.begin_tool_call(tool(rid, f"k2{rid}", now=late))).action == "execute"
    # The child's own deadline, earlier than the extended parent's, binds the grandchild then.
    await led.set_caps("c", {"deadline": t0 + 120}, late)
    res = await led.begin_step(step("g", RunCaps(), now=late))
    assert res.state.deadline == t0 + 120
    await led.settle(res, Settlement(), late)
    # Cut by its own deadline, a run's status is terminal as before.
    own = await led.begin_step(step("c", RunCaps(), now=late))
    assert own.state.deadline == t0 + 120 and own.state.deadline_status == "deadline_exceeded"
    await led.settle(own, Settlement(), late)


def test_an_ancestors_deadline_binds_from_its_instant_past_an_expired_ancestor() -> None:
    """`check_tree_live` on a chain directly: an ancestor that expired (None) does not hide the
    ones above it, a deadline binds at its very instant (as a run's own does), and the refusal
    says how long ago it passed."""
    from proxy.ledger.base import check_tree_live

    t = 1_000.0
    child = RunState(run_id="c", caps=RunCaps(deadline=t + 100))
    mid = RunState(run_id="m", caps=RunCaps(deadline=t + 50))
    root = RunState(run_id="r", caps=RunCaps(deadline=t + 10))
    check_tree_live(child, [mid, None, root], t)
    assert child.tree_deadline == t + 10 and child.deadline == t + 10  # past the expired one
    with pytest.raises(DeadlineExceeded) as d:
        check_tree_live(child, [mid, None, root], t + 10)  # the deadline's instant
    assert "its ancestor r passed its deadline 0.000s ago" in d.value.message
    assert child.status == "ancestor_deadline_exceeded"
    with pytest.raises(DeadlineExceeded) as d:
        check_tree_live(child, [None, root], t + 12.5)
    assert "passed its deadline 2.500s ago" in d.value.message
    root.cancelled = True
    with pytest.raises(RunCancelled):
        check_tree_live(child, [None, root], t)


async def test_recovery_of_a_dead_owner_settles_the_whole_chain(make_ledger):  # type: ignore[no-untyped-def]
    a, b = make_ledger(), make_ledger()
    await call(b, "p", RunCaps(max_usd_nanos=USD))
    await call(b, "c", parent="p")
    res = await a.begin_step(step("g", RunCaps(), parent_run_id="c", input_tokens=BIG, output=BIG))
    assert (await run(b, "p")).sub_reserved_usd_nanos == res.usd_nanos
    await die(a)
    recovered = await b.recover()
    assert [r.reservation_id for r in recovered] == [res.id]
    for rid in ("p", "c"):
        node = await run(b, rid)
        assert node.sub_reserved_usd_nanos == 0 and node.sub_reserved_tokens == 0, rid
    parent = await run(b, "p")
    assert parent.sub_spent_usd_nanos == (await run(b, "c")).spent_usd_nanos + res.usd_nanos
    # The late settlement of the owner taken for dead replaces the estimate, in the whole chain.
    await a.settle(res, Settlement(cost_usd_nanos=7), time.time())
    parent = await run(b, "p")
    assert parent.sub_spent_usd_nanos == (await run(b, "c")).spent_usd_nanos + 7


async def _load(led: Ledger, run_id: str, parent: str, caps: RunCaps) -> None:
    """One client of a run: whole calls until the budget refuses one."""
    while True:
        try:
            res = await led.begin_step(step(run_id, caps, parent_run_id=parent, input_tokens=BIG, output=BIG))
        except BudgetExceeded:
            return
        await asyncio.sleep(0)  # the other clients' calls interleave with this one in flight
        await led.settle(res, full(res), time.time())


@pytest.mark.parametrize("child_usd", [None, 20 * CENT])
async def test_six_children_eight_clients_each_never_overshoot_the_parent(make_ledger, child_usd):  # type: ignore[no-untyped-def]
    leds = [make_ledger(), make_ledger()]  # two instances sharing one store, as two replicas
    cap = 50 * CENT
    await call(leds[0], "p", RunCaps(max_usd_nanos=cap), input_tokens=10, output=10)
    child_caps = RunCaps(max_usd_nanos=child_usd)
    clients = [_load(leds[(i + j) % 2], f"c{i}", "p", child_caps) for i in range(6) for j in range(8)]
    await asyncio.gather(*clients)
    parent = await run(leds[0], "p")
    children = [await run(leds[0], f"c{i}") for i in range(6)]
    assert parent.children == 6
    tree = parent.spent_usd_nanos + parent.sub_spent_usd_nanos
    assert tree <= cap and tree >= cap * 95 // 100, tree
    # The books close: the parent's subtree totals are its children's, nothing is left reserved.
    assert parent.sub_spent_usd_nanos == sum(c.spent_usd_nanos for c in children)
    assert parent.sub_reserved_usd_nanos == 0 and all(c.reserved_usd_nanos == 0 for c in children)
    if child_usd is not None:
        assert all(c.spent_usd_nanos <= child_usd for c in children)


def test_a_run_stored_before_run_trees_reads_as_a_root() -> None:
    root = RunState("old", caps=RunCaps(max_usd_nanos=5))
    data = orjson.loads(state_json(root))
    assert len(data) == 25  # a root without tree caps: no tree fields (23 before repeats)
    decoded = json_state(orjson.dumps(data))
    assert (decoded.parent_run_id, decoded.root, decoded.ancestors, decoded.children) == ("", "old", (), 0)
    child = RunState("c", parent_run_id="p", root_run_id="p", ancestors=("p",), sub_steps=3)
    again = json_state(state_json(child))
    assert (again.parent_run_id, again.root_run_id, again.ancestors, again.sub_steps) == ("p", "p", ("p",), 3)


# -- the refusal of a tree's cap, word for word (base._tree_rejection) -----------------------------


def _tree_refusal(code: str | None, node: RunState, state: RunState) -> BudgetExceeded:
    from proxy.ledger.base import _tree_rejection

    return _tree_rejection(state, node, BudgetExceeded(code, "the run's own words"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "caps", "totals", "told", "what"),
    [
        (
            "max_usd", RunCaps(max_usd_nanos=2_000_000_000),
            {"spent_usd_nanos": 100_000_000, "sub_spent_usd_nanos": 1_200_000_000,
             "reserved_usd_nanos": 50_000_000, "sub_reserved_usd_nanos": 250_000_000},
            "max_usd",
            "$0.400000000 left of its $2.000000000 cap (spent $1.300000000, $0.300000000 reserved "
            "by calls in flight)",
        ),
        (None, RunCaps(max_usd_nanos=10), {"sub_spent_usd_nanos": 30}, "max_usd",
         "$0.000000000 left of its $0.000000010 cap (spent $0.000000030, $0.000000000 reserved "
         "by calls in flight)"),
        (
            "max_tokens", RunCaps(max_tokens=1000),
            {"input_tokens": 100, "output_tokens": 50, "reserved_tokens": 25, "sub_tokens": 300,
             "sub_reserved_tokens": 25},
            "max_tokens", "500 of its 1000 tokens left",
        ),
        ("max_tokens", RunCaps(max_tokens=10), {"sub_tokens": 30}, "max_tokens", "0 of its 10 tokens left"),
        ("max_steps", RunCaps(max_tree_steps=5), {"steps": 2, "sub_steps": 3}, "max_tree_steps",
         "used 5 of its 5 model calls"),
        ("max_tool_calls", RunCaps(max_tree_tool_calls=4), {"tool_calls_requested": 1,
         "sub_tool_calls": 3}, "max_tree_tool_calls", "used 4 of its 4 tool calls"),
    ],
)  # fmt: skip
def test_an_ancestors_refusal_names_it_what_is_left_and_the_way_out(
    code: str | None, caps: RunCaps, totals: dict[str, int], told: str, what: str
) -> None:
    header = {
        "max_usd": "X-Run-Max-Usd",
        "max_tokens": "X-Run-Max-Tokens",
        "max_tree_steps": "X-Run-Max-Tree-Steps",
        "max_tree_tool_calls": "X-Run-Max-Tree-Tool-Calls",
    }
    parent = RunState("plan", caps=caps, **totals)  # type: ignore[arg-type]
    child = RunState("kid", parent_run_id="plan", root_run_id="plan", ancestors=("plan",))
    rej = _tree_refusal(code, parent, child)
    assert rej.code == told and rej.run == "plan"
    assert rej.message == (
        f"{header[told]}: run kid is bounded by its ancestor plan's cap, which covers that run's whole "
        f"subtree: plan has {what}, and this call needs more than that. An operator can top up run plan "
        "(runcap caps plan ...) to let its sub-runs continue; otherwise end the run."
    )
    expected = BudgetExceeded(code, "x").run_status or "budget_exceeded"  # type: ignore[arg-type]
    assert parent.status == expected and child.status == ANCESTOR_STOPPED
    # Its own cap: named as its own, and only it is stopped.
    own = RunState("solo", caps=caps, **totals)  # type: ignore[arg-type]
    rej = _tree_refusal(code, own, own)
    assert "run solo is bounded by its own cap" in rej.message and own.status == expected


def test_a_tree_refusal_keeps_the_status_its_cap_gives() -> None:
    parent = RunState("plan", caps=RunCaps(max_tree_steps=1), steps=1)
    child = RunState("kid", parent_run_id="plan", root_run_id="plan", ancestors=("plan",))

    class StepsExceeded(BudgetExceeded):
        run_status = "steps_exceeded"

    from proxy.ledger.base import _tree_rejection

    _tree_rejection(child, parent, StepsExceeded("max_steps", "x"))
    assert parent.status == "steps_exceeded" and child.status == ANCESTOR_STOPPED


# -- what a call of a sub-run reads and writes of its ancestors (issue 22, Performance) ----------


async def test_children_are_listed_in_order_from_an_index_their_calls_do_not_carry(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "p")
    for kid in ("k2", "k1", "k3"):
        await call(led, kid, parent="p")
        await call(led, kid)  # its later calls add no second entry
    parent = await run(led, "p")
    assert parent.child_ids == ("k2", "k1", "k3") and parent.children == 3
    # A call of a child gets its own state: the parent's ids are not in the chain it moves.
    res = await led.begin_step(step("k1", NO_CAPS))
    assert res.state.child_ids == ()
    await led.settle(res, full(res), time.time())
    assert (await run(led, "k1")).child_ids == ()  # no children of its own


async def test_a_refused_call_records_its_ancestors_status_and_a_settlement_reaches_them(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "top", RunCaps(max_usd_nanos=CENT))
    await call(led, "mid", parent="top")
    await call(led, "leaf", parent="mid")  # $0.0009 of the top's $0.01 spent: not a big call's input
    top, mid, leaf = [await run(led, r) for r in ("top", "mid", "leaf")]
    assert top.sub_spent_usd_nanos == mid.spent_usd_nanos + leaf.spent_usd_nanos
    assert mid.sub_spent_usd_nanos == leaf.spent_usd_nanos
    with pytest.raises(BudgetExceeded):
        await led.begin_step(step("leaf", NO_CAPS, input_tokens=BIG, output=BIG))
    assert (await run(led, "top")).status == "budget_exceeded"
    assert (await run(led, "leaf")).status == ANCESTOR_STOPPED
    assert (await run(led, "mid")).status != "budget_exceeded"  # its own cap did not bind
    # The refusal wrote statuses only: the ancestors' totals are what they were.
    assert (await run(led, "top")).sub_spent_usd_nanos == top.sub_spent_usd_nanos
    assert (await run(led, "top")).sub_reserved_usd_nanos == 0


def test_a_state_copy_takes_every_field() -> None:
    state = RunState("r", task="t", caps=RunCaps(max_steps=3), steps=2, ancestors=("a",), sub_steps=4)
    copy = copy_state(state)
    assert copy == state and copy is not state
    assert all(getattr(copy, f.name) is getattr(state, f.name) for f in fields(RunState))


@backends("sqlite")  # SQLite's own columns: the other backends have no such case
async def test_a_sqlite_file_with_subtree_totals_in_the_tree_array_is_upgraded(make_ledger, tmp_path):  # type: ignore[no-untyped-def]
    led = make_ledger()
    await call(led, "p")
    await call(led, "k", parent="p")
    await call(led, "g", parent="k")
    before = {r: await run(led, r) for r in ("p", "k", "g")}
    await led.close()
    # The file as runcap wrote it while the totals were in the array (and the ids of children after it).
    db = sqlite3.connect(tmp_path / "ledger.sqlite3")
    rows = db.execute(f"SELECT run_id, tree, {', '.join(SUB_COLUMNS)} FROM runs").fetchall()
    for run_id, tree, *subs in rows:
        t = json.loads(tree)
        t[SUB_TOTALS.start : SUB_TOTALS.start] = subs
        db.execute("UPDATE runs SET tree = ? WHERE run_id = ?", (json.dumps([*t, ["x"]]), run_id))
    for name in SUB_COLUMNS:
        db.execute(f"ALTER TABLE runs DROP COLUMN {name}")
    db.commit()
    db.close()
    led = make_ledger()
    for run_id, was in before.items():
        now = await run(led, run_id)
        assert (now.ancestors, now.children, now.sub_spent_usd_nanos, now.sub_steps) == (
            was.ancestors, was.children, was.sub_spent_usd_nanos, was.sub_steps,
        )  # fmt: skip
    assert before["p"].sub_steps == 2
    g = await call(led, "g")  # and the totals go on from there
    added = g.spent_usd_nanos - before["g"].spent_usd_nanos
    assert added > 0 and (await run(led, "p")).sub_spent_usd_nanos == before["p"].sub_spent_usd_nanos + added


@backends("sqlite")  # the SQLite ledger's memory of a run's ancestors
async def test_a_run_opened_again_under_another_parent_is_checked_against_its_new_ancestors(make_ledger):  # type: ignore[no-untyped-def]
    # A run's ancestors are fixed while it lives, so the ledger reads them with the run in one
    # statement once it has seen them; a run that expired and was opened again under another
    # parent is checked against the ancestors its row names, not those remembered.
    led = make_ledger()
    await call(led, "p")
    await call(led, "q", RunCaps(max_usd_nanos=CENT))
    await call(led, "c", parent="p")
    await call(led, "c")  # read with its remembered ancestors
    with sqlite3.connect(led.path) as db:  # c expires (purged) ...
        db.execute("DELETE FROM runs WHERE run_id = 'c'")
    await call(make_ledger(), "c", parent="q")  # ... and another worker opens it again, under q
    with pytest.raises(BudgetExceeded) as e:  # q's cent is what binds it now, here too
        await call(led, "c", input_tokens=BIG, output=BIG)
    assert (e.value.code, e.value.run) == ("max_usd", "q")
    assert (await run(led, "c")).ancestors == ("q",)


def test_the_sqlite_tree_column_is_the_tree_values_less_the_subtree_totals() -> None:
    states = [
        RunState("r"),
        RunState("r", caps=RunCaps(max_depth=0)),
        RunState("r", children=2, sub_steps=3, caps=RunCaps(max_tree_steps=9, max_children=0)),
        RunState("c", parent_run_id="p", root_run_id="g", ancestors=("p", "g")),
    ]
    for state in states:
        row = state_to_row(state)
        values = tree_values(state)
        del values[SUB_TOTALS]
        assert (json.loads(row[25]) if row[25] else []) == values
        again = row_to_state(row)
        assert (again.caps, again.ancestors, again.children, again.sub_steps) == (
            state.caps, state.ancestors, state.children, state.sub_steps,
        )  # fmt: skip


def test_propagate_adds_the_change_of_each_total_to_every_ancestor() -> None:
    state = RunState("c", spent_usd_nanos=5, reserved_usd_nanos=7, input_tokens=1, output_tokens=2,
                     reserved_tokens=3, steps=4, tool_calls_requested=1, tool_calls_executed=2)  # fmt: skip
    before = totals(state)
    state.spent_usd_nanos += 10
    state.reserved_usd_nanos -= 7
    state.input_tokens += 20
    state.output_tokens += 30
    state.reserved_tokens -= 3
    state.steps += 1
    state.tool_calls_executed += 3  # tool calls: the max of requested and executed, 2 -> 5
    held = (100, 20, 1000, 30, 9, 2)  # what the parent's subtree held already
    parent = RunState("p", updated_at=50.0)
    (
        parent.sub_spent_usd_nanos, parent.sub_reserved_usd_nanos, parent.sub_tokens,
        parent.sub_reserved_tokens, parent.sub_steps, parent.sub_tool_calls,
    ) = held  # fmt: skip
    root = RunState("r", updated_at=70.0)
    propagate(before, state, [parent, None, root], 60.0)
    for node, had in ((parent, held), (root, (0,) * 6)):
        subs = (
            node.sub_spent_usd_nanos, node.sub_reserved_usd_nanos, node.sub_tokens,
            node.sub_reserved_tokens, node.sub_steps, node.sub_tool_calls,
        )  # fmt: skip
        assert subs == tuple(h + d for h, d in zip(had, (10, -7, 50, -3, 1, 3), strict=True))
    assert (parent.updated_at, root.updated_at) == (60.0, 70.0)  # the newest wins
    propagate(totals(state), state, [parent], 99.0)  # nothing changed: nothing moves
    assert parent.updated_at == 60.0
