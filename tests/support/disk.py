"""A disk that fills up, at the system call the WAL makes: `os.writev` with `room` bytes left.

A write gets as many bytes as there is room for — a short write, as the kernel gives on a nearly
full filesystem — and a write when there is none fails with ENOSPC. The bytes that are written
are real bytes in the real file (the reader, the ftruncate that cuts a torn record, the restart
all see the file as it is); only the room is counted here. Deterministic, unlike filling a tmpfs.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import pytest


class FillingDisk:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, room: int | None = None) -> None:
        self.room = room  # bytes left; None: no limit
        self.short_writes = 0  # writes that got part of their bytes
        self.failed_writes = 0  # writes that got none (ENOSPC)
        self._real = os.writev
        monkeypatch.setattr(os, "writev", self._writev)

    def fill(self, room: int = 0) -> None:
        self.room = room

    def free(self) -> None:
        self.room = None

    def _writev(self, fd: int, buffers: Sequence[bytes]) -> int:
        if self.room is None:
            return self._real(fd, buffers)
        size = sum(map(len, buffers))
        if size <= self.room:
            written = self._real(fd, buffers)
            self.room -= written
            return written
        if self.room == 0:
            self.failed_writes += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = os.write(fd, b"".join(buffers)[: self.room])
        self.room -= written
        self.short_writes += 1
        return written
