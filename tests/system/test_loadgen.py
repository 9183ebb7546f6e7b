"""Quick self-test of the load generator against a local aiohttp server: counts and shape, not speed."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from bench.loadgen import Result, closed_loop, open_loop, percentile

SSE_BODY = b'data: {"n":1}\n\n' * 5 + b"data: [DONE]\n\n"
ROOT = Path(__file__).resolve().parents[2]


class Upstream:
    def __init__(self) -> None:
        self.seen = 0
        self.bodies: list[bytes] = []
        self.url = ""

    def app(self) -> web.Application:
        async def json_ok(request: web.Request) -> web.Response:
            self.seen += 1
            self.bodies.append(await request.read())
            return web.json_response({"ok": True})

        async def sse(request: web.Request) -> web.StreamResponse:
            self.seen += 1
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(0, len(SSE_BODY), 16):  # several chunks
                await resp.write(SSE_BODY[i : i + 16])
            await resp.write_eof()
            return resp

        async def fail(request: web.Request) -> web.Response:
            self.seen += 1
            return web.Response(status=500 if self.seen % 2 else 402)

        async def slow(request: web.Request) -> web.Response:
            self.seen += 1
            await asyncio.sleep(0.5)
            return web.json_response({})

        async def needs_header(request: web.Request) -> web.Response:
            self.seen += 1
            ok = request.headers.get("X-Run-Id") == "r1" and request.content_type == "application/json"
            return web.json_response({}, status=200 if ok else 400)

        app = web.Application()
        app.router.add_post("/json", json_ok)
        app.router.add_post("/sse", sse)
        app.router.add_post("/fail", fail)
        app.router.add_post("/slow", slow)
        app.router.add_post("/hdr", needs_header)
        return app


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    runner = web.AppRunner(up.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    up.url = f"http://{host}:{port}"
    yield up
    await runner.cleanup()


def test_percentile_is_exact_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile(samples, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([], 50)


async def test_open_loop_sends_rate_times_duration(upstream: Upstream) -> None:
    body = {"model": "m", "messages": []}
    r = await open_loop(upstream.url + "/json", body, None, rate=50, duration_s=1.0)
    assert (r.mode, r.scheduled, r.sent, r.count, r.ok, r.errors, r.dropped) == (
        "open",
        50,
        50,
        50,
        50,
        {},
        0,
    )
    assert upstream.seen == 50
    assert all(orjson.loads(b) == body for b in upstream.bodies)
    lat = r.latency_ms
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert r.ttfb_ms is None
    assert r.achieved_rate > 0 and r.duration_s >= 0.98  # the last request is due at t0 + 0.98 s


async def test_open_loop_stream_reads_whole_body(upstream: Upstream) -> None:
    r = await open_loop(upstream.url + "/sse", {}, None, rate=40, duration_s=0.5, stream=True)
    assert (r.count, r.ok, r.errors) == (20, 20, {})
    assert r.bytes_received == 20 * len(SSE_BODY)
    assert r.ttfb_ms is not None
    assert 0 < r.ttfb_ms["p50"] <= r.ttfb_ms["p99"] <= r.ttfb_ms["max"] <= r.latency_ms["max"]


async def test_custom_headers_are_sent(upstream: Upstream) -> None:
    r = await open_loop(upstream.url + "/hdr", {}, {"X-Run-Id": "r1"}, rate=50, duration_s=0.2)
    assert (r.count, r.ok, r.errors) == (10, 10, {})
    r = await open_loop(upstream.url + "/hdr", {}, None, rate=50, duration_s=0.2)
    assert (r.count, r.ok, r.errors) == (10, 0, {"400": 10})


async def test_errors_by_status(upstream: Upstream) -> None:
    r = await closed_loop(
        upstream.url + "/fail", {}, None, concurrency=2, duration_s=5, max_requests=10, warmup=0
    )
    assert (r.sent, r.count, r.ok) == (10, 10, 0)
    assert r.errors == {"402": 5, "500": 5}
    assert len(r.latency_ms) == 5  # responses with an error status still have a latency


async def test_open_loop_drops_beyond_max_outstanding(upstream: Upstream) -> None:
    # 20 due over 0.4 s, each taking 0.5 s: only the first 5 fit under max_outstanding=5.
    r = await open_loop(upstream.url + "/slow", {}, None, rate=50, duration_s=0.4, max_outstanding=5)
    assert (r.scheduled, r.sent, r.dropped, r.count, r.ok) == (20, 5, 15, 5, 5)
    assert r.errors == {"dropped": 15}


async def test_timeouts_and_refused_connections_are_counted(upstream: Upstream) -> None:
    r = await open_loop(upstream.url + "/slow", {}, None, rate=20, duration_s=0.1, timeout_s=0.1)
    assert (r.sent, r.count, r.errors) == (2, 0, {"timeout": 2})
    assert r.latency_ms == {}
    r = await open_loop("http://127.0.0.1:9/x", {}, None, rate=20, duration_s=0.1)
    assert r.count == 0 and r.errors == {"ClientConnectorError": 2}


async def test_closed_loop_runs_for_duration(upstream: Upstream) -> None:
    r = await closed_loop(upstream.url + "/json", {"a": 1}, None, concurrency=4, duration_s=0.3)
    assert r.mode == "closed" and r.concurrency == 4
    assert r.count == r.sent == r.ok > 0 and r.errors == {}
    assert upstream.seen == r.count + 4  # plus one warm-up request per connection
    assert r.latency_ms["p50"] <= r.latency_ms["max"]


async def test_cli_prints_result_json(upstream: Upstream) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.loadgen", "--url", upstream.url + "/hdr", "--rate", "40",
        "--duration", "0.25", "-H", "X-Run-Id: r1", "--body", '{"model": "m"}',
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 0, err.decode()
    r = Result.from_dict(orjson.loads(out))
    assert (r.mode, r.count, r.ok, r.errors) == ("open", 10, 10, {})
