"""The span pipeline against in-test sinks that really store, fail, or stall, and real spool
files on disk: batching, isolation between sinks, spool + replay with original batch ids,
overflow, restart after a crash (torn record), graceful close, and the hot path's cost."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest

from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.payloads import LocalPayloadStore
from proxy.spans.pipeline import OVERFLOW_DIR, SpanPipeline
from proxy.spans.sink import SinkError
from proxy.spans.spool import HEADER_SIZE, Batch, Spool, decode_batch, encode_batch, frame

FAST = dict(retry_initial_s=0.02, retry_max_s=0.1, flush_interval_s=0.05)


class ListSink:
    """A SpanSink that keeps what it was given; it can be switched to fail or to stall, and it
    dedupes on batch_id as the ClickHouse sink does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failing = False
        self.delay_s = 0.0
        self.deliveries: list[str] = []  # batch ids of every successful write, repeats included
        self.attempts: list[str] = []
        self.rows: dict[str, tuple[list[Span], list[RunSnapshot]]] = {}  # deduplicated by batch_id
        self.closed = False
        self._lock = threading.Lock()

    def write(self, spans: Sequence[Span], runs: Sequence[RunSnapshot], batch_id: str) -> None:
        with self._lock:
            self.attempts.append(batch_id)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.failing:
            raise SinkError(f"{self.name} is down")
        with self._lock:
            self.deliveries.append(batch_id)
            self.rows.setdefault(batch_id, (list(spans), list(runs)))

    def close(self) -> None:
        self.closed = True

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return [s for spans, _ in self.rows.values() for s in spans]

    @property
    def runs(self) -> list[RunSnapshot]:
        with self._lock:
            return [r for _, runs in self.rows.values() for r in runs]


def make_span(i: int, run_id: str = "run-1") -> Span:
    return Span(
        run_id=run_id,
        kind="model",
        step=i,
        started_at=datetime(2026, 11, 29, 12, 0, tzinfo=UTC) + timedelta(microseconds=i),
        model="gpt-4o-mini",
        cost_usd=Decimal("0.000123450") * i,
        attributes={"i": str(i)},
    )


def make_run(i: int) -> RunSnapshot:
    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    return RunSnapshot(
        run_id="run-1",
        task="triage",
        started_at=now,
        updated_at=now + timedelta(seconds=i),
        status="active",
        steps=i,
        tool_calls=0,
        input_tokens=10 * i,
        output_tokens=i,
        cost_usd=Decimal("0.5"),
        max_usd=None,
        max_tokens=1000,
        max_steps=None,
        max_tool_calls=None,
        deadline=None,
    )


def wait_until(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


def spool_files(spool_dir: Path, name: str) -> list[Path]:
    return sorted((spool_dir / name).glob("*.seg"))


def test_flush_by_size_then_rest_on_close(tmp_path: Path) -> None:
    sink = ListSink("a")
    pipe = SpanPipeline([sink], None, tmp_path, batch_size=10, flush_interval_s=30)
    pipe.start()
    spans = [make_span(i) for i in range(25)]
    for s in spans:
        pipe.submit_span(s)
    wait_until(lambda: len(sink.deliveries) == 2)
    time.sleep(0.1)
    assert [len(sink.rows[b][0]) for b in sink.deliveries] == [10, 10]  # the last 5 wait for time
    pipe.close()
    assert [len(sink.rows[b][0]) for b in sink.deliveries] == [10, 10, 5]
    assert sink.spans == spans and sink.closed


def test_flush_by_time(tmp_path: Path) -> None:
    sink = ListSink("a")
    pipe = SpanPipeline([sink], None, tmp_path, batch_size=1000, flush_interval_s=0.2)
    pipe.start()
    started = time.monotonic()
    pipe.submit_span(make_span(1))
    pipe.submit_run(make_run(1))
    wait_until(lambda: len(sink.deliveries) == 1)
    assert 0.05 < time.monotonic() - started < 1.0
    assert len(sink.spans) == 1 and len(sink.runs) == 1
    pipe.close()


def test_failing_sink_spools_and_replays_exactly_once_in_order(tmp_path: Path) -> None:
    down, healthy = ListSink("down"), ListSink("healthy")
    down.failing = True
    pipe = SpanPipeline([down, healthy], None, tmp_path, batch_size=5, **FAST)
    pipe.start()
    spans = [make_span(i) for i in range(40)]
    for i, s in enumerate(spans):
        pipe.submit_span(s)
        if i % 10 == 0:
            time.sleep(0.06)  # several batches, each cut by time or size
    wait_until(lambda: len(healthy.spans) == 40)  # the healthy sink is not held back
    assert healthy.spans == spans
    wait_until(lambda: len(down.attempts) >= len(healthy.deliveries) + 2)
    stats = pipe.stats().sinks["down"]
    assert down.deliveries == []
    assert stats.errors >= 2 and "down is down" in stats.last_error
    assert stats.spooled_records == 40 and stats.spooled_batches == len(healthy.deliveries)
    assert stats.spooled_bytes > 0 and spool_files(tmp_path, "down")
    assert pipe.stats().sinks["healthy"].spooled_batches == 0

    down.failing = False
    wait_until(lambda: len(down.spans) == 40)
    # the same batches, with the same ids, in the same order, each written once
    assert down.deliveries == healthy.deliveries
    assert down.spans == spans
    wait_until(lambda: pipe.stats().sinks["down"].spooled_batches == 0)
    assert spool_files(tmp_path, "down") == []
    pipe.close()
    assert down.deliveries == healthy.deliveries


def test_queue_full_goes_to_overflow_spool_nothing_lost(tmp_path: Path) -> None:
    sink = ListSink("a")
    pipe = SpanPipeline([sink], None, tmp_path, max_queue=10, batch_size=20, **FAST)
    spans = [make_span(i) for i in range(100)]
    for s in spans:  # not started yet: the queue fills after 10
        pipe.submit_span(s)
    stats = pipe.stats()
    assert stats.queue_depth == 10 and stats.overflowed == 90
    assert stats.overflow_pending_records == 90 and list((tmp_path / OVERFLOW_DIR).glob("*.seg"))
    pipe.start()
    wait_until(lambda: len(sink.spans) == 100)
    assert sorted(s.span_id for s in sink.spans) == sorted(s.span_id for s in spans)
    assert len(sink.deliveries) == len(set(sink.deliveries))
    pipe.close()
    assert pipe.stats().overflow_pending_records == 0


def test_payload_bytes_bound_the_queue_too(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path / "payloads", fsync=False)
    pipe = SpanPipeline([], store, tmp_path / "spool", max_queue_bytes=1000, batch_size=100, **FAST)
    bodies = [bytes([i]) * 300 for i in range(10)]
    for body in bodies:
        pipe.submit_payload(Payload(hashlib.sha256(body).hexdigest(), body))
    assert pipe.stats().queue_payload_bytes == 900 and pipe.stats().overflowed == 7
    pipe.start()
    pipe.close()
    for body in bodies:
        assert store.get(hashlib.sha256(body).hexdigest()) == body


def test_restart_replays_spool_with_original_batch_ids(tmp_path: Path) -> None:
    first = ListSink("ch")
    first.failing = True
    pipe = SpanPipeline([first], None, tmp_path, batch_size=4, **FAST)
    pipe.start()
    spans = [make_span(i) for i in range(10)]
    # Three runs (snapshots of one run in one batch are coalesced to the newest: see below).
    runs = [dataclasses.replace(make_run(i), run_id=f"run-{i}") for i in range(3)]
    for s in spans:
        pipe.submit_span(s)
    for r in runs:
        pipe.submit_run(r)
    pipe.close()  # the sink is down: everything ends up in its spool
    spooled_ids = [b.batch_id for b in Spool(tmp_path / "ch")]
    assert len(spooled_ids) == 4 and set(first.attempts) <= set(spooled_ids)

    second = ListSink("ch")  # a new process, same spool directory
    pipe2 = SpanPipeline([second], None, tmp_path, batch_size=4, **FAST)
    pipe2.start()
    wait_until(lambda: len(second.deliveries) == 4)
    assert second.deliveries == spooled_ids
    assert second.spans == spans and second.runs == runs
    pipe2.close()
    assert spool_files(tmp_path, "ch") == []


def test_torn_last_record_is_skipped_on_replay(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sink = ListSink("ch")
    sink.failing = True
    pipe = SpanPipeline([sink], None, tmp_path, batch_size=5, **FAST)
    pipe.start()
    spans = [make_span(i) for i in range(10)]
    for s in spans:
        pipe.submit_span(s)
    pipe.close()
    segment = spool_files(tmp_path, "ch")[-1]
    # kill -9 in the middle of a write: a record's first bytes, no more
    torn = frame(encode_batch(Batch("torn", [make_span(99)])), 1)
    with open(segment, "ab") as fh:
        fh.write(torn[: HEADER_SIZE + 30])
    size_before = segment.stat().st_size

    healthy = ListSink("ch")
    with caplog.at_level(logging.WARNING):
        pipe2 = SpanPipeline([healthy], None, tmp_path, batch_size=5, **FAST)
    assert "torn" in caplog.text
    assert segment.stat().st_size == size_before - (HEADER_SIZE + 30)  # truncated, not replayed
    pipe2.start()
    wait_until(lambda: len(healthy.spans) == 10)
    pipe2.close()
    assert healthy.spans == spans and "torn" not in healthy.deliveries


def test_damaged_record_in_the_middle_is_cut_out(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    batches = [Batch(f"b{i}", [make_span(i)]) for i in range(3)]
    for b in batches:
        spool.append(encode_batch(b))
    spool.close()
    segment = sorted((tmp_path / "s").glob("*.seg"))[0]
    data = bytearray(segment.read_bytes())
    first_len = len(frame(encode_batch(batches[0]), 1))
    data[first_len + HEADER_SIZE + 5] ^= 0xFF  # flip a byte in the second record's body
    segment.write_bytes(bytes(data))
    reopened = Spool(tmp_path / "s")
    assert [b.batch_id for b in reopened] == ["b0", "b2"]
    assert reopened.stats().torn_bytes_skipped == len(frame(encode_batch(batches[1]), 1))


def test_spool_cursor_skips_acknowledged_records_after_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    for i in range(5):
        spool.append(encode_batch(Batch(f"b{i}", [make_span(i)])))
    spool.ack_many(spool.peek_many(2))
    # crash: no close(); a new process opens the directory
    assert [b.batch_id for b in Spool(tmp_path / "s")] == ["b2", "b3", "b4"]
    reopened = Spool(tmp_path / "s")
    assert reopened.stats().records == 3
    entry = reopened.peek()
    assert entry is not None and decode_batch(entry.body).batch_id == "b2"


def test_spool_records_after_an_emptied_spool_survive_restarts(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.append(encode_batch(Batch("old", [make_span(1)])))
    spool.ack_many(spool.peek_many(10))  # consumed: the segment is gone, the cursor stays
    spool.close()
    again = Spool(tmp_path / "s")
    again.append(encode_batch(Batch("new", [make_span(2)])))
    again.close()
    assert [b.batch_id for b in Spool(tmp_path / "s")] == ["new"]
    assert [b.batch_id for b in Spool(tmp_path / "s")] == ["new"]


def test_spool_claim_hands_out_the_same_records_after_a_crash(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    for i in range(6):
        spool.append(encode_batch(Batch(f"b{i}", [make_span(i)])))
    spool.ack(spool.peek())  # type: ignore[arg-type]
    claimed = spool.peek_many(3)
    spool.claim(claimed)
    for i in range(6, 9):  # more arrive after the claim
        spool.append(encode_batch(Batch(f"b{i}", [make_span(i)])))
    reopened = Spool(tmp_path / "s")
    again = reopened.peek_many(100)
    assert [e.body for e in again] == [e.body for e in claimed]  # same unit, so the same batch id
    reopened.ack_many(again)
    assert [decode_batch(e.body).batch_id for e in reopened.peek_many(100)][:2] == ["b4", "b5"]


def test_undecodable_record_is_quarantined_not_blocking(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "ch")
    spool.append(b"\x05\x00\x00\x00{bad}")  # checksum fine, contents not a batch
    spool.append(encode_batch(Batch("good", [make_span(1)])))
    spool.close()
    sink = ListSink("ch")
    pipe = SpanPipeline([sink], None, tmp_path, **FAST)
    pipe.start()
    wait_until(lambda: sink.deliveries == ["good"])
    pipe.close()
    dead = Spool(tmp_path / "ch" / "dead")
    assert dead.pending() == 1 and dead.peek().body == b"\x05\x00\x00\x00{bad}"  # type: ignore[union-attr]


def test_one_process_per_spool_directory(tmp_path: Path) -> None:
    pipe = SpanPipeline([ListSink("a")], None, tmp_path)
    with pytest.raises(RuntimeError, match="in use by another runcap process"):
        SpanPipeline([ListSink("a")], None, tmp_path)
    pipe.close()
    SpanPipeline([ListSink("a")], None, tmp_path).close()


def test_graceful_close_drains_to_sinks(tmp_path: Path) -> None:
    sink = ListSink("a")
    pipe = SpanPipeline([sink], None, tmp_path, batch_size=1000, flush_interval_s=60)
    pipe.start()
    spans = [make_span(i) for i in range(50)]
    for s in spans:
        pipe.submit_span(s)
    assert sink.deliveries == []
    pipe.close()
    assert sink.spans == spans and sink.closed
    assert spool_files(tmp_path, "a") == []


async def test_aclose_with_stuck_sink_spools_within_timeout(tmp_path: Path) -> None:
    stuck = ListSink("ch")
    stuck.delay_s = 2.0
    pipe = SpanPipeline([stuck], None, tmp_path, batch_size=10, lane_queue_batches=2, **FAST)
    pipe.start()
    spans = [make_span(i) for i in range(50)]
    for s in spans:
        pipe.submit_span(s)
    wait_until(lambda: len(stuck.attempts) == 1)
    started = time.monotonic()
    await pipe.aclose(timeout_s=0.3)
    assert time.monotonic() - started < 1.0
    # all 5 batches are on disk, the one still inside the stuck write included
    spooled = list(Spool(tmp_path / "ch"))
    assert sorted(s.span_id for b in spooled for s in b.spans) == sorted(s.span_id for s in spans)

    later = ListSink("ch")
    pipe2 = SpanPipeline([later], None, tmp_path, batch_size=10, **FAST)
    pipe2.start()
    wait_until(lambda: len(later.deliveries) == 5)
    pipe2.close()
    assert sorted(s.span_id for s in later.spans) == sorted(s.span_id for s in spans)


def test_slow_sink_does_not_slow_submit_or_other_sinks(tmp_path: Path) -> None:
    slow, fast = ListSink("slow"), ListSink("fast")
    slow.delay_s = 2.0
    pipe = SpanPipeline([slow, fast], None, tmp_path, batch_size=500, **FAST)
    pipe.start()
    spans = [make_span(i) for i in range(10_000)]
    started = time.perf_counter()
    for s in spans:
        pipe.submit_span(s)
    elapsed = time.perf_counter() - started
    print(f"10,000 submit_span calls with a 2 s/batch sink: {elapsed * 1e6 / 10_000:.2f} µs each")
    assert elapsed < 1.0
    wait_until(lambda: len(fast.spans) == 10_000, timeout_s=3.0)
    assert len(slow.deliveries) <= 1  # still inside its first batch
    assert pipe.stats().overflowed == 0
    pipe.close(timeout_s=0.2)
    spooled = sum(len(b.spans) for b in Spool(tmp_path / "slow"))
    assert spooled >= 10_000 - 500 * len(slow.deliveries)


def test_submit_cost(tmp_path: Path) -> None:
    pipe = SpanPipeline([ListSink("a")], None, tmp_path, batch_size=500, flush_interval_s=0.05)
    pipe.start()
    spans = [make_span(i) for i in range(20_000)]
    timings = []
    for s in spans:
        t0 = time.perf_counter_ns()
        pipe.submit_span(s)
        timings.append(time.perf_counter_ns() - t0)
    timings.sort()
    p50, p99 = timings[len(timings) // 2] / 1000, timings[int(len(timings) * 0.99)] / 1000
    print(f"submit_span: p50 {p50:.2f} µs, p99 {p99:.2f} µs")
    assert p50 < 20
    pipe.close()


def test_records_round_trip_exactly_through_the_spool(tmp_path: Path) -> None:
    tz = timezone(timedelta(hours=5, minutes=30))
    span = Span(
        run_id="r:1",
        kind="tool",
        step=3,
        started_at=datetime(2026, 1, 2, 3, 4, 5, 0, tzinfo=UTC),  # zero microseconds
        parent_span_id="0123456789abcdef",
        duration_ms=0.1 + 0.2,
        ttft_ms=None,
        cost_usd=Decimal("0.001250000"),
        price_known=False,
        tool_name="refund",
        attributes={"k": "v", "ünï": "😀"},
    )
    run = RunSnapshot(
        run_id="r:1",
        task="",
        started_at=datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=tz),
        updated_at=datetime(2026, 1, 2, 3, 4, 6, tzinfo=UTC),
        status="completed",
        steps=2,
        tool_calls=1,
        input_tokens=2**40,
        output_tokens=0,
        cost_usd=Decimal("1E-9"),
        max_usd=Decimal("5.000000000"),
        max_tokens=None,
        max_steps=10,
        max_tool_calls=None,
        deadline=datetime(2026, 1, 2, 4, 0, tzinfo=timezone(timedelta(hours=-3, seconds=-37))),
    )
    payload = Payload(hashlib.sha256(b"\x00\xff").hexdigest(), b"\x00\xff", "application/octet-stream")
    batch = decode_batch(encode_batch(Batch("id", [span], [run], [payload])))
    assert batch == Batch("id", [span], [run], [payload])
    assert str(batch.spans[0].cost_usd) == "0.001250000" and str(batch.runs[0].max_usd) == "5.000000000"
    assert batch.runs[0].started_at.utcoffset() == timedelta(hours=5, minutes=30)
    assert batch.runs[0].deadline is not None
    assert batch.runs[0].deadline.utcoffset() == timedelta(hours=-3, seconds=-37)

    # and through a real outage and restart
    sink = ListSink("a")
    sink.failing = True
    pipe = SpanPipeline([sink], None, tmp_path, **FAST)
    pipe.submit_span(span)
    pipe.submit_run(run)
    pipe.start()
    pipe.close()
    healthy = ListSink("a")
    pipe2 = SpanPipeline([healthy], None, tmp_path, **FAST)
    pipe2.start()
    wait_until(lambda: len(healthy.deliveries) == 1)
    pipe2.close()
    assert healthy.spans == [span] and healthy.runs == [run]


def test_payloads_spool_while_store_fails(tmp_path: Path) -> None:
    class FlakyStore(LocalPayloadStore):
        down = True

        def put_many(self, payloads: Sequence[Payload]) -> list[tuple[Payload, str]]:
            if self.down:
                raise OSError("disk unplugged")
            return super().put_many(payloads)

    store = FlakyStore(tmp_path / "payloads", fsync=False)
    sink = ListSink("a")
    pipe = SpanPipeline([sink], store, tmp_path / "spool", batch_size=3, **FAST)
    pipe.start()
    bodies = [f"body {i}".encode() * 100 for i in range(7)]
    for i, body in enumerate(bodies):
        pipe.submit_payload(Payload(hashlib.sha256(body).hexdigest(), body, "text/plain"))
        pipe.submit_span(make_span(i))
    wait_until(lambda: len(sink.spans) == 7)  # spans are not held back by the payload store
    wait_until(lambda: pipe.stats().sinks["payloads"].spooled_records == 7)
    assert pipe.stats().sinks["payloads"].errors >= 1
    store.down = False
    wait_until(lambda: pipe.stats().sinks["payloads"].spooled_records == 0)
    pipe.close()
    for body in bodies:
        assert store.get(hashlib.sha256(body).hexdigest()) == body


def test_invalid_payload_is_rejected_not_retried_forever(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path / "payloads", fsync=False)
    pipe = SpanPipeline([], store, tmp_path / "spool", **FAST)
    pipe.start()
    pipe.submit_payload(Payload("0" * 64, b"not the bytes of that hash"))
    good = b"good"
    pipe.submit_payload(Payload(hashlib.sha256(good).hexdigest(), good))
    wait_until(lambda: pipe.stats().sinks["payloads"].batches_written == 1)
    pipe.close()
    stats = pipe.stats().sinks["payloads"]
    assert stats.rejected == 1 and stats.records_written == 1 and stats.spooled_batches == 0
    assert store.get(hashlib.sha256(good).hexdigest()) == good


def test_sink_errors_are_logged_rate_limited_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = ListSink("ch")
    sink.failing = True
    errors: list[str] = []
    pipe = SpanPipeline(
        [sink],
        None,
        tmp_path,
        batch_size=1,
        log_interval_s=60,
        on_sink_error=lambda name, exc: errors.append(f"{name}: {exc}"),
        **FAST,
    )
    with caplog.at_level(logging.ERROR, logger="proxy.spans.pipeline"):
        pipe.start()
        for i in range(5):
            pipe.submit_span(make_span(i))
        wait_until(lambda: pipe.stats().sinks["ch"].errors >= 5)
        stats = pipe.stats().sinks["ch"]
        assert stats.oldest_spooled_age_s > 0 and stats.retry_in_s >= 0
        pipe.close()
    lines = [r for r in caplog.records if "could not write batch" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0].getMessage()
    assert errors[0] == "ch: ch is down" and len(errors) == pipe.stats().sinks["ch"].errors


CHILD = """
import sys
from pathlib import Path
from proxy.spans.pipeline import SpanPipeline
from proxy.spans.sink import SinkError
from tests.test_pipeline import make_span

class Down:
    name = "ch"
    def write(self, spans, runs, batch_id):
        raise SinkError("down")
    def close(self):
        pass

pipe = SpanPipeline([Down()], None, Path(sys.argv[1]), batch_size=50, max_queue=200,
                    flush_interval_s=0.01, retry_initial_s=0.01, retry_max_s=0.05)
pipe.start()
i = 0
while True:
    pipe.submit_span(make_span(i))
    i += 1
    if i % 1000 == 0:
        print(i, flush=True)
"""


def test_kill_9_mid_write_then_restart_replays(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    submitted = 0
    while submitted < 20_000:
        submitted = int(child.stdout.readline())
    child.send_signal(signal.SIGKILL)  # while it is writing both spools
    child.wait()

    sink = ListSink("ch")
    pipe = SpanPipeline([sink], None, tmp_path, batch_size=500, **FAST)
    pipe.start()
    wait_until(
        lambda: pipe.stats().overflow_pending_records == 0 and pipe.stats().sinks["ch"].spooled_batches == 0
    )
    pipe.close()
    steps = [s.step for s in sink.spans]
    assert len(steps) == len(set(steps))  # exactly once after batch-id dedup
    # lost at most what was only in memory: the queue (200), the batch being cut (50), the
    # lane's first in-flight batch (50); what overflowed or was spooled all came back
    missing = set(range(max(steps) + 1)) - set(steps)
    assert len(missing) <= 300 and len(steps) >= submitted - 300


def test_undecodable_overflow_record_behind_a_good_one_is_set_aside_once(tmp_path: Path) -> None:
    """A record that never decodes (written by another version, say) after a good one: the good
    one is delivered, the bad one goes to dead/ once, and nothing loops or stalls close()."""
    overflow = Spool(tmp_path / OVERFLOW_DIR, fsync=True)
    good = Batch("")
    first = make_span(0)
    good.spans.append(first)
    overflow.append(encode_batch(good), 1)
    overflow.append(b"\x00not-a-batch", 1)
    overflow.close()
    sink = ListSink("clickhouse")
    pipeline = SpanPipeline([sink], None, tmp_path, flush_interval_s=0.05)
    pipeline.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pipeline.stats().overflow_pending_records:
        time.sleep(0.02)
    t0 = time.monotonic()
    pipeline.close(2.0)
    assert time.monotonic() - t0 < 1.0
    assert [s.span_id for s in sink.spans] == [first.span_id]
    dead = list((tmp_path / OVERFLOW_DIR / "dead").glob("*.seg"))
    assert len(dead) == 1 and dead[0].stat().st_size < 200


def test_a_batch_keeps_the_newest_snapshot_of_each_run_and_each_body_once(tmp_path: Path) -> None:
    sink = ListSink("ch")
    store = LocalPayloadStore(tmp_path / "payloads", fsync=False)
    pipe = SpanPipeline([sink], store, tmp_path / "spool", batch_size=100, flush_interval_s=0.05)
    pipe.start()
    for i in (0, 2, 1):  # out of order: the newest by updated_at wins, not the last submitted
        pipe.submit_run(make_run(i))
    body = b'{"same": "body"}'
    for _ in range(3):
        pipe.submit_payload(Payload(hashlib.sha256(body).hexdigest(), body))
    pipe.close()
    assert sink.runs == [make_run(2)]
    assert store.get(hashlib.sha256(body).hexdigest()) == body
