"""Agent runs for the on-call queries and the read CLI, driven through runcap with the official
`openai` client (sync, so module-scoped fixtures need no event loop): runs that repeat a side
effect (requested by the model, and executed through `/tools`), runs that hit each cap, completed
runs of two tasks, an unpriced model, tool timeouts and an outcome left unknown.

`Services` runs the scripted model, a tool service and (optionally) runcap itself on a background
event loop, so the test thread can drive them with blocking clients.
`play(...)` runs every scenario and returns `Facts`: what the client saw (usage per step, statuses),
for the tests to compute exact expectations from.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
from aiohttp import web

from proxy.pricing import PriceBook
from proxy.providers.base import Usage
from proxy.scripted_upstream import ScriptedUpstream
from tests.support.tool_service import ToolService

UNPRICED_MODEL = "acme-private-7b"
MODEL = "gpt-4o-mini"
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("refund", "lookup_order")
]
REFUND = {"order_id": "A1", "amount": 5}

SCRIPTS: dict[str, list[dict[str, Any]]] = {
    # asks for the same refund twice (the classic duplicate side effect), then answers
    "double-refund": [
        {"tool_calls": [{"name": "refund", "arguments": REFUND}]},
        {"tool_calls": [{"name": "refund", "arguments": REFUND}], "cache_read_tokens": 40},
        {"text": "Refunded A1 (twice, sorry)."},
    ],
    "lookup": [
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "B7"}}]},
        {"text": "Order B7 shipped.", "reasoning_tokens": 12},
    ],
    "answer": [{"text": "Done."}],
    "wanderer": [
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "C1"}}]},
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "C2"}}]},
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "C3"}}]},
    ],
    "essayist": [{"text_tokens": 600}],
    "slow": [{"delay_s": 2.0, "text": "too late"}],
}


def tools_config(tool_url: str) -> dict[str, Any]:
    return {
        "refund": {"url": f"{tool_url}/refund", "side_effects": True, "key_fields": ["order_id", "amount"]},
        # side-effecting, slow: its timeout leaves the outcome unknown
        "charge": {"url": f"{tool_url}/charge", "side_effects": True, "key_fields": ["order_id"],
                   "timeout_s": 0.3},
        # read-only: a timeout is just a timeout
        "search": {"url": f"{tool_url}/search", "side_effects": False, "timeout_s": 0.3},
        # large payouts wait for a person (`defer`: 428 at once, nothing reaches the tool)
        "payout": {"url": f"{tool_url}/payout", "side_effects": True, "rules": [
            {"name": "large", "when": "args.amount > 100", "effect": "approve", "mode": "defer",
             "reason": "payouts over 100 need a person"}]},
    }  # fmt: skip


class Services:
    """Scripted model + tool service (+ runcap apps) on one background event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.upstream = ScriptedUpstream(SCRIPTS)
        self.tool = ToolService()
        self.upstream_url: str = self.run(self.upstream.start())
        self.run(self.tool.start())
        assert self.tool.url is not None
        self.tool_url: str = self.tool.url
        self._runners: list[web.AppRunner] = []

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def config_raw(self, **extra: Any) -> dict[str, Any]:
        raw: dict[str, Any] = {
            "upstreams": {"openai": {"url": self.upstream_url}},
            "tools": tools_config(self.tool_url),
            "log_requests": False,
        }
        raw.update(extra)
        return raw

    def start_runcap(self, data_dir: Path, **extra: Any) -> tuple[str, Any]:
        """runcap in this process, on the background loop; returns (url, Runtime)."""
        from proxy.app import RUNTIME, build_app
        from proxy.config import build_config

        config = build_config(self.config_raw(**extra), {}, listen="127.0.0.1:0", data_dir=str(data_dir))

        async def start() -> tuple[str, Any]:
            app = build_app(config, span_options={"flush_interval_s": 0.05, "retry_initial_s": 0.05})
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self._runners.append(runner)
            return f"http://127.0.0.1:{runner.addresses[0][1]}", app[RUNTIME]

        return self.run(start())

    def stop_runcaps(self) -> None:
        while self._runners:
            self.run(self._runners.pop().cleanup())

    def close(self) -> None:
        self.stop_runcaps()
        self.run(self.tool.stop())
        self.run(self.upstream.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# -- what the client saw ------------------------------------------------------------------------


@dataclass
class StepSeen:
    step: int
    model: str
    usage: Usage
    status: int = 200


@dataclass
class RunSeen:
    run_id: str
    task: str
    steps: list[StepSeen] = field(default_factory=list)
    refusals: list[tuple[int, str]] = field(default_factory=list)  # (HTTP status, error code)
    # A call cut mid-flight (deadline) is charged what it reserved: the agent sees no usage for
    # it, so the run's own state (GET /runs/{id}) says what it cost.
    cut_charge: Decimal = Decimal(0)

    def cost(self, prices: PriceBook) -> Decimal:
        return sum((step_cost(prices, s) for s in self.steps), Decimal(0)) + self.cut_charge


def step_cost(prices: PriceBook, s: StepSeen) -> Decimal:
    return prices.cost("openai", s.model, s.usage).usd


@dataclass
class Facts:
    prefix: str
    runs: dict[str, RunSeen] = field(default_factory=dict)  # by scenario name
    tool_runs: set[str] = field(default_factory=set)  # runs that made /tools calls
    tool_spans: int = 0  # /tools calls made
    model_spans: int = 0  # model calls that reached runcap (refused ones too)
    tool_call_spans: int = 0
    tool_result_spans: int = 0

    def run_id(self, name: str) -> str:
        return self.runs[name].run_id

    def all_run_ids(self) -> set[str]:
        """Every run runcap saw: model calls made a run row, and so did /tools calls."""
        return {s.run_id for s in self.runs.values()} | self.tool_runs


def _usage(u: Any) -> Usage:
    cached = (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
    reasoning = (u.completion_tokens_details.reasoning_tokens or 0) if u.completion_tokens_details else 0
    return Usage(u.prompt_tokens, u.completion_tokens, cache_read_tokens=cached, reasoning_tokens=reasoning)


class Agent:
    """A minimal agent loop over the official client; optionally runs tools through runcap."""

    def __init__(self, base: str, facts: Facts, admin_token: str | None = None) -> None:
        self.base = base
        self.facts = facts
        self.admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)

    def run(
        self, name: str, task: str, script: str, caps: dict[str, str] | None = None, *,
        model: str = MODEL, max_calls: int = 6, via_tools: bool = False, max_tokens: int | None = None,
        keep_writing: bool = False, seen: RunSeen | None = None,
    ) -> RunSeen:  # fmt: skip
        if seen is None:
            seen = self.facts.runs[name] = RunSeen(f"{self.facts.prefix}-{name}", task)
        headers = {"X-Run-Id": seen.run_id, "X-Run-Task": task, "X-Mock-Script": script, **(caps or {})}
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"please handle {name}"}]
        pending_results = 0
        for _ in range(max_calls):
            self.facts.model_spans += 1
            self.facts.tool_result_spans += pending_results  # recorded from this request
            pending_results = 0
            try:
                kwargs: dict[str, Any] = {"max_tokens": max_tokens} if max_tokens else {}
                raw = self.client.chat.completions.with_raw_response.create(
                    model=model, messages=messages, tools=TOOLS, extra_headers=headers, **kwargs
                )
            except openai.APIStatusError as e:
                body = e.body if isinstance(e.body, dict) else {}
                err = body.get("error", body) if isinstance(body, dict) else {}
                seen.refusals.append((e.status_code, str(err.get("code") or err.get("type"))))
                if e.status_code == 504:
                    ask = urllib.request.Request(f"{self.base}/runs/{seen.run_id}", headers=self.admin)
                    with urllib.request.urlopen(ask, timeout=10) as r:
                        ledger = Decimal(json.loads(r.read())["cost_usd"])
                    seen.cut_charge = ledger - seen.cost(PriceBook())
                return seen
            resp = raw.parse()
            seen.steps.append(StepSeen(int(raw.headers["x-run-step"]), model, _usage(resp.usage)))
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            self.facts.tool_call_spans += len(msg.tool_calls or [])
            pending_results = len(msg.tool_calls or [])
            if not msg.tool_calls:
                if not keep_writing:
                    break
                messages.append({"role": "user", "content": "go on"})
                continue
            for call in msg.tool_calls:
                result: Any = {"ok": True}
                if via_tools:
                    _, result = self.tool(
                        seen.run_id, call.function.name, json.loads(call.function.arguments)
                    )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
        return seen

    def tool(
        self, run_id: str, name: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        self.facts.tool_spans += 1
        self.facts.tool_runs.add(run_id)
        return post(f"{self.base}/tools/{name}", body, {"X-Run-Id": run_id, **(headers or {})})

    def cancel(self, run_id: str) -> None:
        status, answer = post(f"{self.base}/runs/{run_id}/cancel", None, self.admin)
        assert status == 200, answer

    def resolve(self, run_id: str, key: str, outcome: str) -> None:
        status, answer = post(
            f"{self.base}/admin/idempotency/{key}/resolve", {"run_id": run_id, "outcome": outcome}, self.admin
        )
        assert status == 200, answer

    def close(self) -> None:
        self.client.close()


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = b"" if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def play(base: str, prefix: str, admin_token: str | None = None) -> Facts:
    """Every scenario, in order; returns what the client saw."""
    facts = Facts(prefix)
    agent = Agent(base, facts, admin_token)
    try:
        # Completed runs of two tasks; the first asks for the same refund twice and runs each call
        # through /tools/refund: executed once, replayed once.
        agent.run("dup", "refunds", "double-refund", {"X-Run-Max-Usd": "1"}, via_tools=True)
        # The same duplicate from an agent that runs its tools itself: only requested calls.
        agent.run("dup-model", "refunds", "double-refund", {"X-Run-Max-Usd": "1"})
        agent.run("ok-lookup", "refunds", "lookup", {"X-Run-Max-Steps": "10", "X-Run-Max-Usd": "1"})
        agent.run("ok-answer", "triage", "answer", {"X-Run-Max-Steps": "8"})
        agent.run("ok-lookup-2", "triage", "lookup", {"X-Run-Max-Steps": "8", "X-Run-Timeout": "600"})

        # Caps.
        agent.run("usd", "essays", "essayist", {"X-Run-Max-Usd": "0.0006"}, max_tokens=600, keep_writing=True)
        agent.run("tokens", "essays", "essayist", {"X-Run-Max-Tokens": "1500"}, max_tokens=600,
                  keep_writing=True)  # fmt: skip
        # The last allowed step answers without tools; the agent goes on and is refused (402).
        agent.run("steps", "triage", "wanderer", {"X-Run-Max-Steps": "2"}, max_calls=3, keep_writing=True)
        toolcap = agent.run(
            "toolcap", "triage", "wanderer", {"X-Run-Max-Tool-Calls": "1"}, max_calls=3, keep_writing=True
        )
        # Executing the call the model requested is not a second use of the cap; another is.
        agent.tool(toolcap.run_id, "refund", {"order_id": "C9", "amount": 1})  # executes
        agent.tool(toolcap.run_id, "refund", {"order_id": "C10", "amount": 1})  # 402 max_tool_calls
        agent.run("deadline", "triage", "slow", {"X-Run-Timeout": "0.3"}, max_tokens=16)
        cancel = agent.run("cancel", "triage", "answer")
        agent.cancel(cancel.run_id)
        agent.run("cancel", "triage", "answer", seen=cancel)  # refused: 410

        # An unpriced model (no dollar cap, so it is allowed).
        agent.run("unpriced", "triage", "answer", model=UNPRICED_MODEL)

        # /tools only: a read-only tool polled in a storm, a side effect that times out (unknown)
        # and is repeated (409), and one that is resolved and then executes.
        storm = f"{prefix}-storm"
        for _ in range(4):
            agent.tool(storm, "search", {"q": "refund policy"})
        unknown = f"{prefix}-unknown"
        agent.tool(unknown, "charge", {"order_id": "Z9", "sleep_s": 1.0})
        agent.tool(unknown, "charge", {"order_id": "Z9", "sleep_s": 0})  # 409: outcome unknown
        resolved = f"{prefix}-resolved"
        status, _ = agent.tool(resolved, "charge", {"order_id": "Y1", "sleep_s": 1.0})
        assert status == 504, status
        from proxy.hashing import idempotency_key

        agent.resolve(resolved, idempotency_key(resolved, "charge", {"order_id": "Y1"}, None), "not_done")
        agent.tool(resolved, "charge", {"order_id": "Y1", "sleep_s": 0})  # executes
        # A payout held for a person (queries/approvals.sql): asked, never decided.
        status, _ = agent.tool(storm, "payout", {"order_id": "P1", "amount": 500})
        assert status == 428, status
        agent.tool(f"{prefix}-search-timeout", "search", {"q": "slow", "sleep_s": 1.0})
    finally:
        agent.close()
    return facts


def wait_for_spans(query: Any, count: int, timeout: float = 20.0) -> None:
    """Poll `query(sql) -> rows` until runcap.spans holds `count` rows (the pipeline flushes
    asynchronously)."""
    deadline = time.monotonic() + timeout
    n = -1
    while time.monotonic() < deadline:
        n = query("SELECT count() FROM runcap.spans")[0][0]
        if n >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"span store has {n} spans, expected {count}")
