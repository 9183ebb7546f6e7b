"""The scripted upstream and a traced runcap for agent frameworks, serving from a background
thread's event loop so that the frameworks' sync and async clients alike can call them (and
embedded chdb allows one traced app per process at a time). Used by tests/system/test_frameworks.py
(single runs) and tests/system/test_framework_trees.py (run trees).

Each run gets a script of its own, named after the run (`Stack.script`), so that the upstream's
records of a run can be told apart (`Stack.calls`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.app import RUNTIME, build_app
from proxy.scripted_upstream import ScriptedUpstream
from tests.conftest import FAST_SPANS, runcap_config


class Stack:
    """The scripted upstream and a traced runcap, serving from a background thread's loop."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="framework-stack", daemon=True)
        self.upstream = ScriptedUpstream()
        self.url = ""
        self.admin: dict[str, str] = {}
        self.admin_token = ""
        self._runner: web.AppRunner | None = None

    def _call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)  # type: ignore[arg-type]

    def start(self) -> Stack:
        self.thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        url = await self.upstream.start()
        app = build_app(runcap_config(url, self.data_dir, {"tracing": True}), span_options=FAST_SPANS)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self.admin_token = app[RUNTIME].config.admin_token
        self.admin = {"Authorization": f"Bearer {self.admin_token}"}

    def stop(self) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            await self.upstream.stop()

        try:
            self._call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)

    def script(self, run_id: str, steps: list[dict[str, Any]]) -> dict[str, str]:
        """Give the run a script of its own; the headers that select it."""
        self.upstream.scripts[run_id] = list(steps)
        return {"X-Run-Id": run_id, "X-Run-Task": "framework-test", "X-Mock-Script": run_id}

    def calls(self, run_id: str) -> list[Any]:
        """The upstream's records of the run's requests."""
        return [r for r in list(self.upstream.requests) if r.script == run_id]

    async def run(self, run_id: str) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{self.url}/runs/{run_id}", headers=self.admin) as r,
        ):
            assert r.status == 200, await r.text()
            return await r.json()

    async def settled(self, run_id: str) -> dict[str, Any]:
        """The run once nothing is reserved (a stream settles after its last byte is relayed)."""
        for _ in range(200):
            state = await self.run(run_id)
            if Decimal(state["reserved_usd"]) == 0:
                return state
            await asyncio.sleep(0.02)
        raise AssertionError(f"run {run_id} never settled: {state}")

    async def sql(self, query: str, params: dict[str, str]) -> list[list[Any]]:
        """Rows of a query of the span store, through `POST /admin/sql`."""
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{self.url}/admin/sql", json={"sql": query, "params": params}, headers=self.admin) as r,
        ):
            assert r.status == 200, await r.text()
            body = await r.json()
        return list(body["rows"])

    async def spans(self, run_id: str, want: dict[str, int]) -> dict[str, int]:
        """Span counts by kind (model spans by outcome), once the shipper wrote `want` (20 s at most)."""
        query = (
            "SELECT if(kind = 'model', concat('model:', outcome), kind) AS k, count() AS n "
            "FROM runcap.spans WHERE run_id = {run:String} GROUP BY k"
        )
        deadline = time.monotonic() + 20
        while True:
            got = {k: int(n) for k, n in await self.sql(query, {"run": run_id})}
            if all(got.get(k, 0) >= n for k, n in want.items()) or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.1)
