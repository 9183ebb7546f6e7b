"""How long a refusal takes while the ledger is down: the timing claim tests/system/test_ledger_faults.py
used to assert with a stopwatch ("answered within the ledger timeout"), measured here instead.

A `GuardedLedger` over a real redis-server, as the server builds it; the server is stopped
(connection refused: `ledger_unreachable`) and then frozen with SIGSTOP (nothing answers:
`ledger_timeout`, cut by the guard). For each, N model-call reservations are refused one after
the other, each in its own task (one request each), and the refusal latency is reported — p50,
p99 and max — next to the configured timeout. A frozen ledger's refusals should take about one
timeout (a request waits once), a stopped one's far less.

    .venv/bin/python -m bench.ledger_outage [--n 20] [--timeout 1.0] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


async def _refusals(ledger: Any, n: int, tag: str) -> dict[str, Any]:
    from proxy.caps import RunCaps
    from proxy.errors import LedgerUnavailable
    from proxy.ledger.base import StepRequest

    took: list[float] = []
    codes: set[str] = set()

    async def one(i: int) -> None:
        req = StepRequest(
            run_id=f"outage-{tag}-{i}", task="", caps=RunCaps(max_usd_nanos=10**9), now=time.time(),
            model="m", input_tokens_bound=100, client_output_limit=None, model_output_bound=1000,
            min_output_tokens=1, input_usd_per_mtok=Decimal(1), output_usd_per_mtok=Decimal(2),
        )  # fmt: skip
        t0 = time.perf_counter()
        try:
            await ledger.begin_step(req)
        except LedgerUnavailable as e:
            codes.add(e.code or "")
        else:
            raise RuntimeError("the ledger answered during the outage")
        took.append(time.perf_counter() - t0)

    for i in range(n):
        await asyncio.create_task(one(i))  # a task each: a request's remembered failure is its own
    q = statistics.quantiles(took, n=100, method="inclusive") if len(took) > 1 else took * 99
    return {
        "codes": sorted(codes),
        "p50_ms": round(1000 * statistics.median(took), 1),
        "p99_ms": round(1000 * q[98], 1),
        "max_ms": round(1000 * max(took), 1),
    }


async def _run(url: str, server: Any, n: int, timeout_s: float) -> dict[str, Any]:
    from proxy.ledger.guarded import GuardedLedger
    from proxy.ledger.redis import RedisLedger

    ledger = GuardedLedger(RedisLedger(url, prefix="outage:", op_timeout_s=timeout_s), timeout_s=timeout_s)
    try:
        await ledger.get_run("warm-up")  # connected
        out: dict[str, Any] = {"timeout_s": timeout_s}
        server.freeze()
        try:
            out["frozen"] = await _refusals(ledger, n, "frozen")
        finally:
            server.thaw()
        await asyncio.to_thread(server.terminate)
        out["stopped"] = await _refusals(ledger, n, "stopped")
        return out
    finally:
        await ledger.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="refusals per fault (default 20)")
    ap.add_argument("--timeout", type=float, default=1.0, help="ledger_timeout_s (default 1.0)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from tests.support.redis_server import RedisServer

    server = RedisServer(persistent=True).start()
    try:
        result = asyncio.run(_run(server.url, server, args.n, args.timeout))
    finally:
        server.thaw()
        server.stop()
    for fault in ("frozen", "stopped"):
        r = result[fault]
        print(
            f"redis {fault:<8} {','.join(r['codes']):<20} p50 {r['p50_ms']:>7.1f} ms  "
            f"p99 {r['p99_ms']:>7.1f} ms  max {r['max_ms']:>7.1f} ms  (ledger_timeout_s {args.timeout:g})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
