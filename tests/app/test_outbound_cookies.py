"""runcap's outbound client keeps no cookies: an upstream's `Set-Cookie` is relayed to the agent
that got it and never stored by runcap, so it cannot ride along on a later call — another run's,
another tenant's (one pooled session serves every run of the process)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import free_port

ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}


@pytest.fixture
async def cookie_upstream() -> AsyncIterator[tuple[str, list[str | None]]]:
    """A model upstream, reached by host name (aiohttp's jar keeps no cookie of a bare IP), that
    sets a session cookie on every answer and records the Cookie header of every request."""
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = web.json_response(ANSWER)
        response.set_cookie("upstream_session", f"tenant-secret-{len(seen)}", path="/")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://localhost:{port}", seen
    await runner.cleanup()


async def test_an_upstream_cookie_is_relayed_but_never_sent_on_a_later_call(
    cookie_upstream, runcap_factory
) -> None:  # type: ignore[no-untyped-def]
    url, seen = cookie_upstream
    rc = await runcap_factory({"upstreams": {"openai": {"url": url}}})
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as agent:
        for run in ("run-a", "run-b", "run-c"):
            async with agent.post(
                f"{rc.openai_url}/chat/completions", json=body, headers={"X-Run-Id": run}
            ) as r:
                assert r.status == 200, await r.text()
                assert "upstream_session=tenant-secret-" in r.headers.get("Set-Cookie", "")
    assert seen == [None, None, None]
