"""A ClickHouse server for the span tests (the HTTP endpoint of tests/support/clickhouse_http.py), SQL
through runcap's admin route, and the one refund run (model → tool call → model) many span tests
send."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai

from proxy.providers.base import Usage
from tests.conftest import REPO, free_port
from tests.support.processes import stop_process

ARGS = {"order_id": "A1", "amount": 5}


TOOLS = [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}]


SCRIPT = [{"tool_calls": [{"name": "refund", "arguments": ARGS}]}, {"text": "Refunded."}]


class ClickHouseProcess:
    """The ClickHouse HTTP fixture (chdb behind ClickHouse's HTTP interface) in its own process,
    so it can be down (killed) and up again on the same port and data."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://default:@127.0.0.1:{self.port}/runcap"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.clickhouse_http", str(self.data_dir), str(self.port)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # the URL, once it listens

    def stop(self) -> None:
        stop_process(self.proc, grace_s=20)
        self.proc = None


async def sql(rc, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rc.url}/admin/sql", json={"sql": query, "params": params or {}}, headers=rc.admin) as r,
    ):
        assert r.status == 200, await r.text()
        d = await r.json()
    return [dict(zip(d["columns"], row, strict=True)) for row in d["rows"]]


async def wait_rows(rc, query: str, want: int, timeout: float = 20.0) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        rows = await sql(rc, query)
        if len(rows) >= want or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.1)


async def chat_run(rc, upstream, run_id: str, stream: bool):  # type: ignore[no-untyped-def]
    """model → refund tool call → (agent runs it) → model answers. Returns both usages."""
    upstream.scripts["refund"] = SCRIPT
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")
    h = {"X-Run-Id": run_id, "X-Run-Task": "refunds", "X-Mock-Script": "refund", "X-Run-Max-Usd": "1"}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "refund A1"}]
    usages = []
    for _ in range(2):
        if stream:
            s = await c.chat.completions.create(
                model="gpt-4o-mini", messages=msgs, tools=TOOLS, stream=True,
                stream_options={"include_usage": True}, extra_headers=h,
            )  # fmt: skip
            calls: dict[int, dict[str, str]] = {}
            content = ""
            async for chunk in s:
                if chunk.usage:
                    usages.append(chunk.usage)
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    for tc in ch.delta.tool_calls or []:
                        d = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                        d["id"] += tc.id or ""
                        d["name"] += tc.function.name or ""
                        d["arguments"] += tc.function.arguments or ""
            msg = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = [
                    {
                        "id": d["id"],
                        "type": "function",
                        "function": {"name": d["name"], "arguments": d["arguments"]},
                    }
                    for d in calls.values()
                ]
        else:
            r = await c.chat.completions.create(
                model="gpt-4o-mini", messages=msgs, tools=TOOLS, extra_headers=h
            )
            usages.append(r.usage)
            msg = r.choices[0].message.model_dump(exclude_none=True)
        msgs.append(msg)
        for call in msg.get("tool_calls") or []:
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true}'})
    return [Usage(u.prompt_tokens, u.completion_tokens) for u in usages]


COUNT = "SELECT kind, count() AS n FROM runcap.spans GROUP BY kind ORDER BY kind"


async def counts(rc) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {r["kind"]: r["n"] for r in await sql(rc, COUNT)}


async def wait_counts(rc, want: dict[str, int], timeout: float = 30.0) -> dict[str, int]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    got: dict[str, int] = {}
    while time.monotonic() < deadline:
        try:
            got = await counts(rc)
        except AssertionError:
            got = {}
        if got == want:
            await asyncio.sleep(0.5)  # and it stays so: no late duplicate
            return await counts(rc)
        await asyncio.sleep(0.2)
    return got
