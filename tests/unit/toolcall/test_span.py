"""A tool call's `tool` span as it reaches the WAL (proxy/toolcall/span.py): the events recorded
on the call (`ToolCall.event`: a policy's verdict, an approval) travel with the span, in order,
with their times and attributes."""

from __future__ import annotations

from pathlib import Path

from proxy.caps import RunCaps, RunRequest
from proxy.server.metrics import Metrics
from proxy.spans.model import SpanEvent
from proxy.spans.payloads import PayloadPolicy
from proxy.spans.recorder import WalRecorder
from proxy.spans.wal import WalWriter
from proxy.toolcall.call import ToolCall
from proxy.toolcall.span import record_tool_call
from tests.support.wal import all_records


def test_the_events_of_a_call_reach_its_span_in_the_wal(tmp_path: Path) -> None:
    writer = WalWriter(tmp_path / "wal", fsync_interval_s=0.05)
    call = ToolCall("refund", run=RunRequest("run-1", False, "", RunCaps()))
    asked = call.event("approval.requested", **{"approval.id": "a" * 32})
    decided = call.event("approval.decided", **{"approval.state": "approved", "approval.by": "ana"})
    assert call.events == [asked, decided] and asked.at <= decided.at
    record_tool_call(WalRecorder(writer, PayloadPolicy()), Metrics(), call, endpoint="POST /tools/refund",
                     metric_label="refund")  # fmt: skip
    writer.close()
    [record] = all_records(tmp_path / "wal")
    [span] = record.spans()
    assert span.kind == "tool" and span.tool_name == "refund"
    assert span.events == [
        SpanEvent("approval.requested", asked.at, {"approval.id": "a" * 32}),
        SpanEvent("approval.decided", decided.at, {"approval.state": "approved", "approval.by": "ana"}),
    ]
