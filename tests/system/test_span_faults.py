"""Nothing is lost when a store is down, and the request path never waits for one: ClickHouse
down then up, S3 down then up, runcap killed with spans in its WAL, a sink that hangs, OTLP."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import openai
import pytest

from tests.conftest import RuncapProcess, free_port
from tests.support.clickhouse import COUNT, ClickHouseProcess, chat_run, counts, sql, wait_counts, wait_rows  # noqa: F401
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.s3 import CREDENTIALS, S3Server

EXPECTED = {"model": 2, "tool_call": 1, "tool_result": 1}  # one chat_run


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_clickhouse_down_for_the_whole_run_then_up(runcap_factory, upstream, tmp_path):  # type: ignore[no-untyped-def]
    ch = ClickHouseProcess(tmp_path / "ch")  # not started: the endpoint refuses connections
    rc = await runcap_factory({"tracing": True, "clickhouse_url": ch.url})
    try:
        for i in range(3):  # the agent's requests keep succeeding
            await chat_run(rc, upstream, f"down-{i}", stream=bool(i % 2))
        for _ in range(200):
            if await metric(rc.url, 'runcap_sink_errors_total{sink="clickhouse"}') > 0:
                break
            await asyncio.sleep(0.05)
        assert await metric(rc.url, 'runcap_wal_unshipped_bytes{sink="clickhouse"}') > 0
        assert await metric(rc.url, 'runcap_wal_oldest_unshipped_age_seconds{sink="clickhouse"}') > 0
        assert await metric(rc.url, 'runcap_sink_errors_total{sink="clickhouse"}') > 0
        ch.start()
        got = await wait_counts(rc, {k: 3 * v for k, v in EXPECTED.items()})
        assert got == {k: 3 * v for k, v in EXPECTED.items()}  # every span, exactly once
        runs = await sql(rc, "SELECT count(DISTINCT run_id) AS n FROM runcap.runs")
        assert runs == [{"n": 3}]
    finally:
        await rc.runner.cleanup()
        ch.stop()


async def test_s3_down_payloads_wait_in_the_wal_then_delivered(runcap_factory, upstream, monkeypatch):  # type: ignore[no-untyped-def]
    s3 = S3Server()
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    s3.start()
    # Moto's state lives in this test process, shared by every moto server it started: a bucket
    # of this test's own, so no other test's bodies are in it.
    s3.client().create_bucket(Bucket="payloads-s3-down")
    s3.stop()  # down for the run
    rc = await runcap_factory({"tracing": True, "s3_url": "s3://payloads-s3-down/runcap/"})
    try:
        await chat_run(rc, upstream, "s3-down", stream=False)
        rows = await wait_rows(
            rc, "SELECT request_hash, response_hash FROM runcap.spans WHERE kind = 'model'", 2
        )
        hashes = {h for r in rows for h in (r["request_hash"], r["response_hash"])}
        assert len(hashes) == 4
        for _ in range(200):
            if await metric(rc.url, 'runcap_sink_errors_total{sink="payloads"}') >= 1:
                break
            await asyncio.sleep(0.05)
        assert await metric(rc.url, 'runcap_wal_unshipped_bytes{sink="payloads"}') >= 1
        s3.start()
        client = s3.client()
        deadline = time.monotonic() + 20
        keys: set[str] = set()
        while time.monotonic() < deadline and len(keys) < 4:
            listed = client.list_objects_v2(Bucket="payloads-s3-down", Prefix="runcap/sha256/")
            keys = {o["Key"] for o in listed.get("Contents", [])}
            await asyncio.sleep(0.2)
        assert keys == {f"runcap/sha256/{h[:2]}/{h}" for h in hashes}
        store = rc.runtime.spans.payloads
        import hashlib

        for h in hashes:
            assert hashlib.sha256(store.get(h)).hexdigest() == h
    finally:
        await rc.runner.cleanup()
        s3.stop()


async def test_kill9_with_spans_in_the_wal_then_restart(upstream, tmp_path):  # type: ignore[no-untyped-def]
    ch = ClickHouseProcess(tmp_path / "ch")  # down
    config = tmp_path / "runcap.toml"
    config.write_text(
        f'log_requests = false\nclickhouse_url = "{ch.url}"\n[upstreams.openai]\nurl = "{upstream.url}"\n'
    )
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        await chat_run(proc, upstream, "k9-a", stream=False)
        await chat_run(proc, upstream, "k9-b", stream=True)
        for _ in range(200):  # the shipper has tried (and failed) to ship them
            if await metric(proc.url, 'runcap_sink_errors_total{sink="clickhouse"}') >= 1:
                break
            await asyncio.sleep(0.05)
        assert await metric(proc.url, 'runcap_wal_unshipped_bytes{sink="clickhouse"}') > 0
        assert await metric(proc.url, "runcap_wal_appended_records_total") == 4  # one record per step
        proc.kill9()  # the shipper goes with it
        ch.start()
        proc.start()  # same data dir: a new shipper ships the WAL
        got = await wait_counts(proc, {k: 2 * v for k, v in EXPECTED.items()})
        assert got == {k: 2 * v for k, v in EXPECTED.items()}
    finally:
        proc.stop()
        ch.stop()


async def test_graceful_shutdown_drains_the_queue(upstream, tmp_path):  # type: ignore[no-untyped-def]
    config = tmp_path / "runcap.toml"
    config.write_text(f'log_requests = false\n[upstreams.openai]\nurl = "{upstream.url}"\n')
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        await chat_run(proc, upstream, "drain", stream=False)
        proc.stop()  # SIGTERM right away: the spans are still in memory
        proc.start()
        got = await wait_counts(proc, EXPECTED, timeout=10)
        assert got == EXPECTED
    finally:
        proc.stop()


async def test_hanging_sink_does_not_slow_requests(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    """A ClickHouse that accepts connections and never answers: once the shipper is stuck on it,
    40 calls are all answered. No timing threshold (bench/span_bench.py measures the cost); a
    hot path that waited on the sink would hang here, which the hang guard turns into a failure."""
    port = free_port()
    tarpit = socket.socket()
    tarpit.bind(("127.0.0.1", port))
    tarpit.listen(100)
    held: list[socket.socket] = []

    async def accept_forever() -> None:
        loop = asyncio.get_running_loop()
        tarpit.setblocking(False)
        while True:
            conn, _ = await loop.sock_accept(tarpit)
            held.append(conn)

    task = asyncio.create_task(accept_forever())
    rc = await runcap_factory({"tracing": True, "clickhouse_url": f"http://default:@127.0.0.1:{port}/runcap"})
    try:
        c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0, timeout=60)

        async def step(i: int) -> str:
            r = await c.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "x"}],
                extra_headers={"X-Run-Id": f"h{i}"},
            )
            return r.choices[0].message.content or ""

        assert await step(-1)
        # The readiness signal: the shipper has connected to the tarpit and waits on it.
        for _ in range(500):
            if held:
                break
            await asyncio.sleep(0.02)
        assert held, "the shipper never reached the hanging sink"
        answers = await asyncio.wait_for(asyncio.gather(*(step(i) for i in range(40))), 60)  # hang guard
        assert len(answers) == 40 and all(answers)
        assert held and not task.done()  # the sink was still hanging throughout
    finally:
        await rc.runner.cleanup()
        task.cancel()
        for conn in held:
            conn.close()
        tarpit.close()


async def test_otlp_export(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    receiver = OTLPReceiver().start()
    rc = await runcap_factory({"tracing": True, "otlp_endpoint": receiver.endpoint})
    try:
        await chat_run(rc, upstream, "otlp-run", stream=False)
        spans = await asyncio.to_thread(receiver.wait_for, 4, 20)
        by_name = {s.name: s for s in spans}
        chat = by_name["chat gpt-4o-mini"]
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.provider.name"] == "openai"
        assert chat.attributes["gen_ai.request.model"] == "gpt-4o-mini"
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0
        assert chat.attributes["runcap.run_id"] == "otlp-run"
        tool = by_name["execute_tool refund"]
        assert tool.attributes["gen_ai.tool.name"] == "refund"
        assert tool.attributes["gen_ai.tool.call.id"]
        assert len({s.trace_id for s in spans}) == 1
        # The same ids as in ClickHouse (the run's invoke_agent span is OTLP's own:
        # tests/app/test_otlp_genai.py).
        steps = {s.span_id for s in spans if s.attributes["gen_ai.operation.name"] != "invoke_agent"}
        rows = await wait_rows(rc, "SELECT span_id FROM runcap.spans WHERE run_id = 'otlp-run'", 4)
        assert {r["span_id"] for r in rows} == steps
    finally:
        await rc.runner.cleanup()
        receiver.stop()


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch):  # type: ignore[no-untyped-def]
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
