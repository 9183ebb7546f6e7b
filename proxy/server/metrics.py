"""Prometheus metrics (`GET /metrics`) and the step that feeds them.

One registry per app (tests build several apps in one process). With `serve --workers N` each
worker exports its own series; scrape every worker or sum them in Prometheus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy.money import NANOS_PER_USD

if TYPE_CHECKING:
    from proxy.ledger.base import Settlement
    from proxy.server.flow import Flow

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


class Metrics:
    def __init__(self) -> None:
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

    def gauge_fn(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """Export a value read at scrape time (pipeline queue depth, spool size, ...)."""
        Gauge(name, doc, registry=self.registry).set_function(fn)

    def ledger_op(self, op: str, seconds: float) -> None:
        self.ledger_latency.labels(op).observe(seconds)

    def settled(self, flow: Flow, s: Settlement) -> None:
        model = (flow.response_info.model if flow.response_info else "") or (
            flow.info.model if flow.info else ""
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
