"""Ledger latency (SQLite and Redis) and tool-call throughput through runcap versus direct.

1. Ledger operations, in-process, one at a time (the latency a request waits for), N pairs each:
   reserve + settle (`begin_step` + `settle`) and idempotency begin + complete
   (`begin_tool_call` + `complete_tool_call`), each on a fresh run — p50/p99 of each operation
   and of the pair. SQLite: a file in a temporary directory; Redis: a redis-server on loopback
   started here (no persistence — see README for production settings). Then 4N reserve + settle
   pairs from 64 concurrent callers: pairs/s and CPU per pair. `--cluster`: the same on a Redis
   Cluster of real processes on loopback (3 masters + 3 replicas, tests/support/redis_server.py),
   beside the single Redis.
2. Tool calls, closed loop: a trivial tool service (bench.loadgen's server) called directly and
   through `runcap serve` (`/tools/echo`, side-effecting, every request a new run and key, so
   each one is recorded in flight, forwarded and completed), with the SQLite and the Redis ledger.

    .venv/bin/python -m bench.ledger_bench [--ops 5000] [--duration 10] [--concurrency 32] [--cluster]
        [--skip-tools] [--json F]
        [--tree]   (3. a run three levels below a root vs a root: reserve + settle, interleaved)
        [--baseline DIR ...] [--rounds 3]
                   (4. parts 1 and 3 of this tree and of other checkouts of runcap, e.g.
                   `git archive REV | tar -x -C DIR`, side by side: each round runs every tree in
                   a subprocess of its own, in turn — the order reversed every other round — on
                   the same Redis servers; medians of the rounds' p50s. A checkout from before run
                   trees runs part 1 only, and one from before Redis Cluster support no cluster.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.loadgen import percentile, run_subprocess
from bench.proxy_bench import free_port, start
from proxy.caps import RunCaps
from proxy.ledger.base import Ledger, Settlement, StepRequest, ToolCallRequest

ROOT = Path(__file__).resolve().parent.parent


def bench_step(run_id: str, caps: RunCaps, now: float) -> StepRequest:
    """The step every ledger benchmark reserves: one priced model call of a capped run."""
    return StepRequest(
        run_id=run_id, task="bench", caps=caps, now=now, model="m", input_tokens_bound=500,
        client_output_limit=256, model_output_bound=4096, min_output_tokens=16,
        input_usd_per_mtok=Decimal(1), output_usd_per_mtok=Decimal(4),
    )  # fmt: skip


def _ms(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_ms": round(percentile(s, 50) * 1000, 4), "p99_ms": round(percentile(s, 99) * 1000, 4)}


async def bench_ledger(ledger: Ledger, n: int) -> dict[str, Any]:
    caps = RunCaps(max_usd_nanos=10**9, max_tokens=10**6, max_steps=100, max_tool_calls=100)
    reserve, settle, pair, begin, complete, pair2 = [], [], [], [], [], []
    tag = secrets.token_hex(3)
    for i in range(n + 200):  # the first 200 warm up
        now = time.time()
        req = bench_step(f"b{tag}-{i}", caps, now)
        t0 = time.perf_counter()
        res = await ledger.begin_step(req)
        t1 = time.perf_counter()
        await ledger.settle(res, Settlement(input_tokens=400, output_tokens=100, cost_usd_nanos=800_000), now)
        t2 = time.perf_counter()
        tc = ToolCallRequest(f"b{tag}-{i}", "bench", caps, now, "echo", f"k{i}", "0" * 64)
        t3 = time.perf_counter()
        await ledger.begin_tool_call(tc)
        t4 = time.perf_counter()
        await ledger.complete_tool_call(
            tc.run_id, f"k{i}", 200, {"content-type": "application/json"}, b"{}", now
        )
        t5 = time.perf_counter()
        if i >= 200:
            reserve.append(t1 - t0)
            settle.append(t2 - t1)
            pair.append(t2 - t0)
            begin.append(t4 - t3)
            complete.append(t5 - t4)
            pair2.append(t5 - t3)
    return {
        "reserve": _ms(reserve), "settle": _ms(settle), "reserve+settle": _ms(pair),
        "idem_begin": _ms(begin), "idem_complete": _ms(complete), "idem_begin+complete": _ms(pair2),
    }  # fmt: skip


async def bench_concurrent(ledger: Ledger, n: int, concurrency: int) -> dict[str, Any]:
    """`concurrency` callers doing reserve + settle on fresh runs, `n` pairs in all: what a loaded
    proxy asks of its ledger. Pairs per second and the process's CPU per pair (the SQLite
    backend runs the operations of one event-loop turn in one transaction)."""
    caps = RunCaps(max_usd_nanos=10**9, max_steps=100)
    tag = secrets.token_hex(3)
    left = iter(range(n))
    used = Settlement(input_tokens=400, output_tokens=100, cost_usd_nanos=800_000)

    async def caller() -> None:
        for i in left:
            now = time.time()
            req = bench_step(f"c{tag}-{i}", caps, now)
            res = await ledger.begin_step(req)
            await asyncio.sleep(0)  # the call is forwarded: other callers run meanwhile
            await ledger.settle(res, used, now)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    return {"pairs_per_s": round(n / wall), "cpu_us_per_pair": round(cpu * 1e6 / n, 1)}


async def bench_tree(ledger: Ledger, n: int, depth: int = 3) -> dict[str, Any]:
    """Run trees (issue 22): reserve + settle of a run `depth` levels below a capped root (its
    chain: the run and `depth` ancestors, each checked and updated in the same atomic operation),
    against the same pair on a root, interleaved so both see the same machine: a new run's first
    call (the child's includes its creation under its parent), as in `bench_ledger`, and the
    next call of a run that exists."""
    caps = RunCaps(max_usd_nanos=10**12, max_tokens=10**9)
    tag = secrets.token_hex(3)
    used = Settlement(input_tokens=400, output_tokens=100, cost_usd_nanos=800_000)
    parent = ""
    for level in range(depth):  # root → ... → the leaves' parent
        run_id = f"t{tag}-l{level}"
        res = await ledger.begin_step(replace(bench_step(run_id, caps, time.time()), parent_run_id=parent))
        await ledger.settle(res, used, time.time())
        parent = run_id
    samples: dict[str, list[float]] = {"root": [], "leaf": [], "root pair": [], "leaf pair": []}
    for i in range(n + 200):  # the first 200 warm up
        for kind in ("root", "leaf"):
            now = time.time()
            req = bench_step(f"t{tag}-{kind}{i}", caps, now)
            if kind == "leaf":
                req = replace(req, parent_run_id=parent)
            t0 = time.perf_counter()
            res = await ledger.begin_step(req)
            t1 = time.perf_counter()
            await ledger.settle(res, used, now)
            if i >= 200:
                samples[kind].append(t1 - t0)
                samples[f"{kind} pair"].append(time.perf_counter() - t0)
    # The steady state: the next call of a run that exists (one root, one leaf, called in turns).
    again: dict[str, list[float]] = {"root": [], "leaf": []}
    for i in range(n + 200):
        for kind in ("root", "leaf"):
            now = time.time()
            req = bench_step(f"t{tag}-{kind}0", caps, now)
            t0 = time.perf_counter()
            res = await ledger.begin_step(req)
            if i >= 200:
                again[kind].append(time.perf_counter() - t0)
            await ledger.settle(res, used, now)
    r2, l2 = _ms(again["root"]), _ms(again["leaf"])
    r, lf, rp, lp = (_ms(samples[k]) for k in ("root", "leaf", "root pair", "leaf pair"))
    return {
        "root reserve (next call)": r2,
        f"depth-{depth} reserve (next call)": l2,
        "next-call reserve ratio_p50": round(l2["p50_ms"] / r2["p50_ms"], 2),
        "root reserve": r,
        f"depth-{depth} reserve": lf,
        "root reserve+settle": rp,
        f"depth-{depth} reserve+settle": lp,
        "reserve ratio_p50": round(lf["p50_ms"] / r["p50_ms"], 2),
        "reserve+settle ratio_p50": round(lp["p50_ms"] / rp["p50_ms"], 2),
    }


def _ledger_part(
    n: int, redis_url: str, cluster_url: str | None = None, tree: bool = False
) -> dict[str, Any]:
    from proxy.ledger.redis import RedisLedger
    from proxy.ledger.sqlite import SQLiteLedger

    out = {}

    async def go() -> None:
        sqlite = SQLiteLedger(Path(tempfile.mkdtemp(prefix="runcap-lbench-")) / "ledger.sqlite3")
        try:
            out["sqlite"] = await bench_ledger(sqlite, n)
            out["sqlite"]["concurrent c=64 reserve+settle"] = await bench_concurrent(sqlite, 4 * n, 64)
            if tree:
                out["sqlite tree"] = await bench_tree(sqlite, n)
        finally:
            await sqlite.close()
        redis = RedisLedger(redis_url, prefix=f"bench{secrets.token_hex(3)}:")
        try:
            out["redis"] = await bench_ledger(redis, n)
            out["redis"]["concurrent c=64 reserve+settle"] = await bench_concurrent(redis, 4 * n, 64)
            if tree:
                out["redis tree"] = await bench_tree(redis, n)
        finally:
            await redis.close()
        if cluster_url is None:
            return
        cluster = RedisLedger(cluster_url, prefix=f"bench{secrets.token_hex(3)}:", cluster=True)
        try:
            out["redis-cluster"] = await bench_ledger(cluster, n)
            loaded = await bench_concurrent(cluster, 4 * n, 64)
            out["redis-cluster"]["concurrent c=64 reserve+settle"] = loaded
            if tree:
                out["redis-cluster tree"] = await bench_tree(cluster, n)
        finally:
            await cluster.close()

    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(go())
    except ImportError:
        asyncio.run(go())
    return out


# Runs in a subprocess whose working directory and PYTHONPATH are a checkout of runcap: that
# checkout's ledger, measured by this file's functions (loaded by path, under another name).
_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("ledger_bench_probe", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
import inspect
from proxy.ledger.base import StepRequest
from proxy.ledger.redis import RedisLedger
tree = sys.argv[5] == "1" and "parent_run_id" in StepRequest.__dataclass_fields__
cluster = sys.argv[4] if "cluster" in inspect.signature(RedisLedger).parameters else ""
out = bench._ledger_part(int(sys.argv[2]), sys.argv[3], cluster or None, tree=tree)
print(json.dumps(out))
"""


def _probe(tree: Path, n: int, redis_url: str, cluster_url: str | None, with_tree: bool) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(Path(__file__).resolve()), str(n), redis_url, cluster_url or "",
         "1" if with_tree else "0"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"ledger probe in {tree} failed: {done.stderr.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.decode().splitlines()[-1])
    return result


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each number over the rounds (nested like one round's result), and the
    rounds' values of each p50 and ratio beside it."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [run[key] for run in runs if key in run]
        if isinstance(first, dict):
            out[key] = _medians(values)
        elif isinstance(first, int | float):
            out[key] = round(statistics.median(values), 4)
            if key == "p50_ms" or "ratio" in key:
                out[f"{key} rounds"] = values
    return out


def bench_side_by_side(
    trees: dict[str, Path], n: int, redis_url: str, cluster_url: str | None, with_tree: bool, rounds: int
) -> dict[str, Any]:
    """Parts 1 and 3 of each checkout in `trees`, `rounds` times, in turn."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for round_ in range(rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for name in order:
            samples[name].append(_probe(trees[name], n, redis_url, cluster_url, with_tree))
            print(f"round {round_ + 1}/{rounds}: {name} done", flush=True)
    return {name: _medians(runs) for name, runs in samples.items()}


def _print_side_by_side(results: dict[str, Any]) -> None:
    names = list(results)
    print(f"{'p50 ms (median of rounds)':<58}" + "".join(f"{name[:16]:>18}" for name in names))
    rows: dict[tuple[str, str], list[str]] = {}
    for col, (_name, by_backend) in enumerate(results.items()):
        for backend, ops in by_backend.items():
            for op, v in ops.items():
                if isinstance(v, dict):
                    cell = v.get("p50_ms", v.get("cpu_us_per_pair"))
                    label = op if "p50_ms" in v else f"{op} (µs CPU/pair)"
                else:
                    cell, label = v, op
                if cell is None or label.endswith(" rounds"):
                    continue
                rows.setdefault((backend, label), [""] * len(names))[col] = str(cell)
    for (backend, label), cells in rows.items():
        print(f"{backend[:14]:<15}{label[:42]:<43}" + "".join(f"{c:>18}" for c in cells), flush=True)


def _summary(r: Any) -> dict[str, Any]:
    return {
        "rate": round(r.achieved_rate, 1), "ok": r.ok, "errors": r.errors,
        "p50_ms": round(r.latency_ms.get("p50", float("nan")), 3),
        "p99_ms": round(r.latency_ms.get("p99", float("nan")), 3),
    }  # fmt: skip


def _tools_part(duration: float, concurrency: int, redis_url: str, tmp: Path) -> list[dict[str, Any]]:
    tool_port = free_port()
    procs = [
        start([sys.executable, "-m", "bench.loadgen", "--serve", f"127.0.0.1:{tool_port}"], tool_port, "tool",
              tmp / "tool.log")
    ]  # fmt: skip
    rows = []
    body = {"order_id": "A1", "amount": 5}
    try:
        direct = f"http://127.0.0.1:{tool_port}/echo"
        run_subprocess(direct, body, {}, concurrency=8, duration_s=1.0)
        d = run_subprocess(direct, body, {}, concurrency=concurrency, duration_s=duration)
        for backend in ("sqlite", "redis"):
            port = free_port()
            conf = tmp / f"runcap-{backend}.toml"
            text = "log_requests = false\ntracing = false\n"
            if backend == "redis":
                text += f'redis_url = "{redis_url}"\n'
            text += f'[tools.echo]\nurl = "http://127.0.0.1:{tool_port}/echo"\nside_effects = true\n'
            conf.write_text(text)
            serve = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(conf), "--listen",
                     f"127.0.0.1:{port}", "--data-dir", str(tmp / f"data-{backend}")]  # fmt: skip
            proc = start(serve, port, f"runcap ({backend})", tmp / f"runcap-{backend}.log")
            try:
                url = f"http://127.0.0.1:{port}/tools/echo"
                # a side-effecting tool needs a run id: one run per request (`{n}`: its number)
                run_subprocess(
                    url, body, {"X-Run-Id": f"warm-{backend}-{{n}}"}, concurrency=8, duration_s=1.0
                )
                p = run_subprocess(
                    url,
                    body,
                    {"X-Run-Id": f"bench-{backend}-{{n}}"},
                    concurrency=concurrency,
                    duration_s=duration,
                )
            finally:
                proc.terminate()
                proc.wait(15)
            row = {
                "scenario": f"tool calls, closed c={concurrency}, ledger {backend}",
                "direct": _summary(d), "runcap": _summary(p),
                "throughput_ratio": round(p.achieved_rate / d.achieved_rate, 3) if d.achieved_rate else None,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(15)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=5000, help="operation pairs per ledger (default 5000)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per throughput run (default 10)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--skip-tools", action="store_true", help="ledger latencies only")
    ap.add_argument("--cluster", action="store_true", help="also on a 3-master Redis Cluster")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument(
        "--tree", action="store_true", help="also a depth-3 run tree's reserve+settle vs a root's"
    )
    ap.add_argument(
        "--baseline", type=Path, action="append", default=[],
        help="another checkout of runcap to measure side by side with this tree (repeatable)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: rounds (default 3)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from tests.support.redis_server import RedisClusterServers, RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="runcap-lbench-"))
    redis = RedisServer().start()
    cluster = RedisClusterServers().start() if args.cluster else None
    if args.baseline:
        trees = {"this tree": ROOT, **{str(b): b.resolve() for b in args.baseline}}
        try:
            results = bench_side_by_side(
                trees, args.ops, redis.url, cluster and cluster.url, args.tree, args.rounds
            )
        finally:
            redis.stop()
            if cluster is not None:
                cluster.stop()
        _print_side_by_side(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    try:
        ledgers = _ledger_part(
            args.ops, redis.url, cluster.url if cluster is not None else None, tree=args.tree
        )
        for backend, ops in ledgers.items():
            for op, v in ops.items():
                if not isinstance(v, dict):
                    print(f"{backend:<7} {op}: {v}", flush=True)
                    continue
                if "pairs_per_s" in v:
                    rate, cpu = v["pairs_per_s"], v["cpu_us_per_pair"]
                    print(f"{backend:<13} {op}: {rate} pairs/s, {cpu} µs CPU/pair", flush=True)
                    continue
                print(
                    f"{backend:<13} {op:<22} p50 {v['p50_ms']:>8.4f} ms   p99 {v['p99_ms']:>8.4f} ms",
                    flush=True,
                )
        tools = [] if args.skip_tools else _tools_part(args.duration, args.concurrency, redis.url, tmp)
    finally:
        redis.stop()
        if cluster is not None:
            cluster.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"ledger": ledgers, "tools": tools}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
