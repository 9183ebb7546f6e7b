"""Serve an aiohttp application for a test on 127.0.0.1, on a free port."""

from __future__ import annotations

from aiohttp import web


async def serve_local(
    app: web.Application, *, handler_cancellation: bool = False
) -> tuple[web.AppRunner, str]:
    """`app` served on a free loopback port: its runner (to clean up) and its base URL. With
    `handler_cancellation`, a handler is cancelled when its caller drops the connection (how a
    test sees a cut reach the server)."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
