"""`serve --workers 2`: `/metrics` is one coherent exposition whichever worker takes the scrape —
every worker's series (labelled `worker`) and the shipper's once — so Prometheus never sees a
counter go backwards (proxy/server/worker_metrics.py)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RuncapProcess

MONOTONE_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and labels (parsed by prometheus_client's
    own parser: the text must be valid exposition format, each family once)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    names: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        names[family.name] += 1
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"sample {key} twice in one exposition"
            out[key] = s.value
    assert not [n for n, k in names.items() if k > 1], f"families given twice: {names}"
    return out


async def scrape(url: str) -> str:
    # A fresh connection each time: the kernel spreads them over the workers.
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        s.get(f"{url}/metrics") as r,
    ):
        assert r.status == 200
        return await r.text()


async def start_two_workers(tmp_path: Path, upstream_url: str) -> RuncapProcess:
    config = tmp_path / "runcap.toml"
    config.write_text(f'log_requests = false\nworkers = 2\n[upstreams.openai]\nurl = "{upstream_url}"\n')
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()  # returns once one worker listens: wait for both, and for their metric sockets
    log_path = tmp_path / "runcap.log"
    for _ in range(300):
        listening = set(re.findall(r'"event": "listening".*?"pid": (\d+)', log_path.read_text()))
        sockets = list((tmp_path / "data").glob("worker-*.metrics.sock"))
        if len(listening) == 2 and len(sockets) == 2:
            return proc
        await asyncio.sleep(0.1)
    proc.stop()
    raise AssertionError(f"two workers did not start:\n{log_path.read_text()[-2000:]}")


async def test_two_workers_answer_one_exposition_and_counters_never_go_back(upstream, tmp_path):  # type: ignore[no-untyped-def]
    proc = await start_two_workers(tmp_path, upstream.url)
    try:
        sent = 0
        previous: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for _ in range(10):
            for _ in range(3):  # a client of its own per call: spread over the workers
                async with openai.AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="k", max_retries=0) as c:
                    await c.chat.completions.create(
                        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}],
                        extra_headers={"X-Run-Id": "metrics-run", "X-Run-Max-Steps": "100"},
                    )  # fmt: skip
                sent += 1
            now = samples(await scrape(proc.url))
            # every worker's requests, each counted once: the sum is what was sent
            requests = {k: v for k, v in now.items() if k[0] == "runcap_requests_total"}
            assert sum(requests.values()) == sent, requests
            assert {dict(k[1])["worker"] for k in requests} <= {"0", "1"}
            # the shipper's view once, without a worker label
            assert [k for k in now if k[0] == "runcap_shipper_up"] == [("runcap_shipper_up", ())]
            for key, value in now.items():
                if key[0].endswith(MONOTONE_SUFFIXES) and key in previous:
                    assert value >= previous[key], f"{key} went back from {previous[key]} to {value}"
            # a series once seen stays (both workers answer every scrape)
            gone = [k for k in previous if k[0].endswith(MONOTONE_SUFFIXES) and k not in now]
            assert not gone, gone
            up = {dict(k[1])["worker"]: v for k, v in now.items() if k[0] == "runcap_worker_up"}
            assert up == {"0": 1.0, "1": 1.0}, up
            previous = now
        # both workers took calls (else the test proves nothing about merging)
        per_worker = Counter()
        for k, v in previous.items():
            if k[0] == "runcap_requests_total":
                per_worker[dict(k[1])["worker"]] += v
        assert set(per_worker) == {"0", "1"}, per_worker
    finally:
        proc.stop()
    assert not list((tmp_path / "data").glob("worker-*.metrics.sock"))  # removed on shutdown
