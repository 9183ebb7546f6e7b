"""Span pipeline benchmarks.

1. Sustained ingestion into ClickHouse through the real pipeline (queue → batcher → sink), for
   embedded chdb and for the ClickHouse HTTP path (clickhouse-connect against the chdb-backed
   HTTP fixture in its own process): spans/s from the first submit until the sink reports every
   record written.
2. Proxy throughput with the full pipeline on (embedded chdb, payloads stored) versus tracing off,
   measured back to back, closed loop at concurrency 64, plus added latency at 200 req/s.

    .venv/bin/python -m bench.span_bench [--spans 200000] [--duration 10] [--skip-proxy]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.loadgen import run_subprocess
from bench.proxy_bench import BODY, CAP_HEADERS, ROOT, free_port, start, stop_all, summarize
from proxy.spans.clickhouse import open_span_store
from proxy.spans.model import RunSnapshot, Span
from proxy.spans.pipeline import SpanPipeline


def synthetic(n: int) -> tuple[list[Span], list[RunSnapshot]]:
    """Spans shaped like a real agent's: 20 steps per run, model spans with usage, tool calls."""
    t0 = datetime.now(UTC)
    spans, runs = [], []
    for i in range(n):
        run = f"bench-{i // 20}"
        kind = "model" if i % 2 == 0 else "tool_call"
        tool = kind != "model"
        spans.append(
            Span(
                run_id=run, kind=kind, step=i % 20 + 1, started_at=t0 + timedelta(microseconds=i),
                duration_ms=812.5, task="bench", provider="openai", model="gpt-4o-mini",
                endpoint="chat.completions", status_code=200, input_tokens=1200 + i % 500,
                output_tokens=80, cost_usd=Decimal("0.000228000"), tool_name="refund" if tool else "",
                tool_call_id=f"call_{i}" if tool else "", args_hash="ab" * 32 if tool else "",
                request_hash="cd" * 32, response_hash="ef" * 32,
            )
        )  # fmt: skip
        if i % 20 == 19:
            runs.append(
                RunSnapshot(
                    run_id=run, task="bench", started_at=t0, updated_at=t0 + timedelta(seconds=1),
                    status="completed", steps=20, tool_calls=10, input_tokens=30000, output_tokens=1600,
                    cost_usd=Decimal("0.00456"), max_usd=Decimal("1"), max_tokens=None, max_steps=50,
                    max_tool_calls=None, deadline=None,
                )
            )  # fmt: skip
    return spans, runs


def ingest(
    store: Any, spans: list[Span], runs: list[RunSnapshot], spool: Path, batch_size: int
) -> dict[str, Any]:
    pipeline = SpanPipeline([store], None, spool, batch_size=batch_size, flush_interval_s=0.2)
    pipeline.start()
    total = len(spans) + len(runs)
    t0 = time.perf_counter()
    for i, span in enumerate(spans):
        pipeline.submit_span(span)
        if i % 20 == 19:
            pipeline.submit_run(runs[i // 20])
    submitted = time.perf_counter() - t0
    while pipeline.stats().sinks["clickhouse"].records_written < total:
        if time.perf_counter() - t0 > 300:
            raise RuntimeError("ingestion did not finish in 300 s")
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    _, rows = store.query("SELECT count() FROM runcap.spans", None)
    assert rows[0][0] >= len(spans), rows
    pipeline.close()  # closes the store too
    return {
        "records": total,
        "spans_per_s": round(len(spans) / elapsed),
        "records_per_s": round(total / elapsed),
        "submit_us_per_record": round(submitted / total * 1e6, 2),
        "seconds": round(elapsed, 2),
        "batch_size": batch_size,
    }


def bench_ingestion(n: int, batch_size: int, tmp: Path) -> list[dict[str, Any]]:
    spans, runs = synthetic(n)
    out = []
    store = open_span_store(None, tmp / "chdb")
    out.append({"backend": "chdb (embedded)", **ingest(store, spans, runs, tmp / "spool-chdb", batch_size)})
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.clickhouse_http", str(tmp / "fixture"), str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().decode().strip()
        store = open_span_store(url, tmp)
        out.append(
            {
                "backend": "HTTP (clickhouse-connect)",
                **ingest(store, spans, runs, tmp / "spool-http", batch_size),
            }
        )
    finally:
        proc.terminate()
        proc.wait(20)
    return out


def bench_proxy(duration: float, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    up_port = free_port()
    procs = [
        start(
            [sys.executable, "-m", "proxy.cli", "mock-upstream", "--listen", f"127.0.0.1:{up_port}"],
            up_port, "upstream", tmp / "upstream.log",
        )
    ]  # fmt: skip
    try:
        ports = {}
        for tracing in (True, False):
            port = free_port()
            cfg = tmp / f"runcap-{tracing}.toml"
            cfg.write_text(
                f"log_requests = false\ntracing = {'true' if tracing else 'false'}\n"
                f'[upstreams.openai]\nurl = "http://127.0.0.1:{up_port}"\n'
            )
            serve = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg)]
            serve += ["--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp / f"data-{tracing}")]
            procs.append(start(serve, port, f"runcap tracing={tracing}", tmp / f"runcap-{tracing}.log"))
            ports[tracing] = port
        for tracing in (True, False):  # warm up
            run_subprocess(f"http://127.0.0.1:{ports[tracing]}/v1/chat/completions", BODY, CAP_HEADERS,
                           concurrency=8, duration_s=1.0)  # fmt: skip
        for name, kw in (("closed c=64", {"concurrency": 64}), ("open 200 req/s", {"rate": 200.0})):
            res = {}
            for tracing in (True, False):
                url = f"http://127.0.0.1:{ports[tracing]}/v1/chat/completions"
                res[tracing] = run_subprocess(url, BODY, CAP_HEADERS, duration_s=duration, **kw)
            row = {"scenario": name, "tracing_on": summarize(res[True]), "tracing_off": summarize(res[False])}
            if "concurrency" in kw:
                row["throughput_ratio_on_off"] = round(res[True].achieved_rate / res[False].achieved_rate, 3)
            else:
                row["p50_delta_ms"] = round(row["tracing_on"]["p50_ms"] - row["tracing_off"]["p50_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_all(procs)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--batch-size", type=int, default=5000)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--skip-proxy", action="store_true")
    ap.add_argument("--skip-ingest", action="store_true")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="runcap-span-bench-"))
    if not args.skip_ingest:
        for row in bench_ingestion(args.spans, args.batch_size, tmp):
            print(json.dumps(row), flush=True)
    if not args.skip_proxy:
        bench_proxy(args.duration, tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
