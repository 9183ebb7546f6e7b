"""A model call that got no answer is not a step (issue 25, item 1).

A provider that is down, overloaded (529), rate limiting (429) or failing (5xx), plus an official
SDK's ordinary retries, must not use up a run's steps nor be taken for its answer-only final
step; it is charged only what the provider may have billed. Upstream failures are still bounded:
`[caps] max_upstream_failures` in a row stop the run with 402 `max_upstream_failures`.

The rules are the ledger's (proxy/ledger/base.py), so they are checked on both backends; the
whole path with the official `openai` and `anthropic` clients and their default retries, once
in-process and once against a real `runcap serve` process.
"""

from __future__ import annotations

import time

import aiohttp
import anthropic
import openai
import pytest

from proxy.caps import RunCaps
from proxy.errors import BudgetExceeded
from proxy.ledger.base import Settlement
from tests.conftest import RuncapProcess, free_port
from tests.support.ledgers import step

FAILED = Settlement(no_answer=True, upstream_failed=True)
ANSWERED = Settlement(input_tokens=10, output_tokens=5, cost_usd_nanos=20)


# -- the ledger's rules, on SQLite and Redis ---------------------------------------------------


async def test_failed_calls_give_their_step_back(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    caps = RunCaps(max_steps=3)
    for _ in range(3):  # the openai client's first try and its two retries
        res = await led.begin_step(step("r", caps, max_upstream_failures=5))
        assert res.step == 1 and not res.final_step
        await led.settle(res, FAILED, time.time())
    run = await led.get_run("r")
    assert run.steps == 0 and run.final_reason is None and run.status == "active"
    assert run.upstream_failures == 3
    # The provider is back: the run has all its steps, and an answer sets the count back.
    res = await led.begin_step(step("r", caps, max_upstream_failures=5))
    assert res.step == 1 and not res.final_step
    state = await led.settle(res, ANSWERED, time.time())
    assert state.steps == 1 and state.upstream_failures == 0


async def test_failed_final_step_is_not_the_final_step(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    caps = RunCaps(max_steps=2)
    res = await led.begin_step(step("r", caps))
    await led.settle(res, ANSWERED, time.time())
    for _ in range(2):  # two 529s on the answer-only step
        res = await led.begin_step(step("r", caps))
        assert res.final_step and res.step == 2
        state = await led.settle(res, FAILED, time.time())
        assert state.final_reason is None and state.status == "active" and state.steps == 1
    res = await led.begin_step(step("r", caps))  # not "already had its answer-only final step"
    assert res.final_step
    state = await led.settle(res, ANSWERED, time.time())
    assert state.status == "steps_exceeded"


async def test_consecutive_failures_stop_the_run(make_ledger):  # type: ignore[no-untyped-def]
    led = make_ledger()
    caps = RunCaps(max_steps=10)
    for _ in range(2):
        res = await led.begin_step(step("r", caps, max_upstream_failures=2))
        await led.settle(res, FAILED, time.time())
    with pytest.raises(BudgetExceeded) as e:
        await led.begin_step(step("r", caps, max_upstream_failures=2))
    assert e.value.code == "max_upstream_failures"
    assert "caps.max_upstream_failures" in e.value.message and "2 in a row" in e.value.message
    run = await led.get_run("r")
    assert run.status == "budget_exceeded" and run.upstream_failures == 2 and run.steps == 0
    # An operator's top-up lets it go on.
    await led.set_caps("r", {"max_steps": 20}, time.time())
    res = await led.begin_step(step("r", caps, max_upstream_failures=2))
    state = await led.settle(res, ANSWERED, time.time())
    assert state.status == "active" and state.upstream_failures == 0


async def test_a_cut_is_not_an_upstream_failure(make_ledger):  # type: ignore[no-untyped-def]
    """A call the agent or a cancel cut before any output gives its step back, but the upstream
    did not fail: the count is neither raised nor set back."""
    led = make_ledger()
    res = await led.begin_step(step("r", RunCaps(max_steps=3)))
    await led.settle(res, FAILED, time.time())
    res = await led.begin_step(step("r", RunCaps(max_steps=3)))
    state = await led.settle(res, Settlement(no_answer=True), time.time())
    assert state.steps == 0 and state.upstream_failures == 1


# -- the whole path, with the official clients and their default retries ------------------------


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


async def test_provider_down_with_openai_retries_in_process(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"upstreams": {"openai": {"url": _dead_url()}}})
    h = {"X-Run-Id": "down-1", "X-Run-Max-Steps": "3"}
    down = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")  # default: two retries
    with pytest.raises(openai.InternalServerError) as e:
        await down.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], extra_headers=h
        )
    assert e.value.status_code == 502
    run = await rc.run("down-1")
    assert run["steps"] == 0 and run["final_step_reason"] is None and run["status"] == "active"
    assert run["upstream_failures"] == 3 and run["cost_usd"] == "0.000000000"
    # The provider is back (the same run through the `local` upstream, the scripted one).
    upstream.scripts["hi"] = [{"text": "hello"}]
    back = openai.AsyncOpenAI(base_url=f"{rc.url}/u/local/v1", api_key="k")
    raw = await back.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
        extra_headers={**h, "X-Mock-Script": "hi"},
    )  # fmt: skip
    assert raw.headers.get("X-Run-Step") == "1" and raw.headers.get("X-Run-Final-Step") is None
    assert raw.headers["X-Run-Remaining-Steps"] == "2"
    run = await rc.run("down-1")
    assert run["steps"] == 1 and run["upstream_failures"] == 0


async def test_529_with_anthropic_retries_does_not_end_the_run(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["busy"] = [{"status": 529, "error": "Overloaded", "error_type": "overloaded_error"}]
    upstream.scripts["ok"] = [{"text": "done"}]
    rc = await runcap_factory({"caps": {"max_upstream_failures": 10}})
    c = anthropic.AsyncAnthropic(base_url=f"{rc.url}/anthropic", api_key="k")  # two retries
    h = {"X-Run-Id": "busy-1", "X-Run-Max-Steps": "2"}
    for _ in range(2):  # two 529s, each retried twice: six calls the provider did not answer
        with pytest.raises(anthropic.APIStatusError) as e:
            await c.messages.create(
                model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                extra_headers={**h, "X-Mock-Script": "busy"},
            )  # fmt: skip
        assert e.value.status_code == 529
    assert upstream.hits() == 6
    run = await rc.run("busy-1")
    assert run["steps"] == 0 and run["final_step_reason"] is None and run["upstream_failures"] == 6
    answer = await c.messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
        extra_headers={**h, "X-Mock-Script": "ok"},
    )  # fmt: skip
    assert answer.headers["X-Run-Step"] == "1" and answer.headers.get("X-Run-Final-Step") is None
    run = await rc.run("busy-1")
    assert run["steps"] == 1 and run["status"] == "completed" and run["upstream_failures"] == 0


async def test_max_upstream_failures_with_a_real_process(tmp_path):  # type: ignore[no-untyped-def]
    config = tmp_path / "runcap.toml"
    config.write_text(
        f'log_requests = false\n[upstreams.openai]\nurl = "{_dead_url()}"\n'
        "[caps]\nmax_upstream_failures = 3\n"
    )
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        c = openai.AsyncOpenAI(base_url=proc.openai_url, api_key="k")  # two retries: three tries
        h = {"X-Run-Id": "down-2", "X-Run-Max-Steps": "3"}
        with pytest.raises(openai.InternalServerError):
            await c.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}], extra_headers=h
            )
        with pytest.raises(openai.APIStatusError) as e:  # refused at once, not retried
            await c.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}], extra_headers=h
            )
        assert e.value.status_code == 402
        err = e.value.body
        assert err["type"] == "run_budget_exceeded" and err["code"] == "max_upstream_failures"
        assert "caps.max_upstream_failures" in err["message"]
        async with aiohttp.ClientSession() as s, s.get(f"{proc.url}/runs/down-2", headers=proc.admin) as r:
            run = await r.json()
        assert run["status"] == "budget_exceeded" and run["upstream_failures"] == 3 and run["steps"] == 0
        assert run["final_step_reason"] is None
    finally:
        proc.stop()


def test_max_upstream_failures_config_bounds(tmp_path):  # type: ignore[no-untyped-def]
    from proxy.config import ConfigError, build_config

    def build(value: object):  # type: ignore[no-untyped-def]
        return build_config({"caps": {"max_upstream_failures": value}}, {}, data_dir=str(tmp_path))

    assert build(7).caps.max_upstream_failures == 7
    assert build_config({}, {}, data_dir=str(tmp_path)).caps.max_upstream_failures == 5
    for bad in (0, -1, 1001, "5", 2.5):
        with pytest.raises(ConfigError, match=r"caps\.max_upstream_failures"):
            build(bad)
