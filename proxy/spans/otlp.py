"""OTLP export of runcap's spans: the same steps that go to ClickHouse, as OpenTelemetry spans
following the GenAI semantic conventions, sent over OTLP/HTTP protobuf.

`OTLPSink` is a `SpanSink`, another end of the one span pipe: the shipper batches the write-ahead
log for it and retries exactly as for ClickHouse. Each Span keeps its own trace id, span id and
start time (nanosecond-exact from the microsecond `started_at`), so a trace in the collector
matches the rows in `runcap.spans`.

The run is the agent invocation: one INTERNAL span `invoke_agent {task}` (`invoke_agent` for a
run without `X-Run-Task`: the conventions' name when there is no agent name — a run id would make
span names unbounded) per run, the parent of its steps. Its span id is derived from the run id
(`agent_span_id`, like the trace id), so a step names it as parent from the first step on, on any
replica; in ClickHouse those steps keep `parent_span_id = ''` (the run is a `runcap.runs` row, not
a span). A run has no explicit end, so the span is exported once, from the first run snapshot in
the WAL that shows the run ended (`completed` or stopped by a cap, deadline or cancel): it spans
`started_at` to that snapshot's `updated_at` and carries the run's totals. Its content comes only
from the batch that holds that snapshot, so a batch shipped again after a crash sends the same
span byte for byte (backends drop such repeats, as they do for the steps). Runs with a generated
id (requests without `X-Run-Id`: one call each) get no agent span; their step stays the root.

Run trees (issue 22): a tree is one trace, its root's (the trace id comes from the root run id:
`Span.trace_id`), and a sub-agent's `invoke_agent` span is a child of its parent run's
`invoke_agent` span (`agent_span_id(parent_run_id)`: derived, so replicas agree without asking
each other); a run's model and tool spans stay under its own `invoke_agent`. The parent's span
may be exported later than the child's (the parent ends last): trace backends join them by id.

Names and attributes (GenAI semconv): model calls are CLIENT spans named `{operation} {model}`
with `gen_ai.operation.name` = `chat` (chat/completions, responses, messages), `embeddings` or
`text_completion` (legacy completions), chosen by the endpoint; tool spans (`tool`, `tool_call`,
`tool_result`) are INTERNAL spans named `execute_tool {gen_ai.tool.name}`, with
`gen_ai.operation.name = execute_tool`, `gen_ai.tool.name`, `gen_ai.tool.call.id`; other step
events (an operator's `caps_change`) are INTERNAL spans named by their kind. An MCP call (a span
with `mcp.method.name`, proxy/mcp/tools_call.py) follows the MCP conventions instead: a CLIENT
span (runcap is the client of the MCP server) named `{mcp.method.name} {target}` (`tools/call
refund`), with `mcp.method.name`, `mcp.session.id`, `mcp.protocol.version`, `jsonrpc.request.id`,
`jsonrpc.protocol.version = "2.0"`, `network.transport = "tcp"`, `network.protocol.name = "http"`
next to the GenAI `execute_tool` attributes. A span's `events` (a policy's verdict, an approval)
are exported as OTLP span events: name, time, attributes. Cost follows the open proposal
(semantic-conventions-genai PR 443, provisional): `gen_ai.usage.cost.amount` (USD, a double),
`gen_ai.usage.cost.currency = "USD"`, `gen_ai.usage.cost.source = "local"` on model spans with a
known price. `gen_ai.system` is set next to `gen_ai.provider.name` for collectors that predate the
rename. runcap's own fields travel as `runcap.*`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from proxy.spans.model import RunSnapshot, Span, trace_id_for_run
from proxy.spans.sink import SinkError

log = logging.getLogger(__name__)

TOOL_KINDS = ("tool", "tool_call", "tool_result")
# Span attributes named by the OpenTelemetry MCP conventions: exported under their own names.
_SEMCONV_ATTRIBUTES = frozenset(
    {"mcp.method.name", "mcp.session.id", "mcp.protocol.version", "jsonrpc.request.id", "mcp.resource.uri"}
)
# What an MCP span adds under the MCP conventions: JSON-RPC 2.0 over Streamable HTTP.
_MCP_TRANSPORT = {
    "jsonrpc.protocol.version": "2.0", "network.transport": "tcp", "network.protocol.name": "http"
}  # fmt: skip
_OK_OUTCOMES = ("ok", "replayed")
# Run statuses that end an agent invocation; the last three are failures (error.type = status).
# A run stopped at its step, tool-call or repeat cap ended with an answer (the answer-only final
# step).
ENDED_STATUSES = (
    "completed", "steps_exceeded", "tool_calls_exceeded", "budget_exceeded", "deadline_exceeded", "cancelled",
    "repeats_exceeded",
)  # fmt: skip
_FAILED_STATUSES = ("budget_exceeded", "deadline_exceeded", "cancelled")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SCOPE = InstrumentationScope("runcap", "0.1.0")


def traces_endpoint(base: str | None = None) -> str:
    """`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as is, else `OTEL_EXPORTER_OTLP_ENDPOINT` (or `base`)
    + `/v1/traces`, as the OTLP exporter specification says."""
    if base is None:
        explicit = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if explicit:
            return explicit
        base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


_OPERATIONS = {"embeddings": "embeddings", "completions": "text_completion"}


def operation_for(span: Span) -> str:
    """The GenAI operation of a step; '' for a step event that is none (a `caps_change`)."""
    if span.kind in TOOL_KINDS:
        return "execute_tool"
    if span.kind != "model":
        return ""
    # span.endpoint is the adapter's name: chat.completions, responses, messages, completions,
    # embeddings.
    return _OPERATIONS.get(span.endpoint, "chat")


def span_name(span: Span) -> str:
    method = span.attributes.get("mcp.method.name")
    if method:  # MCP conventions: `{mcp.method.name} {target}`, the target being the tool
        return f"{method} {span.tool_name}" if span.tool_name else method
    operation = operation_for(span)
    if not operation:
        return span.kind
    target = span.tool_name if operation == "execute_tool" else span.model
    return f"{operation} {target}" if target else operation


def agent_span_id(run_id: str) -> str:
    """The span id of the run's `invoke_agent` span: derived from the run id (as its trace id is),
    so every step, recorded by any process at any time, names the same parent."""
    digest = hashlib.sha256(b"runcap-agent:" + run_id.encode()).hexdigest()[:16]
    return digest if int(digest, 16) else "0000000000000001"


def _generated(span: Span) -> bool:
    return span.attributes.get("generated_run_id") == "true"


def otlp_parent(span: Span) -> str:
    """The parent id sent over OTLP: the span's own parent (a tool call or result: its model
    call), else the run's agent span — unless the span is not in its run's derived trace, or its
    run id was generated (a one-call run has no agent span)."""
    if span.parent_span_id:
        return span.parent_span_id
    if _generated(span) or span.trace_id != trace_id_for_run(span.root_run_id or span.run_id):
        return ""
    return agent_span_id(span.run_id)


def to_unix_nanos(moment: datetime) -> int:
    """Exact: integer microseconds since the epoch, times 1000 (no float rounding)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // timedelta(microseconds=1) * 1000


def span_attributes(span: Span) -> dict[str, str | int | bool | float]:
    operation = operation_for(span)
    attrs: dict[str, str | int | bool | float] = {}
    if operation:
        attrs["gen_ai.operation.name"] = operation
    if span.provider:
        attrs["gen_ai.provider.name"] = span.provider
        attrs["gen_ai.system"] = span.provider
    if span.model:
        attrs["gen_ai.request.model"] = span.model
        attrs["gen_ai.response.model"] = span.model
    if span.kind == "model":
        attrs["gen_ai.usage.input_tokens"] = span.input_tokens
        attrs["gen_ai.usage.output_tokens"] = span.output_tokens
        if span.cache_read_tokens:
            attrs["gen_ai.usage.cache_read.input_tokens"] = span.cache_read_tokens
        if span.cache_write_tokens:
            attrs["gen_ai.usage.cache_creation.input_tokens"] = span.cache_write_tokens
        if span.reasoning_tokens:
            attrs["gen_ai.usage.reasoning.output_tokens"] = span.reasoning_tokens
        if span.price_known:
            # Provisional (semantic-conventions-genai PR 443): priced by runcap, not the provider.
            attrs["gen_ai.usage.cost.amount"] = float(span.cost_usd)
            attrs["gen_ai.usage.cost.currency"] = "USD"
            attrs["gen_ai.usage.cost.source"] = "local"
    if span.tool_name:
        attrs["gen_ai.tool.name"] = span.tool_name
        attrs["gen_ai.tool.type"] = "function"
    if span.tool_call_id:
        attrs["gen_ai.tool.call.id"] = span.tool_call_id
    attrs["gen_ai.conversation.id"] = span.run_id
    if span.status_code:
        attrs["http.response.status_code"] = span.status_code
    if span.outcome not in _OK_OUTCOMES:
        attrs["error.type"] = span.outcome
    # runcap's own columns, so the OTLP trace answers the same questions as ClickHouse
    attrs["runcap.run_id"] = span.run_id
    attrs["runcap.step"] = span.step
    attrs["runcap.kind"] = span.kind
    attrs["runcap.outcome"] = span.outcome
    attrs["runcap.cost_usd"] = str(span.cost_usd)  # a decimal string: OTLP has no decimal type
    attrs["runcap.price_known"] = span.price_known
    optional = {
        "runcap.task": span.task,
        "runcap.endpoint": span.endpoint,
        "runcap.error": span.error,
        "runcap.args_hash": span.args_hash,
        "runcap.result_hash": span.result_hash,
        "runcap.idempotency_key": span.idempotency_key,
        "runcap.request_hash": span.request_hash,
        "runcap.response_hash": span.response_hash,
    }
    attrs.update({k: v for k, v in optional.items() if v})
    if span.parent_run_id:  # a sub-agent's step: its place in the tree (a root's adds nothing)
        attrs["runcap.parent_run_id"] = span.parent_run_id
        attrs["runcap.root_run_id"] = span.root_run_id
    if span.ttft_ms is not None:
        attrs["runcap.ttft_ms"] = str(span.ttft_ms)
    for key, value in span.attributes.items():
        name = key if key in _SEMCONV_ATTRIBUTES else f"runcap.attr.{key}"
        attrs.setdefault(name, value)
    if "mcp.method.name" in span.attributes:
        for key, value in _MCP_TRANSPORT.items():
            attrs.setdefault(key, value)
    return attrs


def span_kind(span: Span) -> SpanKind:
    """CLIENT for a call runcap makes (a model call; an MCP request, runcap being the client of
    the MCP server), INTERNAL otherwise."""
    client = span.kind == "model" or "mcp.method.name" in span.attributes
    return SpanKind.CLIENT if client else SpanKind.INTERNAL


def span_events(span: Span) -> tuple[Event, ...]:
    """The span's events as OTLP span events (their attributes under their own names)."""
    return tuple(
        Event(event.name, dict(event.attributes), timestamp=to_unix_nanos(event.at)) for event in span.events
    )


def _hex_id(value: str, digits: int, what: str) -> int:
    number = int(value, 16) if len(value) == digits else 0
    if not number:
        raise ValueError(f"{what} {value!r} is not {digits} hex digits (and not all zero)")
    return number


def to_readable_span(span: Span, resource: Resource) -> ReadableSpan:
    trace_id = _hex_id(span.trace_id, 32, "trace_id")
    flags = TraceFlags(TraceFlags.SAMPLED)
    context = SpanContext(trace_id, _hex_id(span.span_id, 16, "span_id"), False, flags)
    parent_id = otlp_parent(span)
    parent = None
    if parent_id:
        parent = SpanContext(trace_id, _hex_id(parent_id, 16, "parent_span_id"), False, flags)
    start = to_unix_nanos(span.started_at)
    end = start + round(span.duration_ms * 1_000_000)
    ok = span.outcome in _OK_OUTCOMES
    return ReadableSpan(
        name=span_name(span),
        context=context,
        parent=parent,
        resource=resource,
        attributes=span_attributes(span),
        kind=span_kind(span),
        status=Status(StatusCode.UNSET) if ok else Status(StatusCode.ERROR, span.error or span.outcome),
        start_time=start,
        end_time=end,
        events=span_events(span),
        instrumentation_scope=_SCOPE,
    )


def agent_attributes(run: RunSnapshot, steps: Sequence[Span]) -> dict[str, str | int | bool | float]:
    """The run as an `invoke_agent` span's attributes: its identity, totals and caps. `steps` are
    the run's spans in the same batch (the model call that ended the run is in the snapshot's own
    WAL record), which name the provider and model."""
    task = run.task or next((s.task for s in reversed(steps) if s.task), "")
    attrs: dict[str, str | int | bool | float] = {"gen_ai.operation.name": "invoke_agent"}
    if task:
        attrs["gen_ai.agent.name"] = task
    model_call = next((s for s in reversed(steps) if s.kind == "model" and s.provider), None)
    if model_call is not None:
        attrs["gen_ai.provider.name"] = model_call.provider
        attrs["gen_ai.system"] = model_call.provider
        if model_call.model:
            attrs["gen_ai.request.model"] = model_call.model
    attrs["gen_ai.conversation.id"] = run.run_id
    # The run's totals (recommended on agent spans). Cost stays off gen_ai.usage.cost.*: that is
    # the model spans' (summing it over a trace must not count the run twice).
    attrs["gen_ai.usage.input_tokens"] = run.input_tokens
    attrs["gen_ai.usage.output_tokens"] = run.output_tokens
    if run.status in _FAILED_STATUSES:
        attrs["error.type"] = run.status
    attrs["runcap.run_id"] = run.run_id
    attrs["runcap.kind"] = "run"
    if run.parent_run_id:
        attrs["runcap.parent_run_id"] = run.parent_run_id
        attrs["runcap.root_run_id"] = run.root_run_id
    if task:
        attrs["runcap.task"] = task
    attrs["runcap.run.status"] = run.status
    attrs["runcap.run.steps"] = run.steps
    attrs["runcap.run.tool_calls"] = run.tool_calls
    attrs["runcap.run.cost_usd"] = format(run.cost_usd, "f")
    caps = {
        "runcap.run.max_usd": None if run.max_usd is None else format(run.max_usd, "f"),
        "runcap.run.max_tokens": run.max_tokens,
        "runcap.run.max_steps": run.max_steps,
        "runcap.run.max_tool_calls": run.max_tool_calls,
        "runcap.run.deadline": None if run.deadline is None else run.deadline.isoformat(),
    }
    attrs.update({k: v for k, v in caps.items() if v is not None})
    return attrs


def agent_span(run: RunSnapshot, steps: Sequence[Span], resource: Resource) -> ReadableSpan:
    """The run's `invoke_agent` span, from the snapshot that ended it: from the run's start in
    the ledger (taken as its first request is admitted, a little after that step's span starts:
    the earliest step in the batch when earlier) to that snapshot's update (or the end of its last
    step in the batch, when later)."""
    flags = TraceFlags(TraceFlags.SAMPLED)
    trace_id = _hex_id(trace_id_for_run(run.root_run_id or run.run_id), 32, "trace_id")
    context = SpanContext(trace_id, _hex_id(agent_span_id(run.run_id), 16, "span_id"), False, flags)
    parent = None
    if run.parent_run_id:  # a sub-agent: under the invocation of the run that spawned it
        parent = SpanContext(trace_id, _hex_id(agent_span_id(run.parent_run_id), 16, "parent"), False, flags)
    starts = [to_unix_nanos(s.started_at) for s in steps]
    start = min([to_unix_nanos(run.started_at), *starts])
    ends = [at + round(s.duration_ms * 1_000_000) for at, s in zip(starts, steps, strict=True)]
    end = max([start, to_unix_nanos(run.updated_at), *ends])
    attributes = agent_attributes(run, steps)
    name = attributes.get("gen_ai.agent.name")
    failed = run.status in _FAILED_STATUSES
    return ReadableSpan(
        name=f"invoke_agent {name}" if name else "invoke_agent",
        context=context,
        parent=parent,
        resource=resource,
        attributes=attributes,
        kind=SpanKind.INTERNAL,
        status=Status(StatusCode.ERROR, run.status) if failed else Status(StatusCode.UNSET),
        start_time=start,
        end_time=end,
        instrumentation_scope=_SCOPE,
    )


class OTLPSink:
    """A SpanSink exporting to an OTLP/HTTP (protobuf) endpoint, synchronously on the shipper's
    lane thread. OTLP receivers do not deduplicate, so a batch the collector took but whose reply
    was lost is exported again on retry: at-least-once here, unlike ClickHouse — the same spans
    with the same ids and content, which trace backends collapse.

    The sink remembers (bounded, in memory) the runs whose `invoke_agent` span it exported, so a
    run that continues after it ended (another turn under the same run id, an operator's top-up)
    does not get a second, different span with the same id; after a restart such a run's next end
    exports it once more."""

    name = "otlp"

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        service_name: str = "runcap",
        resource_attributes: Mapping[str, str] | None = None,
        exporter: SpanExporter | None = None,
        remember_runs: int = 100_000,
    ) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self.endpoint = traces_endpoint(endpoint)
        self._resource = Resource.create({"service.name": service_name, **(resource_attributes or {})})
        self._exporter = exporter or OTLPSpanExporter(
            endpoint=self.endpoint, headers=dict(headers) if headers else None, timeout=timeout_s
        )
        self._agents_sent: OrderedDict[str, None] = OrderedDict()
        self._remember_runs = remember_runs

    def write(self, spans: Sequence[Span], runs: Sequence[RunSnapshot], batch_id: str) -> None:
        readable = []
        for span in spans:
            try:
                readable.append(to_readable_span(span, self._resource))
            except ValueError as exc:
                # a malformed id can never export; retrying would block the lane for good
                log.error("OTLP: skipping span %r of run %r: %s", span.span_id, span.run_id, exc)
        agents = self._agent_spans(spans, runs)
        readable += agents.values()
        if not readable:
            return
        result = self._exporter.export(readable)
        if result is not SpanExportResult.SUCCESS:
            raise SinkError(
                f"OTLP export of batch {batch_id} ({len(readable)} spans) to {self.endpoint} failed"
            )
        for run_id in agents:  # only once the collector has them: a failed batch is retried whole
            self._agents_sent[run_id] = None
        while len(self._agents_sent) > self._remember_runs:
            self._agents_sent.popitem(last=False)

    def _agent_spans(self, spans: Sequence[Span], runs: Sequence[RunSnapshot]) -> dict[str, ReadableSpan]:
        """The `invoke_agent` spans of the runs this batch shows ended for the first time."""
        sent = self._agents_sent
        ended: dict[str, RunSnapshot] = {}
        for r in runs:  # the first snapshot of the batch that shows the run ended
            if r.status in ENDED_STATUSES and r.run_id not in sent:
                ended.setdefault(r.run_id, r)
        if not ended:
            return {}
        steps: dict[str, list[Span]] = {}
        for span in spans:
            if span.run_id in ended:
                steps.setdefault(span.run_id, []).append(span)
        out = {}
        for run_id, run in ended.items():
            if any(_generated(s) for s in steps.get(run_id, ())):
                continue  # a one-call run: its step is the root (otlp_parent)
            out[run_id] = agent_span(run, steps.get(run_id, []), self._resource)
        return out

    def close(self) -> None:
        self._exporter.shutdown()
