"""Build the span path a configuration asks for.

In a proxy process: the WAL writer and the recorder the request path uses (`open_span_system`),
plus a client of the shipper's socket (for `/admin/sql` and the shipper's statistics in
`/metrics`). The shipper itself (`open_shipper`: ClickHouse — embedded chdb or a server —, the
payload store, OTLP) runs either in its own process, started and supervised by `runcap serve`
(proxy/spans/supervisor.py: `shipper="external"` here), or in this process on threads of its own
(`shipper="thread"`, the default of `build_app`: tests, the demo, embedding runcap in-process).
Only the in-process variant imports a store's client library.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.config import SpanSettings
from proxy.spans.control import ShipperClient, ShipperUnavailable, socket_path
from proxy.spans.payloads import PayloadPolicy
from proxy.spans.recorder import NullRecorder, SpanRecorder, WalRecorder
from proxy.spans.wal import WalWriter

if TYPE_CHECKING:
    from proxy.spans.shipper import Shipper
    from proxy.spans.sink import PayloadStore

log = logging.getLogger("runcap.spans")

SHIPPER_MODES = ("thread", "external")
WAL_SUBDIR = "wal"


@dataclass
class SpanSystem:
    recorder: SpanRecorder
    writer: WalWriter | None = None
    shipper: Shipper | None = None  # when it runs in this process
    client: ShipperClient | None = None
    stats_interval_s: float = 1.0
    drain_timeout_s: float = 5.0
    # The shipper's latest statistics (read over its socket every `stats_interval_s`).
    shipper_stats: dict[str, Any] | None = None
    shipper_stats_at: float = 0.0  # monotonic
    _poll: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def store(self) -> Any:
        """The ClickHouse sink, when the shipper runs in this process (tests)."""
        return self.shipper.query_store if self.shipper is not None else None

    @property
    def payloads(self) -> PayloadStore | None:
        """The payload store, when the shipper runs in this process (tests)."""
        return self.shipper.payload_store if self.shipper is not None else None

    def start(self) -> None:
        if self.shipper is not None:
            self.shipper.start()
        if self.client is not None:
            self._poll = asyncio.get_running_loop().create_task(self._poll_stats())

    async def _poll_stats(self) -> None:
        assert self.client is not None
        while True:
            try:
                self.shipper_stats = await self.client.stats(timeout_s=max(1.0, self.stats_interval_s))
                self.shipper_stats_at = time.monotonic()
            except ShipperUnavailable:
                pass  # starting, restarting: /metrics shows runcap_shipper_up 0
            except Exception:
                log.exception("reading the span shipper's statistics failed")
            await asyncio.sleep(self.stats_interval_s)

    def shipper_up(self) -> bool:
        return self.shipper_stats is not None and time.monotonic() - self.shipper_stats_at < max(
            3.0, 3 * self.stats_interval_s
        )

    async def aclose(self, timeout_s: float = 10.0) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        if self.writer is not None:
            self.writer.close()  # fsync'd: the shipper (now or on the next start) ships it
        if self.shipper is not None:
            await asyncio.to_thread(self.shipper.stop, min(timeout_s, self.drain_timeout_s))


def open_span_system(
    config: SpanSettings,
    data_dir: Path,
    *,
    shipper: str = "thread",
    stats_interval_s: float = 1.0,
    drain_timeout_s: float = 5.0,
    **shipper_options: Any,
) -> SpanSystem:
    """`shipper_options` tune an in-process shipper (`flush_interval_s`, `retry_initial_s`,
    `retry_max_s`, `batch_size`, ...: proxy/spans/shipper.py)."""
    if not config.tracing:
        return SpanSystem(NullRecorder())
    if shipper not in SHIPPER_MODES:
        raise ValueError(f"shipper must be one of {', '.join(SHIPPER_MODES)} (got {shipper!r})")
    in_process = (
        open_shipper(config, data_dir, lock_timeout_s=5.0, **shipper_options) if shipper == "thread" else None
    )
    writer = WalWriter(
        data_dir / WAL_SUBDIR,
        fsync=config.wal_fsync,
        fsync_interval_s=config.wal_fsync_interval_ms / 1000.0,
        max_bytes=config.wal_max_bytes,
        segment_bytes=config.wal_segment_bytes,
        hold_bytes=config.wal_hold_bytes,
        hold_s=config.wal_hold_ms / 1000.0,
    )
    recorder = WalRecorder(writer, PayloadPolicy(config.payloads, config.payload_max_bytes))
    return SpanSystem(
        recorder, writer, in_process, ShipperClient(data_dir), stats_interval_s, drain_timeout_s
    )


def open_shipper(config: SpanSettings, data_dir: Path, **options: Any) -> Shipper:
    """The shipper for the span path's settings and `data_dir`, with every sink they configure.
    Takes the data directory's shipper lock first (waiting for a previous shipper to exit), then
    opens the stores: embedded chdb at once, so a missing `runcap[embedded]` extra stops start-up
    with its message; a server lazily (runcap starts while ClickHouse is down, and ships once it
    is up)."""
    from proxy.spans.clickhouse import open_span_store
    from proxy.spans.payloads import open_payload_store
    from proxy.spans.shipper import Shipper, lock_shipper
    from proxy.spans.sink import LazySink, SpanSink

    wal_dir = data_dir / WAL_SUBDIR
    wal_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = lock_shipper(wal_dir, options.pop("lock_timeout_s", 60.0))
    try:
        url, read_url = config.clickhouse_url, config.clickhouse_read_url
        store = LazySink("clickhouse", lambda: open_span_store(url, data_dir, read_url=read_url))
        if not url:
            store.get()
        sinks: list[SpanSink] = [store]
        if config.otlp_endpoint:
            from proxy.spans.otlp import OTLPSink

            sinks.append(OTLPSink(config.otlp_endpoint))
        payloads = None
        if config.payloads != "off":
            # Local payload files are written the way ClickHouse writes its parts (no fsync per
            # file: they survive a crash of runcap, not of the machine); the WAL holds a body
            # until the store has it.
            store_options: dict[str, Any] = {}
            if not config.s3_url:
                store_options = {
                    "fsync": False,
                    "retention_days": config.payload_retention_days,
                    "max_total_bytes": config.payload_store_max_bytes,
                }
            payloads = open_payload_store(config.s3_url, data_dir, **store_options)
        # Large batches while catching up (bench/span_bench.py: ~45k spans/s at 5,000 spans per
        # batch on chdb, more at 20,000); at low load the flush interval cuts them small.
        options.setdefault("batch_size", 20_000)
        return Shipper(
            wal_dir,
            sinks=sinks,
            payloads=payloads,
            query_store=store,
            socket_path=socket_path(data_dir),
            lock_fd=lock_fd,
            **options,
        )
    except BaseException:
        os.close(lock_fd)
        raise
