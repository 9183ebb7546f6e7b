"""Span path benchmarks: the proxy appends to its WAL, the shipper ships.

1. Shipper ingest: step records (a model span, a tool_call span and the run's snapshot, as a
   traced model call writes them) appended to a WAL with `WalWriter` first — the append cost per
   record is reported too — then one `Shipper` ships them to ClickHouse: embedded chdb, and a
   ClickHouse over HTTP (clickhouse-connect → the chdb-backed HTTP fixture in its own process).
   Spans/s from the shipper's start until every span is written.
2. The proxy, tracing on (embedded chdb, both bodies of every call stored) versus tracing off,
   measured side by side in one run: closed loop c=64, open loop at 200 and 500 req/s, the
   upstream called directly at the same open-loop rates; every request is a run of its own, once
   without run headers and once with caps (`X-Run-Max-Usd`, `X-Run-Max-Steps`). Per run: the
   proxy process's CPU per request (utime + stime from /proc), and the shipper's, reported apart.
   Each scenario runs `--rounds` on/off pairs (who goes first alternates) and reports medians: on
   a shared two-core machine one pair can be off by ±20 %.
   The closed loops also run tracing on with the shipper paused (SIGSTOP for the run, SIGCONT
   after; it then ships what the run appended): the request path's own cost — TraceStep, the
   record, the WAL write — apart from the shipper's competition for the same cores.
   After the load: the RSS and threads of the proxy and of the shipper (embedded chdb), and the
   shipper's RSS with a ClickHouse server (the HTTP fixture) instead.
3. With `--baseline DIR` (another checkout, e.g. the revision before the WAL): both trees' proxies,
   tracing on and off, side by side in the same rounds, closed loop c=64.

4. With `--payload-lane CALLS` (nothing else): the shipper's payload lane alone — a WAL of CALLS
   traced calls with two unique bodies each, shipped into a local payload store as `runcap serve`
   opens it — the process's CPU per body, in a subprocess per tree (`--baseline DIR` too,
   interleaved rounds); `--profile` prints a cProfile of the lane's thread first.

    .venv/bin/python -m bench.span_bench [--spans 200000] [--duration 10] [--rounds 3] [--skip-proxy]
                                         [--skip-ingest] [--json out.json] [--baseline DIR]
    .venv/bin/python -m bench.span_bench --payload-lane 4000 [--rounds 5] [--baseline DIR] [--profile]

Every run is bounded in time (each load `--duration` seconds; ingestion gives up after 300 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.loadgen import run_subprocess
from bench.proxy_bench import (
    BODY,
    CAP_HEADERS,
    ROOT,
    added_ms,
    cpu_s,
    emit,
    free_port,
    save_json,
    serve_argv,
    start,
    start_upstream,
    stop_all,
    summarize,
    wait_port,
)
from proxy.spans.clickhouse import open_span_store
from proxy.spans.control import ShipperClient, ShipperUnavailable
from proxy.spans.model import RunSnapshot, Span
from proxy.spans.shipper import Shipper
from proxy.spans.wal import WalWriter


def synthetic_steps(n_spans: int) -> list[tuple[list[Span], RunSnapshot]]:
    """Steps shaped like an agent's: a model span with usage and a tool call, the run's state;
    20 steps per run."""
    t0 = datetime.now(UTC)
    steps = []
    for i in range(n_spans // 2):
        run = f"bench-{i // 20}"
        common: dict[str, Any] = dict(
            run_id=run, step=i % 20 + 1, task="bench", provider="openai", model="gpt-4o-mini",
            endpoint="chat.completions", status_code=200,
        )  # fmt: skip
        model = Span(
            kind="model", started_at=t0 + timedelta(microseconds=i), duration_ms=812.5,
            input_tokens=1200 + i % 500, output_tokens=80, cost_usd=Decimal("0.000228000"),
            request_hash="cd" * 32, response_hash="ef" * 32, attributes={"upstream": "openai"}, **common,
        )  # fmt: skip
        call = Span(
            kind="tool_call", started_at=t0 + timedelta(microseconds=i, milliseconds=812),
            parent_span_id=model.span_id, tool_name="refund", tool_call_id=f"call_{i}", args_hash="ab" * 32,
            **common,
        )  # fmt: skip
        state = RunSnapshot(
            run_id=run, task="bench", started_at=t0, updated_at=t0 + timedelta(seconds=i % 20),
            status="active", steps=i % 20 + 1, tool_calls=i % 20, input_tokens=30000, output_tokens=1600,
            cost_usd=Decimal("0.00456"), max_usd=Decimal("1"), max_tokens=None, max_steps=50,
            max_tool_calls=None, deadline=None,
        )  # fmt: skip
        steps.append(([model, call], state))
    return steps


def ingest(store: Any, wal: Path, n_spans: int, batch_size: int) -> dict[str, Any]:
    steps = synthetic_steps(n_spans)
    writer = WalWriter(wal, segment_bytes=64 << 20, max_bytes=16 << 30)
    t0 = time.perf_counter()
    for spans, state in steps:
        writer.append_step(spans, [state])
    append_s = time.perf_counter() - t0
    writer.close()
    total = 2 * len(steps)
    shipper = Shipper(wal, sinks=[store], query_store=store, batch_size=batch_size, flush_interval_s=0.2)
    t0 = time.perf_counter()
    shipper.start()
    lane = shipper.lanes[0]
    while lane.spans_written < total:
        if time.perf_counter() - t0 > 300:
            raise RuntimeError("ingestion did not finish in 300 s")
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    _, rows = store.query("SELECT count() FROM runcap.spans", None)
    assert rows[0][0] >= total, rows
    shipper.stop()  # closes the store too
    return {
        "spans": total,
        "spans_per_s": round(total / elapsed),
        "records_per_s": round(len(steps) / elapsed),
        "append_us_per_record": round(append_s / len(steps) * 1e6, 2),
        "seconds": round(elapsed, 2),
        "batch_size": batch_size,
    }


def start_clickhouse_fixture(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A ClickHouse HTTP endpoint in a process of its own (the test suite's chdb-backed fixture,
    tests/support/clickhouse_http.py): the process and its URL, once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.clickhouse_http", str(directory), str(free_port())],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    url = proc.stdout.readline().decode().strip()
    if not url:
        proc.kill()
        raise RuntimeError(f"the ClickHouse HTTP fixture exited with {proc.wait(5)} before listening")
    return proc, url


def bench_ingestion(n: int, batch_size: int, tmp: Path) -> list[dict[str, Any]]:
    out = []
    store = open_span_store(None, tmp / "chdb")
    out.append({"backend": "chdb (embedded)", **ingest(store, tmp / "wal-chdb", n, batch_size)})
    proc, url = start_clickhouse_fixture(tmp / "fixture")
    try:
        store = open_span_store(url, tmp)
        out.append({"backend": "HTTP (clickhouse-connect)", **ingest(store, tmp / "wal-http", n, batch_size)})
    finally:
        proc.terminate()
        proc.wait(20)
    return out


# -- the proxy ---------------------------------------------------------------------------------------


def memory(pid: int) -> dict[str, Any]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1), "threads": int(status["Threads"])}


def shipper_pid(data_dir: Path, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = int((data_dir / "shipper.pid").read_text())
            if Path(f"/proc/{pid}").exists():
                return pid
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"no shipper in {data_dir}")


def wait_shipped(data_dir: Path, timeout_s: float = 120) -> None:
    """Until the shipper has nothing left to ship (asked on its socket)."""
    client = ShipperClient(data_dir, timeout_s=5)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            sinks = client.request_sync({"op": "stats"})["stats"]["sinks"]
            if all(s["unshipped_bytes"] == 0 for s in sinks.values()):
                return
        except ShipperUnavailable:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the shipper of {data_dir} did not catch up in {timeout_s} s")


def bench_proxy(duration: float, tmp: Path, rounds: int = 3) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    up_port, upstream = start_upstream(tmp / "upstream.log")
    procs = [upstream]
    direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
    try:
        ports: dict[bool, int] = {}
        pids: dict[bool, int] = {}
        for tracing in (True, False):
            port = free_port()
            serve = serve_argv(
                tmp / f"runcap-{tracing}.toml", up_port, port, tmp / f"data-{tracing}", tracing
            )
            proc = start(serve, port, f"runcap tracing={tracing}", tmp / f"runcap-{tracing}.log")
            procs.append(proc)
            ports[tracing], pids[tracing] = port, proc.pid
        shipper = shipper_pid(tmp / "data-True")
        for tracing in (True, False):  # warm up
            run_subprocess(f"http://127.0.0.1:{ports[tracing]}/v1/chat/completions", BODY, CAP_HEADERS,
                           concurrency=8, duration_s=1.0)  # fmt: skip
        for headers_name, headers in (("no run headers", {}), ("capped runs", CAP_HEADERS)):
            for name, kw in (
                ("closed c=64", {"concurrency": 64}),
                ("open 200 req/s", {"rate": 200.0}),
                ("open 500 req/s", {"rate": 500.0}),
            ):
                samples: dict[str, list[dict[str, Any]]] = {"direct": [], "tracing_on": [], "tracing_off": []}
                closed = "rate" not in kw
                if closed:
                    samples["tracing_on_shipper_paused"] = []
                for round_ in range(rounds):  # on/off alternate who goes first: the machine drifts
                    if not closed:
                        samples["direct"].append(
                            summarize(run_subprocess(direct, BODY, {}, duration_s=duration, **kw))
                        )
                    variants: list[tuple[bool, bool]] = [(True, False), (False, False)]
                    if closed:
                        variants.append((True, True))
                    for tracing, paused in variants if round_ % 2 == 0 else variants[::-1]:
                        wait_shipped(tmp / "data-True")  # the shipper is idle again
                        url = f"http://127.0.0.1:{ports[tracing]}/v1/chat/completions"
                        cpu0, ship0 = cpu_s(pids[tracing]), cpu_s(shipper)
                        if paused:
                            os.kill(shipper, signal.SIGSTOP)
                        try:
                            r = run_subprocess(url, BODY, headers, duration_s=duration, **kw)
                        finally:
                            if paused:
                                os.kill(shipper, signal.SIGCONT)
                        sample = {
                            **summarize(r),
                            "proxy_cpu_ms_per_req": round(
                                (cpu_s(pids[tracing]) - cpu0) * 1000 / max(1, r.count), 3
                            ),
                        }
                        if tracing:  # the shipper's CPU for these requests, once it has shipped them
                            wait_shipped(tmp / "data-True")
                            sample["shipper_cpu_ms_per_req"] = round(
                                (cpu_s(shipper) - ship0) * 1000 / max(1, r.count), 3
                            )
                        key = "tracing_on_shipper_paused" if paused else "tracing_on"
                        samples[key if tracing else "tracing_off"].append(sample)
                row: dict[str, Any] = {"scenario": f"{name}, {headers_name}", "rounds": rounds}
                for key, runs in samples.items():
                    if runs:
                        row[key] = {
                            k: round(statistics.median(run[k] for run in runs), 3)
                            for k in runs[0]
                            if isinstance(runs[0][k], (int, float)) and not isinstance(runs[0][k], bool)
                        }
                if "rate" in kw:
                    for key in ("tracing_on", "tracing_off"):
                        row[key].update(added_ms(row[key], row["direct"]))
                else:
                    ratios = [
                        on["rate"] / off["rate"]
                        for on, off in zip(samples["tracing_on"], samples["tracing_off"], strict=True)
                    ]
                    row["throughput_ratio_on_off"] = round(statistics.median(ratios), 3)
                    row["throughput_ratios"] = [round(x, 3) for x in ratios]
                    paused = samples["tracing_on_shipper_paused"]
                    offs = samples["tracing_off"]
                    paused_ratios = [on["rate"] / off["rate"] for on, off in zip(paused, offs, strict=True)]
                    row["throughput_ratio_on_shipper_paused_off"] = round(statistics.median(paused_ratios), 3)
                    row["throughput_ratios_shipper_paused"] = [round(x, 3) for x in paused_ratios]
                row["samples"] = samples
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
        wait_shipped(tmp / "data-True")
        mem = {
            "scenario": "memory after the load",
            "proxy_tracing_on": memory(pids[True]),
            "proxy_tracing_off": memory(pids[False]),
            "shipper_chdb": memory(shipper),
        }
        stop_all(procs[1:])
        del procs[1:]
        mem["shipper_clickhouse_server"] = bench_server_shipper(duration, tmp, up_port)
        rows.append(mem)
        print(json.dumps(mem), flush=True)
    finally:
        stop_all(procs)
    return rows


def bench_server_shipper(duration: float, tmp: Path, up_port: int) -> dict[str, Any]:
    """The shipper's RSS with a ClickHouse server (the HTTP fixture) instead of chdb, after the
    same closed-loop load."""
    port = free_port()
    fixture, url = start_clickhouse_fixture(tmp / "fixture-rss")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cfg = tmp / "runcap-server.toml"
        cfg.write_text(
            f'log_requests = false\nclickhouse_url = "{url}"\n[upstreams.openai]\nurl = "http://127.0.0.1:{up_port}"\n'
        )
        data = tmp / "data-server"
        serve = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg)]
        serve += ["--listen", f"127.0.0.1:{port}", "--data-dir", str(data)]
        procs.append(start(serve, port, "runcap (ClickHouse server)", tmp / "runcap-server.log"))
        shipper = shipper_pid(data)
        run_subprocess(
            f"http://127.0.0.1:{port}/v1/chat/completions", BODY, {}, concurrency=64, duration_s=duration
        )
        wait_shipped(data)
        return {**memory(shipper), "proxy": memory(procs[0].pid)}
    finally:
        stop_all(procs)
        fixture.terminate()
        fixture.wait(20)


def bench_baseline(duration: float, tmp: Path, rounds: int, baseline: Path) -> dict[str, Any]:
    """This tree against another checkout of runcap (`--baseline DIR`, e.g. `git archive REV | tar
    -x -C DIR`), tracing on and off, closed loop c=64 without run headers, interleaved rounds."""
    up_port, upstream = start_upstream(tmp / "upstream-ab.log")
    procs = [upstream]
    servers: dict[str, tuple[int, int]] = {}
    try:
        for tree, root in (("baseline", baseline), ("this tree", ROOT)):
            for tracing in (True, False):
                key = f"{tree}, tracing {'on' if tracing else 'off'}"
                port = free_port()
                slug = f"{'base' if tree == 'baseline' else 'this'}-{tracing}"
                argv = serve_argv(tmp / f"ab-{slug}.toml", up_port, port, tmp / f"ab-data-{slug}", tracing)
                proc = subprocess.Popen(
                    argv, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                    stdout=subprocess.DEVNULL, stderr=open(tmp / f"ab-{slug}.log", "ab"),
                )  # fmt: skip
                procs.append(proc)
                wait_port(port, proc, key)
                servers[key] = (port, proc.pid)
        for port, _ in servers.values():
            run_subprocess(
                f"http://127.0.0.1:{port}/v1/chat/completions", BODY, {}, concurrency=8, duration_s=1.0
            )
        samples: dict[str, list[tuple[float, float]]] = {key: [] for key in servers}
        order = list(servers)
        for round_ in range(rounds):
            for key in order if round_ % 2 == 0 else order[::-1]:
                port, pid = servers[key]
                time.sleep(2.0)  # the traced servers' background work of the run before settles
                cpu0 = cpu_s(pid)
                r = run_subprocess(f"http://127.0.0.1:{port}/v1/chat/completions", BODY, {}, concurrency=64,
                                   duration_s=duration)  # fmt: skip
                samples[key].append((r.achieved_rate, (cpu_s(pid) - cpu0) * 1000 / max(1, r.count)))
        out: dict[str, Any] = {
            "scenario": f"closed c=64, no run headers: this tree vs {baseline}",
            "rounds": rounds,
        }
        for key, xs in samples.items():
            out[key] = {
                "rate": round(statistics.median(x[0] for x in xs), 1),
                "proxy_cpu_ms_per_req": round(statistics.median(x[1] for x in xs), 3),
                "rates": [round(x[0]) for x in xs],
                **memory(servers[key][1]),
            }
        for tree in ("baseline", "this tree"):
            out[f"{tree}: throughput ratio on/off"] = round(
                out[f"{tree}, tracing on"]["rate"] / out[f"{tree}, tracing off"]["rate"], 3
            )
        print(json.dumps(out), flush=True)
        return out
    finally:
        stop_all(procs)


# -- the payload lane --------------------------------------------------------------------------------

# Run in a subprocess with the tree under test as its working directory and import path, so two
# trees' payload stores are measured side by side with the same code (`--payload-lane --baseline`).
# Only APIs both trees have: `WalWriter.append_step`, `Shipper(payloads=...)`, `LocalPayloadStore`.
PAYLOAD_LANE_PROBE = """
import hashlib, json, os, shutil, sys, tempfile, time
from datetime import UTC, datetime
from pathlib import Path
from proxy.spans.model import Payload, Span
from proxy.spans.payloads import LocalPayloadStore
from proxy.spans.shipper import Shipper
from proxy.spans.wal import WalWriter

n, profile = int(sys.argv[1]), sys.argv[2] == "1"
tmp = Path(tempfile.mkdtemp(prefix="runcap-payload-lane-"))
writer = WalWriter(tmp / "wal", segment_bytes=64 << 20, max_bytes=16 << 30)
t0 = datetime.now(UTC)
for i in range(n):  # one traced model call: its span, the request and response bodies (unique)
    request = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"ping %d"}],"max_tokens":32}' % i
    response = (b'{"id":"chatcmpl-%d","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,'
                b'"message":{"role":"assistant","content":"pong pong pong pong pong pong"},"finish_reason":'
                b'"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}' % i)
    bodies = [Payload(hashlib.sha256(b).hexdigest(), b) for b in (request, response)]
    span = Span(run_id=f"r{i}", kind="model", step=1, started_at=t0, request_hash=bodies[0].sha256,
                response_hash=bodies[1].sha256)
    writer.append_step([span], [], bodies)
writer.close()
store = LocalPayloadStore(tmp / "payloads", fsync=False)  # as `runcap serve` opens it
shipper = Shipper(tmp / "wal", payloads=store, flush_interval_s=0.05, poll_interval_s=0.02)
lane = shipper.lanes[-1]
if profile:  # the whole lane thread: reading the WAL, decoding records, the store
    import cProfile, pstats
    prof = cProfile.Profile()
    run = lane._run
    lane._run = lambda: prof.runcall(run)
cpu0, wall0 = time.process_time(), time.perf_counter()
shipper.start()
while lane.records_written < n and time.perf_counter() - wall0 < 120:
    time.sleep(0.005)
cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
shipper.stop()
assert lane.records_written >= n, (lane.records_written, n)
stored = sum(len(files) for _, _, files in os.walk(tmp / "payloads"))
shutil.rmtree(tmp)  # thousands of small files per run
if profile:
    shipper.stop()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
print(json.dumps({"records": n, "files": stored, "cpu_ms_per_record": round(cpu * 1e3 / n, 4),
                  "cpu_us_per_body": round(cpu * 1e6 / (2 * n), 2), "records_per_s": round(n / wall)}))
"""


def payload_lane_run(tree: Path, records: int, profile: bool = False) -> dict[str, Any]:
    """The payload lane of one `Shipper` of `tree` storing `records` calls' bodies (two each)
    from a WAL to a local payload store: the shipper process's CPU (all threads) per record."""
    out = subprocess.run(
        [sys.executable, "-c", PAYLOAD_LANE_PROBE, str(records), "1" if profile else "0"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"payload lane probe in {tree} failed: {out.stderr.decode()[-2000:]}")
    if profile:
        sys.stderr.write(out.stderr.decode())
    return json.loads(out.stdout.decode().splitlines()[-1])


def bench_payload_lane(records: int, rounds: int, baseline: Path | None) -> dict[str, Any]:
    """This tree's payload lane (and `baseline`'s, interleaved, who goes first alternating)."""
    trees = {"this tree": ROOT, **({"baseline": baseline} if baseline is not None else {})}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for round_ in range(rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for name in order:
            samples[name].append(payload_lane_run(trees[name], records))
    scenario = f"payload lane, {records} calls (2 unique bodies each)"
    row: dict[str, Any] = {"scenario": scenario, "rounds": rounds}
    for name, runs in samples.items():
        row[name] = {
            k: round(statistics.median(run[k] for run in runs), 4)
            for k in ("cpu_ms_per_record", "cpu_us_per_body", "records_per_s")
        }
        row[name]["rounds_cpu_us_per_body"] = [run["cpu_us_per_body"] for run in runs]
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--batch-size", type=int, default=20_000, help="spans per batch (the shipper's default)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per load run")
    ap.add_argument("--rounds", type=int, default=3, help="on/off pairs per scenario (medians reported)")
    ap.add_argument("--skip-proxy", action="store_true")
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--baseline", type=Path, help="also compare with this checkout of runcap (side by side)")
    ap.add_argument("--payload-lane", type=int, metavar="CALLS", help="only the payload lane, CALLS per run")
    ap.add_argument("--profile", action="store_true", help="with --payload-lane: cProfile the lane, once")
    args = ap.parse_args(argv)
    if args.payload_lane:
        if args.profile:
            payload_lane_run(ROOT, args.payload_lane, profile=True)
        row = bench_payload_lane(args.payload_lane, args.rounds, args.baseline and args.baseline.resolve())
        save_json(args.json, [row])
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="runcap-span-bench-"))
    results: list[dict[str, Any]] = []
    if not args.skip_ingest:
        for row in bench_ingestion(args.spans, args.batch_size, tmp):
            emit(results, row)
    if not args.skip_proxy:
        results += bench_proxy(args.duration, tmp, args.rounds)
    if args.baseline is not None:
        results.append(bench_baseline(args.duration, tmp, args.rounds, args.baseline.resolve()))
    save_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
