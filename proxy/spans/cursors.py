"""How far each sink has shipped the WAL: `data_dir/wal/cursors/{sink}.cursor`.

One file per sink holds, per segment, the offset up to which that sink has taken the records,
the segments it has finished, and — for a batch being shipped — its bounds, written before the
batch is sent, so that a batch retried after a crash is rebuilt from exactly the same records
(ClickHouse's insert deduplication token is made of them).

The file is preallocated when it is created and then only overwritten in place: two fixed-size
slots written alternately, each with a sequence number and a checksum; the newer slot that checks
out wins, so a write torn by a crash leaves the previous state. Overwriting allocated blocks
needs no free space: on a full disk the shipper can still record its progress — which is what
lets it delete segments and free the disk.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import orjson

_MAGIC = b"RCC1"
_SLOT_HEAD = struct.Struct("<4sQII")  # magic, sequence, length, crc32 of the JSON
SLOT_BYTES = 64 << 10


@dataclass(slots=True)
class Pending:
    segment: str
    first: int  # offset of the batch's first record
    last: int  # offset of its last record
    end: int  # offset after it


@dataclass
class CursorState:
    offsets: dict[str, int] = field(default_factory=dict)  # segment → shipped up to
    done: set[str] = field(default_factory=set)  # sealed segments shipped to their end
    pending: Pending | None = None

    def encode(self) -> bytes:
        pending = self.pending
        return orjson.dumps(
            {
                "offsets": self.offsets,
                "done": sorted(self.done),
                "pending": None
                if pending is None
                else [pending.segment, pending.first, pending.last, pending.end],
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> CursorState:
        raw = orjson.loads(data)
        pending = raw.get("pending")
        return cls(
            offsets={str(k): int(v) for k, v in raw.get("offsets", {}).items()},
            done=set(raw.get("done", [])),
            pending=Pending(str(pending[0]), *map(int, pending[1:])) if pending else None,
        )


class CursorFile:
    def __init__(self, path: Path, slot_bytes: int = SLOT_BYTES) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._slot_bytes = slot_bytes
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        size = os.fstat(self._fd).st_size
        if size < 2 * slot_bytes:
            os.posix_fallocate(self._fd, 0, 2 * slot_bytes)
            os.fsync(self._fd)
        else:
            self._slot_bytes = size // 2  # grown earlier (see _grow)
        self._seq = 0
        self._next_slot = 0

    def load(self) -> CursorState:
        best: tuple[int, int, bytes] | None = None
        for slot in (0, 1):
            raw = os.pread(self._fd, self._slot_bytes, slot * self._slot_bytes)
            if len(raw) < _SLOT_HEAD.size:
                continue
            magic, seq, length, crc = _SLOT_HEAD.unpack_from(raw)
            data = raw[_SLOT_HEAD.size : _SLOT_HEAD.size + length]
            if magic != _MAGIC or len(data) != length or zlib.crc32(data) != crc:
                continue
            if best is None or seq > best[0]:
                best = (seq, slot, data)
        if best is None:
            return CursorState()
        self._seq, slot, data = best
        self._next_slot = 1 - slot
        return CursorState.decode(data)

    def save(self, state: CursorState, *, sync: bool) -> None:
        data = state.encode()
        if _SLOT_HEAD.size + len(data) > self._slot_bytes:
            self._grow(_SLOT_HEAD.size + len(data))
        self._seq += 1
        record = _SLOT_HEAD.pack(_MAGIC, self._seq, len(data), zlib.crc32(data)) + data
        os.pwrite(self._fd, record, self._next_slot * self._slot_bytes)
        if sync:
            os.fdatasync(self._fd)
        self._next_slot = 1 - self._next_slot

    def _grow(self, need: int) -> None:
        """More segments than a slot holds (a sink down for a very long time): bigger slots. The
        current state is written into the new layout before the old one is given up."""
        size = self._slot_bytes
        while size < need:
            size *= 2
        current = self.load()
        os.posix_fallocate(self._fd, 0, 2 * size)
        self._slot_bytes = size
        self._next_slot = 1  # beyond the old layout: the old slots stay intact until this is written
        self.save(current, sync=True)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
