"""`OutboundClient.call` (server/outbound.py) against a real local server: one call bounded as a
whole by the run's deadline or its own limit, whichever comes first — headers and body read
alike — with the cut saying which; and `model_headers`, the one credential rule for model
upstreams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.server.outbound import CallTimedOut, OutboundClient, model_headers


@pytest.fixture
async def slow_server() -> AsyncIterator[TestServer]:
    async def slow_headers(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("s", "5")))
        return web.Response(text="late")

    async def slow_body(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse()
        await reply.prepare(request)
        await reply.write(b"first part;")
        await asyncio.sleep(5)
        await reply.write(b"never")
        return reply

    app = web.Application()
    app.router.add_get("/headers", slow_headers)
    app.router.add_get("/body", slow_body)
    server = TestServer(app)
    await server.start_server()
    yield server
    await server.close()


@pytest.fixture
async def client() -> AsyncIterator[OutboundClient]:
    out = OutboundClient(keepalive_timeout_s=5, connect_timeout_s=5)
    await out.start()
    yield out
    await out.close()


async def test_the_call_s_own_limit_cuts_it_when_it_comes_first(
    slow_server: TestServer, client: OutboundClient
) -> None:
    t0 = time.perf_counter()
    with pytest.raises(CallTimedOut) as e:
        async with client.call(
            "GET", slow_server.make_url("/headers"), deadline=time.time() + 30, limit_s=0.2
        ):
            pass
    assert e.value.by_deadline is False and isinstance(e.value, TimeoutError)
    assert time.perf_counter() - t0 < 2


async def test_the_run_s_deadline_bounds_the_whole_exchange_body_included(
    slow_server: TestServer, client: OutboundClient
) -> None:
    t0 = time.perf_counter()
    got = b""
    with pytest.raises(CallTimedOut) as e:
        async with client.call(
            "GET", slow_server.make_url("/body"), deadline=time.time() + 0.3, limit_s=30
        ) as r:
            assert r.status == 200  # the headers came in time...
            async for chunk in r.content.iter_any():  # ...the rest of the body did not
                got += chunk
    assert e.value.by_deadline is True
    assert got == b"first part;"
    assert time.perf_counter() - t0 < 2


async def test_an_unbounded_call_answers_and_a_passed_deadline_refuses_at_once(
    slow_server: TestServer, client: OutboundClient
) -> None:
    async with client.call("GET", slow_server.make_url("/headers?s=0"), deadline=None) as r:
        assert r.status == 200 and await r.read() == b"late"
    with pytest.raises(CallTimedOut) as e:
        async with client.call("GET", slow_server.make_url("/headers?s=0"), deadline=time.time() - 1):
            pass
    assert e.value.by_deadline is True


def test_model_headers_replace_the_agents_credentials_only_when_runcap_sends_a_key() -> None:
    agent = {"Authorization": "Bearer agent", "x-api-key": "agent", "X-Run-Id": "r1", "Accept": "*/*"}
    assert dict(model_headers(agent, "openai", None)) == {
        "Authorization": "Bearer agent",
        "x-api-key": "agent",
        "Accept": "*/*",
    }
    assert dict(model_headers(agent, "openai", "sk-own")) == {
        "Accept": "*/*",
        "Authorization": "Bearer sk-own",
    }
    assert dict(model_headers(agent, "anthropic", "sk-ant")) == {"Accept": "*/*", "x-api-key": "sk-ant"}
