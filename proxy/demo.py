"""`runcap demo`: runcap and the scripted model on free local ports, three agent runs through the
official `openai` client, and what runcap allowed, clamped or refused at every step; then an MCP
server behind runcap (`/mcp/crm`) whose side-effecting `refund` the agent calls twice through the
official `mcp` client — executed once, replayed once — and the on-call view of the same runs
from the span store: the timeline of the run that hit its dollar cap (`runcap run`) and the
duplicate-side-effect query catching the repeated calls (`runcap query duplicate_side_effects`).

No network, no servers to start: the model is `ScriptedUpstream`, the MCP server an `MCPServer`
in this process, storage is embedded under a data directory (a fresh temporary one unless
`--data-dir` is given).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.app import RUNTIME, build_app
from proxy.config import build_config
from proxy.scripted_upstream import ScriptedUpstream

MODEL = "gpt-4o"  # priced by genai-prices: $2.50 / $10 per million input / output tokens

TOOLS: list[Any] = [  # the openai client's own TypedDicts would add nothing to a literal
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by id",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
]

SCRIPTS: dict[str, list[dict[str, Any]]] = {
    # Looks an order up — twice, with the same arguments (the duplicate the on-call view catches) —
    # then answers.
    "support": [
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1001"}}]},
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1001"}}]},
        {"text": "Order A-1001 shipped yesterday; it should arrive on Friday."},
    ],
    # Never stops calling tools on its own, and writes long answers when it may not.
    "wanderer": [
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1001"}}]},
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1002"}}]},
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1003"}}]},
    ],
    # Long answers every step: spends the dollar cap.
    "essayist": [{"text_tokens": 900}],
}


def usd(amount: str) -> str:
    """runcap's 9-decimal money strings as a person writes them: $0.0209, $0.05."""
    whole, _, frac = str(amount).partition(".")
    return f"${whole}.{frac.rstrip('0').ljust(2, '0')}"


def _fmt_headers(h: Any) -> str:
    parts = []
    if "x-run-remaining-usd" in h:
        parts.append(f"{usd(h['x-run-remaining-usd'])} left")
    if "x-run-remaining-steps" in h:
        n = int(h["x-run-remaining-steps"])
        parts.append(f"{n} step{'' if n == 1 else 's'} left")
    return ", ".join(parts)


async def _agent(  # type: ignore[no-untyped-def]
    base_url: str, run_id: str, script: str, caps: dict[str, str], max_tokens: int, keep_writing: bool, say
) -> int:
    """A small agent loop: call the model, run the tools it asks for, repeat until it answers
    (or, with keep_writing, ask it to go on after each answer) or runcap refuses. Returns the
    number of spans runcap records for it (model calls, tool calls requested, results sent back)."""
    import openai
    from openai.types.chat import ChatCompletionMessageFunctionToolCall

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="demo-key", max_retries=2)
    headers = {"X-Run-Id": run_id, "X-Run-Task": f"demo-{script}", "X-Mock-Script": script, **caps}
    messages: list[Any] = [{"role": "user", "content": "Where is my order A-1001?"}]
    say(f"\nrun {run_id}  script={script}  " + "  ".join(f"{k}={v}" for k, v in caps.items()))
    spans = pending_results = 0
    for _ in range(12):
        spans += 1 + pending_results  # this call, and the results its request carries back
        pending_results = 0
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, tools=TOOLS, max_tokens=max_tokens, extra_headers=headers
            )
        except openai.APIStatusError as e:
            err = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
            code = err.get("code") or err.get("type")
            message = textwrap.fill(
                f"HTTP {e.status_code} {code}: {err.get('message', '')}", width=100,
                initial_indent="  refused   ", subsequent_indent=" " * 12,
            )  # fmt: skip
            say(message)
            break
        h = raw.headers
        resp = raw.parse()
        msg = resp.choices[0].message
        step = h.get("x-run-step")
        notes = []
        if h.get("x-run-final-step") == "true":
            notes.append("answer-only final step: tools stripped")
        usage = resp.usage
        assert usage is not None, "the scripted upstream always reports usage"
        calls = [c for c in msg.tool_calls or [] if isinstance(c, ChatCompletionMessageFunctionToolCall)]
        clamped = h.get("x-run-clamped-output-tokens")
        clamp = f"clamped {max_tokens}→{clamped}" if clamped else "allowed"
        what = (
            "calls " + ", ".join(f"{c.function.name}({c.function.arguments})" for c in calls)
            if calls
            else f"answers {len(msg.content or '')} chars"
        )
        say(
            f"  step {step:>2}  {clamp:<10} {what[:60]:<60} in {usage.prompt_tokens:>5} out "
            f"{usage.completion_tokens:>4}  {_fmt_headers(h)}" + (f"  [{'; '.join(notes)}]" if notes else "")
        )
        messages.append(msg.model_dump(exclude_none=True))
        spans += len(calls)
        pending_results = len(calls)
        if not calls:
            if not keep_writing:
                break
            messages.append({"role": "user", "content": "Go on."})
            continue
        for call in calls:
            result = {"order_id": json.loads(call.function.arguments).get("order_id"), "status": "shipped"}
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return spans


class CRMServer:
    """The demo's MCP server: the SDK's `MCPServer` with a side-effecting `refund` (no
    annotations: side-effecting by the spec's defaults), served in this process by uvicorn."""

    def __init__(self) -> None:
        self.refunds: list[str] = []
        self.url = ""
        self._uvicorn: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        import socket

        import uvicorn
        from mcp.server.mcpserver import MCPServer

        server = MCPServer("demo-crm", log_level="WARNING")

        @server.tool()
        def refund(order_id: str, amount: float) -> dict[str, Any]:
            """Refund an order."""
            self.refunds.append(order_id)
            return {"refund_id": f"rf-{len(self.refunds)}", "order_id": order_id, "amount": amount}

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        app = server.streamable_http_app(stateless_http=True, json_response=True)
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
        self._task = asyncio.create_task(self._uvicorn.serve())
        for _ in range(200):
            if self._uvicorn.started:
                break
            await asyncio.sleep(0.025)
        self.url = f"http://127.0.0.1:{port}/mcp"
        return self.url

    async def stop(self) -> None:
        if self._task is not None:
            self._uvicorn.should_exit = True
            await self._task


async def _mcp_agent(base_url: str, run_id: str, crm: CRMServer, say) -> int:  # type: ignore[no-untyped-def]
    """Call `refund` through runcap, then again with the same arguments (an agent retrying after
    a timeout on its side). Returns the number of spans runcap records for it."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    say(f"\nrun {run_id}  MCP server behind runcap at {base_url}/mcp/crm (official `mcp` client)")
    args = {"order_id": "A-1001", "amount": 25.0}
    async with (
        httpx2.AsyncClient(headers={"X-Run-Id": run_id, "X-Run-Task": "demo-mcp"}) as http,
        streamable_http_client(f"{base_url}/mcp/crm", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        for attempt in ("calls", "retries"):
            result = await session.call_tool("refund", args)
            replay = bool(result.meta and result.meta.get("runcap/replay"))
            say(
                f"  {attempt:<8} refund({json.dumps(args)}) → {json.dumps(result.structured_content)}"
                + ("  [replayed by runcap: not executed again]" if replay else "  [executed]")
            )
    say(f"  → the MCP server executed refund {len(crm.refunds)} time(s)")
    return 2


async def run_demo(data_dir: Path, say=print) -> dict[str, dict[str, Any]]:  # type: ignore[no-untyped-def]
    upstream = ScriptedUpstream(SCRIPTS)
    upstream_url = await upstream.start()
    crm = CRMServer()
    crm_url = await crm.start()
    config = build_config(
        {
            "upstreams": {"openai": {"url": upstream_url}},
            "log_requests": False,
            "mcp": {"crm": {"url": crm_url}},
        },
        {},
        listen="127.0.0.1:0",
        data_dir=str(data_dir),
    )
    app = build_app(config, span_options={"flush_interval_s": 0.05})
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    base = f"http://127.0.0.1:{port}"
    say(f"runcap on {base}, scripted model on {upstream_url}, data in {data_dir}")
    stamp = time.strftime("%H%M%S")
    runs = {
        "finishes": (
            f"demo-{stamp}-finishes",
            "support",
            {"X-Run-Max-Usd": "0.05", "X-Run-Max-Steps": "10"},
            400,
            False,
        ),
        "dollar-cap": (f"demo-{stamp}-dollars", "essayist", {"X-Run-Max-Usd": "0.03"}, 1000, True),
        "step-cap": (f"demo-{stamp}-steps", "wanderer", {"X-Run-Max-Steps": "3"}, 800, False),
    }
    states: dict[str, dict[str, Any]] = {}
    spans = 0
    try:
        import aiohttp

        for name, (run_id, script, caps, max_tokens, keep_writing) in runs.items():
            spans += await _agent(base, run_id, script, caps, max_tokens, keep_writing, say)
            admin = {"Authorization": f"Bearer {app[RUNTIME].config.admin_token}"}
            async with aiohttp.ClientSession() as s, s.get(f"{base}/runs/{run_id}", headers=admin) as r:
                state = await r.json()
            states[name] = state
            say(
                f"  → status {state['status']}: {state['steps']} steps, {state['tool_calls']} tool calls, "
                f"{state['input_tokens']}+{state['output_tokens']} tokens, {usd(state['cost_usd'])} spent"
                + (f" of {usd(state['caps']['max_usd'])}" if state["caps"]["max_usd"] else "")
            )
        spans += await _mcp_agent(base, f"demo-{stamp}-mcp", crm, say)
        states["mcp"] = {"refunds_executed": len(crm.refunds)}
        store = app[RUNTIME].spans.store
        if store is not None:
            await _oncall_view(store, spans, runs["dollar-cap"][0], data_dir, say)
        capped, steps = states["dollar-cap"], states["step-cap"]
        say(
            f"\nWhat runcap just prevented: the essayist would have kept writing past its "
            f"{usd(capped['caps']['max_usd'])} cap — it stopped at {usd(capped['cost_usd'])} (its last call "
            f"clamped, the next refused with a 402 no SDK retries); the wanderer would have called "
            f"tools for ever — it got an answer-only step {steps['steps']}."
        )
        say(
            f"And the MCP refund the agent retried ran once, not twice ({len(crm.refunds)} execution); "
            "the on-call query above shows the replay."
        )
    finally:
        await runner.cleanup()
        await crm.stop()
        await upstream.stop()
    return states


async def _oncall_view(store: Any, spans: int, capped_run: str, data_dir: Path, say) -> None:  # type: ignore[no-untyped-def]
    """What an on-call engineer sees afterwards: the same SQL as `runcap run` / `runcap query`,
    through the in-process span store once the pipeline has written the runs' spans."""
    from proxy.queryfiles import bind, load_query
    from proxy.readcli import render_table

    loop = asyncio.get_running_loop()

    def ask(name: str, **given: str) -> tuple[list[str], list[list[Any]]]:
        query = load_query(name)
        return store.query(query.sql, bind(query, given, store))  # type: ignore[no-any-return]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the pipeline writes in the background: wait for it
        _, rows = await loop.run_in_executor(None, store.query, "SELECT count() FROM runcap.spans", None)
        if rows[0][0] >= spans:
            break
        await asyncio.sleep(0.05)
    say(f"\n── on-call view (the span store in {data_dir}) ──")
    say(f"\n$ runcap run {capped_run}      # the run that hit its dollar cap, one line per span")
    columns, rows = await loop.run_in_executor(None, lambda: ask("run_timeline", run_id=capped_run))
    total = rows[-1][columns.index("cumulative_usd")] if rows else "0"
    show = ["step", "kind", "model", "input_tokens", "output_tokens", "cost_usd", "cumulative_usd", "outcome",
            "status_code", "duration_ms"]  # fmt: skip
    render_table(columns, rows, show=show, title=f"run {capped_run}: {len(rows)} spans, ${total}")
    say("\n$ runcap query duplicate_side_effects      # the same tool, same arguments, more than once")
    columns, rows = await loop.run_in_executor(None, lambda: ask("duplicate_side_effects"))
    show = ["run_id", "tool_name", "args_hash", "seen_as", "times", "replays", "later_all_replayed", "steps"]
    render_table(columns, rows, show=show)


DEFAULT_DATA_DIR = "runcap-demo-data"


def main(data_dir: str | None = None) -> int:
    """Run the demo and keep its data, so the commands it prints work when pasted."""
    where = Path(data_dir or DEFAULT_DATA_DIR)
    states = asyncio.run(run_demo(where))
    runcap = _runcap_command()
    capped = states["dollar-cap"]["run_id"]
    print(
        f"\nThe demo's data is in {where}/ (delete it when done: rm -rf {where}). Try:\n"
        f"  {runcap} run {capped} --data-dir {where}\n"
        f"  {runcap} runs --data-dir {where}\n"
        f"  {runcap} query duplicate_side_effects --data-dir {where}"
    )
    return 0


def _runcap_command() -> str:
    """How to call runcap from here: `runcap` when it is on PATH, else the path to this one."""
    found = shutil.which("runcap")
    mine = Path(sys.executable).parent / "runcap"
    if found and Path(found).resolve() == mine.resolve():
        return "runcap"
    if mine.exists():
        return os.path.relpath(mine) if not os.path.relpath(mine).startswith("../..") else str(mine)
    return f"{sys.executable} -m proxy.cli"
