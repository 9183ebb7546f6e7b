"""The budget step's request and settle hooks against a real SQLite ledger, without a server: what
the ledger is asked (`StepRequest` field by field, from the request, the prices and the
configuration), when it is not asked at all (a one-step run with nothing to enforce), what a
refusal leaves on the flow, and what the settlement writes back. The ledger records what it was
asked and then decides as always. A fast selection of the mutation target `budget`
(docs/mutation.md), beside tests/unit/server/test_budget_rules.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.config import Config
from proxy.errors import BudgetExceeded, LedgerUnavailable
from proxy.ledger.base import StepRequest
from proxy.ledger.guarded import GuardedLedger
from proxy.ledger.sqlite import SQLiteLedger
from proxy.pricing import PriceBook
from proxy.providers.base import ResponseInfo, Usage
from proxy.server.metrics import Metrics
from proxy.server.steps.budget import BudgetStep
from tests.support.flows import tflow

PRICES = PriceBook()


class RecordingLedger(SQLiteLedger):
    """A SQLite ledger that keeps what it was asked."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.steps: list[StepRequest] = []
        self.touched: list[str] = []

    async def begin_step(self, req: StepRequest) -> Any:
        self.steps.append(req)
        return await super().begin_step(req)

    async def touch_run(self, run_id: str, task: str, caps: Any, now: float, parent: str = "") -> Any:
        self.touched.append(run_id)
        return await super().touch_run(run_id, task, caps, now, parent)


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[RecordingLedger]:
    backend = RecordingLedger(tmp_path / "ledger.sqlite3")
    yield backend
    await backend.close()


def budget(ledger: RecordingLedger, config: Config | None = None) -> tuple[BudgetStep, Metrics]:
    metrics = Metrics()
    return BudgetStep(config or Config(), GuardedLedger(ledger), PRICES, metrics), metrics


def ledger_ops(metrics: Metrics) -> set[str]:
    """The operations `runcap_ledger_op_seconds` observed."""
    ops = set()
    for line in metrics.render().decode().splitlines():
        if line.startswith("runcap_ledger_op_seconds_count{"):
            ops.add(line.split('op="', 1)[1].split('"', 1)[0])
    return ops


CAPPED = {"X-Run-Max-Usd": "1"}


async def test_the_ledger_is_asked_with_what_the_request_says(ledger: RecordingLedger) -> None:
    step, metrics = budget(ledger)
    flow = tflow(headers={**CAPPED, "X-Run-Task": "triage"})
    await step.request(flow)
    (req,) = ledger.steps
    assert (req.run_id, req.task, req.model) == ("t-run", "triage", "gpt-4o-mini")
    assert req.caps.max_usd_nanos == 10**9
    assert req.client_output_limit == 16  # the body's max_tokens
    assert req.model_output_bound > 16  # the catalog's maximum for gpt-4o-mini
    assert req.input_usd_per_mtok is not None and req.output_usd_per_mtok is not None
    assert req.input_usd_per_mtok > 0 and req.output_usd_per_mtok > req.input_usd_per_mtok
    assert req.counts_as_step and not req.allow_unpriced
    assert req.max_upstream_failures == Config().caps.max_upstream_failures
    assert req.input_tokens_bound > 0
    assert flow.reservation is not None and flow.state is not None and flow.step == 1
    assert flow.priced_model == "gpt-4o-mini"
    assert ledger_ops(metrics) == {"reserve"}


async def test_the_configuration_reaches_the_ledger(ledger: RecordingLedger, tmp_path: Path) -> None:
    from proxy.config import build_config

    raw = {"models": {"gpt-4o-mini": {"max_output_tokens": 777}},
           "caps": {"allow_unpriced": True, "max_upstream_failures": 9, "min_output_tokens": 3}}  # fmt: skip
    config = build_config(raw, data_dir=str(tmp_path / "d"))
    step, _ = budget(ledger, config)
    await step.request(tflow(headers=CAPPED))
    (req,) = ledger.steps
    assert req.model_output_bound == 777 and req.allow_unpriced and req.max_upstream_failures == 9
    assert req.min_output_tokens >= 3


async def test_embeddings_take_no_step(ledger: RecordingLedger) -> None:
    step, _ = budget(ledger)
    flow = tflow({"model": "text-embedding-3-small", "input": "x"}, path=["v1", "embeddings"], headers=CAPPED)
    await step.request(flow)
    assert not ledger.steps[0].counts_as_step


async def test_hosted_tools_and_their_fees_reach_the_ledger(ledger: RecordingLedger) -> None:
    step, _ = budget(ledger)
    body = {"model": "gpt-4o-mini", "input": "x", "tools": [{"type": "web_search"}], "max_output_tokens": 64}
    flow = tflow(body, path=["v1", "responses"], headers=CAPPED)
    await step.request(flow)
    (req,) = ledger.steps
    # The body sets no use limit: each web search costs its fee plus the tokens it reads.
    assert req.hosted_tools and req.uses_wanted is None
    assert req.use_usd_nanos > 0 and req.use_tokens > 0 and req.fixed_usd_nanos == 0
    # The use limit runcap wrote on the body, and the span's record of it.
    assert flow.body_json is not None and flow.body_json["max_tool_calls"] >= 1
    assert flow.billing["hosted.max_uses_set"] == str(flow.body_json["max_tool_calls"])
    assert flow.billing["hosted.uses_reserved"] == flow.billing["hosted.max_uses_set"]
    # On an answer-only final step the tools are stripped: no use limit is written.
    body = {"model": "gpt-4o-mini", "input": "x", "tools": [{"type": "web_search"}], "max_output_tokens": 64}
    flow = tflow(body, path=["v1", "responses"], headers={**CAPPED, "X-Run-Max-Steps": "1"}, run_id="t-final")
    await step.request(flow)
    assert flow.final_step and flow.body_json is not None
    assert "max_tool_calls" not in flow.body_json and "tools" not in flow.body_json
    assert "hosted.max_uses_set" not in flow.billing


async def test_a_generated_run_without_caps_is_decided_without_the_ledger(ledger: RecordingLedger) -> None:
    step, metrics = budget(ledger)
    flow = tflow(run_id=None)
    assert flow.run is not None and flow.run.generated
    await step.request(flow)
    assert not ledger.steps and flow.reservation is not None and not flow.reservation.ledgered
    # ... and settled in memory too: the flow's run state says what the step used.
    flow.upstream_status, flow.response_body = 200, b"{}"
    flow.response_info = ResponseInfo(model="gpt-4o-mini", usage=Usage(input_tokens=5, output_tokens=7))
    await step.done(flow)
    assert flow.state is not None and (
        flow.state.input_tokens,
        flow.state.output_tokens,
        flow.state.steps,
    ) == (5, 7, 1)
    assert flow.reservation is None
    assert ledger_ops(metrics) == set()


@pytest.mark.parametrize("kind", ["named run", "capped", "inner call"])
async def test_a_run_with_something_to_enforce_goes_to_the_ledger(ledger: RecordingLedger, kind: str) -> None:
    step, _ = budget(ledger)
    if kind == "named run":
        flow = tflow()
    elif kind == "capped":
        flow = tflow(run_id=None, headers={"X-Run-Max-Steps": "3"})
    else:
        flow = tflow(run_id=None, inner=True)
    await step.request(flow)
    assert len(ledger.steps) == 1 and flow.reservation is not None and flow.reservation.ledgered


async def test_a_refusal_leaves_the_runs_state_on_the_flow(ledger: RecordingLedger) -> None:
    step, _ = budget(ledger)
    await step.request(tflow(headers={"X-Run-Max-Steps": "1"}))
    flow = tflow(headers={"X-Run-Max-Steps": "1"})
    with pytest.raises(BudgetExceeded):
        await step.request(flow)
    assert flow.state is not None and flow.state.run_id == "t-run" and flow.state.steps == 1


async def test_a_pass_through_call_touches_a_named_run_only(ledger: RecordingLedger) -> None:
    step, metrics = budget(ledger)
    await step.request(tflow(method="GET", path=["v1", "models"]))
    assert ledger.touched == ["t-run"] and not ledger.steps
    assert ledger_ops(metrics) == {"touch"}
    await step.request(tflow(method="GET", path=["v1", "models"], run_id=None))
    assert ledger.touched == ["t-run"]
    # A body the adapter could not read is a pass-through too: touched, never reserved.
    flow = tflow(path=["v1", "images", "generations"], headers=CAPPED)
    with pytest.raises(BudgetExceeded):
        await step.request(flow)
    assert ledger.touched == ["t-run", "t-run"]


async def test_stored_context_adds_to_the_input_bound(ledger: RecordingLedger) -> None:
    step, _ = budget(ledger)
    body = {"model": "gpt-4o-mini", "input": "x", "max_output_tokens": 16}
    await step.request(tflow(body, path=["v1", "responses"], headers=CAPPED))
    plain = ledger.steps[-1].input_tokens_bound
    body = {**body, "previous_response_id": "resp_unknown"}
    await step.request(tflow(body, path=["v1", "responses"], headers=CAPPED, run_id="t-2"))
    # A previous response this process never saw: the model's whole context window on top.
    assert ledger.steps[-1].input_tokens_bound >= plain + 100_000


async def test_a_buffered_answer_is_settled_at_response_and_said_in_headers(ledger: RecordingLedger) -> None:
    step, metrics = budget(ledger)
    flow = tflow(headers=CAPPED)
    await step.request(flow)
    flow.upstream_status, flow.response_body = 200, b"{}"
    flow.response_info = ResponseInfo(model="gpt-4o-mini", usage=Usage(input_tokens=10, output_tokens=20))
    await step.response(flow)
    assert flow.reservation is None  # settled, exactly once
    assert flow.state is not None and flow.state.output_tokens == 20 and flow.state.reserved_usd_nanos == 0
    assert flow.reply_headers["X-Run-Id"] == "t-run" and "X-Run-Remaining-Usd" in flow.reply_headers
    assert flow.cost is not None and flow.cost_nanos > 0
    assert ledger_ops(metrics) == {"reserve", "settle"}
    await step.done(flow)  # nothing left to settle
    assert flow.state.output_tokens == 20


async def test_a_stream_is_settled_when_it_is_done_not_at_its_headers(ledger: RecordingLedger) -> None:
    step, _ = budget(ledger)
    flow = tflow(headers=CAPPED)
    await step.request(flow)
    flow.upstream_status = 200  # headers in, no buffered body
    await step.response(flow)
    assert flow.reservation is not None
    assert flow.state is not None and flow.state.reserved_usd_nanos > 0
    flow.response_info = ResponseInfo(model="gpt-4o-mini", usage=Usage(input_tokens=1, output_tokens=2))
    flow.response_bytes = 10
    await step.done(flow)
    assert flow.reservation is None and flow.state.output_tokens == 2


async def test_an_answer_is_remembered_for_the_next_steps_bound_only_when_it_is_one(
    ledger: RecordingLedger,
) -> None:
    step, _ = budget(ledger)

    async def settle(outcome: str, usage: Usage | None, run_id: str | None = "t-run") -> None:
        flow = tflow(headers=CAPPED, run_id=run_id)
        await step.request(flow)
        flow.upstream_status, flow.response_body, flow.outcome = 200, b"{}", outcome
        flow.response_info = ResponseInfo(model="gpt-4o-mini", usage=usage)
        await step.done(flow)

    def known() -> bool:
        return step.history.known_prefix("t-run", tflow(headers=CAPPED).info) is not None  # type: ignore[arg-type]

    await settle("error", Usage(input_tokens=1, output_tokens=1))
    await settle("ok", None)
    assert not known()
    await settle("ok", Usage(input_tokens=1, output_tokens=1))
    assert known()  # the next call's history starts with what this one sent


def test_an_answer_without_usage_is_logged_naming_the_run_the_step_and_the_upstream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.unit.server.test_budget_rules import answered, reservation, step

    caplog.set_level(logging.WARNING, "runcap.budget")
    step().settlement(answered(None), reservation())
    assert caplog.messages == [
        "run t-run step 3: openai returned no usage; settled at the reserved worst case"
    ]
    caplog.clear()
    flow = answered(None)
    flow.outcome = "cancelled"  # cut: no usage is expected, nothing to warn about
    step().settlement(flow, reservation())
    assert caplog.messages == []


async def test_a_settlement_not_taken_is_logged_with_why_and_retried(
    ledger: RecordingLedger, caplog: pytest.LogCaptureFixture
) -> None:
    step, _ = budget(ledger)
    caplog.set_level(logging.WARNING, "runcap.budget")
    for error in (LedgerUnavailable("redis timed out", backend="sqlite"), RuntimeError("boom")):
        flow = tflow(headers=CAPPED)
        await step.request(flow)
        res = flow.reservation
        assert res is not None
        flow.upstream_status, flow.response_body = 200, b"{}"
        flow.response_info = ResponseInfo(model="gpt-4o-mini", usage=Usage(input_tokens=3, output_tokens=4))
        settlement = step.settlement(flow, res)
        step._retry_unsettled(res, settlement, time.time(), error)
    assert step.ledger.pending.count() == 2
    assert await step.ledger.pending.flush()  # one round of the background retry takes both
    first, second = caplog.records
    assert first.getMessage() == (
        "run t-run step 1: settlement not taken (redis timed out); retrying it in the background"
    )
    assert first.exc_info is None
    assert second.getMessage() == "run t-run step 2: settling failed; retrying it in the background"
    assert second.exc_info is not None and str(second.exc_info[1]) == "boom"
    state = await ledger.get_run("t-run")
    assert state is not None and state.reserved_usd_nanos == 0 and state.steps == 2
