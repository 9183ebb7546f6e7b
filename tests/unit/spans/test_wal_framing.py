"""The WAL's record framing, byte for byte, and the reader and writer at their edges: the frame's
header and checksum, a body joined or written from its parts, the frame check, the resync past
damage (a magic split across reads, false magics, a length past the end), the reader's limits and
counts, the writer's bound, roll, rate-limited warnings, blanked hashes, a failed append cut back
and its stats (issue 28: the mutants of proxy/spans/wal.py that no other test notices)."""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from pathlib import Path

import pytest

import proxy.spans.wal as wal
from proxy.spans.records import StepRecord, encode_step
from proxy.spans.wal import (
    HEADER_SIZE,
    MAGIC,
    MAX_RECORD_BYTES,
    WalWriter,
    _check,
    _resync,
    frame,
    frame_header,
    read_frames,
    segments,
    valid_end,
    wal_bytes,
)
from tests.support.wal import all_records, make_run, make_span, payload


def expected_frame(body: bytes, time_ms: int) -> bytes:
    crc = zlib.crc32(body, zlib.crc32(struct.pack("<IQ", len(body), time_ms)))
    return b"RCW1" + struct.pack("<IQI", len(body), time_ms, crc) + body


# --- the frame ---------------------------------------------------------------------------------------


def test_the_header_is_magic_length_time_and_the_checksum_of_all_three() -> None:
    assert HEADER_SIZE == 20 and MAGIC == b"RCW1"
    parts = [b"abc", b"", b"defgh"]
    head = frame_header(parts, 1_700_000_000_123)
    assert head == expected_frame(b"abcdefgh", 1_700_000_000_123)[:HEADER_SIZE]
    assert frame_header([], 7) == expected_frame(b"", 7)
    # the time is in the checksum: a different time, a different crc
    assert frame_header(parts, 1)[16:] != frame_header(parts, 2)[16:]


def test_a_small_body_is_joined_into_one_buffer() -> None:
    parts = [b"x" * 10, b"y" * 20]
    out = frame(parts, 42)
    assert out == [expected_frame(b"x" * 10 + b"y" * 20, 42)[:HEADER_SIZE], b"x" * 10 + b"y" * 20]
    at_limit = [b"a" * (wal._JOIN_MAX - 1), b"b"]  # exactly _JOIN_MAX: still joined
    assert len(frame(at_limit, 1)) == 2
    assert b"".join(frame(at_limit, 1)) == expected_frame(b"".join(at_limit), 1)


def test_a_large_body_is_written_from_its_parts() -> None:
    parts = [b"a" * wal._JOIN_MAX, b"b"]  # one byte over
    out = frame(parts, 9)
    assert len(out) == 3 and out[1] is parts[0] and out[2] is parts[1]
    assert b"".join(out) == expected_frame(b"".join(parts), 9)
    assert out[0] == frame_header(parts, 9)


# --- checking a frame --------------------------------------------------------------------------------


def test_check_gives_the_body_length_of_a_valid_frame_and_minus_one_otherwise() -> None:
    good = expected_frame(b"hello", 5)
    assert _check(memoryview(good), 0) == 5
    assert _check(memoryview(b"junk" + good), 4) == 5
    assert _check(memoryview(good + b"more"), 0) == 5
    assert _check(memoryview(expected_frame(b"", 3)), 0) == 0  # an empty body is a frame
    assert _check(memoryview(good[:-1]), 0) == -1  # the body cut short
    assert _check(memoryview(good[: HEADER_SIZE - 1]), 0) == -1  # the header cut short
    assert _check(memoryview(good), 1) == -1
    assert _check(memoryview(b"RCW2" + good[4:]), 0) == -1  # magic
    flipped = bytearray(good)
    flipped[-1] ^= 1
    assert _check(memoryview(bytes(flipped)), 0) == -1  # checksum of the body
    flipped = bytearray(good)
    flipped[8] ^= 1  # the time: in the checksum
    assert _check(memoryview(bytes(flipped)), 0) == -1
    huge = b"RCW1" + struct.pack("<IQI", MAX_RECORD_BYTES + 1, 0, 0)
    assert _check(memoryview(huge + b"\0" * 64), 0) == -1


def test_check_at_the_exact_end_of_the_buffer() -> None:
    good = expected_frame(b"", 1)
    assert _check(memoryview(good), 0) == 0  # header ends exactly at the end: complete
    assert _check(memoryview(b"x" + good), 1) == 0


# --- resync -------------------------------------------------------------------------------------------


def write(tmp_path: Path, data: bytes) -> int:
    path = tmp_path / "seg.wal"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def test_resync_finds_the_first_valid_frame_past_false_magics(tmp_path: Path) -> None:
    good = expected_frame(b"body", 1)
    false_magic = b"RCW1" + b"\xff" * 30  # magic, then a length far past the end
    bad_crc = bytearray(expected_frame(b"zzzz", 1))
    bad_crc[-1] ^= 1
    data = b"junk" + false_magic + bytes(bad_crc) + b"RCW" + good + good
    fd = write(tmp_path, data)
    try:
        first = data.index(good)
        assert _resync(fd, 0, len(data)) == first
        assert _resync(fd, first, len(data)) == first  # at `start` itself
        assert _resync(fd, first + 1, len(data)) == first + len(good)
        assert _resync(fd, first + len(good) + 1, len(data)) is None
        assert _resync(fd, 0, first + len(good) - 1) is None  # the frame ends past the limit
        assert _resync(fd, 0, first + len(good)) == first  # ...or exactly at it
        assert _resync(fd, len(data), len(data)) is None
        assert _resync(fd, len(data) + 10, len(data) + 20) is None  # past the end of the file
    finally:
        os.close(fd)


@pytest.mark.parametrize("chunk", [4, 5, 6, 7, 8, 9, 64])
def test_resync_finds_a_magic_split_across_reads(tmp_path: Path, monkeypatch, chunk: int) -> None:
    monkeypatch.setattr(wal, "_READ_CHUNK", chunk)
    good = expected_frame(b"the body", 3)
    for lead in range(0, 12):
        data = b"." * lead + good
        fd = write(tmp_path, data)
        try:
            assert _resync(fd, 0, len(data)) == lead, (chunk, lead)
            assert _resync(fd, 1, len(data)) == (lead if lead >= 1 else None), (chunk, lead)
        finally:
            os.close(fd)


def test_resync_of_a_short_tail_without_a_frame(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(wal, "_READ_CHUNK", 4)
    data = b"RCW1RCW1RC"
    fd = write(tmp_path, data)
    try:
        assert _resync(fd, 0, len(data)) is None
        assert _resync(fd, 0, len(data) + 100) is None  # the limit past the file's end
    finally:
        os.close(fd)


# --- read_frames --------------------------------------------------------------------------------------


def frames_file(tmp_path: Path, bodies: list[bytes], extra: bytes = b"") -> tuple[Path, list[int]]:
    data, offsets = b"", []
    for i, body in enumerate(bodies):
        offsets.append(len(data))
        data += expected_frame(body, 100 + i)
    path = tmp_path / "seg.wal"
    path.write_bytes(data + extra)
    return path, [*offsets, len(data)]


def test_read_frames_gives_each_frame_its_offset_end_time_and_body(tmp_path: Path) -> None:
    bodies = [b"one", b"", b"three"]
    path, at = frames_file(tmp_path, bodies)
    res = read_frames(path, 0, sealed=True)
    assert [(f.offset, f.end, f.time_ms, bytes(f.body)) for f in res.frames] == [
        (at[i], at[i + 1], 100 + i, bodies[i]) for i in range(3)
    ]
    assert (res.next_offset, res.at_end, res.damaged, res.damaged_bytes, res.torn_bytes) == (
        at[3],
        True,
        0,
        0,
        0,
    )
    res = read_frames(path, at[1], sealed=False)
    assert [bytes(f.body) for f in res.frames] == [b"", b"three"] and res.next_offset == at[3]
    missing = read_frames(tmp_path / "gone.wal", 5, sealed=True)
    assert missing.frames == [] and missing.at_end and missing.next_offset == 5


def test_read_frames_limits_always_give_at_least_one_frame(tmp_path: Path) -> None:
    bodies = [b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 10]
    path, at = frames_file(tmp_path, bodies)
    res = read_frames(path, 0, sealed=True, max_frames=2)
    assert len(res.frames) == 2 and res.next_offset == at[2] and not res.at_end
    res = read_frames(path, 0, sealed=True, max_frames=1)
    assert len(res.frames) == 1 and res.next_offset == at[1]
    res = read_frames(path, 0, sealed=True, max_bytes=1)  # less than one frame: one all the same
    assert len(res.frames) == 1 and res.next_offset == at[1] and not res.at_end
    res = read_frames(path, 0, sealed=True, max_bytes=HEADER_SIZE + 10)  # exactly one frame
    assert len(res.frames) == 1
    res = read_frames(path, 0, sealed=True, max_bytes=HEADER_SIZE + 11)
    assert len(res.frames) == 2
    res = read_frames(path, 0, sealed=True, max_bytes=2 * (HEADER_SIZE + 10))
    assert len(res.frames) == 2 and res.next_offset == at[2]
    res = read_frames(path, 0, sealed=True, until=at[3])
    assert len(res.frames) == 3 and res.at_end and res.next_offset == at[3]
    res = read_frames(path, 0, sealed=True, until=at[3] - 1)  # the third cut by `until`: torn
    assert len(res.frames) == 2 and res.at_end and res.torn_bytes == at[3] - 1 - at[2]
    res = read_frames(path, 0, sealed=True, until=at[4] + 100)  # past the end: the file's size
    assert len(res.frames) == 4 and res.at_end and res.next_offset == at[4]
    res = read_frames(path, at[4], sealed=True)
    assert res.frames == [] and res.at_end and res.next_offset == at[4]


def test_frames_larger_than_a_read_are_read_whole(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(wal, "_READ_CHUNK", 24)  # a header and a bit
    bodies = [b"x" * 50, b"y" * 3, b"z" * 200, b"w"]
    path, at = frames_file(tmp_path, bodies)
    res = read_frames(path, 0, sealed=True, max_bytes=0)
    assert [bytes(f.body) for f in res.frames] == [bodies[0]]
    res = read_frames(path, 0, sealed=True, max_bytes=1 << 20)
    assert [bytes(f.body) for f in res.frames] == bodies and res.next_offset == at[4]
    assert res.damaged == 0 and res.torn_bytes == 0
    res = read_frames(path, at[1] + 5, sealed=True)  # start inside a frame: damage to the next
    assert [bytes(f.body) for f in res.frames] == bodies[2:]
    assert (res.damaged, res.damaged_bytes) == (1, at[2] - at[1] - 5)


def test_an_incomplete_frame_is_waited_for_when_active_and_torn_when_sealed(tmp_path: Path) -> None:
    tail = expected_frame(b"in progress", 1)[:-3]
    path, at = frames_file(tmp_path, [b"done"], tail)
    res = read_frames(path, 0, sealed=False)
    assert len(res.frames) == 1 and res.at_end and res.next_offset == at[1] and res.torn_bytes == 0
    res = read_frames(path, 0, sealed=True)
    assert len(res.frames) == 1 and res.at_end and res.next_offset == at[1]
    assert res.torn_bytes == len(tail) and res.damaged == 0
    # a header cut short
    path, at = frames_file(tmp_path, [b"done"], b"RCW1\x05")
    res = read_frames(path, 0, sealed=False)
    assert res.at_end and res.next_offset == at[1] and res.torn_bytes == 0
    res = read_frames(path, 0, sealed=True)
    assert res.at_end and res.next_offset == at[1] and res.torn_bytes == 5
    end = valid_end(path)
    assert (end.next_offset, end.torn_bytes, end.damaged) == (at[1], 5, 0)


def test_a_length_past_the_end_followed_by_a_valid_frame_is_damage(tmp_path: Path) -> None:
    good = expected_frame(b"after", 2)
    bad_length = b"RCW1" + struct.pack("<IQI", 1000, 0, 0)  # says 1000 bytes: past the end
    path, at = frames_file(tmp_path, [b"first"], bad_length + b"xx" + good)
    for sealed in (True, False):
        res = read_frames(path, 0, sealed=sealed)
        if sealed:
            assert [bytes(f.body) for f in res.frames] == [b"first", b"after"]
            assert (res.damaged, res.damaged_bytes) == (1, len(bad_length) + 2)
        else:  # active: the record in progress is waited for
            assert [bytes(f.body) for f in res.frames] == [b"first"] and res.next_offset == at[1]
    end = valid_end(path)
    assert end.next_offset == path.stat().st_size and (end.damaged, end.damaged_bytes) == (1, 22)


def test_damage_between_frames_is_counted_region_by_region(tmp_path: Path) -> None:
    a, b, c = expected_frame(b"a", 1), expected_frame(b"b", 2), expected_frame(b"c", 3)
    data = b"garbage!" + a + b"XY" + b + b"RCW1" + b"\0" * 30 + c + b"tail"
    path = tmp_path / "seg.wal"
    path.write_bytes(data)
    res = read_frames(path, 0, sealed=True)
    assert [bytes(f.body) for f in res.frames] == [b"a", b"b", b"c"]
    assert (res.damaged, res.damaged_bytes, res.torn_bytes) == (3, 8 + 2 + 34, 4)
    assert res.next_offset == len(data) - 4
    active = read_frames(path, 0, sealed=False)
    assert (active.damaged, active.torn_bytes) == (3, 0) and active.next_offset == len(data) - 4
    end = valid_end(path)
    assert (end.damaged, end.damaged_bytes, end.torn_bytes, end.next_offset) == (3, 44, 4, len(data) - 4)
    assert not end.frames


def test_segments_and_wal_bytes(tmp_path: Path) -> None:
    assert segments(tmp_path / "none") == [] and wal_bytes(tmp_path / "none") == 0
    (tmp_path / "b.wal").write_bytes(b"x" * 10)
    (tmp_path / "a.wal").write_bytes(b"x" * 5)
    (tmp_path / "c.cursor").write_bytes(b"x" * 100)
    (tmp_path / ".w0.lock").write_bytes(b"")
    assert segments(tmp_path) == ["a.wal", "b.wal"] and wal_bytes(tmp_path) == 15


# --- the writer ---------------------------------------------------------------------------------------


def writer(path: Path, **kw: object) -> WalWriter:
    return WalWriter(path, fsync_interval_s=60.0, **kw)  # type: ignore[arg-type]


def test_a_bad_fsync_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="wal_fsync must be one of interval, always"):
        WalWriter(tmp_path, fsync="sometimes")


def test_stats_count_what_was_appended(tmp_path: Path) -> None:
    (tmp_path / "old.wal").write_bytes(b"x" * 1000)  # another writer's: in the WAL's size
    w = writer(tmp_path)
    assert w.append_step([make_span(1)], [], [payload(b"body")])
    assert w.append_step([make_span(2)])
    s = w.stats()
    size = sum((tmp_path / n).stat().st_size for n in segments(tmp_path)) - 1000
    assert (s.slot, s.appended_records, s.appended_bytes, s.wal_bytes) == (0, 2, size, 1000 + size)
    assert (s.dropped_payloads, s.dropped_records, s.append_errors, s.held_records, s.held_bytes) == (0,) * 5
    assert s.segment in segments(tmp_path) and s.segment.endswith("-w0.wal")
    w.sync()
    assert w.stats().wal_bytes == 1000 + size  # scanned again: the same
    w.close()
    assert [r.spans()[0].step for r in all_records(tmp_path)] == [1, 2]


def test_above_three_quarters_of_the_bound_bodies_are_left_out_and_their_hashes_blanked(
    tmp_path: Path,
) -> None:
    body, other = payload(b"request body"), payload(b"response body")
    span = make_span(1, request_hash=body.sha256, response_hash=other.sha256)
    size = HEADER_SIZE + sum(map(len, encode_step([span], [], [body, other])))
    w = writer(tmp_path, max_bytes=size * 4)  # 3/4 of it is three such records
    for _ in range(3):
        s = make_span(1, request_hash=body.sha256, response_hash=other.sha256)
        assert w.append_step([s], [], [body, other])
        assert s.request_hash and s.response_hash
    assert w.stats().dropped_payloads == 0
    s = make_span(1, request_hash=body.sha256, response_hash=other.sha256)
    assert w.append_step([s], [], [body, other])
    assert (s.request_hash, s.response_hash) == ("", "")
    assert w.stats().dropped_payloads == 2
    # a span whose hashes are of other bodies keeps them
    keep = make_span(4, request_hash="aa" * 32, response_hash="bb" * 32)
    assert not w.append_step([keep], [], [body])  # (and past the bound: not appended)
    assert (keep.request_hash, keep.response_hash) == ("aa" * 32, "bb" * 32)
    w.close()
    records = all_records(tmp_path)
    assert [len(r.payloads()) for r in records] == [2, 2, 2, 0]


def test_exactly_at_three_quarters_bodies_go(tmp_path: Path) -> None:
    first = make_span(0)
    size = HEADER_SIZE + sum(map(len, encode_step([first], [], [])))
    w = writer(tmp_path, max_bytes=size * 4)  # 3/4: size * 3
    for _ in range(3):
        w.append_step([make_span(0)])
    assert w.stats().wal_bytes == size * 3
    s = make_span(3, request_hash=payload(b"x").sha256)
    w.append_step([s], [], [payload(b"x")])
    assert s.request_hash == "" and w.stats().dropped_payloads == 1
    w.close()


def test_at_the_bound_a_record_is_not_appended(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    size = HEADER_SIZE + sum(map(len, encode_step([make_span(0)], [], [])))
    w = writer(tmp_path, max_bytes=size * 2)
    assert w.append_step([make_span(0)]) and w.append_step([make_span(0)])  # exactly the bound
    assert not w.append_step([make_span(0)])
    s = w.stats()
    assert (s.appended_records, s.dropped_records, s.append_errors) == (2, 1, 0)
    assert messages(caplog)[0] == (
        f"the WAL holds wal_max_bytes = {size * 2} bytes (a sink is down?): records are held, then dropped"
    )
    w.close()


def test_segments_roll_once_they_reach_segment_bytes(tmp_path: Path) -> None:
    size = HEADER_SIZE + sum(map(len, encode_step([make_span(0)], [], [])))
    w = writer(tmp_path, segment_bytes=size * 2)
    for _ in range(5):
        w.append_step([make_span(0)])
    names = segments(tmp_path)
    assert [(tmp_path / n).stat().st_size for n in names] == [size * 2, size * 2, size]
    assert w.stats().segment == names[-1]
    w.close()


def test_warnings_are_rate_limited_per_kind(tmp_path: Path, caplog, monkeypatch) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    now = [1000.0]
    monkeypatch.setattr(wal.time, "monotonic", lambda: now[0])
    w = writer(tmp_path, log_interval_s=30.0)
    w._warn("a", "first %s", 1)
    w._warn("a", "again %s", 2)
    w._warn("b", "other %s", 3)
    now[0] += 29.9
    w._warn("a", "too soon %s", 4)
    now[0] += 0.1
    w._warn("a", "on time %s", 5)
    assert [r.getMessage() for r in caplog.records] == ["first 1", "other 3", "on time 5"]
    monkeypatch.undo()
    w.close()


def test_the_first_warning_is_logged_at_any_clock(tmp_path: Path, caplog, monkeypatch) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    monkeypatch.setattr(wal.time, "monotonic", lambda: 0.0)
    w = writer(tmp_path, log_interval_s=1e9)
    w._warn("a", "logged")
    assert [r.getMessage() for r in caplog.records] == ["logged"]
    monkeypatch.undo()
    w.close()


def fail_writev(monkeypatch, err: int | None, written: int = 0) -> list[int]:
    """The next writev fails with `err` (None: writes `written` bytes, a short write); then real."""
    real = os.writev
    calls: list[int] = []

    def once(fd: int, buffers: list[bytes]) -> int:
        calls.append(len(buffers))
        if len(calls) > 1:
            return real(fd, buffers)
        if err is not None:
            raise OSError(err, os.strerror(err))
        return os.write(fd, b"".join(buffers)[:written])

    monkeypatch.setattr(os, "writev", once)
    return calls


def test_an_io_error_is_retried_without_bodies_and_is_not_a_lack_of_space(
    tmp_path: Path, monkeypatch
) -> None:
    w = writer(tmp_path)
    w.append_step([make_span(0)])
    first = w.stats().segment
    fail_writev(monkeypatch, errno.EIO)
    body = payload(b"body")
    span = make_span(1, request_hash=body.sha256)
    assert w.append_step([span], [], [body])
    assert span.request_hash == ""  # retried without the body
    s = w.stats()
    assert (s.append_errors, s.dropped_payloads, s.appended_records) == (1, 1, 2)
    assert s.segment != first  # rolled: the failing segment takes no more
    # not a full disk: the next body is written
    nxt = make_span(2, request_hash=payload(b"next").sha256)
    w.append_step([nxt], [], [payload(b"next")])
    assert nxt.request_hash and w.stats().dropped_payloads == 1
    w.close()
    assert [len(r.payloads()) for r in all_records(tmp_path)] == [0, 0, 1]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG, None])
def test_no_space_leaves_bodies_out_for_a_moment(tmp_path: Path, monkeypatch, err: int | None) -> None:
    now = [500.0]
    monkeypatch.setattr(wal.time, "monotonic", lambda: now[0])
    w = writer(tmp_path)
    fail_writev(monkeypatch, err, written=7)  # None: a short write, the disk nearly full
    body = payload(b"body")
    assert w.append_step([make_span(0, request_hash=body.sha256)], [], [body])
    assert w.stats().append_errors == 1
    now[0] += 0.99
    soon = make_span(1, request_hash=payload(b"b2").sha256)
    w.append_step([soon], [], [payload(b"b2")])
    assert soon.request_hash == ""  # the disk was full a moment ago: not even tried
    now[0] += 0.02
    later = make_span(2, request_hash=payload(b"b3").sha256)
    w.append_step([later], [], [payload(b"b3")])
    assert later.request_hash != ""
    s = w.stats()
    assert (s.append_errors, s.dropped_payloads, s.appended_records) == (1, 2, 3)
    monkeypatch.undo()
    w.close()
    records = all_records(tmp_path)
    assert [r.spans()[0].step for r in records] == [0, 1, 2]
    for name in segments(tmp_path):
        res = read_frames(tmp_path / name, 0, sealed=True)
        assert res.damaged == 0 and res.torn_bytes == 0  # the short write was cut back


def test_a_failed_first_append_in_a_fresh_segment_does_not_roll(tmp_path: Path, monkeypatch) -> None:
    w = writer(tmp_path)
    first = w.stats().segment
    fail_writev(monkeypatch, errno.EIO)
    assert not w.append_step([make_span(0)])  # no bodies to leave out, no hold: dropped
    assert w.stats().append_errors == 1 and w.stats().dropped_records == 1
    assert w.append_step([make_span(1)])
    assert w.stats().segment == first  # nothing in it was cut back: no need to roll
    w.close()
    assert segments(tmp_path) == [first]


def test_always_fsync_syncs_each_append(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    w = WalWriter(tmp_path, fsync="always", fsync_interval_s=60.0)
    w.append_step([make_span(0)])
    w.append_step([make_span(1)])
    assert len(synced) == 2
    w.close()
    synced.clear()
    w = writer(tmp_path / "interval")
    w.append_step([make_span(0)])
    assert synced == []
    w.close()


def test_a_record_reads_back_as_written(tmp_path: Path) -> None:
    w = writer(tmp_path)
    body = payload(os.urandom(wal._JOIN_MAX + 10))  # a body written from its parts
    w.append_step([make_span(0, request_hash=body.sha256)], [], [body])
    w.append_step([make_span(1)])
    w.close()
    [name] = segments(tmp_path)
    res = read_frames(tmp_path / name, 0, sealed=True)
    assert [StepRecord(f.body).spans()[0].step for f in res.frames] == [0, 1]
    assert StepRecord(res.frames[0].body).payloads() == [body]


# --- the checks at their exact bounds ---------------------------------------------------------------


def test_a_length_past_the_buffer_is_no_frame_even_when_the_checksum_of_what_is_there_matches() -> None:
    # a header that says 10 bytes, with the checksum of the 5 that are there
    head = struct.pack("<IQ", 10, 1)
    crc = zlib.crc32(b"abcde", zlib.crc32(head))
    cut = b"RCW1" + head + struct.pack("<I", crc) + b"abcde"
    assert _check(memoryview(cut), 0) == -1
    assert _check(memoryview(b"0123456789" + cut), 10) == -1


def test_max_record_bytes_is_the_largest_length_that_is_data(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(wal, "MAX_RECORD_BYTES", 5)
    data = b"junk" + expected_frame(b"12345", 1) + expected_frame(b"123456", 2)
    assert _check(memoryview(data), 4) == 5
    assert _check(memoryview(data), 4 + HEADER_SIZE + 5) == -1
    fd = write(tmp_path, data)
    try:
        assert _resync(fd, 0, len(data)) == 4
        assert _resync(fd, 5, len(data)) is None
    finally:
        os.close(fd)
    res = read_frames(tmp_path / "seg.wal", 0, sealed=True)
    assert [bytes(f.body) for f in res.frames] == [b"12345"] and res.damaged == 1
    assert res.torn_bytes == HEADER_SIZE + 6


def test_resync_finds_a_frame_with_an_empty_body(tmp_path: Path, monkeypatch) -> None:
    data = b"xyz" + expected_frame(b"", 1)
    fd = write(tmp_path, data)
    try:
        assert _resync(fd, 0, len(data)) == 3
        monkeypatch.setattr(wal, "_READ_CHUNK", 4)  # reads of exactly a magic's length
        assert _resync(fd, 0, len(data)) == 3
        data = b"...." + expected_frame(b"b", 1)
        os.close(fd)
        fd = write(tmp_path, data)
        assert _resync(fd, 0, len(data)) == 4
    finally:
        os.close(fd)


# --- what is logged -----------------------------------------------------------------------------------


def messages(caplog) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.getMessage() for r in caplog.records if r.name == "runcap.wal"]


def test_left_out_bodies_are_logged_with_why_and_the_counts(tmp_path: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    w = writer(tmp_path)
    fail_writev(monkeypatch, errno.ENOSPC)
    body = payload(b"body")
    w.append_step([make_span(1, request_hash=body.sha256)], [], [body, payload(b"other")])
    name = w.stats().segment
    assert messages(caplog) == [
        f"appending to WAL segment {name} failed ([Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)})",
        "WAL: payload bodies dropped: the disk is full (2 payload bodies and 0 records so far)",
    ]
    w.close()


def test_a_short_write_is_logged_with_its_sizes(tmp_path: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    w = writer(tmp_path)
    name = w.stats().segment
    fail_writev(monkeypatch, None, written=3)
    span = make_span(1)
    size = HEADER_SIZE + sum(map(len, encode_step([span], [], [])))
    assert not w.append_step([span])
    assert messages(caplog)[0] == f"appending to WAL segment {name} failed (short write: 3 of {size} bytes)"
    assert messages(caplog)[1].startswith(
        "WAL: 1 record of spans dropped (the WAL could not be written; 0 of"
    )
    w.close()


def test_dropped_records_are_logged_with_how_many_were_awaited(tmp_path: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    w = writer(tmp_path)
    w.append_step([make_span(0)])
    real = os.writev

    def full(fd: int, buffers: list[bytes]) -> int:
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(os, "writev", full)
    told: list[str] = []
    with w.group():
        w.append_step([make_span(1, run_id="r-a")], on_done=told.append)
        w.append_step([make_span(2, run_id="r-b")], [make_run(2, run_id="r-c")])
        w.append_step([make_span(3, run_id="r-a")], on_done=told.append)
    monkeypatch.setattr(os, "writev", real)
    dropped = [m for m in messages(caplog) if "of spans dropped" in m]
    assert dropped == [
        "WAL: 3 records of spans dropped (the WAL could not be written; 2 of them awaited: those calls are "
        "refused, not answered); runs: r-a r-b r-c (0 payload bodies and 3 records so far)"
    ]
    assert told == ["the WAL could not be written"] * 2
    w.close()
    assert w.stats().dropped_records == 3


def test_a_segment_that_cannot_be_started_is_logged_and_the_old_one_kept(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    size = HEADER_SIZE + sum(map(len, encode_step([make_span(0)], [], [])))
    w = writer(tmp_path, segment_bytes=size)
    w.append_step([make_span(0)])
    first = w.stats().segment

    def no_inode() -> tuple[int, str]:
        raise OSError(errno.ENOSPC, "No space left on device")

    w._create_segment = no_inode  # type: ignore[method-assign]
    assert w.append_step([make_span(0)])  # into the full segment all the same
    assert w.stats().segment == first
    assert messages(caplog) == ["cannot start a new WAL segment: [Errno 28] No space left on device"]
    w.close()


# --- the hold -------------------------------------------------------------------------------------------


def test_a_record_held_exactly_hold_s_is_still_held(tmp_path: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    now = [100.0]
    monkeypatch.setattr(wal.time, "monotonic", lambda: now[0])
    w = writer(tmp_path, hold_bytes=1 << 20, hold_s=2.5)
    real = os.writev

    def full(fd: int, buffers: list[bytes]) -> int:
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(os, "writev", full)
    told: list[str] = []
    assert w.append_step([make_span(0, run_id="held")], on_done=told.append)
    now[0] += 2.5
    assert w.flush_held() == 1 and told == []
    now[0] += 0.001
    assert w.flush_held() == 0
    assert told == ["no room in the WAL for wal_hold_ms = 2500 ms"]
    assert any("(no room in the WAL for wal_hold_ms = 2500 ms;" in m for m in messages(caplog))
    monkeypatch.setattr(os, "writev", real)
    w.close()


def test_flush_held_waits_for_the_end_of_a_group(tmp_path: Path, monkeypatch) -> None:
    w = writer(tmp_path, hold_bytes=1 << 20, hold_s=60.0)
    real = os.writev

    def full(fd: int, buffers: list[bytes]) -> int:
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(os, "writev", full)
    w.append_step([make_span(0)])
    assert w.held_records == 1
    monkeypatch.setattr(os, "writev", real)
    with w.group():
        assert w.flush_held() == 1  # not inside a group: the group's end appends it first
        assert w.held_records == 1
    assert w.held_records == 0 and w.stats().appended_records == 1
    assert w.flush_held() == 0
    w.close()
    assert w.flush_held() == 0


def test_after_close_a_record_is_dropped_counted_told_and_logged(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    w = writer(tmp_path)
    w.close()
    told: list[str] = []
    body = payload(b"b")
    assert not w.append_step(
        [make_span(0, run_id="r-x")], [make_run(0, run_id="r-y")], [body], on_done=told.append
    )
    assert told == ["the WAL writer is closed"] and w.stats().dropped_records == 1
    assert messages(caplog) == [
        "WAL: 1 record of spans dropped (the WAL writer is closed; 1 of them awaited: those calls are "
        "refused, not answered); runs: r-x r-y (0 payload bodies and 1 records so far)"
    ]
    assert all_records(tmp_path) == []


def test_bodies_wait_exactly_one_second_after_no_space(tmp_path: Path, monkeypatch) -> None:
    now = [500.0]
    monkeypatch.setattr(wal.time, "monotonic", lambda: now[0])
    w = writer(tmp_path)
    fail_writev(monkeypatch, errno.ENOSPC)
    w.append_step([make_span(0)], [], [payload(b"b0")])
    now[0] = 501.0  # the moment is over
    on_time = make_span(1, request_hash=payload(b"b1").sha256)
    w.append_step([on_time], [], [payload(b"b1")])
    assert on_time.request_hash != "" and w.stats().dropped_payloads == 1
    monkeypatch.undo()
    w.close()
    assert [len(r.payloads()) for r in all_records(tmp_path)] == [0, 1]


def test_every_frame_carries_its_append_time_in_ms(tmp_path: Path, monkeypatch) -> None:
    import time

    now = [500.0]
    monkeypatch.setattr(wal.time, "monotonic", lambda: now[0])
    before = time.time_ns() // 1_000_000
    w = writer(tmp_path)
    w.append_step([make_span(0)], [], [payload(b"b0")])  # as it is
    fail_writev(monkeypatch, errno.ENOSPC)
    w.append_step([make_span(1)], [], [payload(b"b1")])  # retried without its body
    with w.group():  # framed by the group
        w.append_step([make_span(2)])
        w.append_step([make_span(3)])
    w._full_until = now[0] + 1  # a framed record with a body, the disk full a moment ago: framed again
    record = wal._Pending(
        [make_span(4)], [], [payload(b"b4")], encode_step([make_span(4)], [], [payload(b"b4")])
    )
    assert w._append(record, buffers=[b"never written"])
    after = time.time_ns() // 1_000_000
    monkeypatch.undo()
    w.close()
    times = [f.time_ms for n in segments(tmp_path) for f in read_frames(tmp_path / n, 0, sealed=True).frames]
    assert len(times) == 5 and all(before <= t <= after for t in times), (before, times, after)


def test_after_a_failed_batch_the_rest_of_the_group_is_not_tried(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(wal, "_IOV_MAX", 2)  # one small record per writev
    w = writer(tmp_path)
    calls = fail_writev(monkeypatch, errno.ENOSPC)
    real_writev = os.writev
    told: list[str] = []
    with w.group():
        for i in range(3):
            w.append_step([make_span(i, run_id=f"r{i}")], on_done=told.append)
    assert len(calls) == 1  # the first failed: the disk is full, the others wait their turn
    assert told == ["the WAL could not be written"] * 3 and w.stats().dropped_records == 3
    assert real_writev is os.writev
    w.close()


def test_held_bytes_are_in_the_stats(tmp_path: Path, monkeypatch) -> None:
    w = writer(tmp_path, hold_bytes=1 << 20, hold_s=60.0)
    fail_writev(monkeypatch, errno.ENOSPC)
    span = make_span(0)
    size = HEADER_SIZE + sum(map(len, encode_step([span], [], [])))
    w.append_step([span])
    s = w.stats()
    assert (s.held_records, s.held_bytes) == (1, size)
    monkeypatch.undo()
    w.close()
    assert w.stats().held_bytes == 0 and w.stats().appended_records == 1


def fail_nth(monkeypatch, n: int, err: int) -> list[int]:
    """The `n`th writev (1 = the next) fails with `err`; the others write."""
    real = os.writev
    calls: list[int] = []

    def nth(fd: int, buffers: list[bytes]) -> int:
        calls.append(len(buffers))
        if len(calls) == n:
            raise OSError(err, os.strerror(err))
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", nth)
    return calls


def test_a_lone_record_of_a_group_batch_is_retried_without_its_bodies(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(wal, "_IOV_MAX", 2)  # one record with a small body per writev
    w = writer(tmp_path)
    calls = fail_nth(monkeypatch, 2, errno.EIO)
    told: list[str] = []
    spans = [make_span(i, request_hash=payload(b"b%d" % i).sha256) for i in range(2)]
    with w.group():
        for i, span in enumerate(spans):
            w.append_step([span], [], [payload(b"b%d" % i)], on_done=told.append)
    assert calls == [2, 2, 2] and told == ["", ""]
    assert spans[0].request_hash and spans[1].request_hash == ""
    monkeypatch.undo()
    w.close()
    assert [len(r.payloads()) for r in all_records(tmp_path)] == [1, 0]


def test_each_appended_record_is_told_it_is_in_the_wal(tmp_path: Path) -> None:
    w = writer(tmp_path)
    told: list[str] = []
    w.append_step([make_span(0)], on_done=told.append)
    assert told == [""]
    with w.group():
        w.append_step([make_span(1)], on_done=told.append)
        w.append_step([make_span(2)], on_done=told.append)
    assert told == ["", "", ""]
    w.close()


def test_a_short_group_write_tells_its_whole_records_and_appends_the_rest(
    tmp_path: Path, monkeypatch
) -> None:
    w = writer(tmp_path)
    sizes = [HEADER_SIZE + sum(map(len, encode_step([make_span(i)], [], []))) for i in range(3)]
    fail_writev(monkeypatch, None, written=sizes[0] + 5)  # the first whole, the second torn
    told: list[str] = []
    with w.group():
        for i in range(3):
            w.append_step([make_span(i)], on_done=told.append)
    assert told == ["", "", ""] and w.stats().append_errors == 1
    monkeypatch.undo()
    w.close()
    assert [r.spans()[0].step for r in all_records(tmp_path)] == [0, 1, 2]


@pytest.mark.parametrize("hold", [0, 1 << 20])
def test_the_records_of_a_group_not_tried_lose_their_bodies_only_when_held(
    tmp_path: Path, monkeypatch, hold: int
) -> None:
    monkeypatch.setattr(wal, "_IOV_MAX", 2)
    w = writer(tmp_path, hold_bytes=hold, hold_s=60.0)
    real = os.writev

    def full(fd: int, buffers: list[bytes]) -> int:
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(os, "writev", full)
    with w.group():
        for i in range(3):
            w.append_step([make_span(i)], [], [payload(b"b%d" % i)])
    s = w.stats()
    if hold:  # what is held is the spans
        assert (s.held_records, s.dropped_payloads, s.dropped_records) == (3, 3, 0)
        assert s.held_bytes == sum(
            HEADER_SIZE + sum(map(len, encode_step([make_span(i)], [], []))) for i in range(3)
        )
    else:  # dropped as they are: only the one tried lost its body first
        assert (s.held_records, s.dropped_payloads, s.dropped_records) == (0, 1, 3)
    monkeypatch.setattr(os, "writev", real)
    w.close()


def test_the_syncer_syncs_a_segment_only_after_an_append(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd))
    w = writer(tmp_path)
    w._sync_once()
    assert synced == []
    w.append_step([make_span(0)])
    w._sync_once()
    assert len(synced) == 1
    w._sync_once()
    assert len(synced) == 1  # nothing new
    monkeypatch.undo()
    w.close()


def test_a_failed_fdatasync_is_logged(tmp_path: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    w = WalWriter(tmp_path, fsync="always", fsync_interval_s=60.0)
    monkeypatch.setattr(os, "fdatasync", broken)
    assert w.append_step([make_span(0)])
    name = w.stats().segment
    assert messages(caplog) == [f"fdatasync of WAL segment {name} failed: [Errno 5] Input/output error"]
    monkeypatch.undo()
    w.close()


def test_append_errors_count_every_failure(tmp_path: Path, monkeypatch) -> None:
    w = writer(tmp_path)
    for _ in range(2):
        fail_writev(monkeypatch, errno.EIO)
        w.append_step([make_span(0)])
    assert w.stats().append_errors == 2
    monkeypatch.undo()
    w.close()


def test_a_segment_that_cannot_be_cut_back_is_logged_and_rolled(tmp_path: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    w = writer(tmp_path)
    first = w.stats().segment

    def no_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    fail_writev(monkeypatch, None, written=3)  # torn at 3 bytes, in a fresh segment
    monkeypatch.setattr(os, "ftruncate", no_truncate)
    assert not w.append_step([make_span(0)])
    assert messages(caplog)[0] == (
        f"cannot cut WAL segment {first} back after a failed append: [Errno 1] Operation not permitted"
    )
    monkeypatch.undo()
    assert w.append_step([make_span(1)])
    assert w.stats().segment != first  # the torn one takes no more appends
    w.close()
    assert [r.spans()[0].step for r in all_records(tmp_path)] == [1]


# --- added after the last measured run (docs/mutation.md) ------------------------------------------


def test_a_read_that_ends_with_the_last_frame_is_at_the_end(tmp_path: Path) -> None:
    path, at = frames_file(tmp_path, [b"a", b"b", b""])  # the last frame: a header alone
    res = read_frames(path, 0, sealed=True, max_frames=3)
    assert len(res.frames) == 3 and res.at_end and res.next_offset == at[3] and res.torn_bytes == 0
    res = read_frames(path, 0, sealed=True, max_frames=2)
    assert len(res.frames) == 2 and not res.at_end


def test_one_byte_of_damage_and_repeated_bad_lengths_are_each_counted(tmp_path: Path) -> None:
    good = expected_frame(b"good", 1)
    bad_length = b"RCW1" + struct.pack("<IQI", 1000, 0, 0)
    data = b"x" + good + bad_length + good + bad_length + good
    path = tmp_path / "seg.wal"
    path.write_bytes(data)
    res = read_frames(path, 0, sealed=True)
    assert len(res.frames) == 3 and res.frames[0].offset == 1
    assert (res.damaged, res.damaged_bytes) == (3, 1 + 2 * HEADER_SIZE)


def test_the_reasons_bodies_are_left_out_are_logged(tmp_path: Path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    now = [500.0]
    monkeypatch.setattr(wal.time, "monotonic", lambda: now[0])
    size = HEADER_SIZE + sum(map(len, encode_step([make_span(0)], [], [])))
    w = writer(tmp_path, max_bytes=size * 4, log_interval_s=0.0)
    for _ in range(3):
        w.append_step([make_span(0)])
    w.append_step([make_span(0)], [], [payload(b"x")])
    assert messages(caplog)[-1] == (
        "WAL: payload bodies dropped: the WAL is over 3/4 of wal_max_bytes (1 payload bodies and 0 records "
        "so far)"
    )
    w._full_until = now[0] + 1
    w.append_step([make_span(0)], [], [payload(b"y")])
    # (then dropped at the bound)
    assert (
        "WAL: payload bodies dropped: the disk is full (2 payload bodies and 0 records so far)"
        in messages(caplog)
    )
    monkeypatch.undo()
    w.close()


def test_a_dropped_record_without_runs_logs_a_dash(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    w = writer(tmp_path)
    w.close()
    w.append_step([])
    assert messages(caplog)[-1].endswith("; runs: - (0 payload bodies and 1 records so far)")


def test_an_on_done_that_fails_is_logged_and_the_writer_goes_on(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="runcap.wal")
    w = writer(tmp_path)

    def broken(why: str) -> None:
        raise RuntimeError("the caller's bug")

    assert w.append_step([make_span(0)], on_done=broken)
    assert w.append_step([make_span(1)])
    assert messages(caplog) == ["a WAL record's on_done failed"]
    w.close()
    assert len(all_records(tmp_path)) == 2


def test_a_segment_that_is_gone_is_sealed(tmp_path: Path) -> None:
    assert wal.segment_sealed(tmp_path / "deleted.wal")
