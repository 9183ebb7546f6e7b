"""The trace step and the tool-call span put a run's place in its tree on every record: the
model span, the tool calls and results seen in it, the `tool` span of a call through a gateway,
and the run snapshot carry the run's `parent_run_id` and `root_run_id` from the ledger's state
(a root: '' and its own id), and a sub-agent's spans are in its root's trace."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.ledger.base import RunState
from proxy.providers.base import ResponseInfo, ToolCall
from proxy.server.metrics import Metrics
from proxy.server.steps.trace import TraceStep
from proxy.spans.model import trace_id_for_run
from proxy.spans.payloads import PayloadPolicy
from proxy.spans.recorder import WalRecorder
from proxy.spans.wal import WalWriter
from proxy.toolcall.call import ToolCall as GatewayCall
from proxy.toolcall.span import record_tool_call
from tests.support.flows import tflow
from tests.support.wal import all_records

TOOL_RESULT_BODY = {
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "tool_calls": [
            {"id": "call-0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call-0", "content": "found"},
    ],
}  # fmt: skip


def state_of(run_id: str, parent: str = "", root: str = "") -> RunState:
    now = time.time()
    return RunState(
        run_id=run_id, started_at=now, updated_at=now, steps=1, parent_run_id=parent, root_run_id=root
    )


@pytest.mark.parametrize(
    ("parent", "root", "expected"),
    [("", "", ("", "planner")), ("planner", "planner", ("planner", "planner")),
     ("researcher", "planner", ("researcher", "planner"))],
    ids=["root", "child", "grandchild"],
)  # fmt: skip
async def test_a_model_call_records_its_run_tree_on_every_record(
    tmp_path: Path, parent: str, root: str, expected: tuple[str, str]
) -> None:
    run_id = "planner" if not parent else f"{parent}-kid"
    writer = WalWriter(tmp_path / "wal")
    trace = TraceStep(WalRecorder(writer, PayloadPolicy()))
    flow = tflow(TOOL_RESULT_BODY, run_id=run_id)
    flow.state = state_of(run_id, parent, root)
    flow.status = flow.upstream_status = 200
    flow.response_info = ResponseInfo(model="gpt-4o-mini", tool_calls=[ToolCall("call-1", "lookup", "{}")])
    await trace.done(flow)
    writer.close()
    [record] = all_records(tmp_path / "wal")
    spans, runs = record.spans(), record.runs()
    assert sorted(s.kind for s in spans) == ["model", "tool_call", "tool_result"]
    assert {(s.parent_run_id, s.root_run_id) for s in spans} == {expected}
    assert {s.trace_id for s in spans} == {trace_id_for_run(expected[1])}
    assert [(r.run_id, r.parent_run_id, r.root_run_id) for r in runs] == [(run_id, *expected)]


async def test_a_gateway_tool_call_records_its_run_tree(tmp_path: Path) -> None:
    writer = WalWriter(tmp_path / "wal")
    flow = tflow(run_id="researcher")
    call = GatewayCall(tool="lookup", run=flow.run, started=time.perf_counter(), started_at=datetime.now(UTC))
    call.state = state_of("researcher", "planner", "planner")
    call.status, call.outcome = 200, "ok"
    record_tool_call(WalRecorder(writer, PayloadPolicy()), Metrics(), call, endpoint="/tools/lookup",
                     metric_label="lookup")  # fmt: skip
    writer.close()
    [record] = all_records(tmp_path / "wal")
    [span] = record.spans()
    assert (span.kind, span.parent_run_id, span.root_run_id) == ("tool", "planner", "planner")
    assert span.trace_id == trace_id_for_run("planner")
    assert [(r.parent_run_id, r.root_run_id) for r in record.runs()] == [("planner", "planner")]
