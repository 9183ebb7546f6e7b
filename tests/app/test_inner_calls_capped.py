"""runcap's own model calls are capped like the agent's (issue 21): a `runcap_fetch` continuation
— the inner call runcap makes to answer the model's fetch of an offloaded result — whose context
is over `X-Run-Max-Context-Tokens` is refused, and the agent's request gets that refusal (402
`max_context_tokens`), exactly as if the agent had sent the continuation itself. It is never
sent to the upstream and costs nothing; the first call stays charged.

Driven like tests/app/test_context_offload.py: the official wire format against runcap in front of
the scripted upstream, whose model asks for a handle at the step under test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from proxy.context import ContextSettings
from proxy.context.offload import offload
from proxy.scripted_upstream import ScriptedUpstream
from proxy.server.steps.context import text_words
from tests.support.context_agents import answered_history, tool_result

PAGE = 8192  # bytes of each tool result in the history; the fetch reads page 0 whole


async def test_a_fetch_continuation_over_the_context_cap_is_refused_like_the_agents_call(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    rc = await runcap_factory({"context": {"keep_last_steps": 1, "offload_min_bytes": 1024}})
    upstream.scripts["ctx-capped"] = [{}] * 4 + [{"fetch": {"handle": 0, "length": PAGE}}, {"text": "done"}]
    body = answered_history("chat", 4, PAGE)
    done = offload(body, "chat.completions", ContextSettings(keep_last_steps=1, offload_min_bytes=1024))
    assert done is not None
    # The forwarded first call (three results offloaded) fits the cap; the continuation adds the
    # whole page 0 (about 1 500 words) to it, which does not.
    first_words = text_words(done.body["messages"])
    fetched_words = len(tool_result(0, PAGE).split())
    cap = first_words + 300
    assert fetched_words > 1000
    h = {
        "X-Run-Id": "ctx-capped",
        "X-Mock-Script": "ctx-capped",
        "X-Run-Context-Policy": "offload",
        "X-Run-Max-Context-Tokens": str(cap),
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rc.url}/v1/chat/completions", json=body, headers=h) as r,
    ):
        status, answer, headers = r.status, await r.json(), r.headers

    assert status == 402, answer
    assert answer["error"]["type"] == "run_budget_exceeded"
    assert answer["error"]["code"] == "max_context_tokens"
    assert "X-Run-Max-Context-Tokens" in answer["error"]["message"]
    assert headers["x-should-retry"] == "false"
    sent = [q for q in upstream.requests if q.script == "ctx-capped"]
    assert len(sent) == 1  # the continuation was never sent
    run = await rc.run("ctx-capped")
    assert run["steps"] == 1 and run["input_tokens"] > 0  # the first call is charged, only it


async def test_the_same_continuation_under_a_cap_it_fits_is_answered(
    upstream: ScriptedUpstream, runcap_factory: Callable[..., Any]
) -> None:
    """The control: with room for the fetched page the loop completes (so the refusal above is the
    cap's, not a failure of the fetch)."""
    rc = await runcap_factory({"context": {"keep_last_steps": 1, "offload_min_bytes": 1024}})
    upstream.scripts["ctx-fits"] = [{}] * 4 + [{"fetch": {"handle": 0, "length": PAGE}}, {"text": "done"}]
    h = {
        "X-Run-Id": "ctx-fits",
        "X-Mock-Script": "ctx-fits",
        "X-Run-Context-Policy": "offload",
        "X-Run-Max-Context-Tokens": "100000",
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rc.url}/v1/chat/completions", json=answered_history("chat", 4, PAGE), headers=h) as r,
    ):
        status, answer = r.status, await r.json()
    assert status == 200 and answer["choices"][0]["message"]["content"] == "done", answer
    assert len([q for q in upstream.requests if q.script == "ctx-fits"]) == 2
    assert (await rc.run("ctx-fits"))["steps"] == 2
