"""The steps' pipeline (server/flow.py) on its own, with flows from `tests/support/flows.py`: its
one error policy — a request hook's rejection stops the request hooks there and propagates; every
done hook runs, an error in one is logged, a cancellation re-raised once the rest have run — and
that only the hooks a step overrides are called. Then one real step, the context step, driven
through the flow factory without a server."""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.config import CapsConfig
from proxy.context import ContextSettings
from proxy.errors import BudgetExceeded, DeadlineExceeded, InvalidRequest, Rejection, RunCancelled
from proxy.server.flow import Flow, FlowStep, Pipeline
from proxy.server.inner import InnerCalls
from proxy.server.metrics import Metrics
from proxy.server.outbound import OutboundClient
from proxy.server.steps.context import ContextStep
from proxy.server.steps.history import ConversationMemory
from tests.support.flows import tflow


class Recorder(FlowStep):
    """Notes each hook it is called for in the shared `log`; `fail` maps a hook to what it raises."""

    def __init__(self, name: str, log: list[str], fail: dict[str, BaseException] | None = None) -> None:
        self.name, self.log, self.fail = name, log, fail or {}

    async def _hook(self, hook: str) -> None:
        self.log.append(f"{self.name}.{hook}")
        if hook in self.fail:
            raise self.fail[hook]

    async def request(self, flow: Flow) -> None:
        await self._hook("request")

    async def response(self, flow: Flow) -> None:
        await self._hook("response")

    async def done(self, flow: Flow) -> None:
        await self._hook("done")


class DoneOnly(FlowStep):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def done(self, flow: Flow) -> None:
        self.log.append("done-only.done")


async def test_a_request_rejection_propagates_and_later_request_hooks_do_not_run() -> None:
    log: list[str] = []
    refusal = InvalidRequest("no")
    pipeline = Pipeline([Recorder("a", log), Recorder("b", log, {"request": refusal}), Recorder("c", log)])
    with pytest.raises(InvalidRequest) as e:
        await pipeline.request(tflow())
    assert e.value is refusal
    assert log == ["a.request", "b.request"]


async def test_every_done_hook_runs_when_one_raises_and_the_error_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[str] = []
    pipeline = Pipeline(
        [Recorder("a", log, {"done": RuntimeError("boom")}), Recorder("b", log), DoneOnly(log)]
    )
    with caplog.at_level(logging.ERROR, logger="runcap.forward"):
        await pipeline.done(tflow())
    assert log == ["a.done", "b.done", "done-only.done"]
    assert any("step Recorder failed after POST /v1/chat/completions" in r.message for r in caplog.records)


async def test_a_cancellation_in_a_done_hook_is_re_raised_after_all_done_hooks() -> None:
    log: list[str] = []
    pipeline = Pipeline(
        [
            Recorder("a", log, {"done": asyncio.CancelledError()}),
            Recorder("b", log, {"done": RuntimeError("later boom")}),
            Recorder("c", log),
        ]
    )
    with pytest.raises(asyncio.CancelledError):
        await pipeline.done(tflow())
    assert log == ["a.done", "b.done", "c.done"]


async def test_only_the_hooks_a_step_overrides_are_called() -> None:
    log: list[str] = []
    done_only, full = DoneOnly(log), Recorder("full", log)
    pipeline = Pipeline([done_only, full])
    assert pipeline.hooks("request") == [full.request]
    assert pipeline.hooks("answer") == []  # nobody overrides it: nothing is called
    assert pipeline.hooks("done") == [done_only.done, full.done]
    flow = tflow()
    await pipeline.request(flow)
    await pipeline.response(flow)
    await pipeline.answer(flow)
    await pipeline.done(flow)
    assert log == ["full.request", "full.response", "done-only.done", "full.done"]
    # A step added later (tests watch the forwarder's steps this way) is called from then on.
    pipeline.append(Recorder("late", log))
    await pipeline.request(flow)
    assert log[-2:] == ["full.request", "late.request"]


def test_a_rejection_carries_its_own_outcome() -> None:
    assert BudgetExceeded("max_usd", "x").outcome == "budget_exceeded"
    assert DeadlineExceeded("x").outcome == "deadline_exceeded"
    assert RunCancelled("x").outcome == "cancelled"
    assert InvalidRequest("x").outcome == "error" and Rejection("x").outcome == "error"


# -- one step through the flow factory -------------------------------------------------------


def context_step() -> ContextStep:
    client = OutboundClient(keepalive_timeout_s=1, connect_timeout_s=1)  # never started: no call made
    return ContextStep(ContextSettings(), CapsConfig(), ConversationMemory(), Metrics(), InnerCalls(client))


async def test_the_context_step_refuses_a_step_over_the_context_cap_before_anything_is_sent() -> None:
    words = " ".join(["word"] * 50)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": words}]}
    step = context_step()

    flow = tflow(body, headers={"X-Run-Max-Context-Tokens": "49"})
    with pytest.raises(BudgetExceeded) as e:
        await step.request(flow)
    assert e.value.code == "max_context_tokens" and e.value.outcome == "budget_exceeded"
    assert "cap of 49" in e.value.message

    fits = tflow(body, headers={"X-Run-Max-Context-Tokens": "50"})
    await step.request(fits)
    assert fits.context is not None and fits.context.lower == 50 and fits.context.cap == 50
    assert fits.rewrite is None and not fits.body_changed  # no policy: the body is untouched


async def test_the_context_step_measures_runcaps_own_calls_but_never_rewrites_them() -> None:
    step = context_step()
    inner = tflow(headers={"X-Run-Context-Policy": "offload", "X-Run-Max-Context-Tokens": "1"}, inner=True)
    with pytest.raises(BudgetExceeded):
        await step.request(inner)
    assert inner.context is not None and inner.context.policies == ()
