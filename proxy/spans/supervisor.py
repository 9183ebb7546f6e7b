"""The shipper as a process of its own, and the supervisor `runcap serve` runs it under.

`ShipperSupervisor` (a thread in `serve`'s first process) starts the shipper
(`run_shipper_process`, a spawned process), restarts it whenever it exits — with a short backoff;
the WAL waits, nothing is lost meanwhile — and on shutdown, once the proxy workers have stopped
appending, asks it to drain (SIGTERM) and waits for it.

The shipper dies with its parent (`PR_SET_PDEATHSIG`): after a `kill -9` of `serve`, no orphan
keeps the data directory's chdb and shipper lock; the next `serve` starts a fresh one.

Shutdown order: the proxy stops appending first, then the shipper drains. A SIGTERM to the whole
process group (what `timeout` and systemd send) reaches the shipper too; it takes only its
supervisor's SIGTERM as the order to drain (it reads who sent the signal), so it keeps shipping
while the workers finish their requests, and the supervisor does not take its exit for a crash.
Shutdown logs one line when draining starts (`serve`) and one when the shipper is done, with
what is left in the WAL.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import orjson

from proxy.config import SpanSettings

log = logging.getLogger("runcap.shipper")

PID_FILE = "shipper.pid"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send this process `sig` when its parent dies (Linux `PR_SET_PDEATHSIG`), so
    a `kill -9` of `serve` leaves no orphan holding the port, the WAL or the store's lock."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent check below still applies
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def run_shipper_process(
    config: SpanSettings, data_dir: Path, parent_pid: int, restarts: int, drain_timeout_s: float
) -> None:
    """The shipper process: ship until its supervisor's SIGTERM, then drain (bounded) and exit."""
    # Blocked before any thread exists (they inherit the mask): SIGTERM is taken only by
    # `_wait_for_stop`, which can tell who sent it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    die_with_parent(parent_pid)
    if config.shipper_nice:
        # Below the proxy: on a busy machine the request path gets the cores first, and the WAL
        # holds the difference until the shipper catches up (/metrics: the age of the oldest
        # unshipped record per sink).
        with contextlib.suppress(OSError):
            os.nice(config.shipper_nice)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # The lanes log a store's failures themselves, rate-limited, with the cause; the clients'
    # own line per failed attempt would repeat it every retry.
    for noisy in ("clickhouse_connect", "urllib3.connectionpool"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    # Ctrl-C reaches the whole process group: the supervisor stops the shipper after the proxy.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from proxy.spans.setup import open_shipper

    shipper = open_shipper(config, data_dir, restarts=restarts)
    with contextlib.suppress(OSError):
        (Path(data_dir) / PID_FILE).write_text(f"{os.getpid()}\n")
    shipper.start()
    log.info('{"event": "shipper started", "pid": %d, "restarts": %d}', os.getpid(), restarts)
    _wait_for_stop(parent_pid)
    shipper.stop(drain_timeout_s)
    try:
        stats = shipper.stats()
        left = {name: sink["unshipped_bytes"] for name, sink in stats["sinks"].items()}
        wal = stats["wal_bytes"]
    except Exception:  # the numbers are a courtesy: the WAL and cursors are the truth
        left, wal = {}, -1
    # What is left stays in the WAL and is shipped at the next start: nothing is lost.
    log.info(
        '{"event": "shipper drained", "pid": %d, "wal_bytes": %d, "unshipped_bytes": %s}',
        os.getpid(), wal, orjson.dumps(left).decode(),
    )  # fmt: skip


def _wait_for_stop(parent_pid: int) -> None:
    """Until the supervisor (`parent_pid`) sends SIGTERM. A SIGTERM from anyone else — the
    process group's, from systemd or `timeout` — is noted and waited out: the supervisor sends
    its own once the proxy has stopped appending (and this process dies with its parent)."""
    noted = False
    while True:
        info = signal.sigtimedwait({signal.SIGTERM}, 1.0)
        if info is None:
            continue
        if info.si_pid in (parent_pid, 0) or os.getppid() != parent_pid:
            return
        if not noted:
            noted = True
            log.info(
                '{"event": "shipper: SIGTERM from pid %d; shipping until runcap has drained its requests"}',
                info.si_pid,
            )


@dataclass(eq=False)
class ShipperSupervisor:
    """Runs the shipper process and restarts it when it exits (see the module docstring)."""

    config: SpanSettings
    data_dir: Path
    _: KW_ONLY
    restart_delay_s: float = 0.5
    max_restart_delay_s: float = 10.0
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        self.restarts = 0
        self._stopping = threading.Event()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._thread = threading.Thread(target=self._run, name="runcap-shipper-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        delay = self.restart_delay_s
        while not self._stopping.is_set():
            started = time.monotonic()
            proc = ctx.Process(
                target=run_shipper_process,
                args=(self.config, self.data_dir, os.getpid(), self.restarts, self.drain_timeout_s),
                name="runcap-shipper",
                daemon=False,
            )
            proc.start()
            self._proc = proc
            if self._stopping.is_set():  # stop() came while it was starting
                os.kill(proc.pid, signal.SIGTERM) if proc.pid else None
            proc.join()
            if self._stopping.is_set():
                return
            if self._asked_to_stop(proc):
                return
            if time.monotonic() - started > 30:
                delay = self.restart_delay_s  # it ran a while: a fresh failure, not a crash loop
            log.error(
                "span shipper (pid %s) exited with %s; restarting in %.1f s (the WAL keeps the spans "
                "meanwhile)", proc.pid, proc.exitcode, delay,
            )  # fmt: skip
            self.restarts += 1
            if self._stopping.wait(delay):
                return
            delay = min(delay * 2, self.max_restart_delay_s)

    def _asked_to_stop(self, proc: multiprocessing.process.BaseProcess, grace_s: float = 5.0) -> bool:
        """The shipper exited on a SIGTERM (or drained and exited after one) that did not come
        from `stop()`: when `serve` got the same signal (a process group's), `stop()` follows
        within moments — no restart, no error. Else someone stopped the shipper alone: False."""
        if proc.exitcode not in (0, -signal.SIGTERM):
            return False
        return self._stopping.wait(grace_s)

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain and stop the shipper (call it after the proxy processes have exited)."""
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.is_alive() and proc.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            proc.join(timeout_s if timeout_s is not None else self.drain_timeout_s + 5.0)
            if proc.is_alive():
                log.error("span shipper did not stop in time; killed (what it did not ship stays in the WAL)")
                proc.kill()
                proc.join(5.0)
        self._thread.join(5.0)
