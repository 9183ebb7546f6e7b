"""The agent's side of the /tools tests: the tool service's configuration and one raw call through
runcap."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from tests.support.tool_service import ToolService


def tools_config(svc: ToolService, **extra: Any) -> dict[str, Any]:
    return {
        "tools": {
            "refund": {
                "url": f"{svc.url}/refund",
                "side_effects": True,
                "key_fields": ["order_id", "amount"],
            },
            "notify": {"url": f"{svc.url}/notify"},  # by method
            "slow": {"url": f"{svc.url}/slow", "timeout_s": 0.5},
        },
        **extra,
    }


async def call(
    url: str, run_id: str, body: Any = None, *, method: str = "POST", headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], Any]:  # fmt: skip
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"X-Run-Id": run_id, "Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.request(method, url, data=data, headers=h) as r:
        text = await r.read()
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        return r.status, dict(r.headers), parsed


async def wait_for(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")
