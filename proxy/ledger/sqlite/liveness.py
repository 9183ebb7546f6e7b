"""Liveness of the SQLite ledger's owners: one lock file per process, under `ledger-owners/` next
to the ledger file.

Reservations and in-flight tool calls are rows owned by the process that made them. Each process
holds an exclusive `flock` on its own owner file for as long as it lives (the kernel drops it when
the process dies, however it dies); an owner whose file can be locked by someone else is dead, and
recovery.py settles what it left.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO


class OwnerFiles:
    """The owner files of one ledger file, and this process's own (locked while it lives)."""

    def __init__(self, directory: Path, owner: str) -> None:
        self.directory = directory
        self.directory.mkdir(exist_ok=True)
        self.owner = owner
        self.own_file: IO[str] = open(self.path(owner), "w")
        fcntl.flock(self.own_file, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def path(self, owner: str) -> Path:
        return self.directory / f"{owner}.lock"

    def alive(self, owner: str) -> bool:
        if owner == self.owner:
            return True
        try:
            fd = os.open(self.path(owner), os.O_RDWR)
        except FileNotFoundError:
            return False  # removed by a recovery (or a clean shutdown with nothing in flight)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also releases the lock we may have taken
        return False

    @contextlib.contextmanager
    def holding_dead(self, owner: str) -> Iterator[bool]:
        """Lock a dead owner's file while its rows are settled; yields False (and holds nothing)
        when its process still holds it. The file is removed afterwards: the owner is settled."""
        path = self.path(owner)
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            yield False
            return
        try:
            yield True
        finally:
            f.close()
            path.unlink(missing_ok=True)

    def release(self, *, leftovers: bool) -> None:
        """This process's file, at close: unlocked, and removed unless it leaves rows behind (then
        the next process sees an unlocked owner file and recovers them)."""
        self.own_file.close()
        if not leftovers:
            self.path(self.owner).unlink(missing_ok=True)
