"""Tool policies: what a tool's rules add to a call (issue 23: ≤ 50 µs per call for ten rules;
a tool without rules costs what it cost before).

    .venv/bin/python -m bench.policy_bench [--calls 2000] [--repeats 5] [--http-calls 400]

1. The decision itself, in-process: `PolicyCheck.admit` — the check both gateways make before
   the ledger — on a tool with no rules, and with ten rules where none holds (every rule is
   evaluated: the worst case) or the first holds; the best per-call time over `repeats` rounds.
2. End to end: `/tools/refund` through a runcap app (SQLite ledger, tracing off) to a tool service,
   `http-calls` sequential side-effecting calls each, with no rules (twice: two equal apps, the
   comparison's noise floor) and with the ten rules (none holding), interleaved so all see the
   same machine; p50 of each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.app import build_app
from proxy.caps import RunCaps, RunRequest
from proxy.config import build_config
from proxy.ledger.base import ToolCallRequest
from proxy.ledger.sqlite.ledger import SQLiteLedger
from proxy.server.metrics import Metrics
from proxy.toolcall.approval import RefusingGate
from proxy.toolcall.call import ToolCall
from proxy.toolcall.policy import PolicyCheck

ARGS = {"order_id": "o-1", "amount": 20, "currency": "EUR", "reason": "late delivery"}
# Ten rules of the kinds operators write: comparisons, string tests, membership, the run's task.
TEN = [
    {"name": "large", "when": "args.amount > 100", "effect": "approve", "reason": "needs a person"},
    {"name": "non-eur", "when": "args.currency != 'EUR'", "effect": "deny", "reason": "only EUR"},
    {"name": "test-orders", "when": "args.order_id.startsWith('test-')", "effect": "deny"},
    {"name": "negative", "when": "args.amount < 0", "effect": "deny"},
    {"name": "vip", "when": "args.order_id in ['o-vip-1', 'o-vip-2']", "effect": "allow"},
    {"name": "fraud", "when": "args.reason.contains('chargeback')", "effect": "deny"},
    {"name": "night-task", "when": "run.task == 'nightly' && args.amount > 50", "effect": "deny"},
    {"name": "tenant-x", "when": "run.tenant == 'x' && args.amount > 10", "effect": "approve"},
    {"name": "big-round", "when": "args.amount >= 1000 && args.amount % 1000 == 0", "effect": "deny"},
    {"name": "others", "when": "tool.name != 'refund'", "effect": "deny"},
]


def per_call(fn: Any, calls: int, repeats: int) -> float:
    loop = asyncio.new_event_loop()
    best = float("inf")
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            loop.run_until_complete(_loop(fn, calls))
            best = min(best, (time.perf_counter() - start) / calls)
    finally:
        loop.close()
    return best


async def _loop(fn: Any, calls: int) -> None:
    for _ in range(calls):
        await fn()


def decision_bench(calls: int, repeats: int, data: Path) -> dict[str, float]:
    def check(rules: list[dict[str, Any]]) -> PolicyCheck:
        tools = {"refund": {"url": "http://127.0.0.1:9/refund", **({"rules": rules} if rules else {})}}
        config = build_config({"tools": tools}, {}, data_dir=str(data))
        return PolicyCheck(config, SQLiteLedger(data / "ledger.sqlite3"), Metrics(), RefusingGate())

    run = RunRequest("bench-run", False, "triage", RunCaps())
    req = ToolCallRequest("bench-run", "triage", RunCaps(), time.time(), "refund", "k" * 32, "h" * 64)
    first_holds = [{"name": "all", "when": "args.amount > 0", "effect": "allow"}, *TEN[1:]]
    out = {}
    cases = (("no rules", []), ("ten rules, none holds", TEN), ("ten rules, first holds", first_holds))
    for name, rules in cases:
        pc = check(rules)

        async def admit(pc: PolicyCheck = pc) -> None:
            call = ToolCall("refund")
            if pc.has_rules("refund"):  # as the gateways call it
                await pc.admit(call, req, run, args=ARGS, method="POST", path="")

        out[name] = per_call(admit, calls, repeats)
    return out


async def http_bench(calls: int, data: Path) -> dict[str, float]:
    """p50 of each app's calls, and ("admit in situ") the p50 of the time the ten-rules app spent
    in `PolicyCheck.admit` — the decision inside a busy process, where cel-cpp's code and data are
    not as hot as in the loop of `decision_bench`."""
    hits = 0
    in_situ: list[float] = []
    admit = PolicyCheck.admit

    async def timed_admit(self: PolicyCheck, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await admit(self, *args, **kwargs)
        finally:
            in_situ.append(time.perf_counter() - t0)

    PolicyCheck.admit = timed_admit  # type: ignore[method-assign]

    async def tool(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        await request.read()
        return web.json_response({"ok": True})

    tool_app = web.Application()
    tool_app.router.add_post("/refund", tool)
    runners = []

    async def serve(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    tool_url = await serve(tool_app)
    urls = {}
    # "no rules (again)": a second app like the first, the noise floor of the comparison.
    for k, (name, rules) in enumerate((("no rules", []), ("no rules (again)", []), ("ten rules", TEN))):
        refund = {"url": f"{tool_url}/refund", "side_effects": True, **({"rules": rules} if rules else {})}
        raw = {"tools": {"refund": refund}, "tracing": False, "log_requests": False}
        config = build_config(raw, {}, listen="127.0.0.1:0", data_dir=str(data / f"app{k}"))
        urls[name] = await serve(build_app(config))
    samples: dict[str, list[float]] = {name: [] for name in urls}
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(calls):
                for k, (name, url) in enumerate(urls.items()):  # interleaved: all see the same machine
                    body = {**ARGS, "order_id": f"o-{i}"}
                    t0 = time.perf_counter()
                    run = {"X-Run-Id": f"r{k}-{i}"}
                    async with s.post(f"{url}/tools/refund", json=body, headers=run) as r:
                        await r.read()
                        assert r.status == 200, await r.text()
                    samples[name].append(time.perf_counter() - t0)
    finally:
        PolicyCheck.admit = admit  # type: ignore[method-assign]
        for runner in reversed(runners):
            await runner.cleanup()
    assert hits == calls * len(urls) and len(in_situ) == calls
    medians = {name: statistics.median(v) for name, v in samples.items()}
    return {**medians, "admit in situ": statistics.median(in_situ)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--http-calls", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        decisions = decision_bench(args.calls, args.repeats, data)
        print("PolicyCheck.admit (the decision, in-process):")
        for name, seconds in decisions.items():
            print(f"  {name:26s} {seconds * 1e6:8.2f} µs/call")
        added = decisions["ten rules, none holds"] - decisions["no rules"]
        print(f"  ten rules add              {added * 1e6:8.2f} µs/call (target ≤ 50 µs)")
        e2e = asyncio.run(http_bench(args.http_calls, data))
        print(f"/tools/refund end to end, p50 of {args.http_calls} sequential calls each:")
        for name, seconds in e2e.items():
            if name != "admit in situ":
                print(f"  {name:26s} {seconds * 1e3:8.3f} ms")
        added = e2e["ten rules"] - e2e["no rules"]
        floor = e2e["no rules (again)"] - e2e["no rules"]
        print(
            f"  ten rules add              {added * 1e6:8.1f} µs (p50 difference; two equal apps differ by "
            f"{floor * 1e6:.1f} µs)"
        )
        print(
            f"  PolicyCheck.admit in situ  {e2e['admit in situ'] * 1e6:8.1f} µs (p50, in the ten-rules app)"
        )


if __name__ == "__main__":
    main()
