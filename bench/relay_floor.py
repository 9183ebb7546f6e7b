"""The floor of one HTTP hop on this machine: the smallest aiohttp relay there is.

A POST to `/{path}` is forwarded to `--upstream` + `/{path}` (`/` to `--upstream` itself) with the
body and the headers a chat completion or a Streamable HTTP MCP call needs, by one pooled aiohttp
client, and answered with the upstream's status, body and `Content-Type` / `Mcp-Session-Id` — no
parsing, no ledger, no spans, no checks. Same stack as `runcap serve` (aiohttp server and client
on uvloop, one process). `bench.mcp_bench --floor` and `bench.proxy_bench --floor` put it beside
runcap, so the added latency and CPU split into what any hop costs on this machine and what
runcap's own work adds.

    .venv/bin/python -m bench.relay_floor --port P --upstream http://127.0.0.1:Q[/mcp]
"""

from __future__ import annotations

import argparse
import sys

import aiohttp
from aiohttp import web

PASSED = ("Content-Type", "Accept", "Authorization", "Mcp-Session-Id", "MCP-Protocol-Version")


def make_app(upstream: str) -> web.Application:
    app = web.Application()

    async def client_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        yield
        await app["http"].close()

    base = upstream.rstrip("/")

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k in PASSED if (v := request.headers.get(k)) is not None}
        url = upstream if request.path == "/" else base + request.path_qs
        async with app["http"].post(url, data=body, headers=headers) as r:
            data = await r.read()
            out = {k: v for k in ("Content-Type", "Mcp-Session-Id") if (v := r.headers.get(k)) is not None}
            return web.Response(status=r.status, body=data, headers=out)

    app.cleanup_ctx.append(client_ctx)
    app.router.add_post("/{tail:.*}", relay)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args(argv)
    import uvloop

    uvloop.install()
    web.run_app(make_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
