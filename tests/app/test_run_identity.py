"""Run identity without headers (`/r/{run_id}[/t/{task}]/...`) and per-task default caps
(`[tasks."NAME"]`): agents that can set a base URL but no headers still get runs and caps."""

from __future__ import annotations

import re

import aiohttp
import anthropic
import openai
import pytest

from proxy.caps import parse_run_headers
from proxy.config import ConfigError, build_config
from tests.support.tool_service import ToolService

USER = [{"role": "user", "content": "hi"}]


def config(tool: ToolService) -> dict:  # type: ignore[type-arg]
    return {
        "tools": {"refund": {"url": f"{tool.url}/refund", "side_effects": True}},
        "tasks": {"refund-triage": {"max_steps": 2, "max_usd": 0.5, "timeout_s": 600}},
        "caps": {"ceiling_max_usd": 0.2},
    }


async def test_run_and_task_in_the_path(runcap_factory, upstream, tool) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory(config(tool))
    # An agent configured by base URL only.
    c = openai.AsyncOpenAI(base_url=f"{rc.url}/r/ticket-4711/t/refund-triage/v1", api_key="k", max_retries=0)
    raw = await c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert raw.headers["x-run-id"] == "ticket-4711" and raw.headers["x-run-remaining-steps"] == "1"
    state = await rc.ledger.get_run("ticket-4711")
    assert state is not None and state.task == "refund-triage" and state.steps == 1
    # The task's caps, clamped by the [caps] ceiling: 2 steps, $0.20 (not the task's $0.50), 600 s.
    assert state.caps.max_steps == 2 and state.caps.max_usd_nanos == 200_000_000
    assert state.caps.deadline is not None and state.caps.deadline - state.started_at == pytest.approx(600)
    await c.chat.completions.create(model="gpt-4o-mini", messages=USER)
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER)
    assert e.value.status_code == 402
    # Anthropic's client, the run without a task.
    a = anthropic.AsyncAnthropic(base_url=f"{rc.url}/r/ant-1/anthropic", api_key="k", max_retries=0)
    await a.messages.create(model="claude-sonnet-4-5", max_tokens=50, messages=USER)
    ant = await rc.ledger.get_run("ant-1")
    assert ant is not None and ant.steps == 1 and ant.task == ""
    # Tool calls too: the run's idempotency applies.
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(f"{rc.url}/r/ticket-4711/tools/refund", json={"order_id": 1}) as r:
                assert r.status == 200
    assert tool.executions == 1 and tool.hits[0].headers["x-run-id"] == "ticket-4711"


async def test_path_and_header_must_agree(runcap_factory, upstream, tool) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory(config(tool))
    url = f"{rc.url}/r/p-1/v1/chat/completions"
    body = {"model": "gpt-4o-mini", "messages": USER}
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, headers={"X-Run-Id": "p-1"}) as r:
            assert r.status == 200
        async with s.post(url, json=body, headers={"X-Run-Id": "other"}) as r:
            assert r.status == 400 and "disagrees" in (await r.json())["error"]["message"]
        t_url = f"{rc.url}/r/p-1/t/refund-triage/v1/chat/completions"
        async with s.post(t_url, json=body, headers={"X-Run-Task": "other"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "X-Run-Task"
        for bad in ("/r/bad%20id/v1/chat/completions", "/r/p-1", "/r/p-1/%2e%2e/v1/chat/completions",
                    "/r/" + "x" * 129 + "/v1/chat/completions"):  # fmt: skip
            async with s.post(rc.url + bad, json=body) as r:
                assert r.status in (400, 404), bad
        # /r/ nested in /r/ with another run: the headers it sets disagree.
        async with s.post(f"{rc.url}/r/p-1/r/p-2/v1/chat/completions", json=body) as r:
            assert r.status == 400
    assert upstream.hits() == 1


def test_task_caps_are_defaults_headers_may_only_lower() -> None:
    caps = build_config(
        {"tasks": {"t": {"max_steps": 5, "max_tokens": 1000}}, "caps": {"default_max_steps": 50}}, {}
    ).caps
    assert parse_run_headers({"X-Run-Task": "t"}, caps).caps.max_steps == 5
    assert parse_run_headers({"X-Run-Task": "t", "X-Run-Max-Steps": "3"}, caps).caps.max_steps == 3
    assert parse_run_headers({"X-Run-Task": "t", "X-Run-Max-Steps": "30"}, caps).caps.max_steps == 5
    assert parse_run_headers({"X-Run-Task": "other"}, caps).caps.max_steps == 50
    assert parse_run_headers({"X-Run-Task": "t"}, caps).caps.max_tokens == 1000
    for bad, setting in (
        ({"tasks": {"t": {"max_steps": -1}}}, 'tasks."t".max_steps'),
        ({"tasks": {"t": {"max_usd": "x"}}}, 'tasks."t".max_usd'),
        ({"tasks": {"t": {"steps": 1}}}, 'tasks."t".steps'),
        ({"tasks": {"t": {"timeout_s": 10**9}}}, 'tasks."t".timeout_s'),
    ):
        with pytest.raises(ConfigError, match=re.escape(setting)):
            build_config(bad, {})


def test_upstream_url_with_v1_is_accepted(caplog: pytest.LogCaptureFixture) -> None:
    cfg = build_config({"upstreams": {"openai": {"url": "https://api.openai.com/v1/"}}}, {})
    assert cfg.upstreams["openai"].url == "https://api.openai.com"
    assert "ends with /v1" in caplog.text
    # Another upstream's base path is its own business (/u/{name}/... sends what the agent sent).
    cfg = build_config({"upstreams": {"local": {"url": "http://127.0.0.1:8000/v1"}}}, {})
    assert cfg.upstreams["local"].url == "http://127.0.0.1:8000/v1"
