"""Shutdown says what it does (issue 25, item 11): one line when draining starts, one when the
span shipper is done with what is left in the WAL — and a SIGTERM to the whole process group
(what `timeout` and systemd send) is a shutdown, not a shipper crash to restart."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai

from tests.conftest import REPO, free_port


def start(tmp_path: Path, upstream_url: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    config = tmp_path / "runcap.toml"
    config.write_text(f'log_requests = false\n[upstreams.openai]\nurl = "{upstream_url}"\n')
    port, log = free_port(), tmp_path / "runcap.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}",
         "--data-dir", str(tmp_path / "data")],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"), start_new_session=True,  # its own process group, as under systemd
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    # the shipper is up when it says so
    while '"shipper started"' not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, port, log


def events(log: Path) -> list[dict[str, object]]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


async def test_sigterm_to_the_process_group_drains_and_says_so(upstream, tmp_path):  # type: ignore[no-untyped-def]
    upstream.scripts["hi"] = [{"text": "hello"}]
    proc, port, log = start(tmp_path, upstream.url)
    try:
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k")
        for i in range(3):
            await c.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Run-Id": f"sd-{i}", "X-Mock-Script": "hi"},
            )  # fmt: skip
        os.killpg(proc.pid, signal.SIGTERM)  # serve, its shipper: the whole group
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "exited with" not in text and "restarting" not in text, text
    names = [e["event"] for e in events(log)]
    assert names.count("draining") == 1, text
    (drained,) = [e for e in events(log) if e["event"] == "shipper drained"]
    assert names.index("draining") < names.index("shipper drained")
    assert (
        set(drained["unshipped_bytes"].values()) == {0}
        and "clickhouse" in drained["unshipped_bytes"]
        and isinstance(drained["wal_bytes"], int)
    )
