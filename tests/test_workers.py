"""`serve --workers N`: N processes share the port, the ledger and the span store; each spools
to its own directory."""

from __future__ import annotations

import asyncio
import re

import openai

from tests.conftest import RuncapProcess
from tests.test_span_faults import wait_counts
from tests.test_spans import ClickHouseProcess


async def test_two_workers_share_port_ledger_and_span_store(upstream, tmp_path):  # type: ignore[no-untyped-def]
    ch = ClickHouseProcess(tmp_path / "ch")
    ch.start()
    config = tmp_path / "runcap.toml"
    config.write_text(
        f'log_requests = false\nworkers = 2\nclickhouse_url = "{ch.url}"\n'
        f'[upstreams.openai]\nurl = "{upstream.url}"\n'
    )
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()  # returns once one worker listens: wait for the other too
    log_path = tmp_path / "runcap.log"
    for _ in range(300):
        if len(set(re.findall(r'"event": "listening".*?"pid": (\d+)', log_path.read_text()))) == 2:
            break
        await asyncio.sleep(0.1)
    try:
        c = openai.AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="k", max_retries=0)
        h = {"X-Run-Id": "two-workers", "X-Run-Max-Steps": "30"}

        async def one() -> None:
            # A client of its own per call: new connections spread over the workers.
            async with openai.AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="k", max_retries=0) as own:
                await own.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], extra_headers=h
                )

        await asyncio.gather(*(one() for _ in range(24)))
        await c.close()
        got = await wait_counts(proc, {"model": 24})
        assert got == {"model": 24}
        async with openai.AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="k") as c2:
            raw = await c2.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], extra_headers=h
            )
        assert raw.headers["x-run-step"] == "25"  # one ledger: steps counted across both workers
    finally:
        proc.stop()
        ch.stop()
    log = (tmp_path / "runcap.log").read_text()
    pids = set(re.findall(r'"event": "listening".*?"pid": (\d+)', log))
    assert len(pids) == 2, log[-2000:]
    assert "is in use" not in log and "Traceback" not in log, log[-3000:]
    spools = sorted(p.name for p in (tmp_path / "data" / "spool").iterdir() if p.is_dir())
    assert spools == ["worker-0", "worker-1"]
