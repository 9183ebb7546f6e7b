"""What `X-Run-Context-Policy: offload` adds to a step of a 200 KB conversation.

Two measurements, on the same conversation (chat completions: a user message, then ten steps
each calling a tool that returned 20 KB; ~205 KB of JSON):

* policy CPU — the work the policy adds to the request path, in this process, without I/O:
  `apply_policies` on a request body (offload: hash and cut the old results, add the fetch tool,
  re-read the body), plus serialising the rewritten body, which the forwarder does instead of sending the
  agent's bytes as they came. p50 / p99 over `--iterations` calls.
* end to end — runcap in-process (SQLite ledger, caps on, tracing off) in front of the scripted
  upstream, one client sending the same body sequentially, requests with and without the header
  interleaved one by one (the pair shares the machine's noise); p50 / p99 latency of each, and the
  difference of the p50s. With offload the upstream receives ~12 KB instead of ~205 KB, so the
  end-to-end figure includes what the smaller body saves downstream.

    .venv/bin/python -m bench.context_bench [--iterations 2000] [--requests 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.app import RUNTIME, build_app
from proxy.config import build_config
from proxy.context import ContextSettings, ModelAnswer
from proxy.context.policy import apply_policies
from proxy.context.summarize import SummaryCache
from proxy.providers.openai_chat import ChatCompletionsAdapter
from proxy.scripted_upstream import ScriptedUpstream

STEPS = 10
RESULT_BYTES = 20_480


def conversation() -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "read every page and summarise them"}]
    for i in range(STEPS):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "read", "arguments": f'{{"i": {i}}}'},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        line = f"page {i}: the quick brown fox jumps over the lazy dog, again and again. "
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": (line * 400)[:RESULT_BYTES]})
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    return {"model": "gpt-4o-mini", "messages": messages, "tools": tools, "max_tokens": 64}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def policy_cpu(body: bytes, iterations: int) -> dict[str, float]:
    """p50 / p99 ms of apply_policies + the re-serialisation, on a fresh body each time."""

    async def no_call(_: dict[str, Any]) -> ModelAnswer:
        raise AssertionError("offload makes no model call")

    adapter = ChatCompletionsAdapter()
    settings = ContextSettings()
    summaries = SummaryCache()
    times = []
    forwarded: dict[str, Any] = {}
    for _ in range(iterations):
        parsed = orjson.loads(body)
        info = adapter.parse_request(parsed)
        t0 = time.perf_counter()
        done = await apply_policies(
            adapter,
            parsed,
            info,
            body,
            ("offload",),
            settings,
            run_id="bench",
            summaries=summaries,
            call=no_call,
        )
        assert done is not None
        orjson.dumps(done.body)
        times.append((time.perf_counter() - t0) * 1000)
        forwarded = done.body
    return {
        "p50_ms": statistics.median(times),
        "p99_ms": percentile(times, 0.99),
        "rewritten_bytes": len(orjson.dumps(forwarded)),
    }


async def end_to_end(body: bytes, requests: int) -> dict[str, Any]:
    up = ScriptedUpstream(record=False)
    up.scripts["default"] = [{"text": "ok"}]
    await up.start()
    with tempfile.TemporaryDirectory() as data:
        raw = {
            "upstreams": {"openai": {"url": up.url}},
            "log_requests": False,
            "tracing": False,
        }
        config = build_config(raw, {}, listen="127.0.0.1:0", data_dir=str(Path(data)))
        app = build_app(config)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
        out: dict[str, list[float]] = {"off": [], "offload": []}
        try:
            async with aiohttp.ClientSession() as s:
                for i in range(requests * 2 + 20):
                    policy = "offload" if i % 2 else "off"
                    h = {"Content-Type": "application/json", "X-Run-Id": f"bench-{i}", "X-Run-Max-Usd": "100"}
                    if policy == "offload":
                        h["X-Run-Context-Policy"] = "offload"
                    t0 = time.perf_counter()
                    async with s.post(url, data=body, headers=h) as r:
                        await r.read()
                        assert r.status == 200, r.status
                    if i >= 20:  # warm-up
                        out[policy].append((time.perf_counter() - t0) * 1000)
        finally:
            assert app[RUNTIME] is not None
            await runner.cleanup()
            await up.stop()
    result: dict[str, Any] = {
        k: {"p50_ms": statistics.median(v), "p99_ms": percentile(v, 0.99), "n": len(v)}
        for k, v in out.items()
    }
    result["added_p50_ms"] = result["offload"]["p50_ms"] - result["off"]["p50_ms"]
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--json")
    args = parser.parse_args()
    body = orjson.dumps(conversation())
    report = {
        "conversation_bytes": len(body),
        "policy_cpu": await policy_cpu(body, args.iterations),
        "end_to_end": await end_to_end(body, args.requests),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
