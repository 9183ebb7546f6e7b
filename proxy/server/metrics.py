"""Prometheus metrics (`GET /metrics`) and the step that feeds them.

One registry per app (tests build several apps in one process). With `serve --workers N` each
worker exports its own series; scrape every worker or sum them in Prometheus.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.money import NANOS_PER_USD

if TYPE_CHECKING:
    from proxy.ledger.base import Settlement
    from proxy.server.flow import Flow
    from proxy.spans.pipeline import SpanPipeline

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
_LEDGER_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25)


# Model names come from clients and upstreams: bound the label values (and so the series).
MAX_MODEL_LABELS = 200


class Metrics:
    def __init__(self) -> None:
        self._models: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "runcap_requests", "Requests answered, by upstream, endpoint and status.",
            ["upstream", "endpoint", "status"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "runcap_request_duration_seconds", "Time from request in to last byte out.",
            ["upstream", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "runcap_rejections", "Calls refused by runcap, by reason (cap code, deadline, cancel...).",
            ["reason"], registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "runcap_tokens", "Tokens settled, by model and kind (input, output, cache_read, cache_write).",
            ["model", "kind"], registry=r,
        )  # fmt: skip
        self.cost = Counter("runcap_cost_usd", "Dollars settled, by model.", ["model"], registry=r)
        self.unpriced = Counter(
            "runcap_unpriced_calls", "Calls settled without a known price.", ["model"], registry=r
        )
        self.ledger_latency = Histogram(
            "runcap_ledger_op_seconds", "Run-ledger operation latency.", ["op"],
            buckets=_LEDGER_BUCKETS, registry=r,
        )  # fmt: skip
        self.clamped = Counter("runcap_clamped_calls", "Calls whose output limit runcap lowered.", registry=r)
        self.final_steps = Counter("runcap_final_steps", "Answer-only final steps enforced.", registry=r)
        self.in_flight = Gauge("runcap_in_flight", "Upstream calls in flight.", registry=r)
        self.tool_calls = Counter(
            "runcap_tool_calls", "Calls through /tools, by tool and outcome (ok, error, replayed, ...).",
            ["tool", "outcome"], registry=r,
        )  # fmt: skip
        self.tool_replays = Counter(
            "runcap_tool_replays", "Side-effecting tool calls answered from their idempotency record.",
            ["tool"], registry=r,
        )  # fmt: skip
        self.tool_unknown = Counter(
            "runcap_tool_unknown_outcomes",
            "Side-effecting tool calls cut in flight (cancel, timeout, reset): outcome unknown "
            "until reconciled.",
            ["tool"], registry=r,
        )  # fmt: skip

    def watch_pipeline(self, pipeline: SpanPipeline) -> None:
        """Export the span pipeline's queue, spools and sink errors, read at scrape time."""
        self.registry.register(_PipelineCollector(pipeline))

    def ledger_op(self, op: str, seconds: float) -> None:
        self.ledger_latency.labels(op).observe(seconds)

    def _model(self, model: str) -> str:
        if model in self._models:
            return model
        if len(self._models) < MAX_MODEL_LABELS:
            self._models.add(model)
            return model
        return "other"

    def settled(self, flow: Flow, s: Settlement) -> None:
        model = self._model(
            (flow.response_info.model if flow.response_info else "") or (flow.info.model if flow.info else "")
        )
        usage = flow.usage
        if usage is not None:
            for kind, n in (
                ("input", usage.input_tokens),
                ("output", usage.output_tokens),
                ("cache_read", usage.cache_read_tokens),
                ("cache_write", usage.cache_write_tokens),
            ):
                if n:
                    self.tokens.labels(model, kind).inc(n)
        if s.cost_usd_nanos:
            self.cost.labels(model).inc(s.cost_usd_nanos / NANOS_PER_USD)
        if not flow.price_known:
            self.unpriced.labels(model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsStep:
    """Counts every finished request."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    async def request(self, flow: Flow) -> None:
        if flow.clamped_to is not None:
            self.m.clamped.inc()
        if flow.final_step:
            self.m.final_steps.inc()

    async def response(self, flow: Flow) -> None:
        pass

    async def done(self, flow: Flow) -> None:
        self.m.requests.labels(flow.upstream.name, flow.endpoint, str(flow.status)).inc()
        self.m.latency.labels(flow.upstream.name, flow.endpoint).observe(flow.duration_ms / 1000.0)


class _PipelineCollector(Collector):
    def __init__(self, pipeline: SpanPipeline) -> None:
        self.pipeline = pipeline

    def collect(self) -> Iterator[Metric]:
        st = self.pipeline.stats()
        yield GaugeMetricFamily("runcap_span_queue_depth", "Records waiting in memory.", value=st.queue_depth)
        yield CounterMetricFamily(
            "runcap_span_overflowed", "Records spooled because the queue was full.", value=st.overflowed
        )
        per_sink = {
            "runcap_spool_records": ("Records spooled on disk, waiting for the sink.", "spooled_records"),
            "runcap_spool_bytes": ("Bytes spooled on disk, waiting for the sink.", "spooled_bytes"),
            "runcap_spool_oldest_age_seconds": ("Age of the oldest spooled record.", "oldest_spooled_age_s"),
        }
        for name, (doc, attr) in per_sink.items():
            g = GaugeMetricFamily(name, doc, labels=["sink"])
            for sink, s in st.sinks.items():
                g.add_metric([sink], getattr(s, attr))
            yield g
        counters = {
            "runcap_sink_errors": ("Failed writes to a sink (replays included).", "errors"),
            "runcap_sink_records_written": ("Records a sink took.", "records_written"),
            "runcap_sink_dropped": ("Records lost because the spool could not be written.", "dropped"),
        }
        for name, (doc, attr) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["sink"])
            for sink, s in st.sinks.items():
                c.add_metric([sink], getattr(s, attr))
            yield c
