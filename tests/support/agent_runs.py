"""A small fleet of agent runs through runcap, for tests that need a span store with realistic
content (the dashboards): two tasks, tool calls executed through `/tools` (ok, replayed, error,
timeout, unknown), duplicate tool requests, a step cap, a dollar cap, a deadline, a cancel, prompt
cache reads and an unpriced model. Every run is driven with the official `openai` client against
runcap, whose upstream is the scripted model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai

from proxy.scripted_upstream import ScriptedUpstream

REFUND = {"order_id": "A1", "amount": 5}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("refund", "lookup", "charge", "broken", "peek")
]

# name → script (the step played = assistant turns already in the history)
SCRIPTS: dict[str, list[dict[str, Any]]] = {
    # refund twice with the same arguments (the model repeats itself), then answer
    "refund": [
        {"tool_calls": [{"name": "refund", "arguments": REFUND}]},
        {"tool_calls": [{"name": "refund", "arguments": REFUND}]},
        {"text": "Refunded order A1."},
    ],
    # long prompts served partly from the prompt cache
    "cached": [
        {"tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}], "input_tokens": 400},
        {"text": "cached answer " * 5, "input_tokens": 600, "cache_read_tokens": 384},
        {"text": "again", "input_tokens": 800, "cache_read_tokens": 512},
    ],
    # asks for tools forever: the step cap ends it with an answer-only step
    "loop": [{"tool_calls": [{"name": "lookup", "arguments": {"q": "more"}}]}],
    "long": [{"text_tokens": 400}],
    "slow": [{"text": "late", "delay_s": 2.0}],
    "search": [
        {"tool_calls": [{"name": "lookup", "arguments": {"q": "runcap"}}]},
        {"tool_calls": [{"name": "broken", "arguments": {"q": "x"}}]},
        {"tool_calls": [{"name": "charge", "arguments": {"card": "c1", "amount": 3, "sleep_s": 5}}]},
        {"tool_calls": [{"name": "peek", "arguments": {"sleep_s": 5}}]},
        {"text": "Found it."},
    ],
    "plain": [{"text": "Hello there, this is an answer of a few words."}],
}


@dataclass
class Fleet:
    """What the runs did, for assertions: run id → (task, expected final status)."""

    runs: dict[str, tuple[str, str]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # run id → the status code that stopped it


async def _tool(base: str, run: str, task: str, name: str, args: dict[str, Any]) -> tuple[int, str]:
    h = {"X-Run-Id": run, "X-Run-Task": task, "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{base}/tools/{name}", data=json.dumps(args), headers=h) as r,
    ):
        return r.status, await r.text()


async def agent(
    base: str, run: str, task: str, script: str, *, model: str = "gpt-4o-mini",
    headers: dict[str, str] | None = None, max_turns: int = 6, execute_tools: bool = True,
) -> int:  # fmt: skip
    """Drive one run: call the model, execute the tools it asks for through runcap's `/tools`
    (or answer them itself), send the results back, until it answers. Returns the last status."""
    c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    h = {"X-Run-Id": run, "X-Run-Task": task, "X-Mock-Script": script, **(headers or {})}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"please handle {run}"}]
    for _ in range(max_turns):
        try:
            r = await c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, extra_headers=h)
        except openai.APIStatusError as e:
            return e.status_code
        msg = r.choices[0].message
        msgs.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return 200
        for call in msg.tool_calls:
            content = '{"ok": true}'
            if execute_tools:
                _, content = await _tool(
                    base, run, task, call.function.name, json.loads(call.function.arguments)
                )
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return 200


async def run_fleet(base: str, upstream: ScriptedUpstream, admin: dict[str, str]) -> Fleet:
    upstream.scripts.update(SCRIPTS)
    fleet = Fleet()
    # task "refunds": a completed run with a repeated refund (the second execution is replayed)
    await agent(base, "ref-1", "refunds", "refund")
    fleet.runs["ref-1"] = ("refunds", "completed")
    # a completed run with prompt-cache reads
    await agent(base, "ref-2", "refunds", "cached")
    fleet.runs["ref-2"] = ("refunds", "completed")
    # the step cap: step 2 is answer-only, the run ends on its cap
    await agent(base, "ref-3", "refunds", "loop", headers={"X-Run-Max-Steps": "2"}, execute_tools=False)
    fleet.runs["ref-3"] = ("refunds", "steps_exceeded")
    # the dollar cap: the first call fits, the second does not → 402 max_usd
    for _ in range(6):
        fleet.errors["ref-4"] = await agent(
            base, "ref-4", "refunds", "long", headers={"X-Run-Max-Usd": "0.0003"}
        )
        if fleet.errors["ref-4"] != 200:
            break
    fleet.runs["ref-4"] = ("refunds", "budget_exceeded")
    # task "search": lookup ok, a failing tool, a side effect that times out (outcome unknown),
    # a tool without side effects that times out (outcome timeout)
    await agent(base, "srch-1", "search", "search", model="gpt-4.1-mini")
    fleet.runs["srch-1"] = ("search", "completed")
    # a model without a known price (no dollar cap, so it is allowed)
    await agent(base, "srch-2", "search", "plain", model="acme-llm-7b")
    fleet.runs["srch-2"] = ("search", "completed")
    # the deadline: the model answers after 2 s, the run has 0.4 s
    fleet.errors["srch-3"] = await agent(
        base, "srch-3", "search", "slow", model="gpt-4.1-mini", headers={"X-Run-Timeout": "0.4"}
    )
    fleet.runs["srch-3"] = ("search", "deadline_exceeded")
    # a cancel: one answer, cancelled, the next call is refused (410)
    await agent(base, "srch-4", "search", "plain", model="gpt-4.1-mini")
    async with aiohttp.ClientSession() as s, s.post(f"{base}/runs/srch-4/cancel", headers=admin) as r:
        assert r.status == 200, await r.text()
    fleet.errors["srch-4"] = await agent(base, "srch-4", "search", "plain", model="gpt-4.1-mini")
    fleet.runs["srch-4"] = ("search", "cancelled")
    return fleet
