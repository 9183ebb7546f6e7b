"""The floor of one HTTP hop on this machine: the smallest aiohttp relay there is.

A POST to `/{path}` is forwarded to `--upstream` + `/{path}` (`/` to `--upstream` itself) with the
body and the headers a chat completion or a Streamable HTTP MCP call needs, by one pooled aiohttp
client, and answered with the upstream's status, body and `Content-Type` / `Mcp-Session-Id` — no
parsing, no ledger, no spans, no checks. Same stack as `runcap serve` (aiohttp server and client
on uvloop, one process). `bench.mcp_bench --floor`, `bench.proxy_bench --floor` and
`bench.perf_table` put it beside runcap, so the added latency and CPU split into what any hop
costs on this machine and what runcap's own work adds.

`--tuned` is the same relay with its client session stripped to what a relay needs (issue 24):
no cookie jar (`aiohttp.DummyCookieJar`: nothing parsed or stored per response), no automatic
decompression (the body passes as it came, with its `Content-Encoding`), no trace hooks, no
automatic `User-Agent` / `Accept-Encoding` headers (only the ones in `PASSED`, as the client
sent them) — and it streams: an event stream is relayed chunk by chunk as it arrives instead of
read whole first, so its time to first byte is a hop's, not the stream's.

    .venv/bin/python -m bench.relay_floor --port P --upstream http://127.0.0.1:Q[/mcp] [--tuned]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

PASSED = ("Content-Type", "Accept", "Authorization", "Mcp-Session-Id", "MCP-Protocol-Version")
RETURNED = ("Content-Type", "Mcp-Session-Id")
TUNED_RETURNED = (*RETURNED, "Content-Encoding")  # not decoded on the way: say how it is encoded


def client_session(tuned: bool) -> aiohttp.ClientSession:
    """The relay's one pooled client: aiohttp's defaults, or tuned (see the module docstring)."""
    connector = aiohttp.TCPConnector(limit=256)
    if not tuned:
        return aiohttp.ClientSession(connector=connector)
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        trace_configs=None,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


def make_app(upstream: str, tuned: bool = False) -> web.Application:
    app = web.Application()
    http = web.AppKey("http", aiohttp.ClientSession)

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        app[http] = client_session(tuned)
        yield
        await app[http].close()

    base = upstream.rstrip("/")
    returned = TUNED_RETURNED if tuned else RETURNED

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k in PASSED if (v := request.headers.get(k)) is not None}
        url = upstream if request.path == "/" else base + request.path_qs
        async with app[http].post(url, data=body, headers=headers) as r:
            out = {k: v for k in returned if (v := r.headers.get(k)) is not None}
            if tuned and r.content_type == "text/event-stream":
                resp = web.StreamResponse(status=r.status, headers=out)
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
            return web.Response(status=r.status, body=await r.read(), headers=out)

    app.cleanup_ctx.append(client_ctx)
    app.router.add_post("/{tail:.*}", relay)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--tuned", action="store_true", help="tuned client, streams relayed")
    args = ap.parse_args(argv)
    import uvloop

    uvloop.install()
    app = make_app(args.upstream, tuned=args.tuned)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
