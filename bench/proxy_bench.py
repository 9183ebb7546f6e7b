"""Added latency and throughput of runcap versus calling the scripted upstream directly.

Three processes on 127.0.0.1: the scripted upstream (`runcap mock-upstream`), runcap
(`runcap serve`, embedded SQLite ledger, caps on every request) and the load generator
(`bench.loadgen`). For each scenario the same load runs against the upstream directly and then
through runcap, back to back, and both runs are reported: the machine is shared and noisy, so a
pair measured together is the only fair comparison.

Scenarios (small bodies, non-streaming and streaming):
  open loop at 20 and 200 req/s — latency p50/p99 from the *scheduled* send time, so queueing shows;
  closed loop at concurrency 64 — maximum throughput.

Every request through runcap carries `X-Run-Max-Usd` (and no run id, so each request is a new
run): the full reserve → forward → settle path with a ledger write on both sides.

    .venv/bin/python -m bench.proxy_bench [--duration 10] [--workers 1] [--floor] [--json out.json]

`--floor` adds a third path to every non-streaming scenario: `bench.relay_floor`, the smallest
aiohttp relay (no parsing, no ledger, no spans), and reports its added latency, throughput and CPU
per request beside runcap's: the floor of any HTTP hop in Python on this machine.

With `--baseline DIR` (another checkout of runcap, e.g. `git archive REV | tar -x -C DIR`) it
compares the two trees instead, side by side in the same minutes: one `runcap serve` of each
(SQLite ledger; `--tracing on` for the span path too), closed loop c=64 and an open loop at
`--rates`, once without run headers (nothing to enforce) and once with caps, `--rounds` rounds in
which the two trees alternate who goes first; per run the proxy process's CPU per request (utime +
stime from /proc) and the throughput, medians over the rounds, and its RSS after each scenario.

    .venv/bin/python -m bench.proxy_bench --baseline /tmp/old [--tracing on] [--rounds 3] [--duration 8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loadgen import Result, run_subprocess

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 32}
CAP_HEADERS = {"X-Run-Max-Usd": "1000", "X-Run-Max-Steps": "100"}
_PLAIN: tuple[str, dict[str, str]] = ("no run headers", {})
_CAPPED: tuple[str, dict[str, str]] = ("capped runs", CAP_HEADERS)
HEADER_SETS = {"both": (_PLAIN, _CAPPED), "none": (_PLAIN,), "capped": (_CAPPED,)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within 30 s")


def start(argv: list[str], port: int, what: str, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "ab"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    wait_port(port, proc, what)
    return proc


def start_upstream(log: Path) -> tuple[int, subprocess.Popen[bytes]]:
    """The scripted upstream (`runcap mock-upstream`) on a free port: (the port, the process)."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "mock-upstream", "--listen", f"127.0.0.1:{port}"]
    return port, start(argv, port, "upstream", log)


def serve_argv(
    cfg: Path, up_port: int, port: int, data_dir: Path, tracing: bool, access_log: bool = False
) -> list[str]:
    """`runcap serve` on `port` in front of the upstream at `up_port`, its config written to `cfg`."""
    cfg.write_text(
        f"log_requests = {'true' if access_log else 'false'}\ntracing = {'true' if tracing else 'false'}\n"
        f'[upstreams.openai]\nurl = "http://127.0.0.1:{up_port}"\n'
    )
    serve = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg)]
    return [*serve, "--listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir)]


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the servers a benchmark started, last started first (SIGTERM, then SIGKILL)."""
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def summarize(r: Result) -> dict[str, Any]:
    return {
        "ok": r.ok,
        "errors": r.errors,
        "rate": round(r.achieved_rate, 1),
        "p50_ms": round(r.latency_ms.get("p50", float("nan")), 3),
        "p99_ms": round(r.latency_ms.get("p99", float("nan")), 3),
        **({"ttfb_p50_ms": round(r.ttfb_ms.get("p50", float("nan")), 3)} if r.stream and r.ttfb_ms else {}),
    }


def added_ms(path: dict[str, Any], direct: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """`path`'s p50 and p99 over `direct`'s, in ms: `{prefix}added_p50_ms`, `{prefix}added_p99_ms`."""
    return {f"{prefix}added_{q}_ms": round(path[f"{q}_ms"] - direct[f"{q}_ms"], 3) for q in ("p50", "p99")}


def emit(results: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """A row as it is measured: kept for the table and the --json file, and printed (JSON lines)."""
    results.append(row)
    print(json.dumps(row), flush=True)


def save_json(path: str | None, results: Any) -> None:
    """The results to the --json file, when one was named."""
    if path:
        Path(path).write_text(json.dumps(results, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per run (default 10)")
    ap.add_argument("--workers", type=int, default=1, help="runcap serve --workers (default 1)")
    ap.add_argument("--rates", default="20,200", help="open-loop rates (default 20,200)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--floor", action="store_true", help="also measure the smallest aiohttp relay")
    ap.add_argument("--baseline", type=Path, help="compare this tree with that checkout, side by side")
    ap.add_argument("--tracing", choices=("on", "off"), default="off", help="with --baseline (default off)")
    ap.add_argument(
        "--access-log", choices=("on", "off"), default="off",
        help="with --baseline: log_requests, runcap's default is on (default off)",
    )  # fmt: skip
    ap.add_argument(
        "--headers", choices=tuple(HEADER_SETS), default="both",
        help="with --baseline: requests without run headers, capped, or both (default both)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: rounds per scenario (default 3)")
    args = ap.parse_args(argv)
    if args.baseline is not None:
        return compare_trees(args)

    tmp = Path(tempfile.mkdtemp(prefix="runcap-bench-"))
    up_port, rc_port, floor_port = free_port(), free_port(), free_port()
    # The core proxy: caps and the ledger on, tracing off (bench/span_bench.py measures tracing).
    (tmp / "runcap.toml").write_text(
        f'log_requests = false\ntracing = false\n[upstreams.openai]\nurl = "http://127.0.0.1:{up_port}"\n'
    )
    runcap = [sys.executable, "-m", "proxy.cli"]
    procs = []
    results: list[dict[str, Any]] = []
    try:
        procs.append(
            start(
                [*runcap, "mock-upstream", "--listen", f"127.0.0.1:{up_port}"],
                up_port,
                "upstream",
                tmp / "upstream.log",
            )
        )
        serve = [*runcap, "serve", "--config", str(tmp / "runcap.toml"), "--listen", f"127.0.0.1:{rc_port}"]
        serve += ["--data-dir", str(tmp / "data"), "--workers", str(args.workers)]
        procs.append(start(serve, rc_port, "runcap", tmp / "runcap.log"))
        direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        proxied = f"http://127.0.0.1:{rc_port}/v1/chat/completions"
        floor = f"http://127.0.0.1:{floor_port}/v1/chat/completions" if args.floor else None
        if args.floor:
            relay = [sys.executable, "-m", "bench.relay_floor", "--port", str(floor_port)]
            relay += ["--upstream", f"http://127.0.0.1:{up_port}"]
            procs.append(start(relay, floor_port, "floor relay", tmp / "floor.log"))
        # Warm the paths (connection pools, price book, SQLite pages).
        for url in (direct, proxied, *([floor] if floor else [])):
            run_subprocess(url, BODY, CAP_HEADERS, concurrency=8, duration_s=1.0)

        scenarios: list[tuple[str, dict[str, Any]]] = []
        for stream in (False, True):
            for rate in (float(x) for x in args.rates.split(",")):
                scenarios.append(
                    (f"open {rate:g} req/s{' stream' if stream else ''}", {"rate": rate, "stream": stream})
                )
            scenarios.append(
                (
                    f"closed c={args.concurrency}{' stream' if stream else ''}",
                    {"concurrency": args.concurrency, "stream": stream},
                )
            )
        for name, kw in scenarios:
            body = {**BODY, "stream": kw["stream"]}
            d = run_subprocess(direct, body, {}, duration_s=args.duration, **kw)
            cpu0 = cpu_s(procs[1].pid)
            p = run_subprocess(proxied, body, CAP_HEADERS, duration_s=args.duration, **kw)
            row = {"scenario": name, "direct": summarize(d), "runcap": summarize(p)}
            row["runcap"]["cpu_ms_per_req"] = round((cpu_s(procs[1].pid) - cpu0) * 1000 / max(1, p.count), 3)
            if floor and not kw["stream"]:
                cpu0 = cpu_s(procs[2].pid)
                f = run_subprocess(floor, body, {}, duration_s=args.duration, **kw)
                row["floor"] = summarize(f)
                floor_cpu = (cpu_s(procs[2].pid) - cpu0) * 1000 / max(1, f.count)
                row["floor"]["cpu_ms_per_req"] = round(floor_cpu, 3)
            if "rate" in kw:
                row.update(added_ms(row["runcap"], row["direct"]))
                if "floor" in row:
                    row.update(added_ms(row["floor"], row["direct"], "floor_"))
            else:
                row["throughput_ratio"] = (
                    round(p.achieved_rate / d.achieved_rate, 3) if d.achieved_rate else None
                )
                if "floor" in row:
                    row["floor_throughput_ratio"] = round(f.achieved_rate / d.achieved_rate, 3)
            emit(results, row)
    finally:
        stop_all(procs)
    save_json(args.json, results)
    _print_table(results)
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU time of a process so far, in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def process_rss_mb(pid: int) -> float:
    """RSS of one process (Linux /proc), in MB; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0.0
    rss = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), "0")
    return round(int(rss) / 1024, 1)


def compare_trees(args: argparse.Namespace) -> int:
    """This tree versus `args.baseline`, each its own `runcap serve` against one upstream."""
    tmp = Path(tempfile.mkdtemp(prefix="runcap-bench-"))
    trees = {"this": ROOT, "baseline": args.baseline.resolve()}
    procs: list[subprocess.Popen[bytes]] = []
    results: list[dict[str, Any]] = []
    try:
        up_port, upstream = start_upstream(tmp / "upstream.log")
        procs.append(upstream)
        urls: dict[str, str] = {}
        pids: dict[str, int] = {}
        for name, tree in trees.items():
            port = free_port()
            cfg, data_dir = tmp / f"runcap-{name}.toml", tmp / f"data-{name}"
            serve = serve_argv(cfg, up_port, port, data_dir, args.tracing == "on", args.access_log == "on")
            proc = subprocess.Popen(
                serve, cwd=tree, stdout=subprocess.DEVNULL, stderr=open(tmp / f"runcap-{name}.log", "ab")
            )
            procs.append(proc)
            wait_port(port, proc, f"runcap ({name})")
            urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
            pids[name] = proc.pid
        for url in urls.values():  # warm up (pools, price book, SQLite pages)
            run_subprocess(url, BODY, CAP_HEADERS, concurrency=8, duration_s=1.0)
        loads: list[tuple[str, dict[str, Any]]] = [
            (f"closed c={args.concurrency}", {"concurrency": args.concurrency})
        ]
        loads += [(f"open {float(r):g} req/s", {"rate": float(r)}) for r in args.rates.split(",") if r]
        for headers_name, headers in HEADER_SETS[args.headers]:
            for load_name, kw in loads:
                samples: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
                for round_ in range(args.rounds):
                    order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                    for name in order:
                        cpu0 = cpu_s(pids[name])
                        r = run_subprocess(urls[name], BODY, headers, duration_s=args.duration, **kw)
                        cpu_ms = (cpu_s(pids[name]) - cpu0) * 1000 / max(1, r.count)
                        samples[name].append({**summarize(r), "proxy_cpu_ms_per_req": round(cpu_ms, 3)})
                row: dict[str, Any] = {"scenario": f"{load_name}, {headers_name}", "tracing": args.tracing}
                for name, runs in samples.items():
                    row[name] = {
                        k: round(statistics.median(run[k] for run in runs), 3)
                        for k in ("rate", "p50_ms", "p99_ms", "proxy_cpu_ms_per_req")
                    }
                    row[name]["rounds"] = [(run["rate"], run["proxy_cpu_ms_per_req"]) for run in runs]
                    row[name]["rss_mb"] = process_rss_mb(pids[name])  # the proxy alone, after the load
                emit(results, row)
    finally:
        stop_all(procs)
    save_json(args.json, results)
    print()
    head = f"scenario (tracing {args.tracing}, access log {args.access_log})"
    print(f"{head:<36} {'req/s this/base':>16} {'CPU ms/req this/base':>21}", end=" ")
    print(f"{'p50 this/base':>14} {'p99 this/base':>14} {'RSS MB this/base':>17}")
    for r in results:
        t, b = r["this"], r["baseline"]
        print(
            f"{r['scenario']:<36} {t['rate']:>7.0f}/{b['rate']:<8.0f} {t['proxy_cpu_ms_per_req']:>10.3f}/"
            f"{b['proxy_cpu_ms_per_req']:<10.3f} {t['p50_ms']:>6.2f}/{b['p50_ms']:<7.2f} "
            f"{t['p99_ms']:>6.2f}/{b['p99_ms']:<7.2f} {t['rss_mb']:>8.1f}/{b['rss_mb']:<8.1f}"
        )
    return 0


def _print_table(results: list[dict[str, Any]]) -> None:
    print()
    print(
        f"{'scenario':<24} {'direct p50/p99 ms':>18} {'runcap p50/p99 ms':>18} "
        f"{'added p50/p99':>14} {'rate d/r':>16} {'CPU ms/req':>10} {'floor relay: added or x, CPU':>30}"
    )
    for r in results:
        d, p = r["direct"], r["runcap"]
        added = (
            f"{r['added_p50_ms']:.2f}/{r['added_p99_ms']:.2f}"
            if "added_p50_ms" in r
            else f"x{r['throughput_ratio']}"
        )
        print(
            f"{r['scenario']:<24} {d['p50_ms']:>8.2f}/{d['p99_ms']:<9.2f} "
            f"{p['p50_ms']:>8.2f}/{p['p99_ms']:<9.2f} "
            f"{added:>14} {d['rate']:>7.0f}/{p['rate']:<8.0f} {p['cpu_ms_per_req']:>10.3f} "
            + (
                (
                    f"{r['floor_added_p50_ms']:.2f}/{r['floor_added_p99_ms']:.2f}"
                    if "floor_added_p50_ms" in r
                    else f"x{r['floor_throughput_ratio']}"
                ).rjust(20)
                + f" {r['floor']['cpu_ms_per_req']:>8.3f}"
                if "floor" in r
                else ""
            )
            + (f"  errors d={d['errors']} r={p['errors']}" if d["errors"] or p["errors"] else "")
        )


if __name__ == "__main__":
    raise SystemExit(main())
