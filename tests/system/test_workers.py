"""`serve --workers N`: N processes share the port and the ledger; each appends to WAL segments of
its own, and one shipper ships them all into one span store — a ClickHouse server, or embedded
chdb (which only the shipper opens), readable with `runcap query` while serving."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import aiohttp
import openai
import pytest

from tests.conftest import REPO, RuncapProcess
from tests.support.clickhouse import ClickHouseProcess, wait_counts


async def appended_per_worker(url: str, total: int) -> dict[str, int]:
    """Each worker's `runcap_wal_appended_records_total{writer}`, scraped on fresh connections
    (spread over the workers) until the values seen add up to `total`."""
    seen: dict[str, int] = {}
    for _ in range(200):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
        # any worker answers for all of them (proxy/server/worker_metrics.py)
        line = r'^runcap_wal_appended_records_total\{[^}]*\bwriter="(\d+)"[^}]*\} (\S+)$'
        matches = re.findall(line, text, re.M)
        assert matches
        for writer, value in matches:
            seen[writer] = int(float(value))
        if sum(seen.values()) == total:
            break
    return seen


def cli(*args: str) -> list[dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNCAP_")}
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args, "--json"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("store", ["server", "embedded"])
async def test_two_workers_share_port_ledger_and_span_store(upstream, tmp_path, store):  # type: ignore[no-untyped-def]
    ch = None
    config = tmp_path / "runcap.toml"
    text = f'log_requests = false\nworkers = 2\n[upstreams.openai]\nurl = "{upstream.url}"\n'
    if store == "server":
        ch = ClickHouseProcess(tmp_path / "ch")
        ch.start()
        text = f'clickhouse_url = "{ch.url}"\n' + text
    config.write_text(text)
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()  # returns once one worker listens: wait for the other too
    log_path = tmp_path / "runcap.log"
    for _ in range(300):
        if len(set(re.findall(r'"event": "listening".*?"pid": (\d+)', log_path.read_text()))) == 2:
            break
        await asyncio.sleep(0.1)
    try:
        h = {"X-Run-Id": "two-workers", "X-Run-Max-Steps": "30"}

        async def one() -> None:
            # A client of its own per call: new connections spread over the workers.
            async with openai.AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="k", max_retries=0) as own:
                await own.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], extra_headers=h
                )

        await asyncio.gather(*(one() for _ in range(24)))
        # both workers appended; one shipper put everything in one store
        per_worker = await appended_per_worker(proc.url, 24)
        assert sorted(per_worker) == ["0", "1"] and all(per_worker.values()), per_worker
        got = await wait_counts(proc, {"model": 24})
        assert got == {"model": 24}
        async with openai.AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="k") as c2:
            raw = await c2.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], extra_headers=h
            )
        assert raw.headers["x-run-step"] == "25"  # one ledger: steps counted across both workers
        if store == "embedded":
            # the read CLI while serving: through the shipper's socket, which owns chdb
            data = str(tmp_path / "data")
            await wait_counts(proc, {"model": 25})
            runs = cli("runs", "--data-dir", data)
            assert [(r["run_id"], r["steps"]) for r in runs] == [("two-workers", 25)]
            cost = cli("query", "run_cost", "--data-dir", data, "--param", "run_id=two-workers")
            assert cost and cost[-1]["row"] == "run"
            assert cli("sql", "SELECT count() AS n FROM runcap.spans", "--data-dir", data) == [{"n": 25}]
    finally:
        proc.stop()
        if ch is not None:
            ch.stop()
    log = (tmp_path / "runcap.log").read_text()
    pids = set(re.findall(r'"event": "listening".*?"pid": (\d+)', log))
    assert len(pids) == 2, log[-2000:]
    assert "is in use" not in log and "Traceback" not in log, log[-3000:]
    assert len(re.findall(r'"event": "shipper started"', log)) == 1  # one shipper for both
    slots = sorted(p.name for p in (tmp_path / "data" / "wal").glob(".w*.lock"))
    assert slots == [".w0.lock", ".w1.lock"]


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


async def test_kill9_of_serve_leaves_no_worker_or_shipper_behind(upstream, tmp_path):  # type: ignore[no-untyped-def]
    """After `kill -9` of `serve`, its workers drain and exit and its shipper dies: nothing keeps
    the port, the WAL slots or chdb's lock, and the next `serve` on the same port and data
    directory starts."""
    config = tmp_path / "runcap.toml"
    config.write_text(f'log_requests = false\nworkers = 2\n[upstreams.openai]\nurl = "{upstream.url}"\n')
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    log_path = tmp_path / "runcap.log"
    workers: set[int] = set()
    for _ in range(300):
        workers = {int(p) for p in re.findall(r'"event": "listening".*?"pid": (\d+)', log_path.read_text())}
        if len(workers) == 2 and (tmp_path / "data" / "shipper.pid").exists():
            break
        await asyncio.sleep(0.1)
    assert len(workers) == 2, log_path.read_text()[-2000:]
    shipper = int((tmp_path / "data" / "shipper.pid").read_text())
    # Below the workers (shipper_nice, default 10): under load the request path comes first.
    worker_nice = os.getpriority(os.PRIO_PROCESS, min(workers))
    assert os.getpriority(os.PRIO_PROCESS, shipper) == min(19, worker_nice + 10)
    proc.kill9()
    for _ in range(200):
        if not any(_alive(p) for p in (*workers, shipper)):
            break
        await asyncio.sleep(0.1)
    assert not [p for p in (*workers, shipper) if _alive(p)], log_path.read_text()[-2000:]
    again = RuncapProcess(config, tmp_path / "data")
    again.port, again.url = proc.port, proc.url  # the same port: nothing holds it any more
    again.start()
    try:
        async with openai.AsyncOpenAI(base_url=f"{again.url}/v1", api_key="k", max_retries=0) as c:
            await c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}])
    finally:
        again.stop()
