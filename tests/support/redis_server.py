"""A real redis-server (Debian's package) on a free 127.0.0.1 port with a temporary directory.

Tests run it without persistence (`--save "" --appendonly no`) unless they ask for it
(`persistent=True`: AOF, `appendfsync everysec`, as production should run it). Fault tests stop it
(`terminate`: SIGTERM, a clean shutdown), kill it (`kill9`), freeze it (`freeze`/`thaw`: SIGSTOP /
SIGCONT) and `start` it again on the same port and directory, reloading what it persisted.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.processes import stop_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, *, persistent: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed (scripts/setup.sh installs it: apt-get install redis-server)"
            )
        self.binary = binary
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="runcap-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.persistent = persistent
        self.frozen = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or start again: same port, same directory, persisted data reloaded)."""
        aof = ["--appendonly", "no"]
        if self.persistent:
            aof = ["--appendonly", "yes", "--appendfsync", "everysec"]
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", *aof, "--protected-mode", "yes", "--daemonize", "no",
             "--loglevel", "warning"],
            stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start within 10 s")

    def terminate(self) -> None:
        """SIGTERM: Redis persists what it holds and exits; clients are cut."""
        self.thaw()
        stop_process(self.proc)

    def kill9(self) -> None:
        """SIGKILL: gone at once; only what reached the AOF survives."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self.frozen = False

    def freeze(self) -> None:
        """SIGSTOP: connections stay open (and new ones are accepted by the kernel), nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        """Stop for good and delete the directory."""
        self.thaw()
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


async def wait_subscribed(url: str, channel: str, subscribers: int, timeout: float = 5.0) -> None:
    """Until `channel` has at least `subscribers` (PUBSUB NUMSUB): the readiness signal of a
    pub/sub listener, instead of a sleep that hopes it subscribed."""
    import asyncio

    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            counts = dict(await client.pubsub_numsub(channel))
            have = counts.get(channel.encode(), 0)
            if have >= subscribers:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{channel}: {have} of {subscribers} subscribers after {timeout} s")
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()
