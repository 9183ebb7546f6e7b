"""Operator top-up (`POST /runs/{id}/caps`, `runcap caps RUN_ID ...`) and `runcap caps suggest`:
"pause, approve, continue" instead of kill-only, and per-task caps from the p99 of completed runs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import aiohttp
import openai
import pytest

from proxy.caps import RunCaps
from proxy.ledger.base import CapsChange, apply_caps_change, merge_caps, new_run
from tests.conftest import REPO

USER = [{"role": "user", "content": "hi"}]


async def post_caps(rc, run_id: str, body: Any, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{rc.url}/runs/{run_id}/caps", json=body, headers=headers if headers is not None else rc.admin
        ) as r,
    ):
        return r.status, await r.json()


def agent(rc, headers: dict[str, str]) -> openai.AsyncOpenAI:  # type: ignore[no-untyped-def]
    """The agent's client, with its run headers on every call (SDK default_headers)."""
    return openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0, default_headers=headers)


async def test_raised_step_cap_lets_a_stopped_run_continue(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": False})
    # The agent sends the same headers on every call, as SDK default_headers do.
    c = agent(rc, {"X-Run-Id": "paused", "X-Run-Max-Steps": "1"})
    raw = await c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert raw.headers["x-run-final-step"] == "true"
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER)
    assert e.value.status_code == 402
    assert (await rc.run("paused"))["status"] == "steps_exceeded"

    status, answer = await post_caps(rc, "paused", {"max_steps": 3, "by": "alice", "reason": "approved"})
    assert status == 200, answer
    assert answer["previous_caps"]["max_steps"] == 1 and answer["caps"]["max_steps"] == 3
    assert answer["status"] == "active" and answer["changed_by"] == "alice"
    # The next call goes through although the agent still says X-Run-Max-Steps: 1.
    raw = await c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert raw.headers["x-run-step"] == "2" and raw.headers["x-run-remaining-steps"] == "1"
    # ... and the next is the answer-only final step of the new cap.
    raw = await c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert raw.headers["x-run-final-step"] == "true"
    with pytest.raises(openai.APIStatusError):
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER)


async def test_raised_dollar_cap_and_refusals(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": False})
    c = agent(rc, {"X-Run-Id": "usd", "X-Run-Max-Usd": "0.0001"})
    with pytest.raises(openai.APIStatusError) as e:
        for _ in range(20):
            await c.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=200)
    assert e.value.status_code == 402
    status, answer = await post_caps(rc, "usd", {"max_usd": "0.05"})
    assert status == 200 and answer["caps"]["max_usd"] == "0.050000000"
    await c.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=200)
    # The agent can still lower its caps? Not those the operator set: its header is ignored.
    state = await rc.ledger.get_run("usd")
    assert state is not None and state.caps.max_usd_nanos == 50_000_000

    # Only the operator; only known runs; clear errors naming the field.
    assert (await post_caps(rc, "usd", {"max_usd": "9"}, headers={}))[0] == 401
    assert (await post_caps(rc, "nope", {"max_usd": "9"}))[0] == 404
    for body, field in (
        ({"max_usd": "lots"}, "max_usd"),
        ({"max_steps": -1}, "max_steps"),
        ({"max_steps": 1.5}, "max_steps"),
        ({"deadline": "tomorrow"}, "deadline"),
        ({"deadline": time.time() + 30 * 86400}, "deadline"),
        ({"extend_s": 0}, "extend_s"),
        ({"steps": 3}, "steps"),
        ({}, "body"),
        ([1], "body"),
    ):
        status, answer = await post_caps(rc, "usd", body)
        assert status == 400 and field in answer["error"]["message"], (body, answer)


async def test_cancelled_stays_cancelled_and_deadline_extends(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": False})
    h = {"X-Run-Id": "late", "X-Run-Timeout": "0.3"}
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0, default_headers=h)
    await c.chat.completions.create(model="gpt-4o-mini", messages=USER)
    await asyncio.sleep(0.4)
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER)
    assert e.value.status_code == 504
    status, answer = await post_caps(rc, "late", {"extend_s": 60})
    assert status == 200 and answer["status"] == "active"
    assert 50_000 < answer["remaining"]["deadline"] <= 60_000
    # The agent's X-Run-Timeout is not applied again: the operator set the deadline.
    await c.chat.completions.create(model="gpt-4o-mini", messages=USER)

    async with aiohttp.ClientSession() as s, s.post(f"{rc.url}/runs/late/cancel", headers=rc.admin) as r:
        assert r.status == 200
    status, answer = await post_caps(rc, "late", {"max_steps": 50})
    assert status == 200 and answer["status"] == "cancelled"
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER)
    assert e.value.status_code == 410


def test_operator_caps_survive_resent_headers() -> None:
    state = new_run("r", "", RunCaps(max_steps=1, max_usd_nanos=10), 0.0)
    change: CapsChange = {"max_steps": 5}
    apply_caps_change(state, change, 1.0)
    merge_caps(state, "", RunCaps(max_steps=1, max_usd_nanos=5), 2.0)
    assert state.caps.max_steps == 5  # the operator's
    assert state.caps.max_usd_nanos == 5  # headers still lower what the operator did not set
    apply_caps_change(state, {"max_usd_nanos": None}, 3.0)
    assert state.caps.max_usd_nanos is None and state.operator_caps == "max_steps,max_usd_nanos"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


async def test_cli_caps_and_suggest(runcap_factory, upstream, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`runcap caps RUN --max-steps` through the HTTP route, and `caps suggest` from the spans of
    completed runs (embedded chdb, read through the running server)."""
    data = tmp_path / "data"
    rc = await runcap_factory({"tracing": True}, data_dir=data)
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    for i in range(6):
        h = {"X-Run-Id": f"tri-{i}", "X-Run-Task": "triage", "X-Run-Max-Steps": "5"}
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers=h)
    loop = asyncio.get_running_loop()
    at = ("--url", rc.url, "--data-dir", str(data))
    done = await loop.run_in_executor(
        None, lambda: cli("caps", "tri-0", "--max-steps", "4", "--by", "bob", "--json", *at)
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)[0]
    assert answer["caps"]["max_steps"] == 4 and answer["changed_by"] == "bob"
    assert (await loop.run_in_executor(None, lambda: cli("caps", "tri-0", *at))).returncode == 2
    # The runs land in the span store; then the suggestion.
    deadline = time.monotonic() + 30
    while True:
        out = await loop.run_in_executor(None, lambda: cli("caps", "suggest", "--task", "triage", *at))
        assert out.returncode == 0, out.stderr
        if '[tasks."triage"]' in out.stdout or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert '[tasks."triage"]' in out.stdout, out.stdout
    assert "max_steps = 2" in out.stdout  # every run completed in 1 step: p99 1 → 2
    assert "0.0% of 6 runs would have exceeded it" in out.stdout
    spans = await loop.run_in_executor(
        None, lambda: cli("sql", "SELECT kind, attributes['caps.by'] AS by FROM runcap.spans "
                          "WHERE run_id = 'tri-0' AND kind = 'caps_change'", "--json", *at),
    )  # fmt: skip
    assert json.loads(spans.stdout) == [{"kind": "caps_change", "by": "bob"}], spans.stderr


async def test_a_top_up_of_a_parents_tree_caps_lets_its_children_continue(
    runcap_factory, upstream, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Run trees: the refusal of `X-Run-Max-Tree-Steps` tells the operator to top up the parent;
    `POST /runs/{parent}/caps {"max_tree_steps": ...}` (and `runcap caps --max-tree-steps`) does
    it, and the child that took the tree's last step goes on. Bad values are a 400 naming them."""
    rc = await runcap_factory({"tracing": False}, data_dir=tmp_path / "data")
    await agent(rc, {"X-Run-Id": "boss", "X-Run-Max-Tree-Steps": "2"}).chat.completions.create(
        model="gpt-4o-mini", messages=USER
    )
    kid = agent(rc, {"X-Run-Id": "boss.kid", "X-Run-Parent": "boss"})
    raw = await kid.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert raw.headers["x-run-final-step"] == "true"  # the tree's last step
    with pytest.raises(openai.APIStatusError) as e:
        await kid.chat.completions.create(model="gpt-4o-mini", messages=USER)
    assert e.value.status_code == 402 and "top up run boss" in str(e.value.message)
    for bad in ({"max_tree_steps": -1}, {"max_children": "many"}, {"max_depth": 1.5}):
        status, answer = await post_caps(rc, "boss", bad)
        assert status == 400 and answer["error"]["param"] == next(iter(bad)), answer
    loop = asyncio.get_running_loop()
    done = await loop.run_in_executor(
        None,
        lambda: cli(
            "caps",
            "boss",
            "--max-tree-steps",
            "5",
            "--max-children",
            "4",
            "--json",
            "--url",
            rc.url,
            "--data-dir",
            str(tmp_path / "data"),
        ),
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)[0]
    # (the run's tree caps are its `tree_caps`; `previous_caps` names every cap the route sets)
    assert answer["previous_caps"]["max_tree_steps"] == 2 and answer["tree_caps"]["max_tree_steps"] == 5
    assert answer["previous_caps"]["max_children"] is None and answer["tree_caps"]["max_children"] == 4
    raw = await kid.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert raw.headers["x-run-step"] == "2" and "x-run-final-step" not in raw.headers
    assert (await rc.run("boss.kid"))["status"] == "completed"  # answered, no longer stopped
