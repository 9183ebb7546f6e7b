"""A stand-in refund service for the example: slow on purpose (so you can kill a worker while a
refund is in flight), and it prints every execution — count them.

    python -m examples.temporal.refund_service --listen 127.0.0.1:9000 --sleep-s 5
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web


def make_app(sleep_s: float) -> web.Application:
    executions = 0

    async def refund(request: web.Request) -> web.Response:
        nonlocal executions
        body = await request.json()
        executions += 1
        key = request.headers.get("Idempotency-Key")
        print(f"refund #{executions}: {body} run={request.headers.get('X-Run-Id')} key={key}", flush=True)
        try:
            await asyncio.sleep(sleep_s)
        except asyncio.CancelledError:
            print(f"refund #{executions}: the caller dropped the connection", flush=True)
            raise
        return web.json_response({"refund_id": f"r-{executions}", **body})

    app = web.Application()
    app.router.add_post("/refund", refund)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:9000")
    p.add_argument("--sleep-s", type=float, default=5.0)
    args = p.parse_args()
    host, port = args.listen.rsplit(":", 1)
    print(json.dumps({"listening": args.listen}), flush=True)
    web.run_app(make_app(args.sleep_s), host=host, port=int(port), print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
