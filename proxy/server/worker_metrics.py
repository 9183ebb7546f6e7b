"""`GET /metrics` under `serve --workers N`: one exposition for all the workers.

The workers share the port, so a scrape reaches whichever worker the kernel picks. Each worker
therefore also answers on a socket of its own in the data directory
(`data_dir/worker-N.metrics.sock`, mode 0600 like the shipper's) with its own series, and the
worker that takes a scrape asks its siblings and answers for all of them:

* each worker's own series (requests, caps, its WAL appends, its ledger writes, its
  connections) carry `worker="N"`: every series comes from one process, read at scrape time, so
  a counter never goes backwards whichever worker answers;
* the shipper's view (WAL on disk, sinks) is read from the shipper at scrape time and given
  once, without a worker label (it is the same whoever asks);
* `runcap_worker_up{worker}` says which workers answered (a worker that does not answer within
  `SIBLING_TIMEOUT_S` is left out of that scrape; its series come back with the next one).

Protocol on a worker's socket: connect, read the JSON list of its metric families to EOF.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.server.metrics import Metrics, shipper_families
from proxy.spans.control import ShipperUnavailable, _address

log = logging.getLogger("runcap.server")

SIBLING_TIMEOUT_S = 2.5  # well within Prometheus' default scrape_timeout (10 s)
MAX_EXPOSITION_BYTES = 64 << 20


def worker_socket(data_dir: Path, worker: int) -> Path:
    return Path(data_dir) / f"worker-{worker}.metrics.sock"


def _encode(families: Iterable[Metric]) -> bytes:
    return orjson.dumps([
        {
            "name": f.name, "help": f.documentation, "type": f.type, "unit": f.unit,
            # orjson writes NaN and the infinities as null: keep them as text
            "samples": [[s.name, s.labels, s.value if math.isfinite(s.value) else repr(s.value)]
                        for s in f.samples],
        }
        for f in families
    ])  # fmt: skip


def _decode(raw: bytes, worker: int) -> list[Metric]:
    out = []
    for f in orjson.loads(raw):
        m = Metric(f["name"], f["help"], f["type"], f["unit"])
        for name, labels, value in f["samples"]:
            m.add_sample(name, {**labels, "worker": str(worker)}, float(value))
        out.append(m)
    return out


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class WorkerSiblings:
    """Worker `worker` of `workers`: serves its own series to its siblings, and answers a scrape
    for all of them."""

    def __init__(self, metrics: Metrics, data_dir: Path, worker: int, workers: int) -> None:
        self.metrics = metrics
        self.data_dir = Path(data_dir)
        self.worker = worker
        self.workers = workers
        self._server: asyncio.AbstractServer | None = None

    def add_to(self, app: web.Application) -> None:
        self.metrics.siblings = self
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        path = worker_socket(self.data_dir, self.worker)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by a worker of an earlier serve (serve.lock keeps serves apart)
        old = os.umask(0o177)
        try:
            with _address(path) as address:
                self._server = await asyncio.start_unix_server(self._answer, address)
        finally:
            os.umask(old)

    async def _stop(self, app: web.Application) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            worker_socket(self.data_dir, self.worker).unlink()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(_encode(self.metrics.registry.collect()))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def _ask(self, worker: int) -> list[Metric] | None:
        try:
            async with asyncio.timeout(SIBLING_TIMEOUT_S):
                with _address(worker_socket(self.data_dir, worker)) as address:
                    reader, writer = await asyncio.open_unix_connection(address, limit=MAX_EXPOSITION_BYTES)
                try:
                    raw = await reader.read()
                finally:
                    writer.close()
                    with contextlib.suppress(OSError, ConnectionError):
                        await writer.wait_closed()
            return _decode(raw, worker)
        except (OSError, TimeoutError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            log.debug("worker %d did not answer for /metrics: %s", worker, e)
            return None  # starting, stopping, or stuck: left out of this scrape

    async def _shipper_stats(self) -> dict[str, Any] | None:
        spans = self.metrics.spans
        if spans is None or spans.client is None:
            return None
        try:
            return await spans.client.stats(timeout_s=SIBLING_TIMEOUT_S)
        except ShipperUnavailable:
            return None

    async def exposition(self) -> bytes:
        others = [w for w in range(self.workers) if w != self.worker]
        # The shipper's statistics read now, not as last polled: whichever worker answers the
        # next scrape reads them later still, so its counters never go back.
        stats, *answers = await asyncio.gather(self._shipper_stats(), *(self._ask(w) for w in others))
        families = _decode(_encode(self.metrics.registry.collect()), self.worker)
        up = GaugeMetricFamily(
            "runcap_worker_up", "1 when the worker answered this scrape (serve --workers N).",
            labels=["worker"],
        )  # fmt: skip
        up.add_metric([str(self.worker)], 1)
        for w, answer in zip(others, answers, strict=True):
            up.add_metric([str(w)], 0 if answer is None else 1)
            families.extend(answer or [])
        families.append(up)
        if self.metrics.spans is not None:
            families.extend(shipper_families(self.metrics.spans, stats))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(_merge(families)))
        return generate_latest(registry)


def _merge(families: list[Metric]) -> list[Metric]:
    """One family per name (the workers' samples of it together), in first-seen order."""
    merged: dict[str, Metric] = {}
    for f in families:
        into = merged.get(f.name)
        if into is None:
            merged[f.name] = f
        else:
            into.samples.extend(f.samples)
    return list(merged.values())
