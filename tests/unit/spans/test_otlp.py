"""OTLP export against a real OTLP/HTTP receiver decoding the protobuf: GenAI span names and
attributes, runcap's own attributes, ids and times identical to the Span (so the trace matches
ClickHouse), the run's `invoke_agent` span (once, from the snapshot that ends the run), and an
unreachable collector: the spans wait in the WAL and are exported once it is back. The same through
runcap with the official clients: tests/app/test_otlp_genai.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PbStatus

from proxy.spans.model import RunSnapshot, Span, trace_id_for_run
from proxy.spans.otlp import (
    OTLPSink,
    agent_span_id,
    operation_for,
    span_name,
    to_unix_nanos,
    traces_endpoint,
)
from proxy.spans.shipper import Shipper
from proxy.spans.sink import SinkError
from proxy.spans.wal import WalWriter
from tests.support.otlp_receiver import OTLPReceiver

T0 = datetime(2026, 11, 29, 17, 0, 0, 123456, tzinfo=UTC)


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver().start()
    yield r
    r.stop()


def model_span(**kw: object) -> Span:
    fields: dict[str, object] = dict(
        run_id="run-42",
        kind="model",
        step=1,
        started_at=T0,
        duration_ms=1234.567891,
        ttft_ms=88.5,
        task="triage",
        provider="openai",
        model="gpt-4o-mini",
        endpoint="chat.completions",
        status_code=200,
        input_tokens=1200,
        output_tokens=80,
        cache_read_tokens=1024,
        cost_usd=Decimal("0.000228000"),
        request_hash="a" * 64,
        attributes={"finish_reason": "tool_calls"},
    )
    fields.update(kw)
    return Span(**fields)  # type: ignore[arg-type]


def test_spans_export_with_genai_names_attributes_ids_and_times(receiver: OTLPReceiver) -> None:
    chat = model_span()
    embed = model_span(endpoint="embeddings", model="text-embedding-3-small", step=2, output_tokens=0)
    tool = Span(
        run_id="run-42",
        kind="tool",
        step=1,
        started_at=T0 + timedelta(seconds=2),
        parent_span_id=chat.span_id,
        duration_ms=50.0,
        status_code=504,
        outcome="timeout",
        error="refund service timed out after 30s",
        tool_name="refund",
        tool_call_id="call_abc",
        args_hash="b" * 64,
        result_hash="",
        idempotency_key="0123456789abcdef0123456789abcdef",
    )
    requested = Span(
        run_id="run-42",
        kind="tool_call",
        step=1,
        started_at=T0,
        parent_span_id=chat.span_id,
        tool_name="refund",
        tool_call_id="call_abc",
    )
    sink = OTLPSink(receiver.endpoint, timeout_s=2)
    sink.write([chat, embed, tool, requested], [], "batch-1")
    got = {s.span_id: s for s in receiver.wait_for(4)}
    sink.close()

    c = got[chat.span_id]
    assert c.name == "chat gpt-4o-mini" and c.kind == PbSpan.SPAN_KIND_CLIENT
    # no parent in ClickHouse; over OTLP the run's invoke_agent span
    assert c.trace_id == chat.trace_id and chat.parent_span_id == ""
    assert c.parent_span_id == agent_span_id("run-42")
    assert c.start_time_unix_nano == 1795971600123456000  # 2026-11-29T17:00:00.123456Z, exact
    assert c.end_time_unix_nano - c.start_time_unix_nano == 1_234_567_891
    assert c.status_code == PbStatus.STATUS_CODE_UNSET
    assert c.resource["service.name"] == "runcap" and c.scope == "runcap"
    assert c.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
        "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.response.model": "gpt-4o-mini",
        "gen_ai.usage.input_tokens": 1200,
        "gen_ai.usage.output_tokens": 80,
        "gen_ai.usage.cache_read.input_tokens": 1024,
        "gen_ai.usage.cost.amount": 0.000228,
        "gen_ai.usage.cost.currency": "USD",
        "gen_ai.usage.cost.source": "local",
        "gen_ai.conversation.id": "run-42",
        "http.response.status_code": 200,
        "runcap.run_id": "run-42",
        "runcap.step": 1,
        "runcap.kind": "model",
        "runcap.outcome": "ok",
        "runcap.cost_usd": "0.000228000",
        "runcap.price_known": True,
        "runcap.task": "triage",
        "runcap.endpoint": "chat.completions",
        "runcap.request_hash": "a" * 64,
        "runcap.ttft_ms": "88.5",
        "runcap.attr.finish_reason": "tool_calls",
    }

    e = got[embed.span_id]
    assert e.name == "embeddings text-embedding-3-small"
    assert e.attributes["gen_ai.operation.name"] == "embeddings"

    t = got[tool.span_id]
    assert t.name == "execute_tool refund" and t.kind == PbSpan.SPAN_KIND_INTERNAL
    assert t.trace_id == chat.trace_id and t.parent_span_id == chat.span_id
    assert t.status_code == PbStatus.STATUS_CODE_ERROR
    assert t.status_message == "refund service timed out after 30s"
    assert t.attributes["gen_ai.operation.name"] == "execute_tool"
    assert t.attributes["gen_ai.tool.name"] == "refund"
    assert t.attributes["gen_ai.tool.call.id"] == "call_abc"
    assert t.attributes["error.type"] == "timeout"
    assert t.attributes["runcap.args_hash"] == "b" * 64
    assert t.attributes["runcap.idempotency_key"] == "0123456789abcdef0123456789abcdef"
    assert t.attributes["runcap.outcome"] == "timeout" and t.attributes["runcap.kind"] == "tool"
    assert "runcap.result_hash" not in t.attributes  # empty columns are not sent
    assert "gen_ai.usage.input_tokens" not in t.attributes

    r = got[requested.span_id]
    assert r.name == "execute_tool refund" and r.attributes["runcap.kind"] == "tool_call"


def snapshot(status: str, **kw: object) -> RunSnapshot:
    fields: dict[str, object] = dict(
        run_id="run-42", task="triage", started_at=T0, updated_at=T0 + timedelta(seconds=3), status=status,
        steps=2, tool_calls=1, input_tokens=2400, output_tokens=160, cost_usd=Decimal("0.000456000"),
        max_usd=Decimal("0.500000000"), max_tokens=None, max_steps=20, max_tool_calls=None, deadline=None,
    )  # fmt: skip
    fields.update(kw)
    return RunSnapshot(**fields)  # type: ignore[arg-type]


def test_an_active_run_is_no_span(receiver: OTLPReceiver) -> None:
    sink = OTLPSink(receiver.endpoint)
    sink.write([], [snapshot("active")], "b")
    sink.close()
    assert receiver.requests == 0


def test_the_run_that_ends_is_one_invoke_agent_span_exported_once(receiver: OTLPReceiver) -> None:
    last = model_span(step=2, started_at=T0 + timedelta(seconds=2), duration_ms=1500.0)
    sink = OTLPSink(receiver.endpoint)
    sink.write([last], [snapshot("completed")], "b1")
    got = {s.name: s for s in receiver.wait_for(2)}
    agent = got["invoke_agent triage"]
    assert agent.span_id == agent_span_id("run-42") and agent.parent_span_id == ""
    assert agent.trace_id == last.trace_id and got["chat gpt-4o-mini"].parent_span_id == agent.span_id
    assert agent.kind == PbSpan.SPAN_KIND_INTERNAL and agent.status_code == PbStatus.STATUS_CODE_UNSET
    assert agent.start_time_unix_nano == to_unix_nanos(T0)
    last_end = T0 + timedelta(seconds=3, milliseconds=500)  # after the snapshot's updated_at
    assert agent.end_time_unix_nano == to_unix_nanos(last_end)
    assert agent.attributes == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "triage",
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
        "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.conversation.id": "run-42",
        "gen_ai.usage.input_tokens": 2400,
        "gen_ai.usage.output_tokens": 160,
        "runcap.run_id": "run-42",
        "runcap.kind": "run",
        "runcap.task": "triage",
        "runcap.run.status": "completed",
        "runcap.run.steps": 2,
        "runcap.run.tool_calls": 1,
        "runcap.run.cost_usd": "0.000456000",
        "runcap.run.max_usd": "0.500000000",
        "runcap.run.max_steps": 20,
    }
    # The run goes on (another turn) and ends again, then an operator cancels it: no second span
    # with the same id.
    more = model_span(step=3, started_at=T0 + timedelta(seconds=9))
    sink.write([more], [snapshot("completed", steps=3, updated_at=T0 + timedelta(seconds=10))], "b2")
    sink.write([], [snapshot("cancelled", steps=3, updated_at=T0 + timedelta(seconds=11))], "b3")
    sink.close()
    assert receiver.requests == 2  # b3 had nothing left to send
    assert [s.name for s in receiver.spans].count("invoke_agent triage") == 1
    assert receiver.spans[-1].span_id == more.span_id and receiver.spans[-1].parent_span_id == agent.span_id


def test_a_failed_export_keeps_the_agent_span_for_the_retry(receiver: OTLPReceiver) -> None:
    receiver.fail_with(400)  # not retried inside the exporter: the sink error comes at once
    sink = OTLPSink(receiver.endpoint, timeout_s=1)
    run = snapshot("budget_exceeded", task="")
    with pytest.raises(SinkError):
        sink.write([], [run], "b1")
    receiver.fail_with(None)
    sink.write([], [run], "b1")  # the lane retries the same batch
    sink.close()
    (agent,) = receiver.spans
    # No task: the conventions' name without an agent name. Stopped by a cap: an error.
    assert agent.name == "invoke_agent" and "gen_ai.agent.name" not in agent.attributes
    assert agent.status_code == PbStatus.STATUS_CODE_ERROR and agent.status_message == "budget_exceeded"
    assert agent.attributes["error.type"] == "budget_exceeded"
    assert "gen_ai.provider.name" not in agent.attributes  # no model call in the batch names it


def test_a_run_without_a_run_id_has_no_agent_span(receiver: OTLPReceiver) -> None:
    one = model_span(run_id="gen-1", attributes={"generated_run_id": "true"})
    sink = OTLPSink(receiver.endpoint)
    sink.write([one], [snapshot("completed", run_id="gen-1")], "b")
    sink.close()
    (got,) = receiver.spans
    assert got.span_id == one.span_id and got.parent_span_id == ""


def test_a_run_tree_is_one_trace_with_each_invoke_agent_under_its_parents(
    receiver: OTLPReceiver, tmp_path: Path
) -> None:
    """planner → researcher → fact-checker, through the WAL and the shipper: one trace (the
    root's), each sub-agent's `invoke_agent` span the child of its parent's (ids derived from run
    ids), each run's model and tool spans under its own `invoke_agent`; the children end first,
    in batches of their own, as a tree's runs do."""
    tree = [("planner", "", ""), ("researcher", "planner", "planner"), ("checker", "researcher", "planner")]
    writer = WalWriter(tmp_path)
    shipper = Shipper(tmp_path, sinks=[OTLPSink(receiver.endpoint)], batch_size=2, flush_interval_s=0.05)
    steps: dict[str, list[Span]] = {}
    for run_id, parent, root in reversed(tree):  # the deepest ends first
        call = model_span(run_id=run_id, parent_run_id=parent, root_run_id=root)
        tool = Span(run_id=run_id, kind="tool", step=1, started_at=T0, tool_name="search",
                    parent_run_id=parent, root_run_id=root)  # fmt: skip
        steps[run_id] = [call, tool]
        writer.append_step([call, tool], [snapshot("completed", run_id=run_id, parent_run_id=parent,
                                                   root_run_id=root)])  # fmt: skip
    shipper.start()
    got = receiver.wait_for(9)
    shipper.stop()
    writer.close()
    assert {s.trace_id for s in got} == {f"{trace_id_for_run('planner')}"}
    agents = {s.attributes["runcap.run_id"]: s for s in got if s.name == "invoke_agent triage"}
    assert agents["planner"].parent_span_id == ""
    assert agents["researcher"].parent_span_id == agents["planner"].span_id == agent_span_id("planner")
    assert agents["checker"].parent_span_id == agents["researcher"].span_id == agent_span_id("researcher")
    assert agents["checker"].attributes["runcap.parent_run_id"] == "researcher"
    assert agents["checker"].attributes["runcap.root_run_id"] == "planner"
    assert "runcap.parent_run_id" not in agents["planner"].attributes
    by_id = {s.span_id: s for s in got}
    for run_id, run_steps in steps.items():
        for step in run_steps:
            assert by_id[step.span_id].parent_span_id == agent_span_id(run_id), (run_id, step.kind)


def test_a_caps_change_is_an_internal_span_named_by_its_kind() -> None:
    span = Span(run_id="r", kind="caps_change", step=2, started_at=T0, endpoint="POST /runs/{id}/caps")
    assert span_name(span) == "caps_change" and operation_for(span) == ""


def test_span_with_malformed_id_is_skipped_not_retried(receiver: OTLPReceiver) -> None:
    good, bad = model_span(), model_span(span_id="xyz")
    sink = OTLPSink(receiver.endpoint)
    sink.write([bad, good], [], "b")
    sink.close()
    assert [s.span_id for s in receiver.spans] == [good.span_id]


def test_collector_down_raises_sink_error(receiver: OTLPReceiver) -> None:
    receiver.fail_with(400)
    sink = OTLPSink(receiver.endpoint, timeout_s=1)
    with pytest.raises(SinkError, match="OTLP export of batch b1"):
        sink.write([model_span()], [], "b1")
    sink.close()


def test_wal_holds_spans_while_collector_fails_then_exports_same_ids(
    receiver: OTLPReceiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint + "/")
    sink = OTLPSink(timeout_s=0.5)
    assert sink.endpoint == receiver.endpoint + "/v1/traces"
    receiver.fail_with(503)
    writer = WalWriter(tmp_path)
    shipper = Shipper(
        tmp_path, sinks=[sink], batch_size=3, flush_interval_s=0.05, retry_initial_s=0.05, retry_max_s=0.2
    )
    shipper.start()
    spans = [model_span(step=i, started_at=T0 + timedelta(milliseconds=i)) for i in range(1, 8)]
    for s in spans:
        writer.append_step([s])
    deadline = time.monotonic() + 5
    while shipper.stats()["sinks"]["otlp"]["errors"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = shipper.stats()["sinks"]["otlp"]
    assert stats["errors"] >= 2 and stats["unshipped_bytes"] > 0 and receiver.spans == []
    receiver.fail_with(None)
    got = receiver.wait_for(7)
    shipper.stop()
    writer.close()
    assert sorted(s.span_id for s in got) == sorted(s.span_id for s in spans)
    assert {s.start_time_unix_nano for s in got} == {to_unix_nanos(s.started_at) for s in spans}


@pytest.mark.parametrize(
    ("kind", "endpoint", "operation"),
    [
        ("model", "chat.completions", "chat"),
        ("model", "responses", "chat"),
        ("model", "messages", "chat"),
        ("model", "embeddings", "embeddings"),
        ("model", "completions", "text_completion"),
        ("model", "", "chat"),
        ("tool_result", "", "execute_tool"),
        ("caps_change", "POST /runs/{id}/caps", ""),
    ],
)
def test_operation_from_endpoint(kind: str, endpoint: str, operation: str) -> None:
    span = Span(run_id="r", kind=kind, step=1, started_at=T0, endpoint=endpoint)
    assert operation_for(span) == operation


def test_traces_endpoint_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert traces_endpoint() == "http://127.0.0.1:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9999/custom")
    assert traces_endpoint() == "http://127.0.0.1:9999/custom"
    assert traces_endpoint("http://127.0.0.1:1/") == "http://127.0.0.1:1/v1/traces"


def test_an_mcp_call_follows_the_mcp_conventions_and_carries_its_events(receiver: OTLPReceiver) -> None:
    """An MCP `tools/call` is a CLIENT span `tools/call {tool}` with the MCP and JSON-RPC
    attributes next to GenAI's `execute_tool` ones; a `/tools` call stays `execute_tool {tool}`.
    Each span's events arrive as OTLP span events with their time and attributes."""
    from proxy.spans.model import SpanEvent

    mcp = Span(
        run_id="run-42", kind="tool", step=1, started_at=T0, tool_name="refund", tool_call_id="call_1",
        attributes={"mcp.server": "crm", "mcp.method.name": "tools/call", "jsonrpc.request.id": "7",
                    "mcp.session.id": "s-1", "mcp.protocol.version": "2025-11-25"},
        events=[
            SpanEvent("policy.decision", T0 + timedelta(microseconds=5), {"effect": "approve", "rule": "0"}),
            SpanEvent("approval.decided", T0 + timedelta(seconds=2), {"approval.state": "approved"}),
        ],
    )  # fmt: skip
    http = Span(run_id="run-42", kind="tool", step=1, started_at=T0, tool_name="refund",
                tool_call_id="call_2")  # fmt: skip
    sink = OTLPSink(receiver.endpoint, timeout_s=2)
    sink.write([mcp, http], [], "batch-1")
    got = {s.span_id: s for s in receiver.wait_for(2)}
    sink.close()

    m = got[mcp.span_id]
    assert m.name == "tools/call refund" and m.kind == PbSpan.SPAN_KIND_CLIENT
    expected = {
        "mcp.method.name": "tools/call", "mcp.session.id": "s-1", "mcp.protocol.version": "2025-11-25",
        "jsonrpc.request.id": "7", "jsonrpc.protocol.version": "2.0", "network.transport": "tcp",
        "network.protocol.name": "http", "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "refund", "gen_ai.tool.call.id": "call_1", "runcap.attr.mcp.server": "crm",
    }  # fmt: skip
    assert {k: m.attributes.get(k) for k in expected} == expected
    start = to_unix_nanos(T0)
    assert m.events == [
        ("policy.decision", start + 5_000, {"effect": "approve", "rule": "0"}),
        ("approval.decided", start + 2_000_000_000, {"approval.state": "approved"}),
    ]

    h = got[http.span_id]
    assert h.name == "execute_tool refund" and h.kind == PbSpan.SPAN_KIND_INTERNAL
    assert h.events == [] and "mcp.method.name" not in h.attributes
    assert "network.transport" not in h.attributes
