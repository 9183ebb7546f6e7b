"""Open- and closed-loop HTTP load generator for runcap's benchmarks.

The benchmarks compare a scripted upstream called directly with the same upstream called through
runcap. Both servers run in their own processes; run this generator in a third one (the CLI, or
`run_subprocess()`), so that on a 2-core machine it competes for CPU as a separate process rather
than sharing an event loop with anything it measures.

* Open loop (`open_loop`): request i is due at t0 + i/rate whether or not earlier ones finished,
  and its latency is measured from that *scheduled* time, so queueing anywhere — in the server or
  in this generator — shows up in the latency instead of silently lowering the rate
  ("coordinated omission"). A request due while `max_outstanding` are in flight is not sent and
  is counted as `dropped`.
* Closed loop (`closed_loop`): `concurrency` workers each send the next request as soon as the
  previous one completes, for `duration_s`: the maximum throughput at that concurrency.

Both are bounded: a fixed number of scheduled requests (open) or a deadline (closed), a per-request
timeout, and a drain timeout after the last send. Latency percentiles are exact (nearest rank over
the sorted samples) and cover every request that got an HTTP response, whatever its status;
`errors` counts non-2xx statuses and transport failures by name.

CLI: `python -m bench.loadgen --url URL [--rate R | --concurrency C] --duration S [--stream]
[--body JSON | --body-file F] [-H 'Name: value' ...]` prints the Result as JSON.
`python -m bench.loadgen --selftest` measures the generator against a trivial aiohttp server
started in another process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

__all__ = ["Result", "closed_loop", "open_loop", "percentile", "run_subprocess"]

DEFAULT_BODY: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "ping"}],
}


@dataclass
class Result:
    mode: str  # "open" or "closed"
    url: str
    stream: bool
    target_rate: float | None  # open loop: requests per second asked for
    concurrency: int  # closed loop: workers; open loop: max outstanding
    scheduled: int  # open loop: requests due in the window; closed loop: requests sent
    sent: int
    dropped: int  # due while max_outstanding were in flight: not sent (open loop only)
    count: int  # requests that got an HTTP response (any status)
    ok: int  # ... with a 2xx status
    errors: dict[str, int]  # "500": n, "ClientConnectorError": n, "timeout": n, "dropped": n
    duration_s: float  # from the first scheduled send to the last completion
    achieved_rate: float  # responses per second over duration_s
    latency_ms: dict[str, float]  # p50, p90, p99, max, mean (empty when no responses)
    ttfb_ms: dict[str, float] | None  # p50, p99, max for streams: time to the first body bytes
    bytes_received: int = 0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Result:
        return cls(**dict(data))


def percentile(sorted_samples: list[float], p: float) -> float:
    """Exact nearest-rank percentile: the smallest sample with at least p% of samples <= it."""
    if not sorted_samples:
        raise ValueError("no samples")
    rank = max(1, math.ceil(p / 100 * len(sorted_samples)))
    return sorted_samples[rank - 1]


def _summary(samples_s: list[float], ps: tuple[float, ...]) -> dict[str, float]:
    if not samples_s:
        return {}
    ordered = sorted(samples_s)
    out = {f"p{p:g}": round(percentile(ordered, p) * 1000, 3) for p in ps}
    out["max"] = round(ordered[-1] * 1000, 3)
    out["mean"] = round(sum(ordered) / len(ordered) * 1000, 3)
    return out


class _Recorder:
    """Shared state of one run; every request records into it exactly once."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.ttfbs: list[float] = []
        self.errors: dict[str, int] = {}
        self.ok = 0
        self.sent = 0
        self.bytes = 0
        self.last_done = 0.0
        self.templated = False  # a header value holds `{n}`
        self.numbered = 0

    def error(self, name: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1


def _prepare(body: Any, headers: Mapping[str, str] | None) -> tuple[bytes, dict[str, str]]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json"}
    hdrs.update(headers or {})
    return data, hdrs


def _session(pool: int, timeout_s: float) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=pool, limit_per_host=0, ttl_dns_cache=None)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
    )


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    data: bytes,
    headers: dict[str, str],
    stream: bool,
    start: float,
    rec: _Recorder,
) -> None:
    """One request; latency from `start` (the scheduled time in open loop, the send in closed).
    A header value holding `{n}` gets the request's own number there (a run id per request)."""
    if rec.templated:
        rec.numbered += 1
        headers = {k: v.replace("{n}", str(rec.numbered)) for k, v in headers.items()}
    try:
        async with session.post(url, data=data, headers=headers) as resp:
            if stream:
                content = resp.content
                first = True
                while True:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    if first:
                        rec.ttfbs.append(time.perf_counter() - start)
                        first = False
                    rec.bytes += len(chunk)
            else:
                rec.bytes += len(await resp.read())
            status = resp.status
    except TimeoutError:
        rec.error("timeout")
        return
    except aiohttp.ClientError as exc:
        rec.error(type(exc).__name__)
        return
    except Exception as exc:  # anything else (OSError, a bad URL...) is still one counted failure
        rec.error(type(exc).__name__)
        return
    done = time.perf_counter()
    rec.latencies.append(done - start)
    rec.last_done = max(rec.last_done, done)
    if 200 <= status < 300:
        rec.ok += 1
    else:
        rec.error(str(status))


async def _warm(
    session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str], n: int
) -> None:
    """Open up to n pooled connections before measuring (their set-up is not what we measure)."""
    if n <= 0:
        return
    scratch = _Recorder()
    await asyncio.gather(
        *(_one(session, url, data, headers, False, time.perf_counter(), scratch) for _ in range(n))
    )


def _result(
    mode: str,
    url: str,
    stream: bool,
    rate: float | None,
    concurrency: int,
    scheduled: int,
    dropped: int,
    rec: _Recorder,
    t0: float,
    notes: list[str],
) -> Result:
    count = len(rec.latencies)
    duration = max((rec.last_done or time.perf_counter()) - t0, 1e-9)
    return Result(
        mode=mode,
        url=url,
        stream=stream,
        target_rate=rate,
        concurrency=concurrency,
        scheduled=scheduled,
        sent=rec.sent,
        dropped=dropped,
        count=count,
        ok=rec.ok,
        errors=dict(sorted(rec.errors.items())),
        duration_s=round(duration, 4),
        achieved_rate=round(count / duration, 2),
        latency_ms=_summary(rec.latencies, (50, 90, 99)),
        ttfb_ms=_summary(rec.ttfbs, (50, 99)) if stream else None,
        bytes_received=rec.bytes,
        notes=notes,
    )


async def open_loop(
    url: str,
    body: Any,
    headers: Mapping[str, str] | None,
    rate: float,
    duration_s: float,
    stream: bool = False,
    *,
    max_outstanding: int = 1024,
    timeout_s: float = 30.0,
    drain_s: float | None = None,
    warmup: int = 0,
) -> Result:
    """Send `round(rate * duration_s)` POSTs, request i due at t0 + i/rate; see the module doc."""
    if rate <= 0 or duration_s <= 0 or max_outstanding <= 0:
        raise ValueError("rate, duration_s and max_outstanding must be positive")
    data, hdrs = _prepare(body, headers)
    total = max(1, round(rate * duration_s))
    interval = 1.0 / rate
    rec = _Recorder()
    rec.templated = any("{n}" in v for v in hdrs.values())
    notes: list[str] = []
    dropped = 0
    max_late = 0.0
    async with _session(max_outstanding, timeout_s) as session:
        await _warm(session, url, data, hdrs, min(warmup, max_outstanding))
        pending: set[asyncio.Task[None]] = set()
        t0 = time.perf_counter()
        for i in range(total):
            due = t0 + i * interval
            delay = due - time.perf_counter()
            if delay > 0:
                # uvloop timers have 1 ms resolution: a send may go out up to ~1 ms early, and
                # its latency is then measured from the actual send (see `start` below).
                await asyncio.sleep(delay)
            else:
                max_late = max(max_late, -delay)
            if len(pending) >= max_outstanding:
                dropped += 1
                rec.error("dropped")
                continue
            rec.sent += 1
            start = max(due, time.perf_counter())  # late: from the schedule; early: from the send
            task = asyncio.create_task(_one(session, url, data, hdrs, stream, start, rec))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=timeout_s + 1 if drain_s is None else drain_s)
            for task in stuck:
                task.cancel()
                rec.error("timeout")
            if stuck:
                await asyncio.wait(stuck)
    if max_late > 0.01:
        notes.append(f"sender fell behind schedule by up to {max_late * 1000:.1f} ms")
    return _result("open", url, stream, rate, max_outstanding, total, dropped, rec, t0, notes)


async def closed_loop(
    url: str,
    body: Any,
    headers: Mapping[str, str] | None,
    concurrency: int,
    duration_s: float,
    stream: bool = False,
    *,
    timeout_s: float = 30.0,
    max_requests: int | None = None,
    warmup: int | None = None,
) -> Result:
    """`concurrency` workers send back-to-back POSTs until `duration_s` (or `max_requests`) is up."""
    if concurrency <= 0 or duration_s <= 0:
        raise ValueError("concurrency and duration_s must be positive")
    data, hdrs = _prepare(body, headers)
    rec = _Recorder()
    rec.templated = any("{n}" in v for v in hdrs.values())
    budget = [max_requests if max_requests is not None else -1]

    async def worker(deadline: float) -> None:
        while time.perf_counter() < deadline and budget[0] != 0:
            budget[0] -= 1
            rec.sent += 1
            await _one(session, url, data, hdrs, stream, time.perf_counter(), rec)

    async with _session(concurrency, timeout_s) as session:
        await _warm(session, url, data, hdrs, concurrency if warmup is None else warmup)
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        # A worker stops sending at the deadline; the one request it may have in flight then is
        # bounded by timeout_s.
        await asyncio.gather(*(worker(deadline) for _ in range(concurrency)))
    return _result("closed", url, stream, None, concurrency, rec.sent, 0, rec, t0, [])


def run_subprocess(
    url: str,
    body: Any = None,
    headers: Mapping[str, str] | None = None,
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    duration_s: float = 10.0,
    stream: bool = False,
    extra_args: list[str] | None = None,
) -> Result:
    """Run the CLI in its own process (so it does not share a core's event loop with a server under
    test started by the caller) and return its Result. Give `rate` for open loop, else closed."""
    argv = [sys.executable, "-m", "bench.loadgen", "--url", url, "--duration", str(duration_s)]
    argv += ["--body", orjson.dumps(DEFAULT_BODY if body is None else body).decode()]
    for name, value in (headers or {}).items():
        argv += ["-H", f"{name}: {value}"]
    if rate is not None:
        argv += ["--rate", str(rate)]
        if concurrency is not None:
            argv += ["--max-outstanding", str(concurrency)]
    else:
        argv += ["--concurrency", str(concurrency or 64)]
    if stream:
        argv.append("--stream")
    argv += extra_args or []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(argv, capture_output=True, check=True, timeout=duration_s + 120, cwd=root)
    return Result.from_dict(orjson.loads(done.stdout))


# -- trivial server and self-test --------------------------------------------------------------

_SSE_EVENTS = 8


def _trivial_app() -> Any:
    from aiohttp import web

    reply = orjson.dumps({"id": "x", "object": "chat.completion", "choices": [], "usage": {}})
    event = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.path.endswith("/sse"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(_SSE_EVENTS):
                await resp.write(event)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.Response(body=reply, content_type="application/json")

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", handle)
    return app


def _serve(hostport: str) -> None:
    from aiohttp import web

    host, _, port = hostport.rpartition(":")
    web.run_app(_trivial_app(), host=host or "127.0.0.1", port=int(port), print=None, access_log=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.perf_counter() > deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return


async def _selftest(duration_s: float) -> dict[str, Any]:
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.loadgen", "--serve", f"127.0.0.1:{port}"])
    try:
        await _wait_listening(port)
        base = f"http://127.0.0.1:{port}"
        out: dict[str, Any] = {}
        for name, coro in (
            ("open_200rps", open_loop(base + "/json", DEFAULT_BODY, None, 200, duration_s, warmup=8)),
            (
                "open_200rps_stream",
                open_loop(base + "/sse", DEFAULT_BODY, None, 200, duration_s, True, warmup=8),
            ),
            ("closed_c64", closed_loop(base + "/json", DEFAULT_BODY, None, 64, duration_s)),
            ("closed_c16", closed_loop(base + "/json", DEFAULT_BODY, None, 16, duration_s)),
            ("closed_c64_stream", closed_loop(base + "/sse", DEFAULT_BODY, None, 64, duration_s, True)),
        ):
            cpu0 = time.process_time()
            result = await coro
            out[name] = {
                "achieved_rate": result.achieved_rate,
                "count": result.count,
                "errors": result.errors,
                "latency_ms": result.latency_ms,
                "ttfb_ms": result.ttfb_ms,
                "loadgen_cpu_per_request_us": round(
                    (time.process_time() - cpu0) / max(result.count, 1) * 1e6, 1
                ),
                "notes": result.notes,
            }
        return out
    finally:
        server.terminate()
        server.wait(timeout=10)


# -- CLI ---------------------------------------------------------------------------------------


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is optional
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"header must look like 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url")
    parser.add_argument("--rate", type=float, help="open loop: requests per second")
    parser.add_argument("--concurrency", type=int, default=64, help="closed loop: workers (default 64)")
    parser.add_argument("--max-outstanding", type=int, default=1024, help="open loop: in-flight bound")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds (default 10)")
    parser.add_argument("--stream", action="store_true", help="read SSE bodies; report time to first byte")
    parser.add_argument("--body", help="JSON request body (default: a tiny chat completion)")
    parser.add_argument("--body-file", help="file holding the JSON request body")
    parser.add_argument("-H", "--header", action="append", type=_parse_header, default=[])
    parser.add_argument("--timeout", type=float, default=30.0, help="per request, seconds")
    parser.add_argument("--warmup", type=int, default=None, help="connections to open before t0")
    parser.add_argument("--serve", metavar="HOST:PORT", help="run the trivial test server instead")
    parser.add_argument("--selftest", action="store_true", help="measure against a trivial server")
    args = parser.parse_args(argv)

    if args.serve:
        _serve(args.serve)
        return 0
    if args.selftest:
        report = _run(_selftest(args.duration if args.duration != 10.0 else 3.0))
        sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        return 0
    if not args.url:
        parser.error("--url is required")
    if args.body_file:
        with open(args.body_file, "rb") as f:
            body: Any = f.read()
        orjson.loads(body)  # fail early on a malformed body
    elif args.body:
        body = orjson.loads(args.body)
    else:
        body = DEFAULT_BODY
    headers = dict(args.header)
    if args.rate is not None:
        coro = open_loop(
            args.url,
            body,
            headers,
            args.rate,
            args.duration,
            args.stream,
            max_outstanding=args.max_outstanding,
            timeout_s=args.timeout,
            warmup=args.warmup if args.warmup is not None else 0,
        )
    else:
        coro = closed_loop(
            args.url,
            body,
            headers,
            args.concurrency,
            args.duration,
            args.stream,
            timeout_s=args.timeout,
            warmup=args.warmup,
        )
    result = _run(coro)
    sys.stdout.buffer.write(result.to_json() + b"\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
