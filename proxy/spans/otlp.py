"""OTLP export of runcap's spans: the same steps that go to ClickHouse, as OpenTelemetry spans
following the GenAI semantic conventions, sent over OTLP/HTTP protobuf.

`OTLPSink` is a `SpanSink`, another end of the one span pipe: the shipper batches the write-ahead
log for it and retries exactly as for ClickHouse. Each Span keeps its own trace id, span id, parent and
start time (nanosecond-exact from the microsecond `started_at`), so a trace in the collector
matches the rows in `runcap.spans`. Run snapshots are state, not events, and are not exported.

Names and attributes (GenAI semconv): model calls are CLIENT spans named `{operation} {model}`
with `gen_ai.operation.name` = `chat` (chat/completions, responses, messages), `embeddings` or
`text_completion` (legacy completions), chosen by the endpoint; tool spans (`tool`, `tool_call`,
`tool_result`) are INTERNAL spans named `execute_tool {tool_name}`. `gen_ai.system` is set next to
`gen_ai.provider.name` for collectors that predate the rename. runcap's own fields travel as
`runcap.*`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from proxy.spans.model import RunSnapshot, Span
from proxy.spans.sink import SinkError

log = logging.getLogger(__name__)

TOOL_KINDS = ("tool", "tool_call", "tool_result")
# Span attributes named by the OpenTelemetry MCP conventions: exported under their own names.
_SEMCONV_ATTRIBUTES = frozenset(
    {"mcp.method.name", "mcp.session.id", "mcp.protocol.version", "jsonrpc.request.id"}
)
_OK_OUTCOMES = ("ok", "replayed")
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
    if span.kind in TOOL_KINDS:
        return "execute_tool"
    # span.endpoint is the adapter's name: chat.completions, responses, messages, completions,
    # embeddings.
    return _OPERATIONS.get(span.endpoint, "chat")


def span_name(span: Span) -> str:
    operation = operation_for(span)
    target = span.tool_name if operation == "execute_tool" else span.model
    return f"{operation} {target}" if target else operation


def to_unix_nanos(moment: datetime) -> int:
    """Exact: integer microseconds since the epoch, times 1000 (no float rounding)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // timedelta(microseconds=1) * 1000


def span_attributes(span: Span) -> dict[str, str | int | bool]:
    operation = operation_for(span)
    attrs: dict[str, str | int | bool] = {"gen_ai.operation.name": operation}
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
    if span.ttft_ms is not None:
        attrs["runcap.ttft_ms"] = str(span.ttft_ms)
    for key, value in span.attributes.items():
        name = key if key in _SEMCONV_ATTRIBUTES else f"runcap.attr.{key}"
        attrs.setdefault(name, value)
    return attrs


def _hex_id(value: str, digits: int, what: str) -> int:
    number = int(value, 16) if len(value) == digits else 0
    if not number:
        raise ValueError(f"{what} {value!r} is not {digits} hex digits (and not all zero)")
    return number


def to_readable_span(span: Span, resource: Resource) -> ReadableSpan:
    trace_id = _hex_id(span.trace_id, 32, "trace_id")
    flags = TraceFlags(TraceFlags.SAMPLED)
    context = SpanContext(trace_id, _hex_id(span.span_id, 16, "span_id"), False, flags)
    parent = (
        SpanContext(trace_id, _hex_id(span.parent_span_id, 16, "parent_span_id"), False, flags)
        if span.parent_span_id
        else None
    )
    start = to_unix_nanos(span.started_at)
    end = start + round(span.duration_ms * 1_000_000)
    ok = span.outcome in _OK_OUTCOMES
    return ReadableSpan(
        name=span_name(span),
        context=context,
        parent=parent,
        resource=resource,
        attributes=span_attributes(span),
        kind=SpanKind.INTERNAL if span.kind in TOOL_KINDS else SpanKind.CLIENT,
        status=Status(StatusCode.UNSET) if ok else Status(StatusCode.ERROR, span.error or span.outcome),
        start_time=start,
        end_time=end,
        instrumentation_scope=_SCOPE,
    )


class OTLPSink:
    """A SpanSink exporting to an OTLP/HTTP (protobuf) endpoint, synchronously on the shipper's
    lane thread. OTLP receivers do not deduplicate, so a batch the collector took but whose reply
    was lost is exported again on retry: at-least-once here, unlike ClickHouse."""

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
    ) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self.endpoint = traces_endpoint(endpoint)
        self._resource = Resource.create({"service.name": service_name, **(resource_attributes or {})})
        self._exporter = exporter or OTLPSpanExporter(
            endpoint=self.endpoint, headers=dict(headers) if headers else None, timeout=timeout_s
        )

    def write(self, spans: Sequence[Span], runs: Sequence[RunSnapshot], batch_id: str) -> None:
        if not spans:
            return
        readable = []
        for span in spans:
            try:
                readable.append(to_readable_span(span, self._resource))
            except ValueError as exc:
                # a malformed id can never export; retrying would block the lane for good
                log.error("OTLP: skipping span %r of run %r: %s", span.span_id, span.run_id, exc)
        if not readable:
            return
        result = self._exporter.export(readable)
        if result is not SpanExportResult.SUCCESS:
            raise SinkError(f"OTLP export of batch {batch_id} ({len(spans)} spans) to {self.endpoint} failed")

    def close(self) -> None:
        self._exporter.shutdown()
