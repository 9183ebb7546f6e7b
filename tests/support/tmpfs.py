"""A small real filesystem that fills up: a tmpfs of `size`, mounted for a test (root only) and
unmounted afterwards whatever happened — how the disk-full tests get a real ENOSPC."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.support.parts import missing


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        missing("mounting a tmpfs needs root")
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    done = subprocess.run(mount, capture_output=True)
    if done.returncode != 0:
        missing(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach it
