"""Shared fixtures: the scripted upstream and runcap itself, built in-process on free ports.

`runcap_factory(**config)` starts a runcap app whose `openai`, `anthropic` and `local`
upstreams all point at the scripted upstream, with its data under the test's tmp_path.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.app import RUNTIME, Runtime, build_app
from proxy.config import build_config
from proxy.ledger.base import Ledger
from proxy.scripted_upstream import ScriptedUpstream
from tests.support.processes import stop_process

REPO = Path(__file__).resolve().parent.parent
# Span path settings for tests: the shipper runs in the test process (on threads of its own),
# flushes and retries quickly; /metrics reads its statistics often.
FAST_SPANS = {"flush_interval_s": 0.05, "retry_initial_s": 0.05, "retry_max_s": 0.5, "stats_interval_s": 0.2}


_handed_out: set[int] = set()


def free_port() -> int:
    """A free port on 127.0.0.1, never one this test process handed out before: a port picked
    for a server started later must not be picked again for another meanwhile."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    up = ScriptedUpstream()
    await up.start()
    yield up
    await up.stop()


@dataclass
class Runcap:
    url: str
    runtime: Runtime
    runner: web.AppRunner

    @property
    def ledger(self) -> Ledger:
        return self.runtime.ledger

    @property
    def openai_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def admin(self) -> dict[str, str]:
        """Headers of an admin call (the token runcap generated, or the configured one)."""
        return {"Authorization": f"Bearer {self.runtime.config.admin_token}"}

    async def run(self, run_id: str) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(f"{self.url}/runs/{run_id}", headers=self.admin) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def runcap_config(upstream_url: str, data_dir: Path, extra: dict[str, Any] | None = None, env=None):  # type: ignore[no-untyped-def]
    raw: dict[str, Any] = {
        "upstreams": {
            "openai": {"url": upstream_url},
            "anthropic": {"url": upstream_url},
            "local": {"url": upstream_url},
        },
        "log_requests": False,
        # Most tests are about the proxy; the span tests turn tracing on (embedded chdb allows one
        # data directory per process at a time, so two traced apps cannot share a test process).
        "tracing": False,
    }
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return build_config(raw, env or {}, listen="127.0.0.1:0", data_dir=str(data_dir))


@pytest.fixture
async def runcap_factory(upstream: ScriptedUpstream, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    started: list[web.AppRunner] = []

    async def start(extra: dict[str, Any] | None = None, *, data_dir: Path | None = None, env=None) -> Runcap:  # type: ignore[no-untyped-def]
        assert upstream.url is not None
        config = runcap_config(upstream.url, data_dir or tmp_path / "data", extra, env)
        app = build_app(config, span_options=FAST_SPANS)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        started.append(runner)
        port = runner.addresses[0][1]
        return Runcap(f"http://127.0.0.1:{port}", app[RUNTIME], runner)

    yield start
    for runner in reversed(started):
        await runner.cleanup()


@pytest.fixture
async def runcap(runcap_factory: Callable[..., Any]) -> Runcap:
    return await runcap_factory()


# -- a runcap in its own process (kill -9 tests) ----------------------------------------------


class RuncapProcess:
    def __init__(self, config_path: Path, data_dir: Path) -> None:
        self.config_path = config_path
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.openai_url = f"{self.url}/v1"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--config", str(self.config_path),
             "--listen", f"127.0.0.1:{self.port}", "--data-dir", str(self.data_dir)],
            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.DEVNULL, stderr=open(self.data_dir.parent / "runcap.log", "ab"),
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.data_dir.parent / "runcap.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"runcap exited with {self.proc.returncode}:\n{log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("runcap did not start in 30 s")

    @property
    def admin(self) -> dict[str, str]:
        """Headers of an admin call: the token the server generated in its data directory."""
        from proxy.server.auth import read_admin_token

        return {"Authorization": f"Bearer {read_admin_token(self.data_dir)}"}

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc, grace_s=15)


def reconcile(*args: str) -> subprocess.CompletedProcess[str]:
    """`runcap reconcile ARGS` in its own process, as an operator runs it after a kill -9."""
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "reconcile", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- redis-server (tests/support/redis_server.py) ----------------------------------------------


@pytest.fixture(scope="session")
def redis_server():  # type: ignore[no-untyped-def]
    """One real redis-server for the session; tests isolate themselves by key prefix."""
    from tests.support.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster():  # type: ignore[no-untyped-def]
    """One real Redis Cluster for the session (3 masters, 1 replica each: 6 redis-server
    processes on loopback); tests isolate themselves by key prefix. A test that kills a node
    starts a cluster of its own."""
    from tests.support.redis_server import RedisClusterServers

    cluster = RedisClusterServers().start()
    yield cluster
    cluster.stop()


# -- skips: every one printed at the end; under CI a missing part fails (tests/support/parts.py) --


@pytest.hookimpl(tryfirst=True)
def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A test module that skipped itself at import (`pytest.importorskip`: its part is missing)
    is a failure under CI=true, where scripts/setup.sh must have installed the part."""
    from tests.support.parts import in_ci

    if report.skipped and in_ci():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"missing part under CI=true (scripts/setup.sh should provide it): {reason}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What the suite did not run, and why — a skip is never silent."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.section(f"{len(skipped)} skipped", sep="-")
    for rep in skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        terminalreporter.line(f"SKIPPED {rep.nodeid}: {reason}")


# Fixtures that live with their helpers in tests/support, offered to every test from here (a
# test module never imports a fixture from another test module).
from tests.support.ledgers import make_ledger  # noqa: E402, F401
from tests.support.mcp_agent import servers  # noqa: E402, F401
from tests.support.tool_service import stub, tool  # noqa: E402, F401
