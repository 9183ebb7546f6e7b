"""A model answer runcap reads whole is bounded (`max_answer_bytes`): an upstream that answers with
more is cut while it is read, so runcap's memory stays bounded whatever an upstream (a buggy
OpenAI-compatible server, a hostile endpoint) sends. The upstream did the work and bills it, so
the step counts and is charged at its reservation; the agent gets 502 `answer_too_large`, which
the official SDKs do not retry (the same request would bring the same answer, and its cost, again).
Streams are relayed, not buffered: the bound does not cut them. runcap's own calls within a run (a
`runcap_fetch` continuation) are bounded the same way.

Driven with the official OpenAI client against runcap in front of the scripted upstream.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from proxy.scripted_upstream import ScriptedUpstream
from tests.support.context_agents import answered_history
from tests.support.local_app import serve_local

LIMIT = 4096
BIG = "word " * 2000  # 10 000 bytes of text: the answer's body is over LIMIT
USER = [{"role": "user", "content": "x"}]


def client(rc: Any, run: str, script: str, **kw: Any) -> openai.AsyncOpenAI:
    headers = {"X-Run-Id": run, "X-Mock-Script": script, "X-Run-Max-Usd": "1"}
    return openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", default_headers=headers, **kw)


async def test_an_answer_over_the_bound_is_cut_charged_and_not_retried(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory({"max_answer_bytes": LIMIT, "tracing": False})
    upstream.scripts["big"] = [{"text": BIG}] * 3
    c = client(rc, "big-answer", "big", max_retries=2)  # the SDK would retry a retryable 502
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=5000)
    assert e.value.status_code == 502
    error = (
        e.value.body["error"] if isinstance(e.value.body, dict) and "error" in e.value.body else e.value.body
    )
    assert isinstance(error, dict), e.value.body
    assert error["code"] == "answer_too_large" and error["param"] == "max_answer_bytes", error
    assert f"max_answer_bytes = {LIMIT}" in error["message"]
    assert e.value.response.headers["x-should-retry"] == "false"
    assert len([q for q in upstream.requests if q.script == "big"]) == 1  # never retried
    run = await rc.run("big-answer")
    # Answered upstream and billed: the step counts, at its reserved worst case (5 000 output tokens).
    assert run["steps"] == 1 and run["output_tokens"] == 5000, run
    assert Decimal(run["cost_usd"]) > 0, run


async def test_an_answer_within_the_bound_and_a_stream_over_it_are_relayed_whole(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    """The controls: the same text under a bound it fits is answered, and as a stream (relayed,
    never buffered) the bound does not apply."""
    rc = await runcap_factory({"max_answer_bytes": LIMIT, "tracing": False})
    upstream.scripts["small"] = [{"text": "word " * 100}]
    answer = await client(rc, "small-answer", "small").chat.completions.create(
        model="gpt-4o-mini", messages=USER
    )
    assert (answer.choices[0].message.content or "").split() == ["word"] * 100

    upstream.scripts["big-stream"] = [{"text": BIG}]
    stream = await client(rc, "big-stream", "big-stream").chat.completions.create(
        model="gpt-4o-mini", messages=USER, stream=True
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert len(text.encode()) > LIMIT and text.split() == BIG.split()


async def test_runcaps_own_call_is_bounded_too(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    """A `runcap_fetch` continuation (runcap's own call) whose answer is over the bound is cut the
    same way: it is charged at its reservation, its answer is never read whole, and the agent is
    not given a partial one."""
    page = 8192
    rc = await runcap_factory(
        {
            "max_answer_bytes": LIMIT,
            "tracing": False,
            "context": {"keep_last_steps": 1, "offload_min_bytes": 1024},
        }
    )
    upstream.scripts["inner-big"] = [{}] * 4 + [{"fetch": {"handle": 0, "length": 64}}, {"text": BIG}]
    h = {"X-Run-Id": "inner-big", "X-Mock-Script": "inner-big", "X-Run-Context-Policy": "offload"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rc.url}/v1/chat/completions", json=answered_history("chat", 4, page), headers=h) as r,
    ):
        status, answer = r.status, await r.json()
    sent = [q for q in upstream.requests if q.script == "inner-big"]
    assert len(sent) == 2, answer  # the agent's call and runcap's continuation
    assert status == 502 and answer["error"]["code"] == "answer_too_large", answer
    run = await rc.run("inner-big")
    assert run["steps"] == 2, run  # both calls were answered upstream, and both are charged


async def test_a_compressed_answer_is_bounded_by_what_it_decodes_to(
    runcap_factory: Callable[..., Any],
) -> None:
    """A gzip answer's Content-Length is its compressed size: 10 000 bytes of text squeezed under
    the bound still decode to more than it, and are cut while decoded (a small body that inflates
    without end cannot fill runcap's memory); the same answer sent plain with a Content-Length
    under the bound is read in one piece and relayed whole (the control)."""

    def completion(text: str) -> bytes:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        return orjson.dumps({"id": "chatcmpl-gz", "object": "chat.completion", "model": "gpt-4o-mini",
                             "choices": [choice], "usage": usage})  # fmt: skip

    answer, small = completion(BIG), completion("word " * 100)
    packed = gzip.compress(answer)
    assert len(packed) < LIMIT < len(answer) and len(small) < LIMIT

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        if request.headers.get("X-Plain") == "1":
            return web.Response(body=small, content_type="application/json")
        return web.Response(
            body=packed, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, url = await serve_local(app)
    try:
        rc = await runcap_factory({"max_answer_bytes": LIMIT, "upstreams": {"openai": {"url": url}}})
        async with aiohttp.ClientSession() as s:
            body = {"model": "gpt-4o-mini", "messages": USER, "max_tokens": 5000}
            async with s.post(
                f"{rc.url}/v1/chat/completions", json=body, headers={"X-Run-Max-Usd": "1"}
            ) as r:
                status, error = r.status, (await r.json())["error"]
            assert status == 502 and error["code"] == "answer_too_large", error
            async with s.post(
                f"{rc.url}/v1/chat/completions", json=body, headers={"X-Run-Max-Usd": "1", "X-Plain": "1"}
            ) as r:
                got = await r.read()  # relayed unchanged
                assert r.status == 200 and got == small, (len(got), len(small), got[-80:])
    finally:
        await runner.cleanup()
