"""The narrow interfaces between the shipper and where records end up.

The shipper's lane threads (proxy/spans/shipper.py) call these, in the shipper process; they may
block (clickhouse-connect, chdb and boto3 are synchronous). A sink raises on failure and the lane
retries the same batch later — the records wait in the write-ahead log meanwhile — so every write
must be idempotent for the same `batch_id` / the same payload hash.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from proxy.spans.model import Payload, RunSnapshot, Span


class SinkError(Exception):
    """A sink could not take a batch; the message says which sink and why."""


class SpanSink(Protocol):
    name: str  # "clickhouse", "otlp": used in metrics, logs and the shipper's cursor file names

    def write(self, spans: Sequence[Span], runs: Sequence[RunSnapshot], batch_id: str) -> None:
        """Write one batch. Writing the same batch_id twice must not duplicate rows."""

    def close(self) -> None: ...


class PayloadStore(Protocol):
    name: str  # "local", "s3"

    def put(self, payload: Payload) -> None:
        """Store bytes under their sha256; storing the same hash again is a no-op."""

    def put_many(self, payloads: Sequence[Payload]) -> list[tuple[Payload, str]]:
        """Store a batch (a store may make it durable once for all of it); return the payloads
        that can never be stored, with the reason. Raises when the store is unavailable."""

    def get(self, sha256: str) -> bytes:
        """Return the exact bytes stored (decompressed); KeyError when absent."""

    def close(self) -> None: ...


class LazySink:
    """A sink opened on first use, and reopened after a failed open: the shipper starts while its
    span store is down, and delivers once it is up. Queries go to the same store."""

    def __init__(self, name: str, open_sink: Callable[[], Any]) -> None:
        self.name = name
        self._open = open_sink
        self._sink: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._sink is None:
                try:
                    self._sink = self._open()
                except SinkError:
                    raise
                except Exception as e:
                    raise SinkError(f"{self.name}: cannot open: {e}") from e
            return self._sink

    def write(self, spans: Sequence[Span], runs: Sequence[RunSnapshot], batch_id: str) -> None:
        self.get().write(spans, runs, batch_id)

    def write_jsonl(self, spans: bytes, runs: bytes, batch_id: str, *, resumed: bool = False) -> None:
        self.get().write_jsonl(spans, runs, batch_id, resumed=resumed)

    def query(self, sql: str, params: dict[str, Any] | None = None) -> Any:
        return self.get().query(sql, params)

    def close(self) -> None:
        with self._lock:
            if self._sink is not None:
                self._sink.close()
                self._sink = None
