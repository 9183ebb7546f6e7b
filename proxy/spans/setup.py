"""Build the span pipeline a configuration asks for: the ClickHouse sink (embedded chdb or a
server), the optional OTLP sink, the payload store, and the recorder the request path uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.config import Config
from proxy.spans.payloads import PayloadPolicy, open_payload_store
from proxy.spans.pipeline import SpanPipeline
from proxy.spans.recorder import NullRecorder, PipelineRecorder, SpanRecorder
from proxy.spans.sink import LazySink, PayloadStore, SpanSink


@dataclass
class SpanSystem:
    recorder: SpanRecorder
    pipeline: SpanPipeline | None = None
    store: LazySink | None = None  # the ClickHouse sink, also answering read-only SQL
    payloads: PayloadStore | None = None

    def start(self) -> None:
        if self.pipeline is not None:
            self.pipeline.start()

    async def aclose(self, timeout_s: float = 10.0) -> None:
        if self.pipeline is not None:
            await self.pipeline.aclose(timeout_s)


def open_span_system(config: Config, **pipeline_options: Any) -> SpanSystem:
    if not config.tracing:
        return SpanSystem(NullRecorder())
    from proxy.spans.clickhouse import open_span_store

    url, data_dir = config.clickhouse_url, config.data_dir
    store = LazySink("clickhouse", lambda: open_span_store(url, data_dir))
    if not url:
        # Embedded chdb is local: open it now, so a missing `runcap[embedded]` extra or a data
        # directory another process holds stops start-up with its message instead of spooling.
        store.get()
    sinks: list[SpanSink] = [store]
    if config.otlp_endpoint:
        from proxy.spans.otlp import OTLPSink

        sinks.append(OTLPSink(config.otlp_endpoint))
    payloads = None
    if config.payloads != "off":
        payloads = open_payload_store(config.s3_url, config.data_dir)
    # Large batches: a ClickHouse insert costs ~13 ms whatever its size (bench/span_bench.py:
    # ~11k spans/s at 500 per batch, ~24k at 5,000); at low load the flush interval cuts them.
    pipeline_options.setdefault("batch_size", 5000)
    pipeline = SpanPipeline(sinks, payloads, config.data_dir / "spool", **pipeline_options)
    policy = PayloadPolicy(config.payloads, config.payload_max_bytes)
    return SpanSystem(PipelineRecorder(pipeline, policy), pipeline, store, payloads)
