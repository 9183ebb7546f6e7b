"""The ledger's rules as pure functions (proxy/ledger/base.py), without a backend: an operator's
caps change, the status a run ends in, a step's reservation at the edge of each cap, a dead
replica's reservation charged and given back, and the refusal of a key reused for another
operation. Every backend calls these same functions (tests/unit/ledger/test_ledger_contract.py checks that
they do, through the backends); here each rule's edges are pinned down, fast, so a changed
comparison or constant is noticed (the mutation target `ledger-rules` runs this file)."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from proxy.caps import RunCaps
from proxy.errors import (
    BudgetExceeded,
    DeadlineExceeded,
    IdempotencyKeyReused,
    InvalidRequest,
    OutcomeUnknown,
    RunCancelled,
)
from proxy.ledger.base import (
    TERMINAL_STATUSES,
    IdempotencyRecord,
    RunState,
    Settlement,
    StepRequest,
    ToolCallRequest,
    apply_caps_change,
    apply_recovery,
    apply_settlement,
    apply_unrecovery,
    begin_unledgered_step,
    decide_step,
    decide_tool_call,
    merge_caps,
    new_run,
)

NOW = 1_000_000.0


def step(**kw: object) -> StepRequest:
    base: dict[str, object] = dict(
        run_id="r", task="", caps=RunCaps(), now=NOW, model="m", input_tokens_bound=100,
        client_output_limit=None, model_output_bound=1000, min_output_tokens=1,
        input_usd_per_mtok=Decimal(1), output_usd_per_mtok=Decimal(2),
    )  # fmt: skip
    base.update(kw)
    return StepRequest(**base)  # type: ignore[arg-type]


def run(**kw: object) -> RunState:
    return RunState(**{"run_id": "r", "started_at": NOW - 10, "updated_at": NOW - 10, **kw})  # type: ignore[arg-type]


# -- an operator's caps change -------------------------------------------------------------------


def test_caps_change_sets_only_the_caps_named_and_remembers_them() -> None:
    state = run(caps=RunCaps(max_usd_nanos=5, max_steps=3, timeout_s=60.0), operator_caps="max_steps")
    apply_caps_change(state, {"max_usd_nanos": 9, "max_tokens": None}, NOW)
    assert state.caps == RunCaps(max_usd_nanos=9, max_steps=3)  # the relative timeout is resolved
    assert state.operator_caps == "max_steps,max_tokens,max_usd_nanos"  # sorted, each once
    apply_caps_change(state, {"max_steps": 4}, NOW)
    assert state.operator_caps == "max_steps,max_tokens,max_usd_nanos"
    assert state.caps.max_steps == 4
    first = run()
    apply_caps_change(first, {"deadline": NOW + 5}, NOW)
    assert first.operator_caps == "deadline" and first.caps.deadline == NOW + 5


def test_caps_change_refuses_what_is_not_an_operator_cap() -> None:
    state = run()
    with pytest.raises(ValueError, match=r"not an operator cap: \['max_context_tokens', 'timeout_s'\]"):
        apply_caps_change(state, {"timeout_s": 5, "max_context_tokens": 9, "max_steps": 2}, NOW)
    assert state.caps == RunCaps() and state.operator_caps == ""


def test_caps_change_moves_updated_at_forward_only() -> None:
    state = run()
    apply_caps_change(state, {"max_steps": 9}, NOW)
    assert state.updated_at == NOW
    apply_caps_change(state, {"max_steps": 8}, NOW - 100)
    assert state.updated_at == NOW


@pytest.mark.parametrize(
    ("status", "cap", "active_again"),
    [
        ("budget_exceeded", "max_usd_nanos", True),
        ("budget_exceeded", "max_tokens", True),
        ("budget_exceeded", "max_steps", False),
        ("steps_exceeded", "max_steps", True),
        ("steps_exceeded", "max_tool_calls", False),
        ("tool_calls_exceeded", "max_tool_calls", True),
        ("tool_calls_exceeded", "max_usd_nanos", False),
        ("deadline_exceeded", "deadline", True),
        ("deadline_exceeded", "max_steps", False),
        ("completed", "max_steps", False),
    ],
)
def test_a_raised_cap_lets_the_run_it_stopped_go_on(status: str, cap: str, active_again: bool) -> None:
    state = run(status=status)
    apply_caps_change(state, {cap: 10}, NOW)
    assert state.status == ("active" if active_again else status)


def test_a_cancelled_run_stays_cancelled_whatever_the_change() -> None:
    state = run(status="cancelled", cancelled=True, upstream_failures=3)
    apply_caps_change(state, {"max_usd_nanos": 10**12, "max_steps": 99, "deadline": NOW + 99}, NOW)
    assert state.status == "cancelled"
    assert state.upstream_failures == 0
    state = run(status="budget_exceeded", cancelled=True, upstream_failures=2)
    apply_caps_change(state, {"max_steps": 99}, NOW)
    assert state.status == "budget_exceeded" and state.upstream_failures == 0


def test_caps_change_forgives_upstream_failures() -> None:
    state = run(status="budget_exceeded", upstream_failures=3)
    apply_caps_change(state, {"max_steps": 99}, NOW)  # no dollar cap named: the failures did it
    assert (state.status, state.upstream_failures) == ("active", 0)
    state = run(status="steps_exceeded", upstream_failures=1)
    apply_caps_change(state, {"max_usd_nanos": 99}, NOW)
    assert (state.status, state.upstream_failures) == ("steps_exceeded", 0)
    state = run(status="budget_exceeded")
    apply_caps_change(state, {"max_steps": 99}, NOW)
    assert state.status == "budget_exceeded"


@pytest.mark.parametrize(
    ("reason", "cap", "cleared"),
    [
        ("max_steps", "max_steps", True),
        ("max_steps", "max_tool_calls", False),
        ("max_tool_calls", "max_tool_calls", True),
        ("max_tool_calls", "max_usd_nanos", False),
    ],
)
def test_a_raised_cap_ends_the_answer_only_step_it_forced(reason: str, cap: str, cleared: bool) -> None:
    state = run(final_reason=reason)
    apply_caps_change(state, {cap: 10}, NOW)
    assert state.final_reason == (None if cleared else reason)


# -- the status a run ends in --------------------------------------------------------------------


@pytest.mark.parametrize("terminal", sorted(TERMINAL_STATUSES - {"cancelled"}))
def test_a_terminal_status_sticks_and_a_refusal_does_not_overwrite_it(terminal: str) -> None:
    state = run(status=terminal, caps=RunCaps(max_steps=1), steps=1)
    with pytest.raises(BudgetExceeded):
        decide_step(state, step())
    assert state.status == terminal


def test_the_refusal_records_its_status_on_a_live_run() -> None:
    state = run(status="active", caps=RunCaps(max_steps=1), steps=1)
    with pytest.raises(BudgetExceeded) as e:
        decide_step(state, step())
    assert state.status == e.value.run_status == "steps_exceeded"
    state = run(status="completed", caps=RunCaps(max_tokens=50))
    with pytest.raises(BudgetExceeded):
        decide_step(state, step())
    assert state.status == "budget_exceeded"


def test_cancelled_wins_over_a_terminal_status() -> None:
    state = run(status="budget_exceeded", cancelled=True)
    with pytest.raises(RunCancelled, match="run r was cancelled"):
        decide_step(state, step())
    assert state.status == "cancelled"


def test_deadline_at_and_after_but_not_before() -> None:
    state = run(caps=RunCaps(deadline=NOW + 1))
    decide_step(state, step())
    assert state.status == "active"
    for now in (NOW + 1, NOW + 2):
        state = run(caps=RunCaps(deadline=NOW + 1))
        with pytest.raises(DeadlineExceeded, match=r"passed its deadline .* ago"):
            decide_step(state, step(now=now))
        assert state.status == "deadline_exceeded"
    state = run(status="steps_exceeded", caps=RunCaps(deadline=NOW))
    with pytest.raises(DeadlineExceeded):
        decide_step(state, step())
    assert state.status == "steps_exceeded"


# -- a step's reservation at the edge of each cap ------------------------------------------------


def test_reservation_without_caps_leaves_the_request_as_it_is() -> None:
    state = run(status="completed")
    res = decide_step(state, step())
    assert res.output_limit is None and not res.clamped and not res.final_step
    assert res.output_tokens == 1000 and res.input_tokens == 100
    assert res.usd_nanos == 100 * 1000 + 1000 * 2000  # $1 and $2 per Mtok, in nanos
    assert (state.steps, state.reserved_tokens, state.reserved_usd_nanos) == (1, 1100, res.usd_nanos)
    assert state.status == "active" and res.step == 1 and res.state == state
    assert res.state is not state  # a snapshot, not the live state
    assert res.counts_as_step and res.ledgered and res.run_id == "r"


def test_reservations_add_up_on_the_run() -> None:
    state = run(reserved_tokens=7, reserved_usd_nanos=11, steps=2)
    res = decide_step(state, step(client_output_limit=10))
    assert res.output_limit is None and res.output_tokens == 10
    assert state.reserved_tokens == 7 + 110 and state.reserved_usd_nanos == 11 + res.usd_nanos
    assert state.steps == 3 and res.step == 3


def test_client_limit_below_the_cap_is_kept_and_above_it_is_clamped() -> None:
    # $0.0021 left = 100 input tokens ($0.0001) + 1000 output tokens at $2/Mtok exactly.
    caps = RunCaps(max_usd_nanos=2_100_000)
    res = decide_step(run(caps=caps), step(client_output_limit=999))
    assert (res.output_limit, res.clamped, res.output_tokens) == (None, False, 999)
    res = decide_step(run(caps=caps), step(client_output_limit=1000))
    assert (res.output_limit, res.clamped, res.output_tokens) == (None, False, 1000)
    res = decide_step(run(caps=caps), step(client_output_limit=1001))
    assert (res.output_limit, res.clamped, res.output_tokens) == (1000, True, 1000)
    # No limit asked for and a cap applies: one is written (an unlimited output is unbounded).
    res = decide_step(run(caps=caps), step(model_output_bound=1000))
    assert (res.output_limit, res.clamped) == (1000, False)
    assert res.usd_nanos == 2_100_000


def test_dollar_cap_counts_spent_and_reserved_and_refuses_below_the_useful_minimum() -> None:
    caps = RunCaps(max_usd_nanos=2_100_000)
    res = decide_step(run(caps=caps, spent_usd_nanos=1_000_000, reserved_usd_nanos=100_000), step())
    assert res.output_tokens == res.output_limit == 450 and res.clamped  # ($0.001 - $0.0001) / $2 per Mtok
    # Exactly the useful minimum left: allowed, clamped to it.
    state = run(caps=caps, spent_usd_nanos=2_100_000 - 100_000 - 2 * 2000)
    res = decide_step(state, step(min_output_tokens=2))
    assert res.output_limit == 2 and state.reserved_usd_nanos == 100_000 + 4000
    # One nano short of it: refused, naming the cap, nothing reserved.
    state = run(caps=caps, spent_usd_nanos=2_100_000 - 100_000 - 2 * 2000 + 1)
    with pytest.raises(BudgetExceeded) as e:
        decide_step(state, step(min_output_tokens=2))
    assert e.value.code == "max_usd" and "X-Run-Max-Usd: run r has $0.000103999 left" in e.value.message
    assert (
        "this call needs at least $0.000104000 (100 input tokens at most + 2 output tokens" in e.value.message
    )
    assert state.reserved_usd_nanos == 0 and state.steps == 0 and state.status == "budget_exceeded"


def test_dollar_cap_less_than_the_input_is_refused() -> None:
    state = run(caps=RunCaps(max_usd_nanos=99_999))  # the input alone costs 100_000
    with pytest.raises(BudgetExceeded) as e:
        decide_step(state, step(min_output_tokens=0))
    assert e.value.code == "max_usd" and "has $0.000099999 left" in e.value.message
    state = run(caps=RunCaps(max_usd_nanos=100_000))  # the input exactly, and no output wanted
    res = decide_step(state, step(min_output_tokens=0))
    assert res.output_tokens == 0 and res.usd_nanos == 100_000
    state = run(caps=RunCaps(max_usd_nanos=1), spent_usd_nanos=5)  # overspent: $0 left, not negative
    with pytest.raises(BudgetExceeded, match=r"has \$0\.000000000 left"):
        decide_step(state, step())


def test_token_cap_counts_used_and_reserved_tokens() -> None:
    caps = RunCaps(max_tokens=1000)
    state = run(caps=caps, input_tokens=200, output_tokens=100, reserved_tokens=50)
    res = decide_step(state, step(input_usd_per_mtok=None, output_usd_per_mtok=None))
    assert res.output_tokens == res.output_limit == 1000 - 350 - 100 and res.clamped
    assert state.reserved_tokens == 50 + 100 + 550
    # Exactly the useful minimum left, then one token short.
    res = decide_step(run(caps=RunCaps(max_tokens=105)), step(min_output_tokens=5))
    assert res.output_limit == 5
    state = run(caps=RunCaps(max_tokens=104), reserved_tokens=0)
    with pytest.raises(BudgetExceeded) as e:
        decide_step(state, step(min_output_tokens=5))
    assert e.value.code == "max_tokens"
    assert "X-Run-Max-Tokens: run r has 104 of its 104 tokens left (0 reserved" in e.value.message
    assert "needs at least 105 (100 input at most + 5 output)" in e.value.message
    state = run(caps=RunCaps(max_tokens=10), input_tokens=50)
    with pytest.raises(BudgetExceeded, match="has 0 of its 10 tokens left"):
        decide_step(state, step())


def test_both_caps_the_tighter_wins() -> None:
    caps = RunCaps(max_usd_nanos=2_100_000, max_tokens=400)
    assert decide_step(run(caps=caps), step()).output_limit == 300
    caps = RunCaps(max_usd_nanos=700_000, max_tokens=10_000)
    assert decide_step(run(caps=caps), step()).output_limit == 300


def test_useful_minimum_is_at_most_what_was_wanted() -> None:
    # min_output_tokens above the client's own limit: the limit is what counts.
    res = decide_step(run(caps=RunCaps(max_tokens=150)), step(client_output_limit=50, min_output_tokens=500))
    assert res.output_tokens == 50 and res.output_limit is None


def test_unpriced_model_under_a_dollar_cap() -> None:
    caps = RunCaps(max_usd_nanos=10**9)
    for prices in ({"input_usd_per_mtok": None}, {"output_usd_per_mtok": None}):
        with pytest.raises(InvalidRequest) as e:
            decide_step(run(caps=caps), step(**prices))
        assert e.value.code == "unpriced_model" and "model 'm' has no known price" in e.value.message
    res = decide_step(run(caps=caps), step(input_usd_per_mtok=None, allow_unpriced=True))
    # Priced by what is known (the output), nothing clamped: the cap cannot be enforced.
    assert res.usd_nanos == 1000 * 2000 and res.output_limit is None and not res.clamped
    res = decide_step(run(), step(input_usd_per_mtok=None))  # no dollar cap: nothing to enforce
    assert res.output_tokens == 1000


def test_steps_the_last_one_is_answer_only_and_the_next_is_refused() -> None:
    state = run(caps=RunCaps(max_steps=3), steps=1)
    res = decide_step(state, step())
    assert not res.final_step and state.final_reason is None and state.steps == 2
    res = decide_step(state, step())
    assert res.final_step and state.final_reason == "max_steps" and state.steps == 3
    with pytest.raises(BudgetExceeded) as e:
        decide_step(state, step())
    assert e.value.code == "max_steps" and "already had its answer-only final step" in e.value.message
    state = run(caps=RunCaps(max_steps=3), steps=3)
    with pytest.raises(BudgetExceeded) as e:
        decide_step(state, step())
    assert e.value.code == "max_steps" and "has used all 3 steps" in e.value.message
    assert state.steps == 3


def test_tool_call_cap_makes_the_step_answer_only() -> None:
    state = run(caps=RunCaps(max_tool_calls=2), tool_calls_requested=1)
    assert not decide_step(state, step()).final_step
    state = run(caps=RunCaps(max_tool_calls=2), tool_calls_executed=2)
    res = decide_step(state, step())
    assert res.final_step and state.final_reason == "max_tool_calls"
    # The step cap's reason wins when both apply.
    state = run(caps=RunCaps(max_tool_calls=0, max_steps=1))
    assert decide_step(state, step()).final_step and state.final_reason == "max_steps"


def test_a_call_that_is_not_a_step() -> None:
    state = run(caps=RunCaps(max_steps=1, max_tool_calls=0), steps=1, final_reason="max_steps")
    res = decide_step(state, step(counts_as_step=False))  # an embedding: tokens, no step
    assert not res.final_step and not res.counts_as_step and state.steps == 1
    assert state.reserved_tokens == 1100


def test_upstream_failures_in_a_row_stop_the_run_at_the_limit() -> None:
    decide_step(run(upstream_failures=2), step(max_upstream_failures=3))
    decide_step(run(upstream_failures=99), step())  # no limit
    state = run(upstream_failures=3)
    with pytest.raises(BudgetExceeded) as e:
        decide_step(state, step(max_upstream_failures=3))
    assert e.value.code == "max_upstream_failures"
    assert "the last 3 model calls of run r got no answer" in e.value.message
    assert "the limit is 3 in a row" in e.value.message
    assert state.steps == 0 and state.reserved_tokens == 0


def test_headers_may_lower_a_cap_and_the_task_sticks() -> None:
    state = run(caps=RunCaps(max_steps=5))
    decide_step(state, step(caps=RunCaps(max_steps=9), task="triage"))
    assert state.caps.max_steps == 5 and state.task == "triage"
    decide_step(state, step(caps=RunCaps(max_steps=2), task="other"))
    assert state.caps.max_steps == 2 and state.task == "triage"


def test_unledgered_step_is_the_same_decision_on_a_new_run() -> None:
    res = begin_unledgered_step(step(run_id="gen", task="t"))
    assert not res.ledgered and res.step == 1 and res.state.steps == 1
    assert res.state.run_id == "gen" and res.state.task == "t"
    assert res.state.started_at == NOW and res.state.updated_at == NOW
    assert res.output_limit is None and res.output_tokens == 1000
    assert res.state.reserved_tokens == 1100 and res.usd_nanos == res.state.reserved_usd_nanos


# -- a dead replica's reservation -------------------------------------------------------------------


def test_recovery_charges_the_worst_case_and_unrecovery_gives_it_back() -> None:
    state = run(
        reserved_usd_nanos=500, reserved_tokens=300, spent_usd_nanos=7, input_tokens=1, output_tokens=2
    )
    apply_recovery(state, 400, 100, 150, NOW)
    assert (state.reserved_usd_nanos, state.reserved_tokens) == (100, 50)
    assert (state.spent_usd_nanos, state.input_tokens, state.output_tokens) == (407, 101, 152)
    assert state.updated_at == NOW
    apply_unrecovery(state, 400, 100, 150, NOW - 5)
    assert (state.reserved_usd_nanos, state.reserved_tokens) == (500, 300)
    assert (state.spent_usd_nanos, state.input_tokens, state.output_tokens) == (7, 1, 2)
    assert state.updated_at == NOW


def test_recovery_and_unrecovery_never_go_below_zero() -> None:
    state = run(reserved_usd_nanos=10, reserved_tokens=10)
    apply_recovery(state, 400, 100, 150, NOW)
    assert (state.reserved_usd_nanos, state.reserved_tokens) == (0, 0)
    state = run(spent_usd_nanos=10, input_tokens=3, output_tokens=4)
    apply_unrecovery(state, 400, 100, 150, NOW)
    assert (state.spent_usd_nanos, state.input_tokens, state.output_tokens) == (0, 0, 0)
    assert (state.reserved_usd_nanos, state.reserved_tokens) == (400, 250)
    state = run(updated_at=NOW + 9)
    apply_recovery(state, 1, 1, 1, NOW)
    assert state.updated_at == NOW + 9


# -- a key reused for another operation ---------------------------------------------------------


def record(**kw: object) -> IdempotencyRecord:
    base: dict[str, object] = dict(
        run_id="r", key="K", tool="refund", args_hash="a", state="completed", owner="o",
        created_at=NOW, updated_at=NOW, method="POST", path="",
    )  # fmt: skip
    base.update(kw)
    return IdempotencyRecord(**base)  # type: ignore[arg-type]


def tool_call(**kw: object) -> ToolCallRequest:
    base: dict[str, object] = dict(
        run_id="r", task="", caps=RunCaps(), now=NOW, tool="refund", key="K", args_hash="a"
    )
    base.update(kw)
    return ToolCallRequest(**base)  # type: ignore[arg-type]


def reused(rec: IdempotencyRecord, req: ToolCallRequest) -> str:
    before = replace(rec)
    with pytest.raises(IdempotencyKeyReused) as e:
        decide_tool_call(run(), rec, req, "o", True)
    assert rec == before  # the record is left as it is
    return e.value.message


def test_key_reused_names_both_operations() -> None:
    message = reused(record(path="accounts/1"), tool_call(method="DELETE", path="?x=1"))
    assert message.startswith(
        "Idempotency-Key 'K' of run r belongs to POST /tools/refund/accounts/1 (completed); "
        "this request is DELETE /tools/refund?x=1, so it was neither executed nor answered"
    )
    assert "Send a new operation with a new Idempotency-Key" in message


def test_key_reused_with_other_arguments_says_so() -> None:
    message = reused(record(state="unknown"), tool_call(args_hash="b"))
    assert (
        "belongs to POST /tools/refund (unknown); this request is POST /tools/refund with other arguments,"
        in message
    )
    message = reused(record(method="", tool="refund"), tool_call(tool="other"))
    assert "belongs to a call to tool 'refund' (completed); this request is POST /tools/other, so" in message
    message = reused(record(state="in_flight"), tool_call(path="x"))
    assert "this request is POST /tools/refund/x, so" in message


def test_key_reused_message_in_full() -> None:
    assert reused(record(), tool_call(path="x")) == (
        "Idempotency-Key 'K' of run r belongs to POST /tools/refund (completed); this request is "
        "POST /tools/refund/x, so it was neither executed nor answered with that call's result. "
        "Send a new operation with a new Idempotency-Key (or none, to let runcap derive one); "
        "repeat the original request unchanged to get its result."
    )


# -- a tool call's decision ---------------------------------------------------------------------


def test_tool_call_replays_a_completed_record_and_waits_for_one_in_flight() -> None:
    rec = record()
    start = decide_tool_call(run(), rec, tool_call(task="refunds"), "me", False)
    assert (start.action, start.record) == ("replay", rec) and start.state.task == "refunds"
    rec = record(state="in_flight", owner="other")
    start = decide_tool_call(run(), rec, tool_call(), "me", True)
    assert start.action == "wait" and start.record is rec and start.state.run_id == "r"
    assert rec.state == "in_flight"


def test_tool_call_of_a_dead_owner_turns_unknown() -> None:
    rec = record(state="in_flight", owner="other", updated_at=NOW - 50)
    with pytest.raises(OutcomeUnknown) as e:
        decide_tool_call(run(), rec, tool_call(), "me", False)
    assert (rec.state, rec.updated_at, rec.error) == ("unknown", NOW, "the runcap process executing it died")
    assert e.value.message == (
        "tool call K (refund) of run r was interrupted (the runcap process executing it died) and "
        "may or may not have taken effect; it will not be executed again until an operator resolves "
        "it with `runcap reconcile` — check the tool's side, or continue the run without it"
    )
    with pytest.raises(OutcomeUnknown, match=r"was interrupted \(outcome unknown\) and may"):
        decide_tool_call(run(), record(state="unknown"), tool_call(), "me", True)


def test_tool_call_cap_counts_executions() -> None:
    state = run(
        status="completed", caps=RunCaps(max_tool_calls=2), tool_calls_executed=1, tool_calls_requested=5
    )
    start = decide_tool_call(state, None, tool_call(key=None), "me", True)
    assert start.action == "execute" and start.record is None
    assert state.tool_calls_executed == 2 and state.status == "active" and start.state == state
    with pytest.raises(BudgetExceeded) as e:
        decide_tool_call(state, None, tool_call(), "me", True)
    assert e.value.code == "max_tool_calls" and e.value.message == (
        "X-Run-Max-Tool-Calls: run r has used all 2 tool calls; the call was not executed — answer "
        "without it or start a new run"
    )
    assert state.status == "tool_calls_exceeded" and state.tool_calls_executed == 2
    state = run(status="steps_exceeded")
    decide_tool_call(state, None, tool_call(), "me", True)
    assert state.status == "steps_exceeded"


def test_tool_call_records_its_intent() -> None:
    state = run(steps=4)
    req = tool_call(method="PUT", path="a?b=1", op_hash="op", args_hash="args")
    new = decide_tool_call(state, None, req, "me", True).record
    assert new == IdempotencyRecord(
        run_id="r", key="K", tool="refund", args_hash="args", state="in_flight", owner="me",
        created_at=NOW, updated_at=NOW, method="PUT", path="a?b=1", op_hash="op", step=4,
    )  # fmt: skip


# -- a settlement -----------------------------------------------------------------------------------


def settled(state: RunState, s: Settlement, **req: object) -> RunState:
    res = decide_step(state, step(**req))
    apply_settlement(state, res, s, NOW + 1)
    return state


def test_settlement_adds_what_was_used_and_frees_the_reservation() -> None:
    state = run(spent_usd_nanos=5, input_tokens=1, output_tokens=2, tool_calls_requested=3, reserved_tokens=7)
    settled(state, Settlement(input_tokens=20, output_tokens=30, cost_usd_nanos=10, tool_calls_requested=4))
    assert (state.spent_usd_nanos, state.input_tokens, state.output_tokens) == (15, 21, 32)
    assert state.tool_calls_requested == 7 and state.reserved_tokens == 7 and state.reserved_usd_nanos == 0
    assert state.updated_at == NOW + 1 and state.status == "active" and state.steps == 1


def test_the_first_context_reading_is_the_baseline() -> None:
    state = settled(run(), Settlement(context_tokens=0))
    assert state.context_baseline == 0
    settled(state, Settlement(context_tokens=70))
    settled(state, Settlement(context_tokens=90))
    assert state.context_baseline == 70


def test_a_call_without_an_answer_gives_its_step_back() -> None:
    state = settled(run(upstream_failures=2), Settlement(no_answer=True, upstream_failed=True))
    assert (state.steps, state.upstream_failures) == (0, 3)
    state = settled(run(steps=2, upstream_failures=2), Settlement(no_answer=True))  # cut by the agent
    assert (state.steps, state.upstream_failures) == (2, 2)
    state = settled(run(upstream_failures=2), Settlement())
    assert (state.steps, state.upstream_failures) == (1, 0)
    # The answer-only final step, unanswered: it is the final step again.
    state = settled(run(caps=RunCaps(max_steps=2), steps=1), Settlement(no_answer=True))
    assert state.final_reason is None and state.steps == 1 and state.status == "active"
    # An embedding (not a step) without an answer takes no step back.
    state = settled(run(steps=3), Settlement(no_answer=True), counts_as_step=False)
    assert state.steps == 3


def test_settlement_status() -> None:
    assert settled(run(), Settlement(finished=True)).status == "completed"
    assert settled(run(status="completed"), Settlement()).status == "active"
    state = run()
    res = decide_step(state, step())
    state.status = "budget_exceeded"
    apply_settlement(state, res, Settlement(finished=True), NOW)
    assert state.status == "budget_exceeded"
    apply_settlement(state, res, Settlement(run_status="cancelled"), NOW)
    assert state.status == "cancelled"
    assert (
        settled(run(), Settlement(run_status="deadline_exceeded", finished=True)).status
        == "deadline_exceeded"
    )


@pytest.mark.parametrize(
    ("caps", "status"),
    [(RunCaps(max_steps=1), "steps_exceeded"), (RunCaps(max_tool_calls=0), "tool_calls_exceeded")],
)
def test_the_answered_final_step_ends_the_run_on_its_cap(caps: RunCaps, status: str) -> None:
    assert settled(run(caps=caps), Settlement(finished=True)).status == status
    assert settled(run(caps=caps), Settlement(no_answer=True)).status == "active"
    state = run(final_reason="max_steps")  # forced earlier; this call was not the final step
    res = decide_step(state, step(counts_as_step=False))
    apply_settlement(state, res, Settlement(), NOW)
    assert state.status == "active"


# -- a new run, and later requests' caps ------------------------------------------------------------


def test_new_run_resolves_its_timeout_from_its_start() -> None:
    state = new_run("r", "t", RunCaps(timeout_s=5.0, max_steps=2), NOW)
    assert (state.task, state.started_at, state.updated_at) == ("t", NOW, NOW)
    assert state.caps == RunCaps(max_steps=2, deadline=NOW + 5)


def test_later_requests_cannot_change_an_operators_caps() -> None:
    state = run(caps=RunCaps(max_steps=9, max_usd_nanos=10**9), operator_caps="max_steps,max_usd_nanos")
    merge_caps(state, "", RunCaps(max_steps=2, max_usd_nanos=1, max_tokens=50, timeout_s=4.0), NOW)
    assert state.caps == RunCaps(max_steps=9, max_usd_nanos=10**9, max_tokens=50, deadline=NOW - 10 + 4)
    assert state.updated_at == NOW


def test_deadline_message_says_how_long_ago() -> None:
    with pytest.raises(DeadlineExceeded) as e:
        decide_step(run(caps=RunCaps(deadline=NOW - 1.5)), step())
    assert e.value.message == (
        "run r passed its deadline (X-Run-Deadline / X-Run-Timeout) 1.500s ago; end the run"
    )


def test_unledgered_step_is_not_ledgered() -> None:
    assert begin_unledgered_step(step()).ledgered is False


# -- fees and hosted-tool uses ----------------------------------------------------------------------


def test_fixed_fees_are_reserved_with_the_input() -> None:
    res = decide_step(run(), step(fixed_usd_nanos=5000))
    assert res.usd_nanos == 100_000 + 5000 + 1000 * 2000


def test_hosted_tool_uses_the_request_limits_are_reserved() -> None:
    hosted = {"hosted_tools": True, "use_tokens": 50, "use_usd_nanos": 7000, "fixed_usd_nanos": 5000}
    res = decide_step(run(), step(uses_wanted=2, **hosted))
    assert (res.uses, res.hosted_uses) == (2, None)  # the request's own limit: left as it is
    assert res.input_tokens == 100 + 2 * 50
    assert res.usd_nanos == 100_000 + 5000 + 2 * 7000 + 1000 * 2000
    # An answer-only step has its tools stripped: no use reserved.
    res = decide_step(run(caps=RunCaps(max_steps=1)), step(uses_wanted=2, **hosted))
    assert res.final_step and (res.uses, res.hosted_uses) == (0, None) and res.input_tokens == 100


def test_hosted_tool_uses_are_bounded_by_the_dollars_left() -> None:
    hosted = {"hosted_tools": True, "use_tokens": 50, "use_usd_nanos": 7000, "fixed_usd_nanos": 5000}
    # Input, fees and the useful output paid for, then three uses and a little less than a fourth.
    cap = 100_000 + 5000 + 10 * 2000 + 3 * 7000 + 6999
    res = decide_step(run(caps=RunCaps(max_usd_nanos=cap)), step(min_output_tokens=10, **hosted))
    assert (res.uses, res.hosted_uses) == (3, 3)  # no limit in the request: runcap writes one
    assert res.usd_nanos <= cap


# -- messages and limits written -----------------------------------------------------------------


def test_a_token_cap_writes_a_limit_when_the_request_has_none() -> None:
    res = decide_step(run(caps=RunCaps(max_tokens=10**9)), step())
    assert (res.output_limit, res.clamped) == (1000, False)


def test_an_unpriced_output_costs_nothing_reserved() -> None:
    res = decide_step(
        run(caps=RunCaps(max_usd_nanos=10**9)), step(output_usd_per_mtok=None, allow_unpriced=True)
    )
    assert res.usd_nanos == 100_000  # the input's price only
    with pytest.raises(InvalidRequest) as e:
        decide_step(run(caps=RunCaps(max_usd_nanos=10**9)), step(output_usd_per_mtok=None))
    assert e.value.param == "model"


def test_refusal_messages_in_full() -> None:
    with pytest.raises(BudgetExceeded) as e:
        decide_step(run(upstream_failures=2), step(max_upstream_failures=2))
    assert e.value.message == (
        "caps.max_upstream_failures: the last 2 model calls of run r got no answer from the upstream "
        "(connection error, 408/409/429/5xx or cut before any output; the limit is 2 in a row), so "
        "runcap stopped the run. Check the provider, then start a new run, or have an operator let "
        "this one go on (runcap caps RUN_ID ...)."
    )
    with pytest.raises(BudgetExceeded) as e:
        decide_step(run(final_reason="max_tool_calls"), step())
    assert e.value.message == (
        "X-Run-Max-Tool-Calls: run r already had its answer-only final step; the run is over — "
        "start a new run to continue"
    )
    with pytest.raises(BudgetExceeded) as e:
        decide_step(run(caps=RunCaps(max_steps=2), steps=2), step())
    assert e.value.message == (
        "X-Run-Max-Steps: run r has used all 2 steps; the run is over — start a new run to continue"
    )
    with pytest.raises(BudgetExceeded) as e:
        decide_step(run(caps=RunCaps(max_usd_nanos=1)), step(fixed_usd_nanos=5000))
    assert e.value.message.endswith(
        "(100 input tokens at most + 1 output tokens of m + $0.000005000 of fees). The run is out of "
        "budget: end it or start a new run."
    ), e.value.message
