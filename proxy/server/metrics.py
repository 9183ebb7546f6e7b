"""Prometheus metrics (`GET /metrics`) and the step that feeds them.

Two registries per app (tests build several apps in one process): `registry`, what this process
counts (requests, caps, its WAL appends, its ledger writes, its connections), and
`shipper_registry`, the span shipper's view (WAL on disk, sinks), the same whichever process reads
it. With `serve --workers N` any worker may answer a scrape: it answers for all of them, each
worker's series labelled `worker` and the shipper's view once (proxy/server/worker_metrics.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.ledger.pending import RESERVATION_KINDS
from proxy.money import NANOS_PER_USD
from proxy.server.flow import Flow, FlowStep

if TYPE_CHECKING:
    from proxy.ledger.base import Settlement
    from proxy.ledger.guarded import GuardedLedger
    from proxy.server.connections import ConnectionGuard
    from proxy.server.worker_metrics import WorkerSiblings
    from proxy.spans.setup import SpanSystem
    from proxy.spans.wal import WalWriter

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
_CONTEXT_BUCKETS = (1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 200000, 400000, 1000000)
_LEDGER_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25)
_ADDED_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


# Label values come from clients and upstreams (model names, tool names): each label of each
# metric takes at most this many distinct values and this many characters; any other value is
# counted under OVERFLOW_LABEL, so neither the series nor the exposition can grow without bound.
MAX_LABEL_VALUES = 200
MAX_LABEL_CHARS = 128
OVERFLOW_LABEL = "other"

_T = TypeVar("_T")


class _LabelValues:
    """The values one label has taken; a new one beyond the limit, or a too-long one, is "other"."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        self._seen: set[str] = set()
        self._limit = limit

    def __call__(self, value: object) -> str:
        text = str(value)
        if text in self._seen:
            return text
        if len(text) > MAX_LABEL_CHARS or len(self._seen) >= self._limit:
            return OVERFLOW_LABEL
        self._seen.add(text)
        return text


class Bounded(Generic[_T]):
    """A labelled Prometheus metric whose `labels(...)` bounds every value (one place for all of
    them, rather than a guard at each call site)."""

    def __init__(self, metric: Any, limit: int = MAX_LABEL_VALUES) -> None:
        self.metric = metric
        self._limit = limit
        self._labels: list[_LabelValues] = []  # one per label, by position
        # The child of each label set seen within the bounds, looked up once and kept: a request
        # counts under the same few (route, status) sets, and prometheus_client's own `labels()`
        # (validation, a lock, a dict) was ~1 % of a request's CPU. Only sets no value of which
        # overflowed are kept, so the cache is bounded as the label values are.
        self._children: dict[tuple[object, ...], _T] = {}

    def labels(self, *values: object) -> _T:
        child = self._children.get(values)
        if child is not None:
            return child
        while len(self._labels) < len(values):
            self._labels.append(_LabelValues(self._limit))
        bounded = [bound(v) for bound, v in zip(self._labels, values, strict=False)]
        child = self.metric.labels(*bounded)
        if OVERFLOW_LABEL not in bounded:
            self._children[values] = child
        return child  # type: ignore[no-any-return]


class Metrics:
    def __init__(self, model_label: Callable[[Flow, str], str] | None = None) -> None:
        """`model_label(flow, model)`: the label a call's model is counted under (None: its name;
        with tenants, app.py passes one that keeps only price-catalog names: `[metrics]
        model_labels`)."""
        self._model_label = model_label
        self.registry = CollectorRegistry(auto_describe=True)
        self.shipper_registry = CollectorRegistry(auto_describe=True)
        self.spans: SpanSystem | None = None
        # `serve --workers N`: the worker's view of its siblings, set by worker_metrics.py
        self.siblings: WorkerSiblings | None = None
        r = self.registry
        self.requests: Bounded[Counter] = Bounded(Counter(
            "runcap_requests", "Requests answered, by upstream, endpoint and status.",
            ["upstream", "endpoint", "status"], registry=r,
        ))  # fmt: skip
        self.latency: Bounded[Histogram] = Bounded(Histogram(
            "runcap_request_duration_seconds", "Time from request in to last byte out.",
            ["upstream", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.added_latency = Histogram(
            "runcap_added_latency_seconds",
            "Time runcap itself added to a forwarded model call: from request in to last byte "
            "out, less the time waiting for the upstream's answer (a stream's relay counts as "
            "upstream time).",
            buckets=_ADDED_BUCKETS, registry=r,
        )  # fmt: skip
        self.rejections: Bounded[Counter] = Bounded(Counter(
            "runcap_rejections", "Calls refused by runcap, by reason (cap code, deadline, cancel...).",
            ["reason"], registry=r,
        ))  # fmt: skip
        self.tokens: Bounded[Counter] = Bounded(Counter(
            "runcap_tokens", "Tokens settled, by model and kind (input, output, cache_read, cache_write).",
            ["model", "kind"], registry=r,
        ))  # fmt: skip
        self.cost: Bounded[Counter] = Bounded(
            Counter("runcap_cost_usd", "Dollars settled, by model.", ["model"], registry=r)
        )
        self.unpriced: Bounded[Counter] = Bounded(
            Counter("runcap_unpriced_calls", "Calls settled without a known price.", ["model"], registry=r)
        )
        self.ledger_latency: Bounded[Histogram] = Bounded(Histogram(
            "runcap_ledger_op_seconds", "Run-ledger operation latency.", ["op"],
            buckets=_LEDGER_BUCKETS, registry=r,
        ))  # fmt: skip
        self.clamped = Counter("runcap_clamped_calls", "Calls whose output limit runcap lowered.", registry=r)
        self.final_steps = Counter("runcap_final_steps", "Answer-only final steps enforced.", registry=r)
        # Read at scrape time: a plain count on the request path, not a gauge's locked inc/dec.
        self.calls_in_flight = 0
        self.in_flight = Gauge("runcap_in_flight", "Upstream calls in flight.", registry=r)
        self.in_flight.set_function(lambda: self.calls_in_flight)
        self.tool_calls: Bounded[Counter] = Bounded(Counter(
            "runcap_tool_calls", "Calls through /tools, by tool and outcome (ok, error, replayed, ...).",
            ["tool", "outcome"], registry=r,
        ))  # fmt: skip
        self.tool_replays: Bounded[Counter] = Bounded(Counter(
            "runcap_tool_replays", "Side-effecting tool calls answered from their idempotency record.",
            ["tool"], registry=r,
        ))  # fmt: skip
        self.context_tokens = Histogram(
            "runcap_context_tokens",
            "Input tokens of each answered model step (its context), as the provider counted them.",
            buckets=_CONTEXT_BUCKETS, registry=r,
        )  # fmt: skip
        self.context_growth_alerts = Counter(
            "runcap_context_growth_alerts",
            "Runs whose context grew past [context] growth_alert times their first step's "
            "(counted once per run by the process that saw it happen).",
            registry=r,
        )
        self.tool_unknown: Bounded[Counter] = Bounded(Counter(
            "runcap_tool_unknown_outcomes",
            "Side-effecting tool calls cut in flight (cancel, timeout, reset): outcome unknown "
            "until reconciled.",
            ["tool"], registry=r,
        ))  # fmt: skip
        self.policy_decisions: Bounded[Counter] = Bounded(Counter(
            "runcap_policy_decisions",
            "Tool calls decided by a tool's rules, by tool and effect (allow, deny, approve; error: a "
            "rule failed to evaluate and the call was denied).",
            ["tool", "effect"], registry=r,
        ))  # fmt: skip
        self.approvals = Counter(
            "runcap_approvals",
            "Approval events (toolcall/approvals.py): requested, approved, denied, expired, cancelled.",
            ["event"], registry=r,
        )  # fmt: skip
        self.approval_webhook_failures = Counter(
            "runcap_approval_webhook_failures",
            "Pending approvals the [approvals] webhook could not announce after every attempt.",
            registry=r,
        )

    def watch_spans(self, spans: SpanSystem) -> None:
        """Export the span path: this process's WAL appends and drops, and the shipper's view —
        WAL bytes, unshipped bytes and the age of the oldest unshipped record per sink, errors."""
        if spans.writer is not None:
            self.spans = spans
            self.registry.register(_WalWriterCollector(spans.writer))
            self.shipper_registry.register(_ShipperCollector(spans))

    def watch_ledger(self, ledger: GuardedLedger) -> None:
        """Export the ledger's failures and the writes waiting for it, read at scrape time."""
        self.registry.register(_LedgerCollector(ledger))

    def watch_connections(self, guard: ConnectionGuard) -> None:
        """Export the connections refused or cut by the server's connection limits."""
        self.registry.register(_ConnectionCollector(guard))

    def ledger_op(self, op: str, seconds: float) -> None:
        self.ledger_latency.labels(op).observe(seconds)

    async def timed_ledger_op(self, op: str, call: Awaitable[_T]) -> _T:
        """Await a ledger operation, its latency observed as `op`."""
        t0 = time.perf_counter()
        try:
            return await call
        finally:
            self.ledger_op(op, time.perf_counter() - t0)

    def settled(self, flow: Flow, s: Settlement) -> None:
        model = flow.response_info.model if flow.response_info else ""
        model = model or (flow.info.model if flow.info else "")
        if self._model_label is not None:
            model = self._model_label(flow, model)
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
        """This process's exposition: its own series and the shipper's view."""
        return generate_latest(self.registry) + generate_latest(self.shipper_registry)

    async def exposition(self) -> bytes:
        """What `GET /metrics` answers: with sibling workers, every worker's series at once."""
        if self.siblings is None:
            return self.render()
        return await self.siblings.exposition()


class MetricsStep(FlowStep):
    """Counts every finished request."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    async def request(self, flow: Flow) -> None:
        if flow.clamped_to is not None:
            self.m.clamped.inc()
        if flow.final_step:
            self.m.final_steps.inc()

    async def done(self, flow: Flow) -> None:
        duration_ms = flow.duration_ms
        self.m.requests.labels(flow.upstream.name, flow.endpoint, str(flow.status)).inc()
        self.m.latency.labels(flow.upstream.name, flow.endpoint).observe(duration_ms / 1000.0)
        if flow.upstream_ms is not None:  # forwarded (a refused call adds nothing to wait for)
            self.m.added_latency.observe(max(0.0, duration_ms - flow.upstream_ms) / 1000.0)


class _WalWriterCollector(Collector):
    """This process's WAL writer: what it appended and what it had to drop."""

    def __init__(self, writer: WalWriter) -> None:
        self.writer = writer

    def collect(self) -> Iterator[Metric]:
        w = self.writer.stats()
        # `writer`: this process's WAL writer slot, so the series of --workers N never collide
        slot = [str(w.slot)]
        for name, doc, value in (
            ("runcap_wal_appended_records", "Step records appended to the WAL.", w.appended_records),
            ("runcap_wal_appended_bytes", "Bytes appended to the WAL.", w.appended_bytes),
            ("runcap_wal_append_errors", "Failed WAL appends (cut back, retried without bodies).",
             w.append_errors),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=["writer"])
            c.add_metric(slot, value)
            yield c
        dropped = CounterMetricFamily(
            "runcap_wal_dropped",
            "What this process could not append: payload bodies (WAL over 3/4 of wal_max_bytes, or "
            "the disk full; their hashes are blank in the spans) and records, one per step (no room "
            "for them even without bodies within wal_hold_bytes / wal_hold_ms: their calls were "
            "refused; the log names the runs).",
            labels=["writer", "what"],
        )
        dropped.add_metric([*slot, "payload"], w.dropped_payloads)
        dropped.add_metric([*slot, "record"], w.dropped_records)
        yield dropped
        held = GaugeMetricFamily(
            "runcap_wal_held_records",
            "Step records held in memory for want of room in the WAL (their answers wait with them).",
            labels=["writer"],
        )
        held.add_metric(slot, w.held_records)
        yield held


class _ShipperCollector(Collector):
    """The span shipper's view, as last polled (every `stats_interval_s`)."""

    def __init__(self, spans: SpanSystem) -> None:
        self.spans = spans

    def collect(self) -> Iterator[Metric]:
        st = self.spans.shipper_stats if self.spans.shipper_up() else None
        return shipper_families(self.spans, st)


def shipper_families(spans: SpanSystem, st: dict[str, Any] | None) -> Iterator[Metric]:
    """The shipper's view from its statistics `st` (None: the shipper does not answer)."""
    writer = spans.writer
    assert writer is not None
    yield GaugeMetricFamily(
        "runcap_shipper_up", "1 when the span shipper answers on its socket.", value=1 if st else 0
    )
    yield GaugeMetricFamily(
        "runcap_wal_bytes", "Bytes of WAL segments on disk (all processes).",
        value=st["wal_bytes"] if st else writer.stats().wal_bytes,
    )  # fmt: skip
    yield GaugeMetricFamily(
        "runcap_wal_max_bytes",
        "wal_max_bytes: past 3/4 of it payload bodies are dropped, at it whole records.",
        value=writer.max_bytes,
    )
    if st is None:
        return
    yield CounterMetricFamily(
        "runcap_shipper_restarts", "Times the span shipper process was restarted.", value=st["restarts"]
    )
    yield CounterMetricFamily(
        "runcap_wal_damaged_records",
        "Damaged WAL regions the shipper skipped to the next valid record (since it started).",
        value=st["damaged_records"],
    )
    sinks = st["sinks"]
    gauges = {
        "runcap_wal_unshipped_bytes": ("WAL bytes a sink has not taken yet.", "unshipped_bytes"),
        "runcap_wal_oldest_unshipped_age_seconds": (
            "Age of the oldest WAL record a sink has not taken yet (alert on it: a store has "
            "been down that long).",
            "oldest_unshipped_age_s",
        ),
        "runcap_sink_retry_in_seconds": ("Time until a failing sink's next attempt.", "retry_in_s"),
    }
    for name, (doc, key) in gauges.items():
        g = GaugeMetricFamily(name, doc, labels=["sink"])
        for sink, s in sinks.items():
            g.add_metric([sink], s[key])
        yield g
    counters = {
        "runcap_sink_errors": ("Failed writes to a sink (retries included).", "errors"),
        "runcap_sink_records_written": ("WAL records a sink took.", "records_written"),
        "runcap_sink_rejected": ("Payloads a store can never take (damaged), skipped.", "rejected"),
    }  # since the shipper (re)started: Prometheus counters handle the resets
    for name, (doc, key) in counters.items():
        c = CounterMetricFamily(name, doc, labels=["sink"])
        for sink, s in sinks.items():
            c.add_metric([sink], s[key])
        yield c


class _LedgerCollector(Collector):
    def __init__(self, ledger: GuardedLedger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        led, pending = self.ledger, self.ledger.pending
        yield GaugeMetricFamily(
            "runcap_unsettled_reservations",
            "Settlements (and releases of reservations) the ledger has not taken yet; retried in "
            "the background. Non-zero for long: the ledger is down.",
            value=pending.count(RESERVATION_KINDS),
        )
        yield CounterMetricFamily(
            "runcap_settle_failures",
            "Settlement attempts the ledger failed to take (first tries and background retries).",
            value=led.settle_failures + pending.failed_attempts["settlement"],
        )
        g = GaugeMetricFamily(
            "runcap_pending_ledger_writes", "Writes waiting for the ledger, by kind.", labels=["kind"]
        )
        for kind, n in sorted(pending.by_kind().items()):
            g.add_metric([kind], n)
        yield g
        yield GaugeMetricFamily(
            "runcap_pending_ledger_write_oldest_age_seconds",
            "Age of the oldest write waiting for the ledger.",
            value=pending.oldest_age_s(),
        )
        c = CounterMetricFamily(
            "runcap_ledger_unavailable",
            "Ledger operations that failed because the ledger was unavailable (unreachable, timed "
            "out, disk full), by operation and reason.",
            labels=["op", "reason"],
        )
        for (op, reason), n in sorted(led.unavailable.items()):
            c.add_metric([op, reason], n)
        yield c


class _ConnectionCollector(Collector):
    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("runcap_connections_open", "Open client connections.", value=self.guard.open)
        c = CounterMetricFamily(
            "runcap_connections_closed",
            "Client connections runcap closed: header_timeout, body_timeout, or refused over "
            "max_connections_per_client.",
            labels=["reason"],
        )
        for reason, n in sorted(self.guard.closed.items()):
            c.add_metric([reason], n)
        yield c
