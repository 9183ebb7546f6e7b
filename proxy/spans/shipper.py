"""The shipper: drains the write-ahead log into every sink, each at its own pace.

    proxies ──append──▶ data_dir/wal/*.wal ──▶ shipper ─┬─ clickhouse lane ─▶ ClickHouse (chdb / server)
                                                        ├─ payloads lane   ─▶ payload store (dir / S3)
                                                        └─ otlp lane       ─▶ OTLP collector

One process (or, for in-process use and tests, one `Shipper` object) per data directory
(`wal/.shipper.lock`). It owns every client library of every store — the proxy processes only
append — and answers read-only SQL and statistics on its socket (proxy/spans/control.py).

A lane is a thread with its own position in every segment (proxy/spans/cursors.py), so a slow or
dead sink never holds back another. It cuts a batch from one segment — up to `batch_size` spans
or `batch_bytes`, or whatever is there once the oldest record is `flush_interval_s` old — writes
the batch's bounds (segment, first offset, last offset) to its cursor file (fsync'd) and only
then ships it; it retries with backoff until the sink takes it, and then advances. A batch retried
after a crash is rebuilt from the bounds on file, so it holds the same records: the ClickHouse
lane sends `{segment}:{first}:{last}` as the insert deduplication token and the engine drops a
repeat — exactly once per record. The one batch in flight at a crash goes again marked `resumed`:
a `kill -9` can leave its token on record without its rows, so the sink then inserts just the
rows it does not hold (ClickHouseSink.write_jsonl). Payloads are deduplicated by hash (within a
batch, and against the hashes stored lately) before they are uploaded; a repeat is harmless
anyway (same key, same bytes). OTLP receivers do not deduplicate: that lane is at-least-once.

A segment is deleted once it is sealed (its writer rolled or died) and every lane has passed its
end. Damaged records are skipped and counted (proxy/spans/wal.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from proxy.spans.control import ControlServer
from proxy.spans.cursors import CursorFile, Pending
from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.records import (
    RUN_ID_INDEX,
    RUN_UPDATED_AT_INDEX,
    RecordError,
    StepRecord,
    json_lines,
    run_from_json,
)
from proxy.spans.sink import PayloadStore, SinkError, SpanSink
from proxy.spans.wal import HEADER_SIZE, MAGIC, Frame, read_frames, segment_sealed, segments

log = logging.getLogger("runcap.shipper")

PAYLOADS_LANE = "payloads"
CURSORS_DIR = "cursors"
LOCK_FILE = ".shipper.lock"


class WalBatch:
    """Consecutive records of one segment, shipped as one unit; what each sink needs is derived
    on demand."""

    def __init__(
        self,
        segment: str,
        frames: Sequence[Frame],
        records: Sequence[StepRecord | None],
        *,
        full: bool = False,
        resumed: bool = False,
    ) -> None:
        self.segment = segment
        self.full = full  # cut at a batch limit: more records follow right behind
        self.resumed = resumed  # in flight when a shipper died: what the sink holds is unknown
        self.first = frames[0].offset
        self.last = frames[-1].offset
        self.end = frames[-1].end
        self.first_time_ms = frames[0].time_ms
        self.records = [r for r in records if r is not None]
        self._spans_jsonl: bytes | None = None
        self._runs_jsonl: bytes | None = None

    @property
    def token(self) -> str:
        """Deterministic for the same records: the insert deduplication token's base."""
        return f"{self.segment.removesuffix('.wal')}:{self.first}:{self.last}"

    @property
    def n_spans(self) -> int:
        return sum(r.n_spans for r in self.records)

    @property
    def n_runs(self) -> int:
        return sum(r.n_runs for r in self.records)

    def spans_jsonl(self) -> bytes:
        if self._spans_jsonl is None:
            self._spans_jsonl = b"".join([r.spans_jsonl for r in self.records])
        return self._spans_jsonl

    def runs_jsonl(self) -> bytes:
        """The newest snapshot of each run in the batch (runcap.runs is read by argMax)."""
        if self._runs_jsonl is None:
            self._runs_jsonl = self._newest_runs()
        return self._runs_jsonl

    def _newest_runs(self) -> bytes:
        newest: dict[str, tuple[datetime, bytes]] = {}
        for record in self.records:
            if not record.n_runs:
                continue
            for line in json_lines(record.runs_jsonl):
                values = orjson.loads(line)
                run_id, updated = values[RUN_ID_INDEX], datetime.fromisoformat(values[RUN_UPDATED_AT_INDEX])
                seen = newest.get(run_id)
                if seen is None or updated >= seen[0]:
                    newest[run_id] = (updated, line)
        return b"".join(line + b"\n" for _, line in newest.values())

    def spans(self) -> list[Span]:
        out: list[Span] = []
        for record in self.records:
            try:
                out += record.spans()
            except (RecordError, ValueError, TypeError) as exc:  # never shippable: skipped
                log.error(
                    "WAL segment %s: skipping the spans of a record that do not decode: %s", self.segment, exc
                )
        return out

    def runs(self) -> list[RunSnapshot]:
        out: list[RunSnapshot] = []
        for line in json_lines(self.runs_jsonl()):
            try:
                out.append(run_from_json(line))
            except (RecordError, ValueError, TypeError) as exc:
                log.error(
                    "WAL segment %s: skipping a run snapshot that does not decode: %s", self.segment, exc
                )
        return out

    def payloads(self) -> list[Payload]:
        return [p for r in self.records for p in r.payloads()]


Delivery = Callable[[WalBatch], int]  # returns the records the sink can never take (rejected)


def span_delivery(sink: SpanSink) -> Delivery:
    """ClickHouse takes the JSON lines as they are (`write_jsonl`); other sinks get objects."""
    write_jsonl = getattr(sink, "write_jsonl", None)

    def deliver(batch: WalBatch) -> int:
        if write_jsonl is not None:
            spans_jsonl, runs_jsonl = batch.spans_jsonl(), batch.runs_jsonl()
            if spans_jsonl or runs_jsonl:
                write_jsonl(spans_jsonl, runs_jsonl, batch.token, resumed=batch.resumed)
            return 0
        spans, runs = batch.spans(), batch.runs()
        if spans or runs:
            sink.write(spans, runs, batch.token)
        return 0

    def prepare(batch: WalBatch) -> None:
        """What `deliver` needs, built ahead (on the lane's reader thread) while the previous
        batch is being sent."""
        if write_jsonl is not None:
            batch.spans_jsonl()
            batch.runs_jsonl()

    deliver.prepare = prepare  # type: ignore[attr-defined]
    return deliver


class PayloadDelivery:
    """Bodies to the payload store, each hash once: within a batch, and not again while it is
    among the `remember` hashes stored last."""

    def __init__(self, store: PayloadStore, remember: int = 100_000) -> None:
        self.store = store
        self._stored: OrderedDict[str, None] = OrderedDict()
        self._remember = remember
        self.skipped = 0  # bodies not uploaded because their hash was stored already

    def __call__(self, batch: WalBatch) -> int:
        fresh: dict[str, Payload] = {}
        for payload in batch.payloads():
            if payload.sha256 in self._stored or payload.sha256 in fresh:
                self.skipped += 1
                continue
            fresh[payload.sha256] = payload
        if not fresh:
            return 0
        rejected = self.store.put_many(list(fresh.values()))
        for payload, reason in rejected:  # wrong hash (damaged), bad key: retrying cannot fix it
            log.error("payload store %s rejected payload %.16s: %s", self.store.name, payload.sha256, reason)
        bad = {p.sha256 for p, _ in rejected}
        for sha256 in fresh:
            if sha256 not in bad:
                self._stored[sha256] = None
        while len(self._stored) > self._remember:
            self._stored.popitem(last=False)
        return len(rejected)


class _Lane:
    """One sink's thread, cursor and retry state."""

    def __init__(
        self,
        shipper: Shipper,
        name: str,
        deliver: Delivery,
        *,
        closer: Callable[[], None],
        batch_spans: int,
        batch_records: int,
        batch_bytes: int,
    ) -> None:
        self.name = name
        self._shipper = shipper
        self._deliver = deliver
        self._closer = closer
        self._batch_spans = batch_spans
        self._batch_records = batch_records
        self._batch_bytes = batch_bytes
        self._cursor = CursorFile(shipper.wal_dir / CURSORS_DIR / f"{name}.cursor")
        self.state = self._cursor.load()
        self.lock = threading.Lock()  # state, between this thread and the coordinator's reads
        self._last_segment = ""
        self._thread: threading.Thread | None = None
        self.drained = False
        self._failures = 0
        self._retry_at = 0.0
        self._last_log = -1e18
        self._suppressed = 0
        self.batches_written = 0
        self.records_written = 0
        self.spans_written = 0
        self.rejected = 0
        self.errors = 0
        self.undecodable = 0
        self.last_error = ""
        self.last_error_at: float | None = None

    # -- thread -------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"runcap-lane-{self.name}", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        shipper = self._shipper
        reader = ThreadPoolExecutor(1, thread_name_prefix=f"runcap-lane-{self.name}-read")
        while not shipper.stopping:
            try:
                self._resume()
                ahead: Future[WalBatch | None] | None = None
                while not shipper.stopping:
                    batch = ahead.result() if ahead is not None else None
                    ahead = None
                    if batch is None:
                        batch, wait_s = self._next_batch()
                    if batch is None:
                        self.drained = shipper.draining and wait_s is None
                        shipper.wait(shipper.poll_interval_s if wait_s is None else min(wait_s, 1.0))
                        continue
                    self.drained = False
                    if batch.full:
                        # A backlog: read the next batch while this one is being sent (the stores'
                        # clients release the GIL while they wait).
                        ahead = reader.submit(self._batch_after, batch)
                    self._ship(batch)
                    if self._shipper.stopping or self.state.offsets.get(batch.segment) != batch.end:
                        ahead = None  # not shipped: the next batch starts where this one did
            except Exception:  # a bug or an I/O error here must not stop this sink for good
                log.exception("span shipper lane %s failed; retrying in 1 s", self.name)
                shipper.wait(1.0)
        reader.shutdown(wait=False)

    def _batch_after(self, batch: WalBatch) -> WalBatch | None:
        """The full batch right behind `batch` in its segment, or None (the normal path decides)."""
        path = self._shipper.wal_dir / batch.segment
        sealed = segment_sealed(path)
        frames, records, _, at_end, full = self._read_batch(batch.segment, path, batch.end, sealed)
        if frames and frames[0].offset == batch.end and (full or (sealed and at_end)):
            after = WalBatch(batch.segment, frames, records, full=full)
            prepare = getattr(self._deliver, "prepare", None)
            if prepare is not None:
                prepare(after)
            return after
        return None

    def _resume(self) -> None:
        """A batch whose bounds are on file but which was not confirmed: ship exactly it again."""
        pending = self.state.pending
        if pending is None:
            return
        path = self._shipper.wal_dir / pending.segment
        if not path.exists():  # deleted: every lane had passed it, so it was shipped
            with self.lock:
                self.state.pending = None
            return
        res = read_frames(path, pending.first, sealed=True, max_bytes=1 << 40, until=pending.end)
        frames = res.frames
        if not frames or frames[0].offset != pending.first or frames[-1].end != pending.end:
            log.error(
                "span shipper lane %s: pending batch %s:%d-%d no longer reads back whole; shipping "
                "what does", self.name, pending.segment, pending.first, pending.end,
            )  # fmt: skip
            if not frames:
                with self.lock:
                    self.state.pending = None
                    self.state.offsets[pending.segment] = max(
                        pending.end, self.state.offsets.get(pending.segment, 0)
                    )
                self._save(sync=True)
                return
        self._ship(WalBatch(pending.segment, frames, self._decode(frames), resumed=True), pending)

    # -- cutting batches ----------------------------------------------------------------------------

    def _decode(self, frames: Sequence[Frame]) -> list[StepRecord | None]:
        out: list[StepRecord | None] = []
        for frame in frames:
            try:
                out.append(StepRecord(frame.body))
            except RecordError as exc:
                self.undecodable += 1
                log.error("span shipper lane %s: skipping a record at %d: %s", self.name, frame.offset, exc)
                out.append(None)
        return out

    def _next_batch(self) -> tuple[WalBatch | None, float | None]:
        shipper = self._shipper
        names = segments(shipper.wal_dir)
        self._forget_deleted(names)
        if self._last_segment in names:  # round robin over the writers' segments
            i = names.index(self._last_segment) + 1
            names = names[i:] + names[:i]
        now_ms = time.time() * 1000.0
        wait_ms: float | None = None
        for name in names:
            with self.lock:
                if name in self.state.done:
                    continue
                pos = self.state.offsets.get(name, 0)
            path = shipper.wal_dir / name
            sealed = segment_sealed(path)  # before reading: sealed + read to the end = complete
            frames, records, next_offset, at_end, full = self._read_batch(name, path, pos, sealed)
            if not frames:
                changed = False
                with self.lock:
                    if next_offset != pos:  # damage skipped
                        self.state.offsets[name] = next_offset
                        changed = True
                    if sealed and at_end:
                        self.state.done.add(name)
                        changed = True
                if changed:
                    self._save(sync=False)
                continue
            age_ms = now_ms - frames[0].time_ms
            if full or not at_end or sealed or shipper.draining or age_ms >= shipper.flush_interval_ms:
                return WalBatch(name, frames, records, full=full), None
            left = shipper.flush_interval_ms - age_ms
            wait_ms = left if wait_ms is None else min(wait_ms, left)
        return None, None if wait_ms is None else max(0.0, wait_ms) / 1000.0

    def _read_batch(
        self, name: str, path: Path, pos: int, sealed: bool
    ) -> tuple[list[Frame], list[StepRecord | None], int, bool, bool]:
        """Records from `pos` on, up to a batch (spans, records, bytes), read in chunks so that
        nothing is read twice: (frames, records, next offset, at the end, batch full)."""
        frames: list[Frame] = []
        records: list[StepRecord | None] = []
        spans = nbytes = 0
        while True:
            # as many records as the batch still needs, by the spans per record seen so far
            per_record = spans / len(frames) if frames and spans else 1.0
            want = int((self._batch_spans - spans) / per_record) + 8
            res = read_frames(
                path, pos, sealed=sealed, max_bytes=min(4 << 20, self._batch_bytes - nbytes),
                max_frames=max(1, min(2000, want, self._batch_records - len(frames))),
            )  # fmt: skip
            if res.damaged:
                self._shipper.count_damage(name, res.damaged, res.damaged_bytes, self.name)
            for frame, record in zip(res.frames, self._decode(res.frames), strict=True):
                frames.append(frame)
                records.append(record)
                spans += record.n_spans if record is not None else 0
                nbytes += frame.end - frame.offset
                if (
                    spans >= self._batch_spans
                    or nbytes >= self._batch_bytes
                    or len(frames) >= self._batch_records
                ):
                    return frames, records, frame.end, False, True
            pos = res.next_offset
            if res.at_end or not res.frames:
                return frames, records, pos, res.at_end, False

    def _forget_deleted(self, names: list[str]) -> None:
        present = set(names)
        with self.lock:
            gone = [n for n in self.state.offsets if n not in present]
            gone += [n for n in self.state.done if n not in present]
            for name in gone:
                self.state.offsets.pop(name, None)
                self.state.done.discard(name)

    # -- shipping -----------------------------------------------------------------------------------

    def _ship(self, batch: WalBatch, pending: Pending | None = None) -> None:
        shipper = self._shipper
        if pending is None:
            with self.lock:
                self.state.pending = Pending(batch.segment, batch.first, batch.last, batch.end)
            self._save(sync=True)  # the bounds first: a retry after a crash rebuilds this batch
        while True:
            if shipper.stopping:
                return  # the bounds are on file: the next start ships exactly this batch first
            now = time.monotonic()
            if now < self._retry_at:
                shipper.wait(self._retry_at - now)
                continue
            started = time.monotonic()
            try:
                rejected = self._deliver(batch)
            except Exception as exc:
                self._failed(exc, batch)
                continue
            break
        with self.lock:
            self.state.pending = None
            self.state.offsets[batch.segment] = max(batch.end, self.state.offsets.get(batch.segment, 0))
        self._save(sync=False)  # losing this only re-sends the batch under the same token
        self._last_segment = batch.segment
        self._succeeded(batch, rejected, time.monotonic() - started)

    def _save(self, *, sync: bool) -> None:
        with self.lock:
            self._cursor.save(self.state, sync=sync)

    def _succeeded(self, batch: WalBatch, rejected: int, seconds: float) -> None:
        if self._failures:
            log.warning("span sink %s recovered after %d failed attempts", self.name, self._failures)
        self._failures = 0
        self._retry_at = 0.0
        self.batches_written += 1
        self.records_written += len(batch.records)
        self.spans_written += batch.n_spans
        self.rejected += rejected
        self._shipper.on_batch_written(self.name, batch, seconds)

    def _failed(self, exc: BaseException, batch: WalBatch) -> None:
        shipper = self._shipper
        self._failures += 1
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:1000]
        self.last_error_at = time.time()
        delay = min(shipper.retry_max_s, shipper.retry_initial_s * 2 ** min(self._failures - 1, 30))
        delay *= random.uniform(0.8, 1.0)  # jitter: replicas do not retry in lockstep
        self._retry_at = time.monotonic() + delay
        now = time.monotonic()
        if now - self._last_log >= shipper.log_interval_s:
            more = f" ({self._suppressed} similar errors not logged)" if self._suppressed else ""
            log.error(
                "span sink %s could not take batch %s (%d records): %s; retry in %.1fs%s",
                self.name, batch.token, len(batch.records), self.last_error, delay, more,
            )  # fmt: skip
            self._last_log = now
            self._suppressed = 0
        else:
            self._suppressed += 1

    # -- shutdown and statistics -------------------------------------------------------------------

    def close(self, stuck: bool) -> None:
        if not stuck:
            try:
                self._closer()
            except Exception:
                log.exception("closing span sink %s failed", self.name)
        with self.lock:  # a stuck thread that wakes up later finds the cursor closed (EBADF)
            self._cursor.close()

    def position(self) -> tuple[dict[str, int], set[str]]:
        with self.lock:
            return dict(self.state.offsets), set(self.state.done)

    def retry_in_s(self) -> float:
        return max(0.0, self._retry_at - time.monotonic()) if self._failures else 0.0


class Shipper:
    """See the module docstring. `start()` runs the lanes, the coordinator (segment deletion) and
    the socket; `stop()` drains what is in the WAL (up to a timeout) and stops."""

    def __init__(
        self,
        wal_dir: Path,
        *,
        sinks: Sequence[SpanSink] = (),
        payloads: PayloadStore | None = None,
        query_store: Any = None,
        socket_path: Path | None = None,
        batch_size: int = 20_000,
        batch_records: int = 50_000,
        batch_bytes: int = 32 << 20,
        payload_batch_bytes: int = 8 << 20,
        flush_interval_s: float = 1.0,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        poll_interval_s: float = 0.2,
        log_interval_s: float = 30.0,
        lock_timeout_s: float = 60.0,
        lock_fd: int | None = None,
        restarts: int = 0,
    ) -> None:
        names = [s.name for s in sinks]
        if len(set(names)) != len(names) or PAYLOADS_LANE in names:
            raise ValueError(f"span sink names must be unique and not {PAYLOADS_LANE!r}: {names}")
        self.wal_dir = Path(wal_dir)
        self.wal_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_fd if lock_fd is not None else lock_shipper(self.wal_dir, lock_timeout_s)
        self.flush_interval_ms = flush_interval_s * 1000.0
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.poll_interval_s = poll_interval_s
        self.log_interval_s = log_interval_s
        self.restarts = restarts
        self.started_at = time.time()
        self.query_store = query_store
        self.payload_store = payloads
        self.draining = False
        self.stopping = False
        self._wake = threading.Event()
        self._stats_lock = threading.Lock()
        self.damaged_records = 0
        self.damaged_bytes = 0
        self.deleted_segments = 0
        self._on_written: list[Callable[[str, WalBatch, float], None]] = []
        self.lanes: list[_Lane] = [
            _Lane(self, s.name, span_delivery(s), closer=s.close, batch_spans=batch_size,
                  batch_records=batch_records, batch_bytes=batch_bytes)
            for s in sinks
        ]  # fmt: skip
        self.payload_delivery: PayloadDelivery | None = None
        if payloads is not None:
            self.payload_delivery = PayloadDelivery(payloads)
            self.lanes.append(
                _Lane(self, PAYLOADS_LANE, self.payload_delivery, closer=payloads.close,
                      batch_spans=1 << 30, batch_records=batch_records, batch_bytes=payload_batch_bytes)
            )  # fmt: skip
        self._coordinator: threading.Thread | None = None
        self._control = ControlServer(socket_path, self.handle) if socket_path is not None else None
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        for lane in self.lanes:
            lane.start()
        self._coordinator = threading.Thread(target=self._run_coordinator, name="runcap-shipper", daemon=True)
        self._coordinator.start()
        if self._control is not None:
            self._control.start()

    def wait(self, seconds: float) -> None:
        """Sleep, but wake at once for a drain or a stop."""
        if seconds > 0:
            self._wake.wait(seconds)

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Ship what the WAL holds (up to `drain_timeout_s`), then stop. What is not shipped stays
        in the WAL, and a failing batch's bounds in its cursor, for the next start."""
        if self._closed:
            return
        deadline = time.monotonic() + drain_timeout_s
        self.draining = True
        self._wake.set()  # wakes whoever waits now (to ship without waiting for the flush age)...
        self._wake.clear()  # ...and no more: a lane backing off from a failing sink still backs off
        while time.monotonic() < deadline and not all(lane.drained for lane in self.lanes):
            time.sleep(0.02)
        self.stopping = True
        self._wake.set()
        if self._control is not None:
            self._control.close()
        if self._coordinator is not None:
            self._coordinator.join(2.0)
        for lane in self.lanes:
            stuck = not lane.join(max(0.5, deadline - time.monotonic()))
            if stuck:
                log.error(
                    "span sink %s did not finish in time; its batch is shipped again next start", lane.name
                )
            lane.close(stuck)
        self._closed = True
        os.close(self._lock_fd)

    # -- coordinator: deletion ---------------------------------------------------------------------

    def _run_coordinator(self) -> None:
        while not self.stopping:
            try:
                self._delete_passed()
            except Exception:
                log.exception("span shipper: deleting shipped segments failed")
            self.wait(max(self.poll_interval_s, 0.1))

    def _delete_passed(self) -> None:
        if not self.lanes:
            return
        positions = [lane.position()[1] for lane in self.lanes]
        for name in segments(self.wal_dir):
            if all(name in done for done in positions) and segment_sealed(self.wal_dir / name):
                try:
                    os.unlink(self.wal_dir / name)
                    self.deleted_segments += 1
                except FileNotFoundError:
                    pass

    def count_damage(self, segment: str, records: int, nbytes: int, lane: str) -> None:
        """Every lane skips the same damage: it is counted (and logged) as the first lane sees it."""
        if lane != self.lanes[0].name:
            return
        with self._stats_lock:
            self.damaged_records += records
            self.damaged_bytes += nbytes
        log.error("WAL segment %s: skipped %d damaged bytes (%d regions) to the next valid record",
                  segment, nbytes, records)  # fmt: skip

    def on_batch_written(self, lane: str, batch: WalBatch, seconds: float) -> None:
        for hook in self._on_written:
            hook(lane, batch, seconds)

    def add_batch_hook(self, hook: Callable[[str, WalBatch, float], None]) -> None:
        self._on_written.append(hook)

    # -- statistics and the socket -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        names = segments(self.wal_dir)
        sizes: dict[str, int] = {}
        for name in names:
            try:
                sizes[name] = os.stat(self.wal_dir / name).st_size
            except FileNotFoundError:
                pass
        now_ms = time.time() * 1000.0
        sinks: dict[str, Any] = {}
        for lane in self.lanes:
            offsets, done = lane.position()
            unshipped = 0
            oldest_ms: float | None = None
            for name, size in sizes.items():
                if name in done:
                    continue
                pos = offsets.get(name, 0)
                if size <= pos:
                    continue
                unshipped += size - pos
                t = _record_time(self.wal_dir / name, pos)
                if t is not None and (oldest_ms is None or t < oldest_ms):
                    oldest_ms = t
            sinks[lane.name] = {
                "batches_written": lane.batches_written,
                "records_written": lane.records_written,
                "spans_written": lane.spans_written,
                "rejected": lane.rejected,
                "undecodable": lane.undecodable,
                "errors": lane.errors,
                "last_error": lane.last_error,
                "last_error_at": lane.last_error_at,
                "retry_in_s": lane.retry_in_s(),
                "unshipped_bytes": unshipped,
                "oldest_unshipped_age_s": 0.0 if oldest_ms is None else max(0.0, now_ms - oldest_ms) / 1000.0,
            }
        return {
            "pid": os.getpid(),
            "started_at": self.started_at,
            "restarts": self.restarts,
            "wal_bytes": sum(sizes.values()),
            "segments": len(sizes),
            "deleted_segments": self.deleted_segments,
            "damaged_records": self.damaged_records,
            "damaged_bytes": self.damaged_bytes,
            "payloads_deduplicated": self.payload_delivery.skipped if self.payload_delivery else 0,
            "sinks": sinks,
        }

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request on the socket (proxy/spans/control.py)."""
        op = message.get("op")
        if op == "ping":
            return {"ok": True}
        if op == "stats":
            return {"ok": True, "stats": self.stats()}
        if op != "query":
            return {"ok": False, "error": {"kind": "bad_request", "message": f"unknown op {op!r}"}}
        sql, params = message.get("sql"), message.get("params") or {}
        if not isinstance(sql, str) or not isinstance(params, dict):
            return {
                "ok": False,
                "error": {"kind": "bad_request", "message": "sql must be a string, params an object"},
            }
        if self.query_store is None:
            return {"ok": False, "error": {"kind": "unavailable", "message": "no span store configured"}}
        from proxy.spans.clickhouse import SpanQueryError, SpanStoreError

        try:
            columns, rows = self.query_store.query(sql, params)
        except SpanQueryError as exc:
            return {"ok": False, "error": {"kind": "query", "message": str(exc), "code": exc.code}}
        except (SpanStoreError, SinkError) as exc:
            return {"ok": False, "error": {"kind": "unavailable", "message": str(exc)}}
        except Exception as exc:  # the store's own failure, said as such
            log.exception("span store query failed")
            return {"ok": False, "error": {"kind": "unavailable", "message": f"{type(exc).__name__}: {exc}"}}
        return {"ok": True, "columns": columns, "rows": rows}


def _record_time(path: Path, offset: int) -> float | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        head = os.pread(fd, HEADER_SIZE, offset)
    finally:
        os.close(fd)
    if len(head) < HEADER_SIZE or head[:4] != MAGIC:
        return None
    return float(int.from_bytes(head[8:16], "little"))


def lock_shipper(wal_dir: Path, timeout_s: float) -> int:
    """One shipper per WAL. A shipper starting while the previous one is still exiting waits."""
    fd = os.open(wal_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise RuntimeError(
                    f"another span shipper holds {wal_dir / LOCK_FILE}: one shipper per data directory"
                ) from None
            if not logged:
                log.warning("waiting for the previous span shipper of %s to exit", wal_dir)
                logged = True
            time.sleep(0.1)
