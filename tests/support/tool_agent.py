"""The agent's side of the /tools tests: the tool service's configuration and one raw call through
runcap."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.support.raw_http import json_bytes, json_or, request
from tests.support.tool_service import ToolService


def refund_tool(svc: ToolService) -> dict[str, Any]:
    """The side-effecting refund tool of `svc`, its calls told apart by order and amount."""
    return {"url": f"{svc.url}/refund", "side_effects": True, "key_fields": ["order_id", "amount"]}


def tools_config(svc: ToolService, **extra: Any) -> dict[str, Any]:
    return {
        "tools": {
            "refund": refund_tool(svc),
            "notify": {"url": f"{svc.url}/notify"},  # by method
            "slow": {"url": f"{svc.url}/slow", "timeout_s": 0.5},
        },
        **extra,
    }


async def call(
    url: str, run_id: str, body: Any = None, *, method: str = "POST", headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], Any]:  # fmt: skip
    h = {"X-Run-Id": run_id, "Content-Type": "application/json", **(headers or {})}
    status, answer_headers, answer = await request(method, url, json_bytes(body, raw), h)
    return status, answer_headers, json_or(answer, answer)


async def wait_for(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")
