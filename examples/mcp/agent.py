"""An agent that reaches its tools over MCP through runcap: the official `mcp` client, pointed at
`http://127.0.0.1:8787/mcp/crm` instead of the server, with the run's headers on its transport.

It refunds a damaged order, then — as agents do after a timeout or a crash on their side — sends
the very same call again. runcap answers the repeat from its record (`_meta["runcap/replay"]`)
instead of refunding twice, counts both calls against the run's caps, and records a `tool` span
for each (`runcap run RUN_ID`, `runcap query duplicate_side_effects`).

    .venv/bin/python -m examples.mcp.agent [--url http://127.0.0.1:8787/mcp/crm] [--run ticket-4711]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


async def run_agent(url: str, run_id: str, say: Any = print) -> list[dict[str, Any]]:
    """The agent's tool calls; returns what each one answered (with `replayed`)."""
    headers = {"X-Run-Id": run_id, "X-Run-Max-Tool-Calls": "10", "X-Run-Timeout": "120"}
    answers = []
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        tools = (await session.list_tools()).tools
        say("tools: " + ", ".join(t.name for t in tools))
        status = await session.call_tool("order_status", {"order_id": "A-1001"})
        say(f"order_status → {json.dumps(status.structured_content)}")
        args = {"order_id": "A-1001", "amount": 25.0, "reason": "arrived damaged"}
        for attempt in ("first", "retry"):
            result = await session.call_tool("refund", args)
            replayed = bool(result.meta and result.meta.get("runcap/replay"))
            say(
                f"refund ({attempt}) → {json.dumps(result.structured_content)}"
                + ("  [replayed]" if replayed else "")
            )
            answers.append({**(result.structured_content or {}), "replayed": replayed})
    return answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8787/mcp/crm")
    ap.add_argument("--run", default="ticket-4711")
    args = ap.parse_args()
    asyncio.run(run_agent(args.url, args.run))


if __name__ == "__main__":
    main()
