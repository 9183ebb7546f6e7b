"""The budget step's own decisions, one function at a time, without a server: what a settled call
is charged (`BudgetStep.settlement`), whether it gave its step back (`answer_missing`), what the
agent is told (`run_headers`), which unmetered endpoints an operator allowed
(`passthrough_allowed`), and how a reservation is written into the request
(`_apply_reservation`). The app tests (tests/app/test_caps.py, test_budget_step.py) drive the same
code end to end; these are the fast tests the mutation target `budget` runs first (docs/mutation.md).

Flows come from `tflow` (a real adapter reading a real body); prices from genai-prices' catalog.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.caps import RunCaps
from proxy.config import Config
from proxy.context import ContextReading
from proxy.ledger.base import Reservation, RunState
from proxy.pricing import PriceBook
from proxy.providers.base import ResponseInfo, ToolCall, Usage
from proxy.server.metrics import Metrics
from proxy.server.steps.budget import BudgetStep, answer_missing, passthrough_allowed, run_headers
from tests.support.flows import tflow

PRICES = PriceBook()


def step() -> BudgetStep:
    # settlement() and _apply_reservation() use the prices and the history only, never the ledger.
    return BudgetStep(Config(), None, PRICES, Metrics())  # type: ignore[arg-type]


def reservation(**kw: Any) -> Reservation:
    base: dict[str, Any] = {
        "id": "r1", "run_id": "t-run", "step": 3, "usd_nanos": 5_000_000, "input_tokens": 100,
        "output_tokens": 400, "output_limit": None, "clamped": False, "final_step": False,
        "state": RunState("t-run"),
    }  # fmt: skip
    base.update(kw)
    return Reservation(**base)


def price(inp: int, out: int) -> int:
    flow = tflow()
    flow.priced_model = "gpt-4o-mini"
    cost = PRICES.cost("openai", "gpt-4o-mini", Usage(input_tokens=inp, output_tokens=out), ())
    assert cost.known
    return round(cost.usd * 10**9)


# -- answer_missing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "unreached", "body", "nbytes", "cut", "error", "expected"),
    [
        (200, False, b"{}", 2, None, "", (False, False)),  # answered
        (200, True, None, 0, None, "", (True, True)),  # never reached
        (408, False, b"{}", 2, None, "", (True, True)),  # the retried statuses
        (409, False, b"{}", 2, None, "", (True, True)),
        (429, False, b"{}", 2, None, "", (True, True)),
        (500, False, b"{}", 2, None, "", (True, True)),
        (529, False, b"{}", 2, None, "", (True, True)),
        (499, False, b"{}", 2, None, "", (False, False)),  # the agent's own 4xx: an answer
        (400, False, b"{}", 2, None, "", (False, False)),
        (404, False, b"{}", 2, None, "", (False, False)),
        (0, False, None, 0, None, "", (True, True)),  # cut before any header: the upstream's doing
        (0, False, None, 0, "deadline", "", (True, False)),  # ... but not when runcap cut it
        (0, False, None, 0, "cancel", "", (True, False)),
        (0, False, None, 0, None, "client disconnected", (True, False)),  # nor when the agent left
        (0, False, b"", 5, None, "", (True, True)),  # no status is no answer, whatever was counted
        (200, False, None, 0, None, "", (True, True)),  # headers, then nothing
        (200, False, None, 10, None, "", (False, False)),  # a stream that sent bytes: an answer
        (200, False, b"", 0, None, "", (False, False)),  # a buffered empty body is an answer
    ],
)
def test_answer_missing(
    status: int, unreached: bool, body: bytes | None, nbytes: int, cut: str | None, error: str,
    expected: tuple[bool, bool],
) -> None:  # fmt: skip
    flow = tflow()
    flow.upstream_status, flow.upstream_unreached = status, unreached
    flow.response_body, flow.response_bytes, flow.cut_reason, flow.error = body, nbytes, cut, error
    assert answer_missing(flow) == expected


# -- run_headers --------------------------------------------------------------------------------


def test_run_headers_say_what_is_left_of_each_cap() -> None:
    caps = RunCaps(
        max_usd_nanos=2_000_000_000, max_tokens=1000, max_steps=5, max_tool_calls=4, deadline=1060.0
    )
    state = RunState("t-run", caps=caps, spent_usd_nanos=250_000_000, reserved_usd_nanos=50_000_000,
                     input_tokens=100, output_tokens=200, reserved_tokens=50, steps=2,
                     tool_calls_requested=3, tool_calls_executed=1)  # fmt: skip
    flow = tflow()
    flow.step = 2
    assert run_headers(flow, state, now=1000.0) == {
        "X-Run-Id": "t-run",
        "X-Run-Step": "2",
        "X-Run-Remaining-Usd": "1.700000000",
        "X-Run-Remaining-Tokens": "650",
        "X-Run-Remaining-Steps": "3",
        "X-Run-Remaining-Tool-Calls": "1",
        "X-Run-Remaining-Ms": "60000",
    }


def test_run_headers_without_caps_name_the_run_only_and_say_final_and_clamped() -> None:
    flow = tflow()
    assert run_headers(flow, RunState("t-run"), now=0.0) == {"X-Run-Id": "t-run"}  # step 0: no X-Run-Step
    flow.final_step, flow.clamped_to, flow.step = True, 77, 1
    assert run_headers(flow, RunState("t-run"), now=0.0) == {
        "X-Run-Id": "t-run",
        "X-Run-Step": "1",
        "X-Run-Final-Step": "true",
        "X-Run-Clamped-Output-Tokens": "77",
    }


def test_run_headers_never_go_negative() -> None:
    caps = RunCaps(max_usd_nanos=1, max_tokens=1, max_steps=1, max_tool_calls=1, deadline=10.0)
    state = RunState("t-run", caps=caps, spent_usd_nanos=5, input_tokens=9, steps=4, tool_calls_requested=7)
    headers = run_headers(tflow(), state, now=20.0)
    assert headers["X-Run-Remaining-Usd"] == "0.000000000"
    assert headers["X-Run-Remaining-Tokens"] == headers["X-Run-Remaining-Steps"] == "0"
    assert headers["X-Run-Remaining-Tool-Calls"] == headers["X-Run-Remaining-Ms"] == "0"


# -- passthrough_allowed ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patterns", "path", "allowed"),
    [
        (("/v1/files",), "/v1/files", True),
        (("/v1/files",), "/v1/files/", True),
        (("/v1/files/",), "/v1/files", True),
        (("/v1/files",), "/v1/files/f1/content", True),
        (("/v1/files",), "/v1/filesystem", False),
        (("/v1/files",), "/v1", False),
        (("/v1/threads/*/runs",), "/v1/threads/t1/runs", True),
        (("/v1/threads/*/runs",), "/v1/threads/t1/runs/r1", True),
        (("/v1/threads/*/runs",), "/v1/threads/runs", False),
        (("/v1/threads/*/runs",), "/v1/threads/t1/messages", False),
        (("/v1/a", "/v1/b"), "/v1/b/x", True),  # any pattern
        ((), "/v1/files", False),
        (("/v1/threads/*",), "/v1/threads/", False),  # a trailing slash is not a segment
        (("/v1/fileX",), "/v1/fileX", True),  # only slashes are stripped
        (("/v1/files",), "/v1/fileX", False),
    ],
)
def test_passthrough_allowed(patterns: tuple[str, ...], path: str, allowed: bool) -> None:
    assert passthrough_allowed(patterns, path) is allowed


# -- settlement ---------------------------------------------------------------------------------


def answered(usage: Usage | None, **kw: Any) -> Any:
    flow = tflow()
    flow.priced_model = "gpt-4o-mini"
    flow.upstream_status = flow.status = 200
    flow.response_body = b"{}"
    flow.response_info = ResponseInfo(model="gpt-4o-mini", usage=usage, **kw)
    return flow


def test_an_answer_is_charged_what_it_reports() -> None:
    flow = answered(Usage(input_tokens=30, output_tokens=70), finished=True)
    s = step().settlement(flow, reservation())
    assert (s.input_tokens, s.output_tokens) == (30, 70)
    assert s.cost_usd_nanos == flow.cost_nanos == price(30, 70) > 0
    assert s.finished and not s.no_answer and not s.upstream_failed and s.run_status is None
    assert flow.usage_reserved == (False, False) and flow.price_known
    assert (
        flow.cost is not None and flow.cost.known and flow.usage == Usage(input_tokens=30, output_tokens=70)
    )


def test_an_answer_without_usage_is_charged_the_reserved_worst_case() -> None:
    flow = answered(None)
    s = step().settlement(flow, reservation())
    assert (s.input_tokens, s.output_tokens) == (100, 400)
    assert s.cost_usd_nanos == price(100, 400)
    assert flow.usage_reserved == (True, True)
    assert not s.finished  # no answer read: it did not end the run


@pytest.mark.parametrize("status", [400, 429, 503])
def test_a_refusal_of_the_provider_costs_nothing(status: int) -> None:
    flow = answered(None)
    flow.upstream_status = status
    s = step().settlement(flow, reservation())
    assert (s.input_tokens, s.output_tokens, s.cost_usd_nanos) == (0, 0, 0)
    assert flow.usage_reserved == (False, False)


def test_an_unreached_upstream_costs_nothing_and_gives_the_step_back() -> None:
    flow = answered(None)
    flow.upstream_status, flow.upstream_unreached, flow.response_body = 0, True, None
    s = step().settlement(flow, reservation())
    assert (s.input_tokens, s.output_tokens, s.cost_usd_nanos) == (0, 0, 0)
    assert s.no_answer and s.upstream_failed and flow.no_answer


def test_an_incomplete_stream_is_charged_at_least_its_reservation() -> None:
    flow = answered(Usage(input_tokens=500, output_tokens=10))
    flow.outcome = "incomplete"
    s = step().settlement(flow, reservation())
    assert (s.input_tokens, s.output_tokens) == (500, 400)  # the larger of each
    assert s.cost_usd_nanos == max(price(500, 400), 5_000_000)
    assert flow.usage_reserved == (False, True)
    flow = answered(None)
    flow.outcome = "incomplete"
    s = step().settlement(flow, reservation(usd_nanos=10**12))  # the reservation's dollars win
    assert (s.input_tokens, s.output_tokens) == (100, 400) and s.cost_usd_nanos == 10**12
    flow = answered(Usage(input_tokens=1, output_tokens=2), finished=True)
    flow.outcome = "incomplete"
    assert step().settlement(flow, reservation()).finished  # its answer reached the agent


def test_a_stream_cut_before_its_usage_counts_what_was_read_as_a_lower_bound() -> None:
    flow = answered(Usage(input_tokens=0, output_tokens=900), complete=False)
    flow.streamed = True
    s = step().settlement(flow, reservation())
    assert (s.input_tokens, s.output_tokens) == (100, 900)
    assert flow.usage_reserved == (True, False)
    flow = answered(Usage(input_tokens=60, output_tokens=5), complete=False)
    flow.streamed = True
    s = step().settlement(flow, reservation())
    assert (s.input_tokens, s.output_tokens) == (60, 400)
    # A complete stream is charged what it reported.
    flow = answered(Usage(input_tokens=60, output_tokens=5), complete=True)
    flow.streamed = True
    assert (step().settlement(flow, reservation()).output_tokens) == 5


@pytest.mark.parametrize(
    ("cut", "status"), [("deadline", "deadline_exceeded"), ("cancel", "cancelled"), (None, None)]
)
def test_a_cut_call_says_why_in_the_runs_status(cut: str | None, status: str | None) -> None:
    flow = answered(Usage(input_tokens=1, output_tokens=1))
    flow.cut_reason = cut
    assert step().settlement(flow, reservation()).run_status == status


def test_tool_calls_the_model_asked_for_and_the_provider_ran_are_counted() -> None:
    calls = [ToolCall(id=f"c{i}", name="f", arguments="{}") for i in range(3)]
    flow = answered(Usage(input_tokens=1, output_tokens=1), tool_calls=calls)
    flow.response_info.provider_tool_calls = calls[:2]
    assert step().settlement(flow, reservation()).tool_calls_requested == 5
    assert step().settlement(answered(None), reservation()).tool_calls_requested == 0
    flow = answered(None)
    flow.response_info = None  # nothing read of the answer
    assert step().settlement(flow, reservation()).tool_calls_requested == 0


def test_only_an_ok_or_incomplete_finished_answer_ends_the_run() -> None:
    for outcome, finished in (("ok", True), ("incomplete", True), ("error", False), ("cancelled", False)):
        flow = answered(Usage(input_tokens=1, output_tokens=1), finished=True)
        flow.outcome = outcome
        assert step().settlement(flow, reservation()).finished is finished, outcome


def test_the_context_reading_goes_to_the_ledger() -> None:
    flow = answered(Usage(input_tokens=1, output_tokens=1))
    assert step().settlement(flow, reservation()).context_tokens == 0
    flow.context = ContextReading(lower=1000, upper=2000, estimate=1500, tool_output_share=0.0, tokens=1234)
    assert step().settlement(flow, reservation()).context_tokens == 1234


# -- _apply_reservation -------------------------------------------------------------------------


def test_a_clamped_limit_is_written_and_said() -> None:
    flow = tflow()
    res = reservation(output_limit=9, clamped=True)
    step()._apply_reservation(flow, res)
    assert flow.body_json is not None and flow.body_json["max_tokens"] == 9
    assert flow.body_changed and flow.clamped_to == 9
    assert flow.reservation is res and flow.state is res.state and flow.step == 3


def test_a_limit_written_without_a_clamp_is_not_said() -> None:
    flow = tflow()
    step()._apply_reservation(flow, reservation(output_limit=16, clamped=False))
    assert flow.body_json is not None and flow.body_json["max_tokens"] == 16
    assert flow.clamped_to is None


def test_no_limit_leaves_the_body_as_sent() -> None:
    flow = tflow()
    step()._apply_reservation(flow, reservation())
    assert not flow.body_changed and flow.clamped_to is None and not flow.final_step


def test_the_final_step_strips_the_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    flow = tflow(body)
    step()._apply_reservation(flow, reservation(final_step=True))
    assert flow.final_step and flow.body_changed
    assert flow.body_json is not None and "tools" not in flow.body_json
    # Without tools there is nothing to strip: the body stays as sent.
    flow = tflow()
    step()._apply_reservation(flow, reservation(final_step=True))
    assert flow.final_step and not flow.body_changed


def test_a_stream_is_made_to_report_its_usage() -> None:
    flow = tflow({**dict(model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}]), "stream": True})
    step()._apply_reservation(flow, reservation())
    assert flow.injected_stream_usage and flow.body_changed
    assert flow.body_json is not None and flow.body_json["stream_options"] == {"include_usage": True}
