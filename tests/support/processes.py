"""Stopping the servers tests start as subprocesses."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0) -> None:
    """SIGTERM (a graceful shutdown: runcap drains its spans), then SIGKILL after `grace_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
