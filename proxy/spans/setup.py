"""Build the span pipeline a configuration asks for: the ClickHouse sink (embedded chdb or a
server), the optional OTLP sink, the payload store, and the recorder the request path uses."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.config import Config
from proxy.spans.payloads import PayloadPolicy, open_payload_store
from proxy.spans.pipeline import SpanPipeline
from proxy.spans.recorder import NullRecorder, PipelineRecorder, SpanRecorder
from proxy.spans.sink import LazySink, PayloadStore, SpanSink
from proxy.spans.spool import SEGMENT_SUFFIX

log = logging.getLogger("runcap.spans")


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
        # Local payload files are written the way ClickHouse writes its parts (no fsync per
        # file: they survive a crash of runcap, not of the machine) — an fsync per body was most
        # of what tracing cost a call. The spool, which holds what a store could not take yet,
        # is fsync'd.
        options = {} if config.s3_url else {"fsync": False}
        payloads = open_payload_store(config.s3_url, config.data_dir, **options)
    # Large batches: a ClickHouse insert costs ~13 ms whatever its size (bench/span_bench.py:
    # ~11k spans/s at 500 per batch, ~24k at 5,000); at low load the flush interval cuts them.
    pipeline_options.setdefault("batch_size", 5000)
    spool_dir = pipeline_options.pop("spool_dir", config.data_dir / "spool")
    _warn_about_other_spools(config, Path(spool_dir))
    pipeline = SpanPipeline(sinks, payloads, spool_dir, **pipeline_options)
    policy = PayloadPolicy(config.payloads, config.payload_max_bytes)
    return SpanSystem(PipelineRecorder(pipeline, policy), pipeline, store, payloads)


def _warn_about_other_spools(config: Config, mine: Path) -> None:
    """`serve --workers N` gives each worker a spool of its own (spool/worker-i). Records left in
    the spool of a worker that no longer exists (N lowered, or 1 worker ↔ N) are not lost, but
    nobody replays them until runcap runs with that worker count again: say so at start-up."""
    root = config.data_dir / "spool"
    if not root.is_dir():
        return

    def holds_records(spool: Path) -> bool:  # segments left in its per-sink directories
        return any(
            True
            for sub in spool.iterdir()
            if sub.is_dir() and not sub.name.startswith("worker-")
            for _ in sub.glob("*" + SEGMENT_SUFFIX)
        )

    for path in [root, *sorted(root.glob("worker-*"))]:
        if path == mine or not holds_records(path):
            continue
        log.warning(
            "span spool %s holds records of a runcap with another --workers count; they will be "
            "delivered when runcap runs with that count again",
            path,
        )
