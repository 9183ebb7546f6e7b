"""The shipper against in-test sinks that really store, fail or stall, real WAL files and real
chdb: batches cut by size and by age, one lane per sink (a dead or stuck sink holds back no
other), retries with the same batch token, a batch pending at a crash rebuilt from its bounds
and deduplicated by ClickHouse, cursors across restarts, segments deleted once every sink passed
them, payloads once per hash, damaged and undecodable records skipped and counted, and the
socket: read-only SQL through sqlguard, statistics."""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.spans.clickhouse import open_span_store
from proxy.spans.control import ShipperClient, ShipperQueryError, socket_path
from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.payloads import LocalPayloadStore
from proxy.spans.records import encode_step
from proxy.spans.shipper import PAYLOADS_LANE, Shipper
from proxy.spans.sink import SinkError
from proxy.spans.wal import HEADER_SIZE, WalWriter, frame_header, read_frames, segments
from tests.support.wal import make_run, make_span, payload

FAST = dict(retry_initial_s=0.02, retry_max_s=0.1, flush_interval_s=0.05, poll_interval_s=0.01)


class ListSink:
    """A SpanSink that keeps what it was given, deduplicating on the batch id as ClickHouse does;
    it can fail, or stall until released."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failing = False
        self.stall: threading.Event | None = None
        self.attempts: list[str] = []
        self.deliveries: list[str] = []  # ids of every successful write, repeats included
        self.rows: dict[str, tuple[list[Span], list[RunSnapshot]]] = {}
        self.closed = False
        self._lock = threading.Lock()

    def write(self, spans: Sequence[Span], runs: Sequence[RunSnapshot], batch_id: str) -> None:
        with self._lock:
            self.attempts.append(batch_id)
        if self.stall is not None:
            self.stall.wait(30)
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


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:  # generous: 2 cores
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


def shipper(wal: Path, sinks: Sequence[Any] = (), payloads: Any = None, **kw: Any) -> Shipper:
    options = {**FAST, **kw}
    return Shipper(wal, sinks=sinks, payloads=payloads, lock_timeout_s=5, **options)


def steps(sink: ListSink) -> list[int]:
    return [s.step for s in sink.spans]


# --- batching ---------------------------------------------------------------------------------------


def test_batches_cut_by_size_then_the_rest_by_age(tmp_path: Path) -> None:
    w = WalWriter(tmp_path)
    sink = ListSink("a")
    for i in range(25):
        w.append_step([make_span(i)])
    s = shipper(tmp_path, [sink], batch_size=10, flush_interval_s=30)
    s.start()
    wait_until(lambda: len(sink.deliveries) == 2)
    time.sleep(0.1)
    assert [len(sink.rows[b][0]) for b in sink.deliveries] == [10, 10]  # the last 5 wait for age
    s.stop(drain_timeout_s=5)  # a stop drains them
    assert [len(sink.rows[b][0]) for b in sink.deliveries] == [10, 10, 5]
    assert steps(sink) == list(range(25)) and sink.closed
    w.close()


def test_batch_cut_by_age(tmp_path: Path) -> None:
    w = WalWriter(tmp_path)
    sink = ListSink("a")
    s = shipper(tmp_path, [sink], batch_size=1000, flush_interval_s=0.2)
    s.start()
    w.append_step([make_span(1)], [make_run(1)])
    started = time.monotonic()
    wait_until(lambda: len(sink.deliveries) == 1)
    assert time.monotonic() - started >= 0.1  # waited for the age, not for more records
    assert len(sink.spans) == 1 and len(sink.runs) == 1
    s.stop()
    w.close()


def test_each_batch_keeps_the_newest_snapshot_of_each_run(tmp_path: Path) -> None:
    w = WalWriter(tmp_path)
    for i in (0, 2, 1):  # out of order: the newest by updated_at wins, not the last appended
        w.append_step((), [make_run(i)])
    w.close()
    sink = ListSink("a")
    s = shipper(tmp_path, [sink])
    s.start()
    wait_until(lambda: len(sink.deliveries) == 1)
    s.stop()
    assert sink.runs == [make_run(2)]


# --- lanes: a failing or stuck sink ------------------------------------------------------------------


def test_a_failing_sink_holds_back_no_other_and_gets_the_same_batches_once(tmp_path: Path) -> None:
    w = WalWriter(tmp_path)
    down, healthy = ListSink("down"), ListSink("healthy")
    down.failing = True
    s = shipper(tmp_path, [down, healthy], batch_size=5)
    s.start()
    for i in range(40):
        w.append_step([make_span(i)])
        if i % 10 == 0:
            time.sleep(0.06)  # several batches, cut by age or size
    wait_until(lambda: len(healthy.spans) == 40)
    assert steps(healthy) == list(range(40))
    wait_until(lambda: len(down.attempts) >= 3)
    stats = s.stats()["sinks"]
    assert (
        down.deliveries == []
        and stats["down"]["errors"] >= 2
        and "down is down" in stats["down"]["last_error"]
    )
    assert stats["down"]["unshipped_bytes"] > 0 and stats["down"]["oldest_unshipped_age_s"] > 0
    assert stats["healthy"]["unshipped_bytes"] == 0
    first_attempt = down.attempts[0]
    assert set(down.attempts) == {first_attempt}  # retried as the same batch, the same token
    down.failing = False
    wait_until(lambda: len(down.spans) == 40)
    assert down.deliveries[0] == first_attempt and steps(down) == list(range(40))
    assert len(down.deliveries) == len(set(down.deliveries))
    s.stop()
    w.close()


def test_a_stuck_sink_does_not_slow_appends_or_other_sinks(tmp_path: Path) -> None:
    w = WalWriter(tmp_path)
    stuck, fast = ListSink("stuck"), ListSink("fast")
    stuck.stall = threading.Event()
    s = shipper(tmp_path, [stuck, fast], batch_size=500)
    s.start()
    for i in range(10_000):
        assert w.append_step([make_span(i)])  # the request path never waits for a sink
    wait_until(lambda: len(fast.spans) == 10_000)
    assert len(stuck.attempts) == 1 and stuck.deliveries == []  # still inside its first batch
    s.stop(drain_timeout_s=0.3)  # returns although the stuck write does not
    stuck.stall.set()
    w.close()
    later = ListSink("stuck")
    s2 = shipper(tmp_path, [later], batch_size=500)
    s2.start()
    wait_until(lambda: len(later.spans) >= 10_000)
    s2.stop()
    assert sorted(steps(later)) == list(range(10_000))
    assert later.deliveries[0] == stuck.attempts[0]  # the pending batch, rebuilt from its bounds


def test_sink_errors_are_logged_rate_limited_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = WalWriter(tmp_path)
    sink = ListSink("ch")
    sink.failing = True
    with caplog.at_level(logging.ERROR, logger="runcap.shipper"):
        s = shipper(tmp_path, [sink], log_interval_s=60)
        s.start()
        w.append_step([make_span(1)])
        wait_until(lambda: s.stats()["sinks"]["ch"]["errors"] >= 5)
        s.stop(drain_timeout_s=0.1)
    lines = [r for r in caplog.records if "could not take batch" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0].getMessage() and "ch is down" in lines[0].getMessage()
    w.close()


# --- restarts: cursors, pending batches, exactly once in ClickHouse -----------------------------------


def test_a_restart_resumes_at_the_cursor(tmp_path: Path) -> None:
    w = WalWriter(tmp_path)
    for i in range(10):
        w.append_step([make_span(i)])
    first = ListSink("a")
    s = shipper(tmp_path, [first])
    s.start()
    wait_until(lambda: len(first.spans) == 10)
    s.stop()
    for i in range(10, 15):
        w.append_step([make_span(i)])
    second = ListSink("a")
    s2 = shipper(tmp_path, [second])
    s2.start()
    wait_until(lambda: len(second.spans) == 5)
    s2.stop()
    assert steps(second) == list(range(10, 15))  # nothing shipped twice
    w.close()


def test_a_batch_pending_at_a_crash_lands_once_in_clickhouse(tmp_path: Path) -> None:
    """The insert commits, then the shipper dies before it records that: the next shipper
    rebuilds the batch from the bounds on file — although more records arrived meanwhile — sends
    the same token marked `resumed` (the sink then leaves out the rows it holds), and nothing
    lands twice."""
    wal = tmp_path / "wal"
    w = WalWriter(wal)
    for i in range(30):
        w.append_step([make_span(i, run_id=f"r{i % 3}")], [make_run(i, f"r{i % 3}")])
    store = open_span_store(None, tmp_path / "data")
    tokens: list[str] = []

    class DiesAfterCommit:
        name = "clickhouse"

        def __init__(self) -> None:
            self.shipper: Shipper | None = None

        def write_jsonl(self, spans: bytes, runs: bytes, batch_id: str, *, resumed: bool = False) -> None:
            tokens.append(batch_id)
            store.write_jsonl(spans, runs, batch_id, resumed=resumed)
            assert self.shipper is not None
            self.shipper.stopping = True  # "killed" right after the commit
            raise SinkError("the answer was lost")

        def close(self) -> None:
            pass

    dying = DiesAfterCommit()
    s = shipper(wal, [dying], batch_size=10)
    dying.shipper = s
    s.start()
    wait_until(lambda: len(tokens) == 1)
    s.stop(drain_timeout_s=0)
    for i in range(30, 40):  # the WAL goes on meanwhile
        w.append_step([make_span(i, run_id="r9")])

    resumed_flags: list[bool] = []

    class Recording:
        name = "clickhouse"

        def write_jsonl(self, spans: bytes, runs: bytes, batch_id: str, *, resumed: bool = False) -> None:
            tokens.append(batch_id)
            resumed_flags.append(resumed)
            store.write_jsonl(spans, runs, batch_id, resumed=resumed)

        def close(self) -> None:
            pass

    s2 = shipper(wal, [Recording()], batch_size=10)
    s2.start()

    def count() -> int:
        return store.query("SELECT count() AS n FROM runcap.spans")[1][0][0]

    wait_until(lambda: count() == 40 and s2.stats()["sinks"]["clickhouse"]["unshipped_bytes"] == 0)
    s2.stop()
    w.close()
    assert tokens[1] == tokens[0]  # the same bounds, the same token
    assert resumed_flags[0] and not any(resumed_flags[1:])  # only the batch in flight is in doubt
    assert count() == 40
    by_step = store.query("SELECT step, count() AS n FROM runcap.spans GROUP BY step HAVING n > 1")[1]
    assert by_step == []
    runs = store.query(
        "SELECT run_id, argMax(steps, updated_at) FROM runcap.runs GROUP BY run_id ORDER BY run_id"
    )
    assert runs[1] == [["r0", 27], ["r1", 28], ["r2", 29]]
    store.close()


def test_segments_are_deleted_once_every_sink_passed_them(tmp_path: Path) -> None:
    w = WalWriter(tmp_path, segment_bytes=4096)
    fast, slow = ListSink("fast"), ListSink("slow")
    slow.failing = True
    s = shipper(tmp_path, [fast, slow], batch_size=50)
    s.start()
    for i in range(200):
        w.append_step([make_span(i)])
    wait_until(lambda: len(fast.spans) == 200)
    # The slow sink tried (and failed) again after the fast one had everything: the shipper has
    # been round since, and deleted nothing the slow sink has not passed.
    tried = len(slow.attempts)
    wait_until(lambda: len(slow.attempts) > tried)
    assert s.deleted_segments == 0
    kept = segments(tmp_path)
    assert len(kept) > 5  # the failing sink has not passed them: all kept
    slow.failing = False
    wait_until(lambda: len(slow.spans) == 200)
    wait_until(lambda: segments(tmp_path) == [w.stats().segment])  # only the active one is left
    s.stop()
    w.close()
    assert s.deleted_segments >= len(kept) - 1


# --- payloads --------------------------------------------------------------------------------------


def test_payloads_once_per_hash_and_not_held_back_by_spans_or_an_outage(tmp_path: Path) -> None:
    class FlakyStore(LocalPayloadStore):
        down = True
        puts: list[str] = []

        def put_many(self, payloads: Sequence[Payload]) -> list[tuple[Payload, str]]:
            if self.down:
                raise OSError("disk unplugged")
            self.puts.extend(p.sha256 for p in payloads)
            return super().put_many(payloads)

    store = FlakyStore(tmp_path / "payloads", fsync=False)
    w = WalWriter(tmp_path / "wal")
    sink = ListSink("ch")
    s = shipper(tmp_path / "wal", [sink], store)
    s.start()
    same = payload(b'{"same": "body"}')
    bodies = [payload(f"body {i}".encode() * 100) for i in range(7)]
    for i, body in enumerate(bodies):
        w.append_step([make_span(i)], [], [body, same])
    wait_until(lambda: len(sink.spans) == 7)  # spans are not held back by the payload store
    wait_until(lambda: s.stats()["sinks"][PAYLOADS_LANE]["errors"] >= 1)
    store.down = False
    wait_until(lambda: s.stats()["sinks"][PAYLOADS_LANE]["unshipped_bytes"] == 0)
    before = s.stats()["sinks"][PAYLOADS_LANE]["records_written"]
    w.append_step([make_span(8)], [], [same])  # stored already: not uploaded again
    wait_until(lambda: s.stats()["sinks"][PAYLOADS_LANE]["records_written"] > before)
    wait_until(lambda: s.stats()["sinks"][PAYLOADS_LANE]["unshipped_bytes"] == 0)
    s.stop()
    w.close()
    for body in [*bodies, same]:
        assert store.get(body.sha256) == body.data
    assert sorted(store.puts) == sorted({b.sha256 for b in [*bodies, same]})


def test_a_payload_that_does_not_match_its_hash_is_rejected_not_retried(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path / "payloads", fsync=False)
    w = WalWriter(tmp_path / "wal")
    good = payload(b"good")
    w.append_step((), (), [Payload("0" * 64, b"not the bytes of that hash"), good])
    s = shipper(tmp_path / "wal", [], store)
    s.start()
    wait_until(lambda: s.stats()["sinks"][PAYLOADS_LANE]["batches_written"] == 1)
    stats = s.stats()["sinks"][PAYLOADS_LANE]
    s.stop()
    w.close()
    assert stats["rejected"] == 1 and stats["errors"] == 0 and stats["unshipped_bytes"] == 0
    assert store.get(good.sha256) == good.data


# --- damage -------------------------------------------------------------------------------------------


def test_damaged_and_undecodable_records_are_skipped_counted_and_block_nothing(tmp_path: Path) -> None:
    w = WalWriter(tmp_path)
    for i in range(3):
        w.append_step([make_span(i)])
    w.close()
    [name] = segments(tmp_path)
    path = tmp_path / name
    frames = read_frames(path, 0, sealed=True).frames
    data = bytearray(path.read_bytes())
    data[frames[1].offset + HEADER_SIZE + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    # a record of a future version: the checksum is fine, the contents are not readable here
    future = [b"\x09" + b"\0" * 27]
    with open(path, "ab") as fh:
        fh.write(frame_header(future, 0) + future[0])
        body = encode_step([make_span(3)], [], [])
        fh.write(frame_header(body, 0) + b"".join(body))
    sink = ListSink("a")
    s = shipper(tmp_path, [sink])
    s.start()
    wait_until(lambda: steps(sink) == [0, 2, 3])
    wait_until(lambda: segments(tmp_path) == [])  # passed: deleted
    stats = s.stats()
    s.stop()
    assert stats["damaged_records"] == 1 and stats["sinks"]["a"]["undecodable"] == 1


# --- the socket ---------------------------------------------------------------------------------------


async def test_the_socket_answers_sql_through_sqlguard_and_statistics(tmp_path: Path) -> None:
    deep = tmp_path / ("a-rather-long-directory-name-" * 4) / "data"  # beyond AF_UNIX's 107 bytes
    deep.mkdir(parents=True)
    store = open_span_store(None, deep)
    w = WalWriter(deep / "wal")
    w.append_step([make_span(1)], [make_run(1)])
    s = Shipper(deep / "wal", sinks=[store], query_store=store, socket_path=socket_path(deep), **FAST)
    s.start()
    try:
        client = ShipperClient(deep)
        assert len(str(client.path)) > 107
        wait_until(lambda: store.query("SELECT count() FROM runcap.spans")[1] == [[1]])
        columns, rows = await client.query(
            "SELECT run_id, step FROM runcap.spans WHERE run_id = {r:String}", {"r": "run-1"}
        )
        assert (columns, rows) == (["run_id", "step"], [["run-1", 1]])
        assert client.query_sync("SELECT count() AS n FROM runcap.runs") == (["n"], [[1]])
        with pytest.raises(ShipperQueryError) as refused:
            await client.query("SELECT * FROM file('/etc/passwd', 'LineAsString')")
        assert refused.value.code in (164, 497)
        with pytest.raises(ShipperQueryError):
            client.query_sync("INSERT INTO runcap.spans (run_id) VALUES ('x')")
        stats = await client.stats()
        assert stats["sinks"]["clickhouse"]["spans_written"] == 1 and stats["pid"] > 0
    finally:
        s.stop()
        w.close()
    assert not socket_path(deep).exists()


def test_one_shipper_per_wal(tmp_path: Path) -> None:
    s = shipper(tmp_path, [ListSink("a")])
    with pytest.raises(RuntimeError, match="one shipper per data directory"):
        Shipper(tmp_path, sinks=[ListSink("a")], lock_timeout_s=0.2)
    s.stop()
    shipper(tmp_path, [ListSink("a")]).stop()


def test_body_bytes_through_the_wal_are_exact(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path / "payloads", fsync=False)
    w = WalWriter(tmp_path / "wal")
    bodies = [payload(bytes(range(256)) * 40), payload(b""), payload("ünï 😀".encode())]
    w.append_step([make_span(1)], [], bodies)
    w.close()
    s = shipper(tmp_path / "wal", [], store)
    s.start()
    wait_until(lambda: s.stats()["sinks"][PAYLOADS_LANE]["records_written"] == 1)
    s.stop()
    for body in bodies:
        assert hashlib.sha256(store.get(body.sha256)).hexdigest() == body.sha256


# --- record versions ------------------------------------------------------------------------------


def version_2_body(spans: Sequence[Span], runs: Sequence[RunSnapshot]) -> list[bytes]:
    """A record as runcap wrote it before span events and run trees (version 2): the same layout,
    span rows without their last three fields (events, parent_run_id, root_run_id), run rows
    without the last two."""
    head, span_lines, run_lines, meta, *_ = encode_step(spans, runs, [])
    cut = [
        b"".join(orjson.dumps(orjson.loads(line)[:-drop], option=orjson.OPT_APPEND_NEWLINE)
                 for line in block.splitlines())
        for block, drop in ((span_lines, 3), (run_lines, 2))
    ]  # fmt: skip
    counts = struct.unpack_from("<B3xIIIIII", head)[1:4]
    head = struct.pack("<B3xIIIIII", 2, *counts, len(cut[0]), len(cut[1]), len(meta))
    return [head, cut[0], cut[1], meta]


def test_records_written_before_run_trees_ship_as_roots(tmp_path: Path) -> None:
    """A WAL still holding version-2 records after an upgrade loses none of them: they ship to
    ClickHouse and to object sinks as roots (root = the run's own id), next to a new record of a
    child that keeps its parent and root."""
    wal = tmp_path / "wal"
    old = version_2_body([make_span(1, run_id="old")], [make_run(1, "old")])
    child_span = make_span(2, run_id="kid", parent_run_id="old", root_run_id="old")
    child_run = make_run(2, "kid")
    child_run.parent_run_id, child_run.root_run_id = "old", "old"
    new = encode_step([child_span], [child_run], [])
    w = WalWriter(wal)
    w.append_step([make_span(0, run_id="first")])
    w.close()
    [name] = segments(wal)
    with open(wal / name, "ab") as fh:
        for body in (old, new):
            fh.write(frame_header(body, 0) + b"".join(body))
    store = open_span_store(None, tmp_path / "data")

    class Store:
        name = "clickhouse"

        def write_jsonl(self, spans: bytes, runs: bytes, batch_id: str, *, resumed: bool = False) -> None:
            store.write_jsonl(spans, runs, batch_id, resumed=resumed)

        def close(self) -> None:
            pass

    objects = ListSink("objects")
    s = shipper(wal, [Store(), objects])
    s.start()
    wait_until(lambda: len(objects.spans) == 3 and s.stats()["sinks"]["clickhouse"]["unshipped_bytes"] == 0)
    stats = s.stats()
    s.stop()
    assert stats["sinks"]["clickhouse"]["undecodable"] == 0
    tree = [(x.run_id, x.parent_run_id, x.root_run_id) for x in objects.spans]
    assert tree == [("first", "", "first"), ("old", "", "old"), ("kid", "old", "old")]
    assert [(r.run_id, r.root_run_id) for r in objects.runs] == [("old", "old"), ("kid", "old")]
    for table in ("spans", "runs"):
        sql = f"SELECT run_id, parent_run_id, root_run_id FROM runcap.{table} ORDER BY run_id"
        rows = store.query(sql)[1]
        expected = [["first", "", "first"]] if table == "spans" else []
        assert rows == [*expected, ["kid", "old", "old"], ["old", "", "old"]], table
    store.close()
