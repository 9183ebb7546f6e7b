"""Readiness covers the span shipper, and the read commands wait for a starting one (issue 25,
item 9): right after `runcap serve` starts, /readyz is 503 until the shipper answers, and
`runcap runs` waits briefly instead of failing with "the span shipper does not answer"."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.conftest import REPO, free_port


def start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    config = tmp_path / "runcap.toml"
    config.write_text('log_requests = false\n[upstreams.openai]\nurl = "http://127.0.0.1:9"\n')
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}",
         "--data-dir", str(tmp_path / "data")],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "runcap.log", "wb"),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "runcap.log").read_text()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            time.sleep(0.02)
    raise AssertionError("runcap did not listen in 30 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


async def test_readyz_waits_for_the_shipper(tmp_path: Path) -> None:
    proc, port = start(tmp_path)
    try:
        answers = []
        async with aiohttp.ClientSession() as s:
            for _ in range(600):  # at most 30 s
                async with s.get(f"http://127.0.0.1:{port}/readyz") as r:
                    answers.append((r.status, await r.json()))
                if r.status == 200:
                    break
                time.sleep(0.05)
        status, body = answers[-1]
        assert status == 200 and body["shipper"] == "ready", answers[-3:]
        assert all(b.get("shipper") == "unavailable" for st, b in answers[:-1] if st == 503), answers
        # ready means the read commands work at once
        done = runs_json(tmp_path)
        assert done.returncode == 0, done.stderr
    finally:
        stop(proc)


def runs_json(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`runcap runs --json` on the test's data directory, as an operator types it."""
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "runs", "--json", "--data-dir", str(tmp_path / "data"),
         "--config", str(tmp_path / "runcap.toml")],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_read_command_right_after_start_waits_for_the_shipper(tmp_path: Path) -> None:
    proc, _ = start(tmp_path)
    try:
        done = runs_json(tmp_path)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == []
    finally:
        stop(proc)
