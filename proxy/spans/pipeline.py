"""The span pipeline: hot path → in-memory queue → batcher → one lane per sink → sink or spool.

The request path calls `submit_span` / `submit_run` / `submit_payload` on the event loop (one
thread). Normally each is a deque append and a length check (~0.5 µs): it never awaits and takes
no lock. When the queue is full (records or payload bytes), the record is appended to the
overflow spool instead — one write() of ~1 KB, no fsync (~10 µs; it survives kill -9 through the
page cache, and the batcher fsyncs it within `flush_interval_s`) — bounded memory without
dropping records or waiting for a sink.

A batcher thread cuts batches by size (`batch_size`) or age (`flush_interval_s`), gives each a
batch id, and offers it to every lane. A lane is a thread per sink (and one for the payload
store) with a short in-memory queue, so a slow or dead sink never holds back another. A failed
batch is appended — with its batch id — to the lane's spool (`spool_dir/{sink.name}/`, fsync'd);
the lane replays its spool oldest-first with exponential backoff and acknowledges (deletes) a
record only after the sink took it. Replays carry the original batch id, so sinks that dedupe on
it see each batch exactly once. While a lane's spool is non-empty, its new batches go behind
them into the spool, keeping the sink's order. Spools left by an earlier process are replayed
on start (the payload store's spool is `spool_dir/payloads/`, the overflow `spool_dir/_overflow/`;
a `.lock` keeps a second process out of the same directory).

Like OpenTelemetry's BatchSpanProcessor: producing, batching and shipping are three objects,
and the producer never blocks on the shipper.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.sink import PayloadStore, SpanSink
from proxy.spans.spool import Batch, Spool, SpoolRecordError, decode_batch, encode_batch

log = logging.getLogger(__name__)

OVERFLOW_DIR = "_overflow"
PAYLOADS_LANE = "payloads"

SinkErrorHook = Callable[[str, BaseException], None]
BatchWrittenHook = Callable[[str, int, float], None]  # lane name, records, seconds


@dataclass(frozen=True, slots=True)
class SinkStats:
    name: str
    batches_written: int
    records_written: int
    errors: int  # failed write attempts, replays included
    last_error: str
    last_error_at: float | None  # unix time
    queued_batches: int  # in memory, waiting for the sink
    spooled_batches: int
    spooled_records: int
    spooled_bytes: int
    oldest_spooled_age_s: float
    retry_in_s: float  # 0 when healthy
    rejected: int  # records a sink can never take (invalid payloads), logged and skipped
    dropped: int  # records lost because the spool itself could not be written (disk full)


@dataclass(frozen=True, slots=True)
class PipelineStats:
    queue_depth: int
    queue_payload_bytes: int
    submitted: int
    overflowed: int  # records that took the overflow path since start
    overflow_pending_records: int
    overflow_pending_bytes: int
    sinks: dict[str, SinkStats]


def new_batch_id() -> str:
    # time-ordered, so spool files and sink logs read in order; random tail makes it unique
    return f"{time.time_ns():016x}{os.urandom(8).hex()}"


class SpanPipeline:
    """See the module docstring. Thread model: `submit_*` from one thread (the event loop);
    everything else runs on the pipeline's own threads."""

    def __init__(
        self,
        sinks: Sequence[SpanSink],
        payloads: PayloadStore | None,
        spool_dir: Path,
        *,
        max_queue: int = 50_000,
        max_queue_bytes: int = 256 << 20,
        batch_size: int = 500,
        flush_interval_s: float = 1.0,
        lane_queue_batches: int = 16,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        fsync: bool = True,
        log_interval_s: float = 30.0,
        on_sink_error: SinkErrorHook | None = None,
        on_batch_written: BatchWrittenHook | None = None,
    ) -> None:
        names = [s.name for s in sinks]
        if len(set(names)) != len(names) or PAYLOADS_LANE in names or OVERFLOW_DIR in names:
            raise ValueError(f"span sink names must be unique and not reserved: {names}")
        self._spool_dir = Path(spool_dir)
        self._spool_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self._spool_dir)
        self._max_queue = max_queue
        self._max_queue_bytes = max_queue_bytes
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._queue: deque[Span | RunSnapshot | Payload] = deque()
        # single-writer counters (hot path adds, batcher subtracts): exact without a lock
        self._bytes_in = 0
        self._bytes_out = 0
        self._submitted = 0
        self._overflowed = 0
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False
        self._started = False
        self._batcher: threading.Thread | None = None
        self._overflow = Spool(self._spool_dir / OVERFLOW_DIR, fsync=False)
        lane_args = dict(
            queue_batches=lane_queue_batches,
            retry_initial_s=retry_initial_s,
            retry_max_s=retry_max_s,
            fsync=fsync,
            log_interval_s=log_interval_s,
            on_error=on_sink_error,
            on_written=on_batch_written,
        )
        self._lanes: list[_Lane] = [
            _Lane(
                sink.name,
                _span_delivery(sink),
                _span_part,
                self._spool_dir / sink.name,
                closer=sink.close,
                **lane_args,  # type: ignore[arg-type]
            )
            for sink in sinks
        ]
        if payloads is not None:
            self._lanes.append(
                _Lane(
                    PAYLOADS_LANE,
                    _payload_delivery(payloads),
                    _payload_part,
                    self._spool_dir / PAYLOADS_LANE,
                    closer=payloads.close,
                    **lane_args,  # type: ignore[arg-type]
                )
            )

    # hot path ------------------------------------------------------------------------------------

    def submit_span(self, span: Span) -> None:
        self._submit(span, 0)

    def submit_run(self, snapshot: RunSnapshot) -> None:
        self._submit(snapshot, 0)

    def submit_payload(self, payload: Payload) -> None:
        self._submit(payload, len(payload.data))

    def _submit(self, record: Span | RunSnapshot | Payload, size: int) -> None:
        self._submitted += 1
        queue = self._queue
        if (
            not self._closed
            and len(queue) < self._max_queue
            and (not size or self._bytes_in - self._bytes_out + size <= self._max_queue_bytes)
        ):
            self._bytes_in += size
            queue.append(record)
            if len(queue) >= self._batch_size and not self._wake.is_set():
                self._wake.set()
            return
        self._overflow_record(record)

    def _overflow_record(self, record: Span | RunSnapshot | Payload) -> None:
        batch = Batch("")
        if isinstance(record, Span):
            batch.spans.append(record)
        elif isinstance(record, RunSnapshot):
            batch.runs.append(record)
        else:
            batch.payloads.append(record)
        self._overflow.append(encode_batch(batch), 1)
        self._overflowed += 1
        if self._closed:
            self._overflow.sync()  # nobody is left to fsync it; the next start replays it
        elif not self._wake.is_set():
            self._wake.set()

    # lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for lane in self._lanes:
            lane.start()
        self._batcher = threading.Thread(target=self._run_batcher, name="runcap-span-batcher", daemon=True)
        self._batcher.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Drain the queue to the sinks (or to their spools where a sink fails or is too slow for
        the timeout), then close the sinks. Nothing queued is lost: what could not be written is
        on disk for the next start."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout_s
        self._stopping = True
        self._wake.set()
        if self._batcher is not None:
            self._batcher.join(max(0.0, deadline - time.monotonic()))
            if self._batcher.is_alive():
                log.error("span batcher did not finish within %.1fs; leftovers go to the spool", timeout_s)
        self._closed = True  # from here on, submissions go straight to the overflow spool
        self._spill_queue_to_overflow()
        for lane in self._lanes:
            lane.stop()
        for lane in self._lanes:
            lane.join(max(0.0, deadline - time.monotonic()))
        for lane in self._lanes:
            lane.finish()
        self._spill_queue_to_overflow()  # a submit that raced with close() still lands on disk
        self._overflow.close()
        os.close(self._lock_fd)  # releases the directory for the next process

    async def aclose(self, timeout_s: float = 10.0) -> None:
        await asyncio.to_thread(self.close, timeout_s)

    def _spill_queue_to_overflow(self) -> None:
        while True:
            try:
                record = self._queue.popleft()
            except IndexError:
                break
            if isinstance(record, Payload):
                self._bytes_out += len(record.data)
            self._overflow_record(record)
        self._overflow.sync()

    # batcher -------------------------------------------------------------------------------------

    def _run_batcher(self) -> None:
        next_flush = time.monotonic() + self._flush_interval_s
        more_overflow = bool(self._overflow.pending())
        while True:
            try:
                now = time.monotonic()
                if not self._stopping and not more_overflow and now < next_flush:
                    self._wake.wait(next_flush - now)
                self._wake.clear()
                stopping = self._stopping
                now = time.monotonic()
                due = stopping or now >= next_flush
                while len(self._queue) >= self._batch_size or (due and self._queue):
                    self._dispatch(self._take(), durable=False)
                    time.sleep(0)  # let the lanes run before cutting the next batch (GIL)
                if due:
                    next_flush = now + self._flush_interval_s
                    self._overflow.sync()
                more_overflow = False
                if len(self._queue) < self._batch_size:
                    more_overflow = self._drain_overflow()
                if stopping and not self._queue and not more_overflow:
                    return
            except Exception:  # a bug here must not silently stop all tracing
                log.exception("span batcher failed; retrying in 1s")
                time.sleep(1.0)

    def _take(self) -> Batch:
        batch = Batch(new_batch_id())
        size = 0
        queue = self._queue
        # A run's snapshots only matter by their newest (runcap.runs is read by argMax(updated_at)),
        # and a body is stored once per hash: a batch carries each once.
        runs: dict[str, RunSnapshot] = {}
        payloads: dict[str, Payload] = {}
        for _ in range(min(self._batch_size, len(queue))):
            record = queue.popleft()
            if isinstance(record, Span):
                batch.spans.append(record)
            elif isinstance(record, RunSnapshot):
                seen = runs.get(record.run_id)
                if seen is None or record.updated_at >= seen.updated_at:
                    runs[record.run_id] = record
            else:
                payloads[record.sha256] = record
                size += len(record.data)
        batch.runs = list(runs.values())
        batch.payloads = list(payloads.values())
        self._bytes_out += size
        return batch

    def _drain_overflow(self) -> bool:
        """Move one batch of overflow records into the lanes' spools; True if more are waiting."""
        entries = self._overflow.peek_many(self._batch_size)
        if not entries:
            return False
        # Decode before claiming: a record that never decodes is set aside only once it is the
        # oldest (acknowledgements go in order), and the good ones before it go first.
        parts = []
        for i, entry in enumerate(entries):
            try:
                parts.append(decode_batch(entry.body))
            except SpoolRecordError as exc:
                if i == 0:
                    self._overflow.quarantine(entry, str(exc))
                    return True
                entries = entries[:i]
                break
        self._overflow.sync()
        self._overflow.claim(entries)
        # The id is a hash of the records, so a crash between spooling and acknowledging yields
        # the same batch id again on replay, and the sinks' dedup drops the repeat.
        digest = hashlib.sha256()
        batch = Batch("")
        for entry, part in zip(entries, parts, strict=False):
            digest.update(entry.body)
            batch.spans.extend(part.spans)
            batch.runs.extend(part.runs)
            batch.payloads.extend(part.payloads)
        batch.batch_id = "o" + digest.hexdigest()[:31]
        self._dispatch(batch, durable=True)
        self._overflow.ack_many(entries)
        return bool(self._overflow.pending())

    def _dispatch(self, batch: Batch, *, durable: bool) -> None:
        for lane in self._lanes:  # each lane on its own: one lane's disk trouble is not another's
            lane.offer(batch, durable=durable)

    # metrics -------------------------------------------------------------------------------------

    def stats(self) -> PipelineStats:
        overflow = self._overflow.stats()
        return PipelineStats(
            queue_depth=len(self._queue),
            queue_payload_bytes=self._bytes_in - self._bytes_out,
            submitted=self._submitted,
            overflowed=self._overflowed,
            overflow_pending_records=overflow.records,
            overflow_pending_bytes=overflow.bytes,
            sinks={lane.name: lane.stats() for lane in self._lanes},
        )


def _lock_directory(directory: Path) -> int:
    """One process per spool directory: two writers would interleave segments and cursors."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"span spool {directory} is in use by another runcap process; "
            "give each process its own data directory (RUNCAP_DATA_DIR / --data-dir)"
        ) from None
    return fd


# --- what each lane sends where --------------------------------------------------------------------


def _span_part(batch: Batch) -> Batch | None:
    if not batch.spans and not batch.runs:
        return None
    return Batch(batch.batch_id, batch.spans, batch.runs, [])


def _payload_part(batch: Batch) -> Batch | None:
    if not batch.payloads:
        return None
    return Batch(batch.batch_id, [], [], batch.payloads)


def _span_delivery(sink: SpanSink) -> Callable[[Batch], int]:
    def deliver(batch: Batch) -> int:
        sink.write(batch.spans, batch.runs, batch.batch_id)
        return 0

    return deliver


def _payload_delivery(store: PayloadStore) -> Callable[[Batch], int]:
    def deliver(batch: Batch) -> int:
        rejected = store.put_many(batch.payloads)
        for payload, reason in rejected:  # wrong hash, bad key: retrying cannot fix it
            log.error("payload store %s rejected payload %.16s: %s", store.name, payload.sha256, reason)
        return len(rejected)

    return deliver


# --- lanes -----------------------------------------------------------------------------------------


class _Lane:
    """One sink's thread, short in-memory queue, spool and retry state."""

    def __init__(
        self,
        name: str,
        deliver: Callable[[Batch], int],
        select: Callable[[Batch], Batch | None],
        spool_dir: Path,
        *,
        closer: Callable[[], None],
        queue_batches: int,
        retry_initial_s: float,
        retry_max_s: float,
        fsync: bool,
        log_interval_s: float,
        on_error: SinkErrorHook | None,
        on_written: BatchWrittenHook | None,
    ) -> None:
        self.name = name
        self._deliver = deliver
        self._select = select
        self._closer = closer
        self._spool = Spool(spool_dir, fsync=fsync)
        self._mem: deque[Batch] = deque()
        self._cap = max(1, queue_batches)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._abandoned = False
        self._inflight: Batch | None = None
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._failures = 0  # consecutive
        self._retry_at = 0.0
        self._log_interval_s = log_interval_s
        self._last_log = -1e18
        self._suppressed = 0
        self._on_error = on_error
        self._on_written = on_written
        self.batches_written = 0
        self.records_written = 0
        self.errors = 0
        self.rejected = 0
        self.dropped = 0
        self.last_error = ""
        self.last_error_at: float | None = None

    # batcher side --------------------------------------------------------------------------------

    def offer(self, batch: Batch, *, durable: bool) -> None:
        part = self._select(batch)
        if part is None:
            return
        with self._cond:
            if durable or len(self._mem) >= self._cap or self._spool.pending():
                # The spool is the overflow for a slow or failing sink; everything already queued
                # goes in first so the sink still sees batches in order.
                self._spill_locked([*self._mem, part])
                self._mem.clear()
            else:
                self._mem.append(part)
            self._cond.notify()

    def _spill_locked(self, batches: list[Batch]) -> None:
        try:
            self._spool.append_many([(encode_batch(b), len(b)) for b in batches])
        except OSError as exc:  # disk full or gone: the one place records are lost, loudly
            lost = sum(len(b) for b in batches)
            self.dropped += lost
            log.error("span sink %s: cannot write its spool, %d records lost: %s", self.name, lost, exc)

    # lane thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"runcap-sink-{self.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                batch = None
                while True:
                    if self._abandoned:
                        return
                    pending = self._spool.pending()
                    if pending and self._mem:
                        self._spill_locked(list(self._mem))
                        self._mem.clear()
                    if pending:
                        if self._stopping and self._failures:
                            return  # a failing sink's spool waits for the next start
                        wait = self._retry_at - time.monotonic()
                        if wait <= 0:
                            break  # a healthy sink takes the spool before close() returns
                        self._cond.wait(wait)
                        continue
                    if self._mem:
                        batch = self._mem.popleft()
                        self._inflight = batch
                        break
                    if self._stopping:
                        return
                    self._cond.wait()
            try:
                if batch is None:
                    self._replay_one()
                else:
                    self._write_new(batch)
            except Exception:  # spool I/O trouble: log, back off, keep the thread alive
                log.exception("span sink lane %s failed", self.name)
                with self._cond:
                    self._cond.wait(1.0)

    def _write_new(self, batch: Batch) -> None:
        started = time.monotonic()
        try:
            rejected = self._deliver(batch)
        except Exception as exc:
            with self._cond:
                self._inflight = None
                if self._abandoned:
                    return  # close() already spooled it
                self._spill_locked([batch])
                self._failed(exc, batch)
            return
        with self._cond:
            self._inflight = None
            self._succeeded(batch, rejected, time.monotonic() - started)

    def _replay_one(self) -> None:
        entry = self._spool.peek()
        if entry is None:
            return
        try:
            batch = decode_batch(entry.body)
        except SpoolRecordError as exc:  # a record no sink could ever take
            self._spool.quarantine(entry, str(exc))
            return
        started = time.monotonic()
        try:
            rejected = self._deliver(batch)
        except Exception as exc:
            with self._cond:
                self._failed(exc, batch)
            return
        with self._cond:
            if self._abandoned:
                return  # close() gave up on us; the next start replays it (deduped by batch id)
        self._spool.ack(entry)
        with self._cond:
            self._succeeded(batch, rejected, time.monotonic() - started)

    def _succeeded(self, batch: Batch, rejected: int, seconds: float) -> None:
        if self._failures:
            log.warning(
                "span sink %s recovered after %d failed attempts; %d batches still spooled",
                self.name,
                self._failures,
                self._spool.pending(),
            )
        self._failures = 0
        self._retry_at = 0.0
        self.batches_written += 1
        self.records_written += len(batch) - rejected
        self.rejected += rejected
        if self._on_written is not None:
            self._on_written(self.name, len(batch) - rejected, seconds)

    def _failed(self, exc: BaseException, batch: Batch) -> None:
        self._failures += 1
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:1000]
        self.last_error_at = time.time()
        delay = min(self._retry_max_s, self._retry_initial_s * 2 ** min(self._failures - 1, 30))
        delay *= random.uniform(0.8, 1.0)  # jitter, so replicas do not retry in lockstep
        self._retry_at = time.monotonic() + delay
        now = time.monotonic()
        if now - self._last_log >= self._log_interval_s:
            more = f" ({self._suppressed} similar errors not logged)" if self._suppressed else ""
            log.error(
                "span sink %s could not write batch %s (%d records): %s; "
                "%d batches spooled, retry in %.1fs%s",
                self.name,
                batch.batch_id,
                len(batch),
                self.last_error,
                self._spool.pending(),
                delay,
                more,
            )
            self._last_log = now
            self._suppressed = 0
        else:
            self._suppressed += 1
        if self._on_error is not None:
            try:
                self._on_error(self.name, exc)
            except Exception:
                log.exception("on_sink_error hook failed")

    # shutdown ------------------------------------------------------------------------------------

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def finish(self) -> None:
        """After the join: spool whatever a stuck sink still holds, then close the sink."""
        stuck = self._thread is not None and self._thread.is_alive()
        with self._cond:
            leftovers = list(self._mem)
            if stuck and self._inflight is not None:
                # it may still land; the sink's batch-id dedup absorbs the replay then
                leftovers.insert(0, self._inflight)
            if leftovers:
                self._spill_locked(leftovers)
                self._mem.clear()
            self._abandoned = True
            self._cond.notify_all()
        if stuck:
            log.error("span sink %s did not finish in time; its batches are spooled", self.name)
        else:
            try:
                self._closer()
            except Exception:
                log.exception("closing span sink %s failed", self.name)
        self._spool.close()

    def stats(self) -> SinkStats:
        spool = self._spool.stats()
        with self._cond:
            queued = len(self._mem)
            retry_in = max(0.0, self._retry_at - time.monotonic()) if self._failures else 0.0
        return SinkStats(
            name=self.name,
            batches_written=self.batches_written,
            records_written=self.records_written,
            errors=self.errors,
            last_error=self.last_error,
            last_error_at=self.last_error_at,
            queued_batches=queued,
            spooled_batches=spool.records,
            spooled_records=spool.items,
            spooled_bytes=spool.bytes,
            oldest_spooled_age_s=spool.oldest_age_s,
            retry_in_s=retry_in,
            rejected=self.rejected,
            dropped=self.dropped,
        )
