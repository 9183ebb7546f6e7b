"""A small tool service for tests: counts executions, can sleep, records the headers it got and
whether the caller dropped the connection while it was working."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web


@dataclass
class ToolHit:
    method: str
    path: str
    query: str
    raw_path: str  # the request target as received: still percent-encoded, with the query
    headers: dict[str, str]  # lower-cased names
    body: bytes
    disconnected: bool = False
    finished: bool = False


@dataclass
class ToolService:
    sleep_s: float = 0.0  # per call; a body field "sleep_s" overrides it
    max_sleep_s: float | None = None  # caps either
    status: int = 200
    hits: list[ToolHit] = field(default_factory=list)
    url: str | None = None
    _runner: web.AppRunner | None = None

    @property
    def executions(self) -> int:
        return len(self.hits)

    def on_path(self, path: str) -> list[ToolHit]:
        return [h for h in self.hits if h.path == path]

    async def start(self) -> ToolService:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: the handler is cancelled when the caller drops the connection,
        # which is how the tests see a cancel or timeout reach the tool.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        hit = ToolHit(
            request.method, request.path, request.query_string, request.raw_path,
            {k.lower(): v for k, v in request.headers.items()}, body,
        )  # fmt: skip
        self.hits.append(hit)
        n = len(self.hits)
        sleep = self.sleep_s
        try:
            parsed: Any = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("sleep_s"), (int, float)):
            sleep = float(parsed["sleep_s"])
        if self.max_sleep_s is not None:
            sleep = min(sleep, self.max_sleep_s)
        try:
            if sleep:
                await asyncio.sleep(sleep)
        except asyncio.CancelledError:
            hit.disconnected = True
            raise
        hit.finished = True
        return web.Response(
            status=self.status,
            body=orjson.dumps({"execution": n, "path": request.path, "args": parsed}),
            content_type="application/json",
        )


@pytest.fixture
async def tool() -> AsyncIterator[ToolService]:
    """A tool service on a free port for the test, stopped after it."""
    svc = await ToolService().start()
    yield svc
    await svc.stop()


@pytest.fixture
def stub(tool: ToolService) -> ToolService:
    """The same service, named for the tests that point every upstream at it to record calls."""
    return tool
