"""Added latency of an MCP `tools/call` through runcap (`/mcp/{name}`) versus straight to the server.

Three processes on 127.0.0.1: the test suite's MCP server (the official SDK's `MCPServer`,
Streamable HTTP; stateless with JSON answers by default, `--sse` for a stateful server answering
with SSE streams), runcap (`runcap serve`, embedded SQLite ledger, tracing off) and this sender.
For each kind of call one open-loop load (`--rate` calls per second for `--duration` seconds,
each call's latency measured from its scheduled send time) alternates its calls between the
server directly and runcap: the machine is shared and noisy, and calls interleaved in the same
seconds see the same noise — the fairest comparison there is here.

Kinds of call:
  read-only        `lookup` (readOnlyHint: true): counted against the run's tool-call cap, then
                   relayed — one ledger transaction;
  side-effecting   `refund` (no annotations), different arguments on every call: each one
                   executes — intent recorded before, outcome after (two ledger writes);
  replayed         `refund` with the same arguments every time: runcap answers from the record,
                   the server is not called (a "direct" figure does not exist for it).

Every call through runcap carries `X-Run-Id` and `X-Run-Max-Tool-Calls`. Bounded: the number of
calls is rate * duration, each with a 10 s timeout.

With `--floor` a third path joins the alternation: `bench.relay_floor`, the smallest aiohttp relay
(no parsing, no ledger), so the added latency splits into what any HTTP hop costs on this machine
and what runcap's own work adds to it.

    .venv/bin/python -m bench.mcp_bench [--rate 100] [--duration 10] [--sse] [--floor] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen import percentile
from bench.proxy_bench import added_ms, cpu_s, emit, free_port, save_json, start, stop_all

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 20  # calls to each url before the measured ones
HEADERS = {
    "Content-Type": "application/json",
    "Accept": "application/json, text/event-stream",
    "MCP-Protocol-Version": "2025-11-25",
}


async def initialize(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> dict[str, str]:
    """A session's handshake (stateful servers); returns the headers later requests carry."""
    client = {"name": "bench", "version": "1"}
    params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": client}
    hello = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}
    async with http.post(url, json=hello, headers=headers) as r:
        await r.read()
        session = r.headers.get("Mcp-Session-Id")
    out = dict(headers)
    if session:
        out["Mcp-Session-Id"] = session
    notice = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    async with http.post(url, json=notice, headers=out) as r:
        await r.read()
    return out


async def open_loop(
    urls: list[str], kind: str, rate: float, duration_s: float, run_id: str
) -> list[dict[str, Any]]:
    """Call i goes to urls[i % len(urls)], due at t0 + i / rate; one summary per url."""
    base = {**HEADERS, "X-Run-Id": run_id, "X-Run-Max-Tool-Calls": "1000000"}
    total = max(1, round(rate * duration_s))
    latencies: list[list[float]] = [[] for _ in urls]
    errors = [0 for _ in urls]
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=256)) as http:
        sessions = [await initialize(http, url, base) for url in urls]

        def body(i: int) -> bytes:
            if kind == "read-only":
                call = {"name": "lookup", "arguments": {"order_id": "A-1"}}
            elif kind == "side-effecting":
                call = {"name": "refund", "arguments": {"order_id": f"o-{run_id}-{i}", "amount": 1}}
            else:
                call = {"name": "refund", "arguments": {"order_id": "same", "amount": 1}}
            message = {"jsonrpc": "2.0", "id": i + 1, "method": "tools/call", "params": call}
            return json.dumps(message).encode()

        async def one(i: int, due: float, n: int) -> None:
            try:
                async with http.post(urls[n], data=body(i), headers=sessions[n]) as r:
                    data = await r.read()
                    ok = r.status == 200 and b'"result"' in data
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                latencies[n].append(time.perf_counter() - due)
            else:
                errors[n] += 1

        for i in range(WARMUP):  # warm the pools (and, for replays, record the outcome)
            for n in range(len(urls)):
                await one(-1 - i if kind != "replayed" else 0, time.perf_counter(), n)
        for n in range(len(urls)):
            latencies[n].clear()
            errors[n] = 0
        pending: set[asyncio.Task[None]] = set()
        t0 = time.perf_counter()
        for i in range(total):
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i, due, i % len(urls)))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending, timeout=15)
    out = []
    for samples, failed in zip(latencies, errors, strict=True):
        samples.sort()
        out.append(
            {
                "ok": len(samples),
                "errors": failed,
                "p50_ms": round(percentile(samples, 50) * 1000, 3) if samples else None,
                "p99_ms": round(percentile(samples, 99) * 1000, 3) if samples else None,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=100.0, help="calls per second (default 100)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per run (default 10)")
    ap.add_argument("--sse", action="store_true", help="a stateful server answering with SSE streams")
    ap.add_argument("--floor", action="store_true", help="also measure the smallest aiohttp relay")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="runcap-mcp-bench-"))
    mcp_port, rc_port, floor_port = free_port(), free_port(), free_port()
    (tmp / "runcap.toml").write_text(
        f'log_requests = false\ntracing = false\n[mcp.crm]\nurl = "http://127.0.0.1:{mcp_port}/mcp"\n'
    )
    flags = [] if args.sse else ["--stateless", "--json"]
    procs = []
    results: list[dict[str, Any]] = []
    try:
        server = [sys.executable, "-m", "tests.support.mcp_server", "--port", str(mcp_port), *flags]
        procs.append(start(server, mcp_port, "MCP server", tmp / "mcp.log"))
        serve = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(tmp / "runcap.toml")]
        serve += ["--listen", f"127.0.0.1:{rc_port}", "--data-dir", str(tmp / "data")]
        procs.append(start(serve, rc_port, "runcap", tmp / "runcap.log"))
        direct = f"http://127.0.0.1:{mcp_port}/mcp"
        proxied = f"http://127.0.0.1:{rc_port}/mcp/crm"
        floor = [f"http://127.0.0.1:{floor_port}/"] if args.floor else []
        if args.floor:
            relay = [sys.executable, "-m", "bench.relay_floor", "--port", str(floor_port)]
            relay += ["--upstream", direct]
            procs.append(start(relay, floor_port, "floor relay", tmp / "floor.log"))
        for kind in ("read-only", "side-effecting", "replayed"):
            run_id = f"bench-{secrets.token_hex(4)}"
            row: dict[str, Any] = {"kind": kind, "rate": args.rate, "answers": "sse" if args.sse else "json"}
            cpu_before = cpu_s(procs[1].pid)
            floor_before = cpu_s(procs[2].pid) if floor else 0.0
            if kind == "replayed":
                [row["runcap"]] = asyncio.run(open_loop([proxied], kind, args.rate, args.duration, run_id))
            else:
                urls = [direct, proxied, *floor]
                paths = asyncio.run(open_loop(urls, kind, args.rate, args.duration, run_id))
                row["direct"], row["runcap"] = paths[:2]
                if floor:
                    row["floor"] = paths[2]
            # CPU runcap spent per call (warm-up included): a figure the machine's noise barely moves.
            calls = row["runcap"]["ok"] + row["runcap"]["errors"] + WARMUP
            row["runcap_cpu_ms_per_call"] = round((cpu_s(procs[1].pid) - cpu_before) * 1000 / calls, 3)
            if "floor" in row:
                calls = row["floor"]["ok"] + row["floor"]["errors"] + WARMUP
                row["floor_cpu_ms_per_call"] = round((cpu_s(procs[2].pid) - floor_before) * 1000 / calls, 3)
            if (
                "direct" in row
                and row["direct"]["p50_ms"] is not None
                and row["runcap"]["p50_ms"] is not None
            ):
                row.update(added_ms(row["runcap"], row["direct"]))
                if row.get("floor", {}).get("p50_ms") is not None:
                    row.update(added_ms(row["floor"], row["direct"], "floor_"))
            emit(results, row)
    finally:
        stop_all(procs)
    save_json(args.json, results)
    print(
        f"\n{'kind':<16}{'direct p50/p99 ms':>20}{'runcap p50/p99 ms':>20}{'added p50/p99 ms':>20}"
        f"{'runcap CPU/call':>17}{'floor relay added p50/p99, CPU':>34}"
    )
    for r in results:
        d = f"{r['direct']['p50_ms']}/{r['direct']['p99_ms']}" if "direct" in r else "-"
        p = f"{r['runcap']['p50_ms']}/{r['runcap']['p99_ms']}"
        a = f"{r['added_p50_ms']}/{r['added_p99_ms']}" if "added_p50_ms" in r else "-"
        f_ = "-"
        if "floor_added_p50_ms" in r:
            f_ = f"{r['floor_added_p50_ms']}/{r['floor_added_p99_ms']}, {r['floor_cpu_ms_per_call']} ms"
        print(f"{r['kind']:<16}{d:>20}{p:>20}{a:>20}{r['runcap_cpu_ms_per_call']:>14} ms{f_:>34}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
