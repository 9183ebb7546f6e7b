"""The write-ahead log on real files: records round-trip exactly, one record per step, torn tails
cut on the next open, damage skipped to the next valid record and counted, a failed append (a
real ENOSPC on a small tmpfs) cut back so nothing behind it is torn, the WAL bound (bodies first,
then records — counted), the cursor file's in-place slots, and a writer killed -9 mid-append."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest

from proxy.spans.cursors import CursorFile, CursorState, Pending
from proxy.spans.model import RunSnapshot, Span
from proxy.spans.records import StepRecord, encode_step
from proxy.spans.wal import HEADER_SIZE, WalWriter, frame_header, read_frames, segment_sealed, segments
from tests.conftest import REPO
from tests.support.disk import FillingDisk
from tests.support.tmpfs import small_tmpfs
from tests.support.wal import T0, all_records, count_writevs, make_run, make_span, payload  # noqa: F401


def writer(wal: Path, **kw: object) -> WalWriter:
    return WalWriter(wal, fsync_interval_s=0.05, **kw)  # type: ignore[arg-type]


# --- records ---------------------------------------------------------------------------------------


def test_records_round_trip_exactly(tmp_path: Path) -> None:
    tz = timezone(timedelta(hours=5, minutes=30))
    span = Span(
        run_id="r:1", kind="tool", step=3, started_at=datetime(2026, 1, 2, 3, 4, 5, 0, tzinfo=tz),
        parent_span_id="0123456789abcdef", duration_ms=0.1 + 0.2, ttft_ms=None,
        cost_usd=Decimal("0.001250000"), price_known=False, tool_name="refund",
        attributes={"k": "v", "ünï": "😀"},
    )  # fmt: skip
    run = RunSnapshot(
        run_id="r:1", task="", started_at=datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=tz),
        updated_at=datetime(2026, 1, 2, 3, 4, 6, tzinfo=UTC), status="completed", steps=2, tool_calls=1,
        input_tokens=2**40, output_tokens=0, cost_usd=Decimal("1E-9"), max_usd=Decimal("5.000000000"),
        max_tokens=None, max_steps=10, max_tool_calls=None,
        deadline=datetime(2026, 1, 2, 4, 0, tzinfo=timezone(timedelta(hours=-3, seconds=-37))),
    )  # fmt: skip
    body = payload(b"\x00\xff binary")
    w = writer(tmp_path)
    assert w.append_step([span], [run], [body])
    w.close()
    [record] = all_records(tmp_path)
    # the same instants (written in UTC: ClickHouse stores UTC), the same exact decimals
    assert record.spans() == [span] and record.runs() == [run] and record.payloads() == [body]
    assert str(record.spans()[0].cost_usd) == "0.001250000"
    assert b',"0.000000001",' in record.runs_jsonl.tobytes()  # fixed point, never "1E-9"
    assert record.runs()[0].deadline == datetime(2026, 1, 2, 7, 0, 37, tzinfo=UTC)
    assert record.spans_jsonl.tobytes().count(b"\n") == 1  # JSONCompactEachRow, ready for ClickHouse


def test_one_step_is_one_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = writer(tmp_path)
    spans = [make_span(i) for i in range(4)]
    bodies = [payload(b"request"), payload(b"response")]
    writes = count_writevs(monkeypatch)
    w.append_step(spans, [make_run(1)], bodies)
    monkeypatch.undo()
    w.close()
    assert len(writes) == 1
    [record] = all_records(tmp_path)
    assert (record.n_spans, record.n_runs, len(record.payloads())) == (4, 1, 2)


def test_a_group_is_one_write_of_whole_records_in_order(tmp_path: Path, monkeypatch) -> None:
    """The steps that end in one event-loop turn (server/steps/trace.py) are written together: one
    writev for the group, each record still its own frame; past the limit of buffers per call,
    more writevs of whole records."""
    import proxy.spans.wal as wal_module

    w = writer(tmp_path)
    writes = count_writevs(monkeypatch)
    with w.group():
        for i in range(30):
            assert w.append_step([make_span(i)], [make_run(i)], [payload(f"body {i}".encode())])
        assert writes == []  # nothing written before the group ends
    assert len(writes) == 1 and w.stats().appended_records == 30
    monkeypatch.setattr(wal_module, "_IOV_MAX", 8)  # 2 buffers per small record: 4 per writev
    writes.clear()
    with w.group():
        for i in range(30, 40):
            w.append_step([make_span(i)])
    assert writes == [8, 8, 4]
    with w.group():  # an empty group writes nothing
        pass
    assert len(writes) == 3
    monkeypatch.undo()
    w.close()
    records = all_records(tmp_path)
    assert [s.step for r in records for s in r.spans()] == list(range(40))
    assert [p.data for r in records[:30] for p in r.payloads()] == [f"body {i}".encode() for i in range(30)]


def test_a_group_on_a_full_disk_falls_back_record_by_record(tmp_path: Path) -> None:
    """A group that does not fit is cut back to the last good offset and appended record by
    record: bodies go first (their hashes blanked), spans stay, nothing torn or damaged."""
    with small_tmpfs(tmp_path / "fs", "1m") as fs:
        wal = fs / "wal"
        w = writer(wal, segment_bytes=64 << 10, max_bytes=1 << 30)
        spans = []
        for g in range(8):  # 8 groups of 5 bodies of 48 KiB into 1 MiB
            with w.group():
                for i in range(5):
                    body = payload(os.urandom(48 << 10) + uuid.uuid4().bytes)
                    span = make_span(g * 5 + i, request_hash=body.sha256)
                    spans.append(span)
                    w.append_step([span], [], [body])
        stats = w.stats()
        assert stats.append_errors >= 1 and stats.dropped_payloads >= 1 and stats.dropped_records == 0
        # after the first failure the rest drops its bodies up front (no retry per record, each
        # failing again and rolling to a segment of its own)
        assert stats.append_errors <= 3, stats
        w.close()
        records = all_records(wal)
        got = [(s.step, s.request_hash) for r in records for s in r.spans()]
        assert got == [(s.step, s.request_hash) for s in spans]  # every span, in order
        assert "" in {h for _, h in got}  # some without their bodies, said so
        stored = {p.sha256 for r in records for p in r.payloads()}
        assert all(h in stored for _, h in got if h)
        for name in segments(wal):
            res = read_frames(wal / name, 0, sealed=True, max_bytes=1 << 30)
            assert res.damaged == 0 and res.torn_bytes == 0


def test_a_short_group_write_keeps_its_whole_records_and_cuts_the_torn_rest(
    tmp_path: Path, monkeypatch
) -> None:
    """A nearly full disk gives a short write, not an error: the records it holds whole stay (a
    shipper may already have read them — writing them again would duplicate them), the torn
    rest is cut off, the others follow record by record, each once, in order."""
    w = writer(tmp_path)
    real = os.writev
    short = []

    def torn_once(fd: int, parts: list[bytes]) -> int:
        if short:
            return real(fd, parts)
        data = b"".join(parts)
        short.append(len(data))
        return os.write(fd, data[: len(data) * 2 // 5])  # the tear lands inside a record

    monkeypatch.setattr(os, "writev", torn_once)
    with w.group():
        for i in range(10):
            w.append_step([make_span(i)], [], [payload(os.urandom(1000) + bytes([i]))])
    monkeypatch.setattr(os, "writev", real)
    stats = w.stats()
    assert short and stats.append_errors == 1 and stats.appended_records == 10
    w.close()
    records = all_records(tmp_path)
    assert [s.step for r in records for s in r.spans()] == list(range(10))  # none twice, none lost
    for name in segments(tmp_path):
        res = read_frames(tmp_path / name, 0, sealed=True, max_bytes=1 << 30)
        assert res.damaged == 0 and res.torn_bytes == 0


# --- no room: held, appended first when space returns, or dropped before the answer ---------------


class Fates(dict[str, str]):
    """What each record's `on_done` was told, by run id ("" = in the WAL, else why it was dropped)."""

    def of(self, run_id: str):  # type: ignore[no-untyped-def]
        return lambda why: self.__setitem__(run_id, why)


def logged_runs(text: str) -> list[str]:
    """The runs the WAL's drop lines name, in order."""
    return [run for names in re.findall(r"runs: (.*?) \(\d+ payload bodies", text) for run in names.split()]


def step_runs(wal: Path) -> list[str]:
    return [s.run_id for r in all_records(wal) for s in r.spans()]


def assert_clean(wal: Path) -> None:
    for name in segments(wal):
        res = read_frames(wal / name, 0, sealed=True, max_bytes=1 << 30)
        assert res.damaged == 0 and res.torn_bytes == 0, name


def test_a_group_torn_by_a_full_disk_is_held_and_appended_first_when_space_returns(
    tmp_path: Path, monkeypatch
) -> None:
    """The issue's short write: a group of ten steps, the disk full after two and a half of them.
    The two whole ones stay, the torn third is cut off, and the eight that did not fit are held —
    none of them told it is on record — then appended first, in order, before a newer step, once
    there is room again."""
    w = writer(tmp_path, hold_bytes=1 << 20)
    bodies = [payload(os.urandom(1000) + bytes([i])) for i in range(10)]
    framed = [HEADER_SIZE + sum(map(len, encode_step([make_span(i, run_id=f"run-{i}",
              request_hash=b.sha256)], [], [b]))) for i, b in enumerate(bodies)]  # fmt: skip
    disk = FillingDisk(monkeypatch, room=framed[0] + framed[1] + framed[2] // 2)
    fates = Fates()
    with w.group():
        for i, body in enumerate(bodies):
            span = make_span(i, run_id=f"run-{i}", request_hash=body.sha256)
            assert w.append_step([span], [], [body], on_done=fates.of(f"run-{i}"))
    assert disk.short_writes == 1
    assert fates == {"run-0": "", "run-1": ""}  # on record; the others are not told anything yet
    stats = w.stats()
    assert (stats.appended_records, stats.held_records, stats.dropped_records) == (2, 8, 0)
    assert step_runs(tmp_path) == ["run-0", "run-1"]  # the torn third was cut off
    # still full: the next step waits behind the held ones, and trying again changes nothing
    assert w.append_step([make_span(10, run_id="run-10")], on_done=fates.of("run-10"))
    assert w.flush_held() == 9 and len(fates) == 2
    disk.free()
    assert w.flush_held() == 0
    assert fates == {f"run-{i}": "" for i in range(11)}
    w.append_step([make_span(11, run_id="run-11")])
    stats = w.stats()
    assert (stats.appended_records, stats.held_records, stats.dropped_records) == (12, 0, 0)
    w.close()
    assert step_runs(tmp_path) == [f"run-{i}" for i in range(12)]  # each once, in order
    assert_clean(tmp_path)
    records = all_records(tmp_path)
    # what was held is its spans: its bodies went first (counted, their hashes blanked)
    assert [bool(s.request_hash) for r in records[:10] for s in r.spans()] == [True] * 2 + [False] * 8
    assert stats.dropped_payloads == 8


def test_past_the_hold_records_are_dropped_counted_per_step_and_logged_with_their_runs(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """A group of several steps on a full disk: each step that the hold cannot keep is one
    dropped record (not one per failed write), its `on_done` says why, and the log names its
    run — every time, not once per 30 s."""
    caplog.set_level("ERROR", logger="runcap.wal")
    room = sum(HEADER_SIZE + sum(map(len, encode_step([make_span(i, run_id=f"run-{i}")], [], [])))
               for i in range(3))  # fmt: skip
    w = writer(tmp_path, hold_bytes=room, hold_s=60.0)  # holds three steps
    disk = FillingDisk(monkeypatch, room=0)
    fates = Fates()
    for g in range(2):  # two groups of five steps
        with w.group():
            for i in range(g * 5, g * 5 + 5):
                w.append_step([make_span(i, run_id=f"run-{i}")], on_done=fates.of(f"run-{i}"))
    dropped = {run for run, why in fates.items() if why}
    assert set(fates) == dropped == {f"run-{i}" for i in range(3, 10)}  # 3 held, 7 dropped
    assert all("wal_hold_bytes" in why for why in fates.values())
    stats = w.stats()
    assert (stats.held_records, stats.dropped_records) == (3, 7)
    assert sorted(logged_runs(caplog.text)) == sorted(dropped)  # each dropped run, once
    # held past wal_hold_ms: dropped too, counted and logged
    w.hold_s = 0.0
    caplog.clear()
    assert w.flush_held() == 0
    assert {run for run, why in fates.items() if "wal_hold_ms" in why} == {"run-0", "run-1", "run-2"}
    assert w.stats().dropped_records == 10
    assert logged_runs(caplog.text) == ["run-0", "run-1", "run-2"]
    disk.free()
    w.close()
    assert step_runs(tmp_path) == [] and disk.failed_writes >= 2


def test_without_a_hold_each_step_of_a_failed_group_is_counted_and_its_run_logged(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """The writer without a hold (the default for a bare WalWriter): a group that finds the disk
    full drops all of its steps — ten steps are ten dropped records, all ten runs in the log."""
    caplog.set_level("ERROR", logger="runcap.wal")
    w = writer(tmp_path)
    FillingDisk(monkeypatch, room=0)
    fates = Fates()
    with w.group():
        for i in range(10):
            span = make_span(i, run_id=f"run-{i}")
            w.append_step([span], [], [payload(b"b%d" % i)], on_done=fates.of(f"run-{i}"))
    assert w.stats().dropped_records == 10 and len(fates) == 10 and all(fates.values())
    assert logged_runs(caplog.text) == [f"run-{i}" for i in range(10)]
    w.close()


def test_close_appends_what_is_held_if_there_is_room_and_drops_the_rest_counted(
    tmp_path: Path, monkeypatch
) -> None:
    """A restart loses nothing that was answered: what is held was not answered (its caller
    waits), and close() — shutting down — appends it if the disk has room again, else drops it,
    counted and told."""
    w = writer(tmp_path / "a", hold_bytes=1 << 20)
    disk = FillingDisk(monkeypatch, room=0)
    fates = Fates()
    for i in range(3):
        w.append_step([make_span(i, run_id=f"a-{i}")], on_done=fates.of(f"a-{i}"))
    assert w.stats().held_records == 3 and fates == {}
    disk.free()
    w.close()
    assert fates == {"a-0": "", "a-1": "", "a-2": ""}
    assert step_runs(tmp_path / "a") == ["a-0", "a-1", "a-2"]

    w = writer(tmp_path / "b", hold_bytes=1 << 20)
    disk.fill(0)
    for i in range(3):
        w.append_step([make_span(i, run_id=f"b-{i}")], on_done=fates.of(f"b-{i}"))
    w.close()
    assert w.stats().dropped_records == 3 and all("shutting down" in fates[f"b-{i}"] for i in range(3))
    disk.free()
    assert step_runs(tmp_path / "b") == []


# --- segments, torn tails, damage ----------------------------------------------------------------------


def test_segments_roll_and_are_sealed_when_their_writer_moves_on(tmp_path: Path) -> None:
    w = writer(tmp_path, segment_bytes=4096, max_bytes=1 << 30)
    for i in range(100):
        w.append_step([make_span(i)])
    names = segments(tmp_path)
    assert len(names) > 3 and all(n.endswith("-w0.wal") for n in names)
    assert [segment_sealed(tmp_path / n) for n in names] == [True] * (len(names) - 1) + [False]
    w.close()
    assert segment_sealed(tmp_path / names[-1])  # its writer is gone
    assert [s.step for r in all_records(tmp_path) for s in r.spans()] == list(range(100))


def test_writers_take_their_own_slots_and_names_never_repeat(tmp_path: Path) -> None:
    a, b = writer(tmp_path), writer(tmp_path)
    assert (a.slot, b.slot) == (0, 1)
    a.append_step([make_span(1)])
    b.append_step([make_span(2)])
    first = set(segments(tmp_path))
    a.close()
    for name in first:
        (tmp_path / name).unlink()  # shipped and deleted
    c = writer(tmp_path)  # slot 0 again: a new name all the same
    assert c.slot == 0 and not set(segments(tmp_path)) & first
    b.close()
    c.close()


def test_torn_tail_is_cut_when_the_slot_is_opened_again(tmp_path: Path) -> None:
    w = writer(tmp_path)
    for i in range(3):
        w.append_step([make_span(i)])
    w.close()
    [name] = segments(tmp_path)
    good = (tmp_path / name).stat().st_size
    body = encode_step([make_span(99)], [], [])
    with open(tmp_path / name, "ab") as fh:  # killed in the middle of a write
        fh.write((frame_header(body, 0) + b"".join(body))[: HEADER_SIZE + 30])
    res = read_frames(tmp_path / name, 0, sealed=True)
    assert [f.offset for f in res.frames][-1] < good and res.torn_bytes == HEADER_SIZE + 30
    w2 = writer(tmp_path)  # the same slot: its last segment's torn tail is cut off
    assert w2.slot == 0 and (tmp_path / name).stat().st_size == good
    w2.close()
    assert [s.step for r in all_records(tmp_path) for s in r.spans()] == [0, 1, 2]


def test_an_incomplete_record_in_an_active_segment_is_waited_for(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.append_step([make_span(1)])
    [name] = segments(tmp_path)
    size = (tmp_path / name).stat().st_size
    res = read_frames(tmp_path / name, 0, sealed=False)
    assert len(res.frames) == 1 and res.next_offset == size and res.at_end
    w.append_step([make_span(2)])
    res = read_frames(tmp_path / name, size, sealed=False, until=size + HEADER_SIZE + 10)
    assert res.frames == [] and res.damaged == 0 and res.torn_bytes == 0 and res.next_offset == size
    w.close()


def test_damage_is_skipped_to_the_next_valid_record_and_counted(tmp_path: Path) -> None:
    w = writer(tmp_path)
    for i in range(3):
        w.append_step([make_span(i)], [], [payload(b"body %d" % i * 50)])
    w.close()
    [name] = segments(tmp_path)
    path = tmp_path / name
    first = read_frames(path, 0, sealed=True).frames
    data = bytearray(path.read_bytes())
    data[first[1].offset + HEADER_SIZE + 40] ^= 0xFF  # a flipped byte in the second record
    path.write_bytes(bytes(data))
    res = read_frames(path, 0, sealed=True)
    assert [StepRecord(f.body).spans()[0].step for f in res.frames] == [0, 2]
    assert res.damaged == 1 and res.damaged_bytes == first[1].end - first[1].offset
    # damage at the very start (no magic), and a length that points past the end
    data[0:4] = b"XXXX"
    data[first[2].offset + 4 : first[2].offset + 8] = (1 << 27).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    res = read_frames(path, 0, sealed=True)
    # nothing valid from the first byte on: all of it is a torn tail, nothing is read as a record
    assert res.frames == [] and res.at_end and res.torn_bytes == len(data) and res.next_offset == 0


# --- a failed append, the WAL bound ------------------------------------------------------------------


def test_enospc_cuts_the_append_back_drops_bodies_first_and_nothing_written_is_damaged(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "fs", "1m") as fs:
        wal = fs / "wal"
        w = writer(wal, segment_bytes=64 << 10, max_bytes=1 << 30)
        big = [payload(os.urandom(48 << 10) + uuid.uuid4().bytes) for _ in range(40)]
        written_steps = []
        for i, body in enumerate(big):  # 40 bodies of 48 KiB into 1 MiB
            span = make_span(i, request_hash=body.sha256)
            if w.append_step([span], [], [body]):
                written_steps.append((i, span.request_hash))
        stats = w.stats()
        assert stats.append_errors >= 1 and stats.dropped_payloads >= 1
        # the spans kept coming, without their bodies: their hashes blanked ('' = not stored)
        assert len(written_steps) > 20 and ("" in {h for _, h in written_steps})
        for _ in range(200):  # more spans than fit: counted, the WAL stays readable
            w.append_step([make_span(1000)])
        w.close()
        records = all_records(wal)
        got = [(s.step, s.request_hash) for r in records for s in r.spans() if s.step < 1000]
        assert got == written_steps  # every appended record reads back whole, in order
        stored = {p.sha256 for r in records for p in r.payloads()}
        assert all(h in stored for _, h in got if h)
        for name in segments(wal):
            res = read_frames(wal / name, 0, sealed=True, max_bytes=1 << 30)
            assert res.damaged == 0 and res.torn_bytes == 0  # cut back, never torn


def test_the_wal_bound_drops_bodies_first_then_records_counted(tmp_path: Path) -> None:
    w = writer(tmp_path, max_bytes=1 << 20, segment_bytes=64 << 10)
    body_steps = bare_steps = 0
    n = 2000
    for i in range(n):
        body = payload(os.urandom(16 << 10))
        span = make_span(i, request_hash=body.sha256, error="x" * 200)
        if w.append_step([span], [], [body]):
            if span.request_hash:
                body_steps += 1
            else:
                bare_steps += 1
    stats = w.stats()
    assert 0 < body_steps and stats.dropped_payloads == n - body_steps
    assert bare_steps > 0 and stats.dropped_records == n - body_steps - bare_steps
    assert stats.dropped_records > 0  # at the bound, whole records go — counted
    w.close()
    total = sum((tmp_path / n).stat().st_size for n in segments(tmp_path))
    assert total <= 1 << 20
    spans = [s for r in all_records(tmp_path) for s in r.spans()]
    assert len(spans) == body_steps + bare_steps
    # spans whose bodies were dropped say so: no hash of a body that is not there
    assert sum(1 for s in spans if not s.request_hash) == bare_steps


# --- the cursor file --------------------------------------------------------------------------------


def test_cursor_slots_survive_a_torn_write(tmp_path: Path) -> None:
    path = tmp_path / "c" / "clickhouse.cursor"
    cursor = CursorFile(path)
    size = path.stat().st_size
    state = CursorState({"a.wal": 10}, {"old.wal"}, Pending("a.wal", 10, 20, 30))
    cursor.save(state, sync=True)
    state.offsets["a.wal"] = 30
    state.pending = None
    cursor.save(state, sync=False)
    cursor.close()
    assert path.stat().st_size == size  # overwritten in place: no new blocks
    loaded = CursorFile(path).load()
    assert loaded.offsets == {"a.wal": 30} and loaded.pending is None and loaded.done == {"old.wal"}
    # the newest slot torn by a crash: the one before it wins
    raw = bytearray(path.read_bytes())
    raw[64 << 10 : (64 << 10) + 40] = b"\0" * 40
    path.write_bytes(bytes(raw))
    loaded = CursorFile(path).load()
    assert loaded.offsets == {"a.wal": 10} and loaded.pending == Pending("a.wal", 10, 20, 30)


def test_cursor_grows_for_many_segments(tmp_path: Path) -> None:
    cursor = CursorFile(tmp_path / "x.cursor")
    state = CursorState({f"{i:020d}-w0.wal": i for i in range(5000)})
    cursor.save(state, sync=True)
    cursor.close()
    assert CursorFile(tmp_path / "x.cursor").load().offsets == state.offsets


# --- kill -9 while appending -------------------------------------------------------------------------

CHILD = """
import sys
from pathlib import Path
from proxy.spans.wal import WalWriter
from tests.support.wal import make_span, payload

w = WalWriter(Path(sys.argv[1]), segment_bytes=256 << 10)
i = 0
while True:
    body = payload(b"%d " % i * 300)
    w.append_step([make_span(i, request_hash=body.sha256)], [], [body])
    print(i, flush=True)  # appended: in the page cache
    i += 1
"""


def test_kill_9_mid_append_loses_nothing_that_was_appended(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    last = -1
    deadline = time.monotonic() + 60
    while last < 5000 and time.monotonic() < deadline:
        last = int(child.stdout.readline())
    child.send_signal(signal.SIGKILL)  # while it is writing
    child.wait()
    w = writer(tmp_path)  # the next process on the slot cuts a torn tail, if there is one
    w.close()
    steps = [s.step for r in all_records(tmp_path) for s in r.spans()]
    assert steps[: last + 1] == list(range(last + 1))  # every append it reported is there, once
    assert len(steps) == len(set(steps))
    for name in segments(tmp_path):
        res = read_frames(tmp_path / name, 0, sealed=True, max_bytes=1 << 30)
        assert res.damaged == 0 and res.torn_bytes == 0
