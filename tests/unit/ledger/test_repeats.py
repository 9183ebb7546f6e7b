"""Loops that stop themselves (`X-Run-Max-Repeats`, proxy/ledger/repeats.py): the rule against an
oracle that reads the whole call sequence (hypothesis: a sequence with no repeat beyond N and no
short cycle is never touched; one with is caught at the call that makes it one), and on both
ledgers (SQLite, Redis): the answer-only step that follows, the refused repeat of a request, the
run's status, the window's bounds, and the state shared by replicas and kept across restarts."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.caps import RunCaps
from proxy.errors import BudgetExceeded
from proxy.ledger.base import Settlement
from proxy.ledger.repeats import (
    CALLS_KEPT,
    PERIODS,
    REQUESTS_KEPT,
    Repeats,
    call_fingerprint,
    note_calls,
)
from tests.support.ledgers import step

# ---- the rule, against an oracle over the whole sequence -----------------------------------------


def oracle(calls: list[str], limit: int) -> int | None:
    """The index of the first call that makes the sequence spin, read off the whole sequence:
    a call requested more than `limit` times so far, or the sequence so far ending in a block of
    2-4 calls (not all one call) repeated max(limit, 2) times back to back."""
    rounds = max(limit, 2)
    for i in range(len(calls)):
        seen = calls[: i + 1]
        if seen.count(calls[i]) > limit:
            return i
        for p in PERIODS:
            if len(seen) >= p * rounds:
                block = seen[-p:]
                if len(set(block)) > 1 and seen[-p * rounds :] == block * rounds:
                    return i
    return None


def first_caught(answers: list[list[str]], limit: int) -> int | None:
    """The answer (0-based) at which `note_calls` first says the run spins."""
    repeats = Repeats()
    for n, answer in enumerate(answers):
        if note_calls(repeats, answer, limit, n + 1):
            assert repeats.stopped and repeats.stopped_step == n + 1
            return n
    assert not repeats.stopped
    return None


# A few tools and arguments, so that repeats and cycles happen often; answers of 0-3 calls.
POOL = [call_fingerprint(t, a) for t in ("refund", "lookup", "search") for a in ("a1", "b2")]
CALLS = st.sampled_from(POOL)
ANSWERS = st.lists(st.lists(CALLS, max_size=3), min_size=1, max_size=14)
PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(answers=ANSWERS, limit=st.integers(min_value=1, max_value=4))
def test_the_rule_matches_the_oracle(answers: list[list[str]], limit: int) -> None:
    flat = [c for a in answers for c in a]
    index = oracle(flat, limit)
    expected = None
    if index is not None:  # the answer holding that call
        expected = next(n for n in range(len(answers)) if sum(map(len, answers[: n + 1])) > index)
    assert first_caught(answers, limit) == expected


def test_the_rule_matches_the_oracle_on_a_fixed_count_of_both_kinds() -> None:
    """The same check on 600 seeded sequences, with a minimum of clean and of caught runs (so
    the property is not vacuous whatever hypothesis happens to draw)."""
    rng = random.Random(2323)
    pool = POOL
    kinds = {"clean": 0, "caught": 0}
    for _ in range(600):
        limit = rng.randint(1, 4)
        answers = [[rng.choice(pool[: rng.randint(2, 6)]) for _ in range(rng.randint(0, 3))]
                   for _ in range(rng.randint(1, 12))]  # fmt: skip
        flat = [c for a in answers for c in a]
        index = oracle(flat, limit)
        caught = first_caught(answers, limit)
        if index is None:
            assert caught is None, (answers, limit)
            kinds["clean"] += 1
        else:
            assert caught is not None, (answers, limit)
            assert sum(map(len, answers[:caught])) <= index < sum(map(len, answers[: caught + 1]))
            kinds["caught"] += 1
    assert kinds["clean"] >= 100 and kinds["caught"] >= 100, kinds


def test_a_run_that_repeats_nothing_is_never_touched() -> None:
    """Hundreds of distinct calls (more than the window keeps) and short cycles that never come
    round max(N, 2) times: nothing is caught."""
    repeats = Repeats()
    for i in range(500):
        assert not note_calls(repeats, [call_fingerprint("lookup", f"{i:016x}")], 2, i + 1)
    assert len(repeats.calls) == CALLS_KEPT and len(repeats.last) == max(PERIODS)
    assert not repeats.stopped
    # A B then C: a block seen once is not a cycle at N = 2; nor is A A (the repeat rule's).
    a, b, c = (call_fingerprint(t, "x") for t in "abc")
    assert not note_calls(Repeats(), [a, b, a, c, b, c], 2, 1)
    assert not note_calls(Repeats(), [a, a, b, b], 2, 1)


def test_the_window_is_bounded_and_round_trips() -> None:
    repeats = Repeats()
    for i in range(200):
        note_calls(repeats, [call_fingerprint("t" * 500, f"{i:016x}")], 3, i)
    assert len(repeats.calls) == CALLS_KEPT
    assert all(len(fp) == 64 + 1 + 16 for fp in repeats.calls)  # the name is cut at 64 characters
    for i in range(40):
        from proxy.ledger.repeats import note_request

        note_request(repeats, f"{i:032x}")
    assert len(repeats.requests) == REQUESTS_KEPT
    assert list(repeats.requests)[-1] == f"{39:032x}"  # the most recent are kept
    assert Repeats.from_json(repeats.to_json()) == repeats
    assert Repeats().to_json() == "" and Repeats.from_json("") == Repeats()


# ---- on both ledgers ------------------------------------------------------------------------------

CAP = RunCaps(max_repeats=2)
REFUND = call_fingerprint("refund", "a" * 64)
LOOKUP = call_fingerprint("lookup", "b" * 64)


async def answer(led, run_id, calls, caps=CAP, fingerprint=""):  # type: ignore[no-untyped-def]
    res = await led.begin_step(step(run_id, caps, request_fingerprint=fingerprint))
    settled = Settlement(tool_calls_requested=len(calls), tool_call_fingerprints=tuple(calls))
    state = await led.settle(res, settled, time.time())
    return res, state


async def test_a_repeated_call_makes_the_next_step_answer_only(make_ledger):  # type: ignore[no-untyped-def]
    """At N = 2 the third identical call is caught: the next step is answer-only, the one after
    is refused naming the cap, and the run ends `repeats_exceeded` — on another instance (a
    replica) and a new one (a restart) alike."""
    a, b = make_ledger(), make_ledger()
    for n in (1, 2):
        res, state = await answer(a if n == 1 else b, "spin", [REFUND])
        assert not res.final_step and not state.repeats.stopped
    res, state = await answer(a, "spin", [REFUND])
    assert not res.final_step  # this answer is out already: the next step is the answer-only one
    assert state.repeats.stopped.startswith(f"repeat: {REFUND} requested 3 times")
    assert state.repeats.stopped_step == 3
    restarted = make_ledger()
    res = await restarted.begin_step(step("spin", RunCaps()))  # a request without the header
    assert res.final_step and res.state.final_reason == "max_repeats"
    state = await restarted.settle(res, Settlement(finished=True), time.time())
    assert state.status == "repeats_exceeded"
    with pytest.raises(BudgetExceeded) as refused:
        await b.begin_step(step("spin", CAP))
    assert refused.value.code == "max_repeats"
    assert refused.value.message.startswith(
        "X-Run-Max-Repeats: run spin already had its answer-only final step"
    )


async def test_a_ping_pong_is_caught_the_same_way(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    for calls in ([REFUND], [LOOKUP], [REFUND]):
        res, state = await answer(led, "pp", calls)
        assert not state.repeats.stopped
    _, state = await answer(led, "pp", [LOOKUP])
    assert state.repeats.stopped.startswith(f"cycle: {REFUND}, {LOOKUP} repeated 2 times")
    res = await led.begin_step(step("pp", CAP))
    assert res.final_step and res.state.final_reason == "max_repeats"


async def test_an_unanswered_step_gives_its_answer_only_step_back(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    for _ in range(3):
        await answer(led, "retry", [REFUND])
    res = await led.begin_step(step("retry", CAP))
    assert res.final_step
    await led.settle(res, Settlement(no_answer=True, upstream_failed=True), time.time())
    res = await led.begin_step(step("retry", CAP))  # the provider failed: the next is it again
    assert res.final_step and res.state.final_reason == "max_repeats"


async def test_the_same_request_answered_n_times_is_refused(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    body = "0" * 32
    await answer(led, "same", [], fingerprint=body)
    # A copy that got no answer (a 5xx the SDK retries) is not counted.
    res = await led.begin_step(step("same", CAP, request_fingerprint=body))
    await led.settle(res, Settlement(no_answer=True, upstream_failed=True), time.time())
    await answer(led, "same", [], fingerprint=body)
    with pytest.raises(BudgetExceeded) as refused:
        await led.begin_step(step("same", CAP, request_fingerprint=body))
    assert refused.value.code == "max_repeats" and refused.value.status == 402
    said = "X-Run-Max-Repeats: run same sent this same model request (byte for byte) 2 times"
    assert said in refused.value.message
    state = await led.get_run("same")
    assert state.status != "repeats_exceeded" and state.reserved_tokens == 0  # nothing left reserved
    # Another request goes on.
    await answer(led, "same", [], fingerprint="1" * 32)


async def test_a_run_without_the_cap_keeps_nothing(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    for _ in range(6):
        res, state = await answer(led, "free", [REFUND], caps=RunCaps(), fingerprint="")
        assert not res.final_step
    assert state.repeats == Repeats() and state.final_reason is None and state.status == "active"


async def test_generated_sequences_on_the_ledger_match_the_oracle(make_ledger):  # type: ignore[no-untyped-def]
    """A fixed number of generated runs through the ledger: each is caught exactly at the answer
    the oracle names (its next step answer-only), and a clean one never has an answer-only step."""
    led = make_ledger()
    rng = random.Random(23)
    pool = [call_fingerprint(t, a * 64) for t in ("refund", "lookup") for a in "ab"]
    kinds = {"clean": 0, "caught": 0}
    for n in range(40):
        limit = rng.randint(1, 3)
        answers = [[rng.choice(pool) for _ in range(rng.randint(0, 2))] for _ in range(rng.randint(1, 8))]
        expected = first_caught(answers, limit)
        run, caps = f"gen-{n}", RunCaps(max_repeats=limit)
        for i, calls in enumerate(answers):
            res, _ = await answer(led, run, calls, caps=caps)
            assert not res.final_step
            if i == expected:
                break
        res = await led.begin_step(step(run, caps))
        assert res.final_step == (expected is not None), (answers, limit)
        kinds["clean" if expected is None else "caught"] += 1
    assert kinds["clean"] >= 5 and kinds["caught"] >= 5, kinds
