"""The write-ahead log between the request path and the shipper: `data_dir/wal/*.wal`.

Each proxy process appends with a `WalWriter` to segments of its own; the shipper
(proxy/spans/shipper.py) reads every segment with `read_frames` and deletes a segment once every
sink has passed it. Like Vector's disk buffer or the OpenTelemetry Collector's persistent queue:
the data path appends and moves on, the sinks drain at their own pace.

Record frame (little-endian), then the body (proxy/spans/records.py):

    magic "RCW1" | u32 body length | u64 append time (unix ms) | u32 crc32 of (length, time, body)

Writer (one per process; not thread-safe — the event loop is its only caller):

* one `writev` per record, no fsync per record: a record is in the page cache when `append_step`
  returns, so killing runcap loses nothing; a background thread `fdatasync`s the segment every
  `fsync_interval_s` (an OS crash loses at most that), or every append with `fsync="always"`;
* a process takes the lowest free writer slot (`.w{N}.lock`, flock) and names its segments
  `{creation time ns}-{random}-w{N}.wal`: names never repeat, so a sink's saved position can never be
  applied to a different file. The active segment is flock'ed by its writer: unlocked means
  sealed (rolled at `segment_bytes`, or its writer died) and nothing will be appended any more;
* a failed append (ENOSPC, a short write) is cut back with `ftruncate` to the last good offset —
  never leaving torn bytes for later appends to land behind — and retried once without its
  payload bodies; the writer then rolls to a fresh segment so the full one can be shipped and
  deleted. Truncating frees space, so this repair never needs any;
* `max_bytes` bounds the whole WAL (all writers, as last measured plus what this process appended
  since): above 3/4 of it a record is appended without its bodies (their hashes are blanked in the
  spans: `''` = not stored), at the bound a record is not appended;
* a record that cannot be appended even without its bodies (the disk full, the bound reached) is
  held in memory — up to `hold_bytes` and `hold_s` — and appended first, before any newer record,
  once there is room again (the next append, or `flush_held()`). A record past either bound is
  dropped: counted one per record (a record is one step), logged with the runs it held, and its
  `on_done` told so. The caller that waits for `on_done` (server/steps/trace.py) answers only once its
  record is in the WAL, or refuses the call: no answer goes out for a step that is only held, so a
  restart, which loses what is held, loses nothing that was answered (`close()` appends what it can
  and drops the rest, counted). Without `hold_bytes` a record that cannot be appended is dropped
  at once.

Reader: a frame whose magic, length or checksum is wrong is damage, skipped to the next frame
that checks out (counted); an incomplete frame at the end is a record in progress in an active
segment, and a torn tail (a process killed mid-`write`) in a sealed one — cut off on the next
writer start of that slot, or read around by the shipper.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.records import encode_step

log = logging.getLogger("runcap.wal")

MAGIC = b"RCW1"
_FRAME = struct.Struct("<4sIQI")
HEADER_SIZE = _FRAME.size
_CRC_FIELDS = struct.Struct("<IQ")
MAX_RECORD_BYTES = 256 << 20  # a length beyond this is damage, not data
SEGMENT_SUFFIX = ".wal"
FSYNC_MODES = ("interval", "always")
_READ_CHUNK = 1 << 20
_JOIN_MAX = 64 << 10  # a record body up to this is joined into one buffer before its write
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)  # buffers per writev


# What a record's `on_done` is told: "" once it is in the WAL, else why it was dropped.
RecordDone = Callable[[str], None]


@dataclass(slots=True)
class _Pending:
    """A record encoded and not yet written (a group's, or one held while the WAL had no room)."""

    spans: Sequence[Span]
    runs: Sequence[RunSnapshot]
    payloads: Sequence[Payload]
    parts: list[bytes]
    on_done: RecordDone | None = None
    held_since: float = 0.0  # monotonic; 0 while not held
    dropped: bool = False

    @property
    def size(self) -> int:
        return HEADER_SIZE + sum(map(len, self.parts))

    def run_ids(self) -> list[str]:
        return list(dict.fromkeys([*(s.run_id for s in self.spans), *(r.run_id for r in self.runs)]))


def frame_header(body_parts: Sequence[bytes], time_ms: int) -> bytes:
    length = sum(map(len, body_parts))
    crc = zlib.crc32(_CRC_FIELDS.pack(length, time_ms))
    for part in body_parts:
        crc = zlib.crc32(part, crc)
    return _FRAME.pack(MAGIC, length, time_ms, crc)


def frame(body_parts: Sequence[bytes], time_ms: int) -> list[bytes]:
    """The buffers one `writev` writes for a record: the header, then its body. A small body is
    joined first (one copy of a few KiB costs less than a checksum call and an iovec per part);
    a large one is written from its parts as they are (no copy of the bodies)."""
    length = sum(map(len, body_parts))
    if length > _JOIN_MAX:
        return [frame_header(body_parts, time_ms), *body_parts]
    body = b"".join(body_parts)
    crc = zlib.crc32(body, zlib.crc32(_CRC_FIELDS.pack(length, time_ms)))
    return [_FRAME.pack(MAGIC, length, time_ms, crc), body]


def segments(directory: Path) -> list[str]:
    """Segment file names in `directory`, oldest first."""
    try:
        with os.scandir(directory) as entries:
            return sorted(e.name for e in entries if e.name.endswith(SEGMENT_SUFFIX))
    except FileNotFoundError:
        return []


def wal_bytes(directory: Path) -> int:
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.endswith(SEGMENT_SUFFIX):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:
                        pass
    except FileNotFoundError:
        pass
    return total


def lock_held(path: Path) -> bool | None:
    """Whether a process holds an exclusive lock on `path` (a WAL writer on its segment, a
    `runcap serve` on its serve.lock); None when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock, if we got it
    return False


def segment_sealed(path: Path) -> bool:
    """True when no writer holds the segment: nothing will be appended to it any more."""
    return not lock_held(path)


# --- reading ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Frame:
    offset: int
    end: int
    time_ms: int
    body: memoryview


@dataclass(slots=True)
class ReadResult:
    frames: list[Frame] = field(default_factory=list)
    next_offset: int = 0  # where the next read starts: after the last frame or skipped damage
    at_end: bool = False  # nothing complete after next_offset (for now, if the segment is active)
    damaged: int = 0  # damaged regions skipped
    damaged_bytes: int = 0
    torn_bytes: int = 0  # sealed segment: bytes after the last frame that are no frame


def _check(buf: memoryview, at: int) -> int:
    """Length of the valid frame at `at` in `buf`, or -1 (damage or not complete in `buf`)."""
    if at + HEADER_SIZE > len(buf):
        return -1
    magic, length, _, crc = _FRAME.unpack_from(buf, at)
    if magic != MAGIC or length > MAX_RECORD_BYTES or at + HEADER_SIZE + length > len(buf):
        return -1
    body = buf[at + HEADER_SIZE : at + HEADER_SIZE + length]
    return length if zlib.crc32(body, zlib.crc32(buf[at + 4 : at + 16])) == crc else -1


def _resync(fd: int, start: int, limit: int) -> int | None:
    """Offset of the first valid frame at or after `start` (before `limit`), or None."""
    pos = start
    while pos < limit:
        chunk = os.pread(fd, min(_READ_CHUNK, limit - pos), pos)
        if not chunk:
            return None
        at = chunk.find(MAGIC)
        while at != -1:
            head = os.pread(fd, HEADER_SIZE, pos + at)
            if len(head) == HEADER_SIZE:
                _, length, _, _ = _FRAME.unpack(head)
                if length <= MAX_RECORD_BYTES and pos + at + HEADER_SIZE + length <= limit:
                    whole = memoryview(os.pread(fd, HEADER_SIZE + length, pos + at))
                    if _check(whole, 0) >= 0:
                        return pos + at
            at = chunk.find(MAGIC, at + 1)
        if len(chunk) < len(MAGIC):
            return None
        pos += len(chunk) - (len(MAGIC) - 1)  # a magic split across chunks is found next time
    return None


def read_frames(
    path: Path,
    offset: int,
    *,
    sealed: bool,
    max_bytes: int = 8 << 20,
    max_frames: int = 1 << 30,
    until: int | None = None,
) -> ReadResult:
    """Complete, valid frames from `offset` on (at least one when there is one, then up to
    `max_bytes` / `max_frames`; never past `until`). Damage is skipped and counted."""
    res = ReadResult(next_offset=offset)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        res.at_end = True
        return res
    try:
        size = os.fstat(fd).st_size
        limit = size if until is None else min(until, size)
        pos = offset
        buf = memoryview(b"")
        base = pos
        taken = 0
        while True:
            if pos >= limit:
                res.at_end = True
                break
            if res.frames and (taken >= max_bytes or len(res.frames) >= max_frames):
                break
            rel = pos - base
            if rel + HEADER_SIZE > len(buf):
                base, rel = pos, 0
                buf = memoryview(os.pread(fd, min(max(_READ_CHUNK, max_bytes - taken), limit - pos), pos))
            if len(buf) - rel < HEADER_SIZE:
                header_ok = False
                length = time_ms = crc = 0
            else:
                magic, length, time_ms, crc = _FRAME.unpack_from(buf, rel)
                header_ok = magic == MAGIC and length <= MAX_RECORD_BYTES
            end = pos + HEADER_SIZE + length
            if header_ok and end > limit:
                # Incomplete: a record being written (active segment), or a torn tail or a
                # damaged length (sealed): damage only if a valid frame follows.
                if not sealed:
                    res.at_end = True
                    break
            elif header_ok:
                if end - base > len(buf):
                    base, rel = pos, 0
                    buf = memoryview(os.pread(fd, max(_READ_CHUNK, end - pos), pos))
                body = buf[rel + HEADER_SIZE : rel + HEADER_SIZE + length]
                if zlib.crc32(body, zlib.crc32(buf[rel + 4 : rel + 16])) == crc:
                    res.frames.append(Frame(pos, end, time_ms, body))
                    taken += HEADER_SIZE + length
                    pos = end
                    continue
            # Damage (bad magic, length or checksum, a header cut short, or a sealed segment's
            # incomplete frame).
            nxt = _resync(fd, pos + 1, limit)
            if nxt is None:
                if sealed:
                    res.torn_bytes = limit - pos
                # active: valid records appended later will be found behind it
                res.at_end = True
                break
            res.damaged += 1
            res.damaged_bytes += nxt - pos
            pos = nxt
        res.next_offset = pos
    finally:
        os.close(fd)
    return res


def valid_end(path: Path) -> ReadResult:
    """Scan a sealed segment to its end; `next_offset` is where its valid data ends."""
    res = ReadResult()
    pos = 0
    while True:
        part = read_frames(path, pos, sealed=True, max_bytes=64 << 20)
        res.damaged += part.damaged
        res.damaged_bytes += part.damaged_bytes
        pos = part.next_offset
        if part.at_end:
            res.torn_bytes = part.torn_bytes
            res.next_offset = pos
            return res


# --- writing ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class WriterStats:
    slot: int
    segment: str
    appended_records: int
    appended_bytes: int
    dropped_payloads: int  # bodies not appended: WAL over 3/4 of max_bytes, or the disk full
    dropped_records: int  # whole records (steps) lost: no room for them within hold_bytes / hold_s
    append_errors: int
    wal_bytes: int  # estimate: last scan + appended since
    held_records: int = 0  # not appended yet: waiting in memory for room
    held_bytes: int = 0


class WalWriter:
    """See the module docstring."""

    def __init__(
        self,
        directory: Path,
        *,
        fsync: str = "interval",
        fsync_interval_s: float = 0.2,
        max_bytes: int = 1 << 30,
        segment_bytes: int = 16 << 20,
        log_interval_s: float = 30.0,
        hold_bytes: int = 0,
        hold_s: float = 5.0,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"wal_fsync must be one of {', '.join(FSYNC_MODES)} (got {fsync!r})")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._always = fsync == "always"
        self._fsync_interval_s = fsync_interval_s
        self.max_bytes = max_bytes
        self._body_bytes = max_bytes * 3 // 4
        self.segment_bytes = segment_bytes
        self._log_interval_s = log_interval_s
        self._last_log: dict[str, float] = {}
        self.hold_bytes = hold_bytes
        self.hold_s = hold_s
        self._held: deque[_Pending] = deque()  # oldest first: appended before any newer record
        self._held_bytes = 0
        self.slot, self._slot_fd = _take_slot(self.directory)
        self._cut_torn_tail()
        self._lock = threading.Lock()  # the active fd, between a roll and the syncer
        self._retired: list[int] = []
        self._fd, self._name = self._create_segment()
        self._offset = 0
        self._dirty = False
        self._roll_wanted = False
        self._full_until = 0.0  # monotonic: after ENOSPC, bodies wait a moment
        self._group: list[_Pending] | None = None  # inside group(): records waiting for its end
        self.appended_records = self.appended_bytes = 0
        self.dropped_payloads = self.dropped_records = self.append_errors = 0
        self._scan_base = wal_bytes(self.directory)
        self._scan_mark = 0
        self._closed = False
        self._stop = threading.Event()
        self._syncer = threading.Thread(target=self._run_syncer, name="runcap-wal-sync", daemon=True)
        self._syncer.start()

    # -- the request path ---------------------------------------------------------------------------

    def append_step(
        self,
        spans: Sequence[Span],
        runs: Sequence[RunSnapshot] = (),
        payloads: Sequence[Payload] = (),
        *,
        on_done: RecordDone | None = None,
    ) -> bool:
        """Append one record; False when it was dropped (counted and logged), True when it is in
        the WAL or held until there is room. Bodies may be left out (counted), their hashes
        blanked in the spans. `on_done` is called once the record's fate is known: with "" when
        it is in the WAL, with the reason when it was dropped. Inside `group()` the record is
        only encoded here, and written when the group ends (True then means: queued)."""
        if self._closed:
            self._drop_records([_Pending(spans, runs, payloads, [], on_done)], "the WAL writer is closed")
            return False
        if payloads:
            if time.monotonic() < self._full_until:  # the disk was full a moment ago
                payloads = self._drop_bodies(spans, payloads, "the disk is full")
            elif self._wal_estimate() >= self._body_bytes:
                payloads = self._drop_bodies(spans, payloads, "the WAL is over 3/4 of wal_max_bytes")
        record = _Pending(spans, runs, payloads, encode_step(spans, runs, payloads), on_done)
        if self._group is not None:
            self._group.append(record)
            return True
        self._append_group([record])
        return not record.dropped

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """The records appended inside are written together when it exits: one `writev` for all
        of them (each still its own frame: a reader sees whole records, and a write torn by a
        kill loses only what came after the tear). The request path groups the steps that end in
        the same event-loop turn: under load, one system call and one warm pass over the encoder
        instead of one of each per request. Not reentrant."""
        if self._group is not None:
            raise RuntimeError("WalWriter.group() is not reentrant")
        self._group = []
        try:
            yield
        finally:
            pending, self._group = self._group, None
            self._append_group(pending)

    def _append(self, record: _Pending, buffers: list[bytes] | None = None) -> bool:
        """One record (`buffers`: already framed): with its bodies unless the disk was full a
        moment ago; without them if that fails (the spans alone may still fit). False: not in
        the WAL (its bodies are gone from it: what is held is its spans)."""
        if record.payloads and time.monotonic() < self._full_until:
            self._strip_bodies(record)
            buffers = None
        if buffers is None:
            buffers = frame(record.parts, time.time_ns() // 1_000_000)
        if self._write(buffers, [sum(map(len, buffers))]):
            return True
        if record.payloads:  # the disk is full (or failing): the spans alone may still fit
            self._strip_bodies(record)
            if self._write(frame(record.parts, time.time_ns() // 1_000_000), [record.size]):
                return True
        return False

    def _strip_bodies(self, record: _Pending) -> None:
        record.payloads = self._drop_bodies(record.spans, record.payloads, "the disk is full")
        record.parts = encode_step(record.spans, record.runs, ())

    def _append_group(self, pending: list[_Pending]) -> None:
        """Append the held records, then `pending`, in order. Once a record fails even without its
        bodies, the ones behind it are not tried (the disk has no room: one system call each
        would only fail again): held, or dropped past the hold's bounds."""
        if self._held:
            pending = [*self._take_held(), *pending]
        time_ms = time.time_ns() // 1_000_000
        failed: list[_Pending] = []
        at = 0
        while at < len(pending):
            if failed:
                failed.extend(pending[at:])
                break
            # Whole records per writev, within the system's limit of buffers per call.
            buffers: list[bytes] = []
            ends: list[int] = []  # where each record ends in the buffers
            end = at
            while end < len(pending):
                framed = frame(pending[end].parts, time_ms)
                if buffers and len(buffers) + len(framed) > _IOV_MAX:
                    break
                buffers.extend(framed)
                ends.append((ends[-1] if ends else 0) + sum(map(len, framed)))
                end += 1
            if end - at == 1:
                if self._append(pending[at], buffers):
                    _done(pending[at], "")
                else:
                    failed.append(pending[at])
            else:
                # A failed or short write keeps the records it holds whole and cuts the rest off:
                # those go record by record, so a full disk costs bodies before it costs records.
                written = self._write(buffers, ends)
                for record in pending[at : at + written]:
                    _done(record, "")
                for record in pending[at + written : end]:
                    if failed or not self._append(record):
                        failed.append(record)
                    else:
                        _done(record, "")
            at = end
        self._hold(failed)

    # -- records that do not fit: held, then dropped -------------------------------------------------

    def _take_held(self) -> list[_Pending]:
        """The held records to try again (oldest first); those held longer than `hold_s` are
        dropped first."""
        now = time.monotonic()
        expired = []
        while self._held and now - self._held[0].held_since > self.hold_s:
            expired.append(self._held.popleft())
        if expired:
            self._drop_records(expired, f"no room in the WAL for wal_hold_ms = {self.hold_s * 1000:.0f} ms")
        held, self._held = list(self._held), deque()
        self._held_bytes = 0
        return held

    def _hold(self, records: list[_Pending]) -> None:
        """Hold `records` (the tail of what was to be appended, in order) while `hold_bytes` has
        room; drop the rest."""
        if not records:
            return
        now = time.monotonic()
        dropped = []
        for record in records:
            if record.payloads and self.hold_bytes:  # what is held is the spans: bodies go first
                self._strip_bodies(record)
            if self._held_bytes + record.size <= self.hold_bytes and not self._closed:
                record.held_since = record.held_since or now
                self._held.append(record)
                self._held_bytes += record.size
            else:
                dropped.append(record)
        if dropped:
            why = (f"the WAL could not be written and wal_hold_bytes = {self.hold_bytes} is used up"
                   if self.hold_bytes else "the WAL could not be written")  # fmt: skip
            self._drop_records(dropped, why)

    def _drop_records(self, records: list[_Pending], why: str) -> None:
        """Records lost: counted one each (a record is a step), logged with their runs — every
        time, not rate-limited: the log is where an operator finds which runs lost a span."""
        self.dropped_records += len(records)
        runs = list(dict.fromkeys(run for record in records for run in record.run_ids()))
        waited = sum(1 for record in records if record.on_done is not None)
        log.error("WAL: %d record%s of spans dropped (%s; %d of them awaited: those calls are refused, "
                  "not answered); runs: %s (%d payload bodies and %d records so far)", len(records),
                  "" if len(records) == 1 else "s", why, waited, " ".join(runs) or "-",
                  self.dropped_payloads, self.dropped_records)  # fmt: skip
        for record in records:
            record.dropped = True
            _done(record, why)

    def flush_held(self) -> int:
        """Try the held records again now (e.g. on a timer while the request path is idle): those
        that fit are appended, those held past `hold_s` dropped. Returns how many are still held."""
        if self._held and self._group is None and not self._closed:
            self._append_group([])
        return len(self._held)

    @property
    def held_records(self) -> int:
        return len(self._held)

    def _write(self, buffers: list[bytes], ends: list[int]) -> int:
        """Write records framed back to back (`ends`: where each one ends in `buffers`). Returns
        how many are in the segment whole: all of them, or after a short write those it holds
        whole — the torn rest is cut off (`ftruncate`: needs no free space) so that the next
        append lands right behind the last good record."""
        size = ends[-1]
        if self._wal_estimate() + size > self.max_bytes:
            if len(ends) == 1:  # (a group is retried record by record: some may still fit)
                self._warn("cap", "the WAL holds wal_max_bytes = %d bytes (a sink is down?): records are "
                           "held, then dropped", self.max_bytes)  # fmt: skip
            return 0
        if self._roll_wanted or self._offset >= self.segment_bytes:
            self._roll()
        fd = self._fd
        error: OSError | None = None
        try:
            written = os.writev(fd, buffers)
        except OSError as exc:
            written, error = 0, exc
        kept = len(ends) if written == size else bisect.bisect_right(ends, written)
        if kept:
            kept_bytes = ends[kept - 1]
            self._offset += kept_bytes
            self.appended_records += kept
            self.appended_bytes += kept_bytes
            self._dirty = True
            if self._always:
                try:
                    os.fdatasync(fd)
                except OSError as exc:
                    self._warn("fsync", "fdatasync of WAL segment %s failed: %s", self._name, exc)
        if written == size:
            return kept
        # Cut back to the last good offset, so the next append does not land behind torn bytes.
        self.append_errors += 1
        cut = True
        try:
            os.ftruncate(fd, self._offset)
        except OSError as exc:
            cut = False
            self._warn(
                "truncate", "cannot cut WAL segment %s back after a failed append: %s", self._name, exc
            )
        # Roll: a full segment is shipped and deleted sooner on its own, and one that could not be
        # cut back must take no more appends (the reader skips its torn tail once it is sealed).
        self._roll_wanted = self._offset > 0 or not cut
        full = error is None or error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        if full:
            self._full_until = time.monotonic() + 1.0
        self._warn("append", "appending to WAL segment %s failed (%s)", self._name,
                   error or f"short write: {written} of {size} bytes")  # fmt: skip
        return kept

    def _drop_bodies(self, spans: Sequence[Span], payloads: Sequence[Payload], why: str) -> list[Payload]:
        dropped = {p.sha256 for p in payloads}
        for span in spans:  # '' = not in the payload store (DESIGN.md "Span store")
            if span.request_hash in dropped:
                span.request_hash = ""
            if span.response_hash in dropped:
                span.response_hash = ""
        self.dropped_payloads += len(payloads)
        self._warn("drop-payload", "WAL: payload bodies dropped: %s (%d payload bodies and %d records so "
                   "far)", why, self.dropped_payloads, self.dropped_records)  # fmt: skip
        return []

    def _warn(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -1e18) >= self._log_interval_s:
            self._last_log[key] = now
            log.error(message, *args)

    def _wal_estimate(self) -> int:
        return self._scan_base + (self.appended_bytes - self._scan_mark)

    # -- segments -----------------------------------------------------------------------------------

    def _create_segment(self) -> tuple[int, str]:
        stamp = time.time_ns()
        while True:
            # A random part too: the name is in ClickHouse's deduplication token, and replicas
            # on other hosts writing to one ClickHouse must never produce the same token.
            name = f"{stamp:020d}-{secrets.token_hex(4)}-w{self.slot}{SEGMENT_SUFFIX}"
            try:
                fd = os.open(
                    self.directory / name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                    0o600,
                )
            except FileExistsError:
                stamp += 1
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)  # ours: the shipper sees it as active
            return fd, name

    def _roll(self) -> None:
        try:
            fd, name = self._create_segment()
        except OSError as exc:  # no inode, no directory space: keep the current one, try later
            self._warn("roll", "cannot start a new WAL segment: %s", exc)
            return
        with self._lock:
            old, self._fd, self._name, self._offset = self._fd, fd, name, 0
            fcntl.flock(old, fcntl.LOCK_UN)  # sealed: the shipper may finish and delete it
            self._retired.append(old)  # fsync'd and closed by the syncer
        self._roll_wanted = False

    def _cut_torn_tail(self) -> None:
        """The newest segment of this slot was left by a process that died: cut off a record it
        was writing when it was killed (ftruncate: needs no free space)."""
        mine = [n for n in segments(self.directory) if n.endswith(f"-w{self.slot}{SEGMENT_SUFFIX}")]
        if not mine:
            return
        path = self.directory / mine[-1]
        try:
            res = valid_end(path)
            if res.torn_bytes:
                os.truncate(path, res.next_offset)
                log.warning("WAL segment %s: cut off a torn record of %d bytes (a process died writing it)",
                            path.name, res.torn_bytes)  # fmt: skip
        except OSError as exc:
            log.warning("WAL segment %s: could not check its tail: %s", path.name, exc)

    # -- background ---------------------------------------------------------------------------------

    def _run_syncer(self) -> None:
        while not self._stop.wait(self._fsync_interval_s):
            try:
                self._sync_once()
            except Exception:  # a bug here must not stop the fsyncs for good
                log.exception("WAL syncer failed")

    def _sync_once(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
            fd = os.dup(self._fd) if self._dirty and not self._always else -1
            self._dirty = False
        for old in retired:
            try:
                os.fdatasync(old)
            except OSError:
                pass
            os.close(old)
        if fd >= 0:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                self._warn("fsync", "fdatasync of WAL segment %s failed: %s", self._name, exc)
            finally:
                os.close(fd)
        if retired:
            _fsync_dir(self.directory)
        mark = self.appended_bytes
        self._scan_base, self._scan_mark = wal_bytes(self.directory), mark

    def sync(self) -> None:
        """Make everything appended so far durable now."""
        self._dirty = True
        self._sync_once()

    def stats(self) -> WriterStats:
        return WriterStats(
            slot=self.slot,
            segment=self._name,
            appended_records=self.appended_records,
            appended_bytes=self.appended_bytes,
            dropped_payloads=self.dropped_payloads,
            dropped_records=self.dropped_records,
            append_errors=self.append_errors,
            wal_bytes=self._wal_estimate(),
            held_records=len(self._held),
            held_bytes=self._held_bytes,
        )

    def close(self) -> None:
        """Append what is held if there is room now (its callers may still be waiting: shutting
        down, their answers are not sent), drop the rest — counted and logged — and seal."""
        if self._closed:
            return
        if self._held and self._group is None:
            self.hold_s = float("inf")  # the last try: none expires on the way
            self._append_group([])
        self._closed = True
        if self._held:
            held, self._held = list(self._held), deque()
            self._held_bytes = 0
            self._drop_records(held, "runcap is shutting down and the WAL still has no room")
        self._stop.set()
        self._syncer.join(5.0)
        try:
            self.sync()
        except OSError:
            pass
        with self._lock:
            os.close(self._fd)  # releases the segment's lock: sealed
            self._fd = -1
        os.close(self._slot_fd)


def _done(record: _Pending, why: str) -> None:
    if record.on_done is not None:
        on_done, record.on_done = record.on_done, None  # told once
        try:
            on_done(why)
        except Exception:  # a caller's bug must not stop the writer
            log.exception("a WAL record's on_done failed")


def _take_slot(directory: Path) -> tuple[int, int]:
    """The lowest writer slot no live process holds (flock): one writer per slot."""
    for slot in itertools.count():
        fd = os.open(directory / f".w{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if slot >= 4096:
                raise RuntimeError(f"no free WAL writer slot in {directory}") from None
            continue
        return slot, fd
    raise AssertionError("unreachable")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
