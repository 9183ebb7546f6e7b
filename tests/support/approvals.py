"""The operator's side of approvals in tests: list them and decide one through runcap's own routes
(`GET /approvals`, `POST /approvals/{id}`), and wait until held calls have asked."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp


async def listed(s: aiohttp.ClientSession, url: str, headers: dict[str, str], **query: str) -> list[Any]:
    async with s.get(f"{url}/approvals", params=query, headers=headers) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["approvals"]


async def until_pending(
    s: aiohttp.ClientSession, url: str, headers: dict[str, str], run: str, n: int = 1
) -> list[Any]:
    """The run's pending approvals, once there are `n` (the held calls asked)."""
    for _ in range(2000):
        rows = await listed(s, url, headers, run=run)
        if len(rows) >= n:
            return rows
        await asyncio.sleep(0.005)
    raise AssertionError(f"{n} approvals never became pending for run {run}")


async def decide(s: aiohttp.ClientSession, url: str, headers: dict[str, str], approval_id: str,
                 **body: str) -> tuple[int, Any]:  # fmt: skip
    async with s.post(f"{url}/approvals/{approval_id}", json=body, headers=headers) as r:
        return r.status, await r.json()
