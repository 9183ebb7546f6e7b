"""The span pipeline's durable on-disk spool, and the byte encoding of the records in it.

When a sink is down, slow, or the in-memory queue is full, batches are appended here and replayed
later in the order they were appended; nothing is dropped. A spool is a directory of append-only
segment files. Each record is framed as

    magic "RCS1" | u32 body length | u32 item count | u64 append time (unix ms) | u32 crc32 | body

(little-endian; the crc covers length, count, time and body). A record cut short by a crash
(kill -9 while writing) or damaged later fails the length or checksum test and is skipped on
open — a torn tail is truncated, damage in the middle is cut out by rewriting the segment — so a
replay never crashes on it. A record that checks out but does not decode is moved to `dead/`.

Consumption is tracked by a small `cursor` file (segment, offset, and the extent of a claimed
unit of work), so a restart resumes where the last process stopped instead of replaying whole
segments; a segment is deleted once every record in it was acknowledged.

The body of a record is an encoded `Batch` (`encode_batch` / `decode_batch`): an orjson header
with the spans, run snapshots and payload metadata, followed by the raw payload bytes. No pickle:
Decimal travels as its string, datetime as ISO 8601 with its offset, so every field round-trips
exactly.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from proxy.spans.model import Payload, RunSnapshot, Span

log = logging.getLogger(__name__)

MAGIC = b"RCS1"
_HEAD = struct.Struct("<4sIIQI")  # magic, body length, item count, append time ms, crc32
_CRC_PART = struct.Struct("<IIQ")  # the header fields the crc covers, before the body
HEADER_SIZE = _HEAD.size
MAX_RECORD_BYTES = 1 << 30  # a length beyond this is damage, not data
SEGMENT_SUFFIX = ".seg"
CURSOR_FILE = "cursor"
DEAD_DIR = "dead"


# --- records -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Batch:
    """What the pipeline moves: a batch id (the sinks' dedup key) and the records in it."""

    batch_id: str
    spans: list[Span] = field(default_factory=list)
    runs: list[RunSnapshot] = field(default_factory=list)
    payloads: list[Payload] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.spans) + len(self.runs) + len(self.payloads)


_SPAN_FIELDS = frozenset(f.name for f in fields(Span))
_RUN_FIELDS = frozenset(f.name for f in fields(RunSnapshot))
_SPAN_DATETIMES = ("started_at",)
_SPAN_DECIMALS = ("cost_usd",)
_RUN_DATETIMES = ("started_at", "updated_at", "deadline")
_RUN_DECIMALS = ("cost_usd", "max_usd")
_BODY_HEAD = struct.Struct("<I")


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        # isoformat() keeps any offset exactly; orjson's own encoding rounds sub-minute offsets
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)  # str(Decimal) round-trips exactly, trailing zeros included
    raise TypeError(f"cannot encode {type(value).__name__} in a spool record")


def _restore(
    data: dict[str, Any], known: frozenset[str], datetimes: tuple[str, ...], decimals: tuple[str, ...]
) -> dict[str, Any]:
    kwargs = {k: v for k, v in data.items() if k in known}  # fields of a newer version are dropped
    for name in datetimes:
        if kwargs.get(name) is not None:
            kwargs[name] = datetime.fromisoformat(kwargs[name])
    for name in decimals:
        if kwargs.get(name) is not None:
            kwargs[name] = Decimal(kwargs[name])
    return kwargs


def encode_batch(batch: Batch) -> bytes:
    head = {
        "v": 1,
        "batch_id": batch.batch_id,
        "spans": batch.spans,  # orjson encodes the dataclasses field by field, natively
        "runs": batch.runs,
        "payloads": [[p.sha256, p.content_type, len(p.data)] for p in batch.payloads],
    }
    encoded = orjson.dumps(head, default=_default, option=orjson.OPT_PASSTHROUGH_DATETIME)
    return b"".join([_BODY_HEAD.pack(len(encoded)), encoded, *(p.data for p in batch.payloads)])


class SpoolRecordError(ValueError):
    """A record that passed its checksum but is not a batch this version can read."""


def decode_batch(body: bytes | memoryview) -> Batch:
    try:
        return _decode_batch(memoryview(body))
    except SpoolRecordError:
        raise
    except (ValueError, TypeError, KeyError, ArithmeticError, struct.error) as exc:
        raise SpoolRecordError(f"undecodable spool record: {type(exc).__name__}: {exc}") from exc


def _decode_batch(view: memoryview) -> Batch:
    (head_len,) = _BODY_HEAD.unpack_from(view, 0)
    start = _BODY_HEAD.size
    head = orjson.loads(view[start : start + head_len])
    if head.get("v") != 1:
        raise SpoolRecordError(f"spool record format version {head.get('v')!r} is not 1")
    offset = start + head_len
    payloads = []
    for sha256, content_type, size in head["payloads"]:
        data = bytes(view[offset : offset + size])
        payloads.append(Payload(sha256=sha256, data=data, content_type=content_type))
        offset += size
    if offset != len(view):
        raise SpoolRecordError(f"spool record has {len(view) - offset} stray bytes after its payloads")
    return Batch(
        batch_id=head["batch_id"],
        spans=[Span(**_restore(s, _SPAN_FIELDS, _SPAN_DATETIMES, _SPAN_DECIMALS)) for s in head["spans"]],
        runs=[RunSnapshot(**_restore(r, _RUN_FIELDS, _RUN_DATETIMES, _RUN_DECIMALS)) for r in head["runs"]],
        payloads=payloads,
    )


# --- framing -------------------------------------------------------------------------------------


def frame(body: bytes, items: int, now_ms: int | None = None) -> bytes:
    ts = int(time.time() * 1000) if now_ms is None else now_ms
    crc = zlib.crc32(body, zlib.crc32(_CRC_PART.pack(len(body), items, ts)))
    return _HEAD.pack(MAGIC, len(body), items, ts, crc) + body


@dataclass(slots=True)
class _Frame:
    offset: int
    size: int  # header + body
    items: int
    ts_ms: int


def _parse_at(buf: bytes | memoryview, offset: int) -> _Frame | None:
    """The record starting at offset, or None when it is torn or damaged."""
    if len(buf) - offset < HEADER_SIZE:
        return None
    magic, length, items, ts, crc = _HEAD.unpack_from(buf, offset)
    if magic != MAGIC or length > MAX_RECORD_BYTES or len(buf) - offset - HEADER_SIZE < length:
        return None
    body = buf[offset + HEADER_SIZE : offset + HEADER_SIZE + length]
    if zlib.crc32(body, zlib.crc32(_CRC_PART.pack(length, items, ts))) != crc:
        return None
    return _Frame(offset, HEADER_SIZE + length, items, ts)


def scan_frames(buf: bytes) -> tuple[list[_Frame], int]:
    """Valid records in a segment's bytes, and how many bytes were skipped as torn or damaged.
    After damage the scan resynchronises on the next magic whose record checks out."""
    frames: list[_Frame] = []
    skipped = 0
    offset = 0
    view = memoryview(buf)
    while offset < len(buf):
        found = _parse_at(view, offset)
        if found is not None:
            frames.append(found)
            offset += found.size
            continue
        nxt = buf.find(MAGIC, offset + 1)
        while nxt != -1 and _parse_at(view, nxt) is None:
            nxt = buf.find(MAGIC, nxt + 1)
        end = len(buf) if nxt == -1 else nxt
        skipped += end - offset
        offset = end
    return frames, skipped


# --- the spool -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Segment:
    path: Path
    records: int = 0  # appended, including consumed ones
    items: int = 0
    size: int = 0
    read_offset: int = 0  # where the next unconsumed record starts
    read_records: int = 0
    read_items: int = 0
    oldest_ms: list[int] = field(default_factory=list)  # append time of each record, for ages
    # recovery only: items per record, record end offset → records up to it, rewritten on open
    items_at: list[int] = field(default_factory=list)
    frame_ends: dict[int, int] = field(default_factory=dict)
    repaired: bool = False

    @property
    def pending_records(self) -> int:
        return self.records - self.read_records


@dataclass(frozen=True, slots=True)
class SpoolStats:
    records: int  # spool records (batches) waiting
    items: int  # spans + runs + payloads in them
    bytes: int
    oldest_age_s: float  # 0.0 when empty
    torn_bytes_skipped: int


@dataclass(frozen=True, slots=True)
class SpoolEntry:
    """The oldest waiting record; pass it back to `Spool.ack` once it landed."""

    segment: Path
    offset: int
    size: int
    items: int
    ts_ms: int
    body: bytes


class Spool:
    """An append-only, checksummed, segment-file FIFO in one directory; thread-safe.

    `append` writes one record with a single write() and, with `fsync=True`, fsyncs it before
    returning. `peek` returns the oldest record not yet acknowledged; `ack` marks it consumed and
    deletes its segment once every record in it was consumed. Existing segments (a previous
    process, possibly killed mid-write) are validated and queued on construction.
    """

    def __init__(self, directory: Path, *, fsync: bool = True, segment_bytes: int = 8 << 20) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []  # oldest first; the last one may be open for append
        self._write_fd: int | None = None
        self._write_seg: _Segment | None = None
        self._dirty = False  # appended without fsync since the last sync()
        self.torn_bytes_skipped = 0
        self._next_seq = 1
        # (segment, end offset) of records handed out by `claim` but not yet acknowledged
        self._claim: tuple[Path, int] | None = None
        self._cursor_path = self.directory / CURSOR_FILE
        self._recover()

    # recovery ------------------------------------------------------------------------------------

    def _recover(self) -> None:
        paths = sorted(self.directory.glob("*" + SEGMENT_SUFFIX))
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a rewrite interrupted by a crash; the original stands
        for path in paths:
            self._next_seq = max(self._next_seq, _seq_of(path) + 1)
            buf = path.read_bytes()
            frames, skipped = scan_frames(buf)
            if skipped:
                self.torn_bytes_skipped += skipped
                self._repair(path, buf, frames, skipped)
            if not frames:
                path.unlink(missing_ok=True)
                continue
            seg = _Segment(path=path)
            for fr in frames:
                seg.records += 1
                seg.items += fr.items
                seg.oldest_ms.append(fr.ts_ms)
                seg.items_at.append(fr.items)
            seg.size = sum(fr.size for fr in frames)
            seg.frame_ends = {fr.offset + fr.size: i + 1 for i, fr in enumerate(frames)}
            seg.repaired = bool(skipped)
            self._segments.append(seg)
        self._apply_cursor()

    def _apply_cursor(self) -> None:
        """Skip what an earlier process already acknowledged, so a restart does not replay it.
        The cursor is written without fsync: it survives kill -9 (page cache) but maybe not a
        power loss, after which records are replayed once more and the sinks' dedup absorbs it."""
        try:
            cursor = orjson.loads(self._cursor_path.read_bytes())
            cur_seq, offset, claim_end = (
                _seq_of(Path(cursor["segment"])),
                cursor["offset"],
                cursor["claim_end"],
            )
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError):
            log.warning("spool %s: unreadable cursor file ignored; replaying from the start", self.directory)
            return
        # new segments must sort after the cursor, or they would look consumed on the next open
        self._next_seq = max(self._next_seq, cur_seq + 1)
        for seg in list(self._segments):
            seq = _seq_of(seg.path)
            if seq < cur_seq:  # consumed earlier; the crash came before the unlink
                self._segments.remove(seg)
                seg.path.unlink(missing_ok=True)
            elif seq == cur_seq and offset:
                consumed = seg.frame_ends.get(offset)
                if consumed is None or seg.repaired:
                    log.warning(
                        "spool %s: cursor does not fit %s; replaying it whole", self.directory, seg.path
                    )
                    continue
                seg.read_offset = offset
                seg.read_records = consumed
                seg.read_items = sum(seg.items_at[:consumed])
                if claim_end is not None and claim_end in seg.frame_ends:
                    self._claim = (seg.path, claim_end)
                if seg.pending_records == 0:
                    self._segments.remove(seg)
                    seg.path.unlink(missing_ok=True)

    def _repair(self, path: Path, buf: bytes, frames: list[_Frame], skipped: int) -> None:
        valid_end = frames[-1].offset + frames[-1].size if frames else 0
        contiguous = sum(fr.size for fr in frames) == valid_end
        if contiguous:
            log.warning(
                "spool %s: skipped a torn last record (%d bytes) in %s; truncated",
                self.directory,
                skipped,
                path.name,
            )
            with open(path, "r+b") as fh:
                fh.truncate(valid_end)
                fh.flush()
                os.fsync(fh.fileno())
            return
        log.error(
            "spool %s: %d damaged bytes inside %s were cut out; the records around them are kept",
            self.directory,
            skipped,
            path.name,
        )
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            for fr in frames:
                fh.write(buf[fr.offset : fr.offset + fr.size])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.directory)

    # writing -------------------------------------------------------------------------------------

    def append(self, body: bytes, items: int = 1) -> int:
        """Append one record; returns its size on disk."""
        return self.append_many([(body, items)])

    def append_many(self, bodies: list[tuple[bytes, int]]) -> int:
        """Append several records with one write() and at most one fsync."""
        if not bodies:
            return 0
        now_ms = int(time.time() * 1000)
        framed = [frame(body, items, now_ms) for body, items in bodies]
        data = b"".join(framed)
        with self._lock:
            seg, fd = self._writer(len(data))
            _write_all(fd, data)
            if self._fsync:
                os.fsync(fd)
            else:
                self._dirty = True
            seg.size += len(data)
            seg.records += len(bodies)
            seg.items += sum(items for _, items in bodies)
            seg.oldest_ms.extend([now_ms] * len(bodies))
        return len(data)

    def _writer(self, incoming: int) -> tuple[_Segment, int]:
        seg, fd = self._write_seg, self._write_fd
        if seg is not None and fd is not None:
            if seg.size == 0 or seg.size + incoming <= self._segment_bytes:
                return seg, fd
        self._close_writer()
        path = self.directory / f"{self._next_seq:012d}{SEGMENT_SUFFIX}"
        self._next_seq += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if self._fsync:
            _fsync_dir(self.directory)  # the new name must survive a crash too
        seg = _Segment(path=path)
        self._segments.append(seg)
        self._write_seg, self._write_fd = seg, fd
        return seg, fd

    def _close_writer(self) -> None:
        if self._write_fd is not None:
            if self._dirty:
                os.fsync(self._write_fd)
                self._dirty = False
            os.close(self._write_fd)
        self._write_fd = None
        self._write_seg = None

    def sync(self) -> None:
        """fsync records appended with `fsync=False` (the hot path's overflow spool)."""
        with self._lock:
            if self._dirty and self._write_fd is not None:
                os.fsync(self._write_fd)
                self._dirty = False

    # reading -------------------------------------------------------------------------------------

    def peek(self) -> SpoolEntry | None:
        """The oldest record not yet acknowledged, or None."""
        entries = self.peek_many(1)
        return entries[0] if entries else None

    def peek_many(self, limit: int, max_bytes: int = 32 << 20) -> list[SpoolEntry]:
        """Up to `limit` oldest unacknowledged records (from one segment, at least one record)."""
        with self._lock:
            seg = next((s for s in self._segments if s.pending_records), None)
            if seg is None:
                return []
            want = min(seg.pending_records, limit)
            stop_at = None
            if self._claim is not None and self._claim[0] == seg.path and self._claim[1] > seg.read_offset:
                want, stop_at = seg.pending_records, self._claim[1]  # exactly the claimed records
            out: list[SpoolEntry] = []
            with open(seg.path, "rb") as fh:
                fh.seek(seg.read_offset)
                offset = seg.read_offset
                total = 0
                while len(out) < want and (not out or total < max_bytes or stop_at is not None):
                    if stop_at is not None and offset >= stop_at:
                        break
                    head = fh.read(HEADER_SIZE)
                    _magic, length, items, ts, _crc = _HEAD.unpack(head)
                    buf = head + fh.read(length)
                    if _parse_at(buf, 0) is None:  # changed on disk since it was validated
                        raise OSError(f"spool record at {seg.path}:{offset} is damaged")
                    out.append(SpoolEntry(seg.path, offset, len(buf), items, ts, buf[HEADER_SIZE:]))
                    offset += len(buf)
                    total += len(buf)
            return out

    def claim(self, entries: list[SpoolEntry]) -> None:
        """Record (in the cursor file) that these records are being processed as one unit, so
        that after a crash `peek_many` hands out exactly the same records again — the overflow
        drain derives a batch id from them, and the same id is what makes the replay a no-op."""
        if not entries:
            return
        with self._lock:
            last = entries[-1]
            self._claim = (last.segment, last.offset + last.size)
            seg = next(s for s in self._segments if s.path == last.segment)
            self._write_cursor(seg.path, seg.read_offset, self._claim[1])

    def ack(self, entry: SpoolEntry) -> None:
        self.ack_many([entry])

    def ack_many(self, entries: list[SpoolEntry]) -> None:
        """Mark records consumed, in order; a segment is deleted once all of it is."""
        if not entries:
            return
        with self._lock:
            for entry in entries:
                seg = next((s for s in self._segments if s.path == entry.segment), None)
                if seg is None or seg.read_offset != entry.offset:
                    raise ValueError(f"spool ack out of order: {entry.segment.name}:{entry.offset}")
                seg.read_offset += entry.size
                seg.read_records += 1
                seg.read_items += entry.items
                if self._claim is not None and self._claim == (seg.path, seg.read_offset):
                    self._claim = None
                if seg.pending_records == 0:
                    if seg is self._write_seg:
                        self._close_writer()
                    self._segments.remove(seg)
                    seg.path.unlink(missing_ok=True)
            last = entries[-1]
            self._write_cursor(last.segment, last.offset + last.size, self._claim[1] if self._claim else None)

    def quarantine(self, entry: SpoolEntry, reason: str) -> None:
        """Move a record that can never be processed (it does not decode) to `dead/` beside the
        spool, for a human, and acknowledge it — so it cannot block everything behind it."""
        dead = Spool(self.directory / DEAD_DIR, fsync=True)
        try:
            dead.append(entry.body, entry.items)
        finally:
            dead.close()
        log.error(
            "spool %s: record %s:%d cannot be processed (%s); moved to %s",
            self.directory,
            entry.segment.name,
            entry.offset,
            reason,
            dead.directory,
        )
        self.ack(entry)

    def _write_cursor(self, segment: Path, offset: int, claim_end: int | None) -> None:
        data = orjson.dumps({"segment": segment.name, "offset": offset, "claim_end": claim_end})
        tmp = self._cursor_path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, self._cursor_path)  # atomic: the old cursor or the new one, never half

    def __iter__(self) -> Iterator[Batch]:
        """Every waiting record decoded, oldest first, without consuming (for tools and tests)."""
        with self._lock:
            snapshot = [(s.path, s.read_offset) for s in self._segments if s.pending_records]
        for path, start in snapshot:
            data = path.read_bytes()[start:]
            frames, _ = scan_frames(data)
            for fr in frames:
                yield decode_batch(data[fr.offset + HEADER_SIZE : fr.offset + fr.size])

    # bookkeeping ---------------------------------------------------------------------------------

    def pending(self) -> int:
        with self._lock:
            return sum(s.pending_records for s in self._segments)

    def stats(self) -> SpoolStats:
        with self._lock:
            records = items = size = 0
            oldest: int | None = None
            for seg in self._segments:
                if not seg.pending_records:
                    continue
                records += seg.pending_records
                items += seg.items - seg.read_items
                size += seg.size - seg.read_offset
                first = seg.oldest_ms[seg.read_records]
                oldest = first if oldest is None else min(oldest, first)
            age = max(0.0, time.time() - oldest / 1000) if oldest is not None else 0.0
            return SpoolStats(records, items, size, age, self.torn_bytes_skipped)

    def close(self) -> None:
        with self._lock:
            self._close_writer()


def _seq_of(path: Path) -> int:
    try:
        return int(path.stem)
    except ValueError:
        return 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
