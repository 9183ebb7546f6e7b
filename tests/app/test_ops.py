"""Operational routes: run state, cancel, health, readiness, metrics."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import aiohttp
import openai
import pytest


async def get(url: str, headers=None):  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, await r.read()


async def test_run_json_shape(runcap, upstream):  # type: ignore[no-untyped-def]
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k")
    deadline = datetime.fromtimestamp(time.time() + 3600, UTC).replace(microsecond=0)
    await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}],
        extra_headers={"X-Run-Id": "shape", "X-Run-Max-Usd": "0.5", "X-Run-Max-Steps": "4",
                       "X-Run-Deadline": deadline.isoformat(), "X-Run-Task": "triage"},
    )  # fmt: skip
    run = await runcap.run("shape")
    assert set(run) >= {"run_id", "status", "task", "steps", "tool_calls", "input_tokens", "output_tokens",
                        "cost_usd", "reserved_usd", "caps", "remaining"}  # fmt: skip
    assert run["caps"] == {"max_usd": "0.500000000", "max_tokens": None, "max_steps": 4,
                           "max_tool_calls": None,
                           "deadline": deadline.strftime("%Y-%m-%dT%H:%M:%S.000Z")}  # fmt: skip
    assert set(run["remaining"]) == set(run["caps"])
    assert run["remaining"]["max_steps"] == 3 and run["remaining"]["max_tokens"] is None
    assert isinstance(run["cost_usd"], str) and "." in run["cost_usd"]
    status, _ = await get(f"{runcap.url}/runs/nope", runcap.admin)
    assert status == 404
    # The run's state is the operator's: no token (or a wrong one), no answer — also on loopback.
    assert (await get(f"{runcap.url}/runs/shape"))[0] == 401
    assert (await get(f"{runcap.url}/runs/shape", {"Authorization": "Bearer nope"}))[0] == 401


async def test_health_ready_metrics(runcap, upstream):  # type: ignore[no-untyped-def]
    assert (await get(f"{runcap.url}/healthz"))[0] == 200
    assert (await get(f"{runcap.url}/readyz"))[0] == 200
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=0)
    await c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.APIStatusError):
        await c.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Run-Max-Steps": "0"},
        )
    status, body = await get(f"{runcap.url}/metrics")
    text = body.decode()
    assert status == 200
    assert 'runcap_requests_total{endpoint="chat.completions",status="200",upstream="openai"} 1.0' in text
    assert 'runcap_rejections_total{reason="max_steps"} 1.0' in text
    assert 'runcap_tokens_total{kind="input",model="gpt-4o-mini"}' in text
    assert 'runcap_cost_usd_total{model="gpt-4o-mini"}' in text
    # The first call (no run id, no cap) needs no ledger; the capped one reserves.
    assert 'runcap_ledger_op_seconds_count{op="reserve"} 1.0' in text
    assert "runcap_request_duration_seconds_bucket" in text


async def test_cancel_aborts_in_flight_and_refuses_later_calls(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"admin_token": "s3cret" * 6})
    upstream.scripts["slow"] = [{"text": "word " * 50, "chunk_delay_s": 0.05}]
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")
    h = {"X-Run-Id": "cx", "X-Mock-Script": "slow"}
    stream = await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], stream=True, extra_headers=h
    )

    flowing = asyncio.Event()

    async def consume():  # type: ignore[no-untyped-def]
        async for _ in stream:
            flowing.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(flowing.wait(), 10)  # the stream is in flight (2.5 s of chunks)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{rc.url}/runs/cx/cancel") as r:
            assert r.status == 401  # admin token required
        async with s.post(f"{rc.url}/runs/cx/cancel", headers=rc.admin) as r:
            assert r.status == 200
            body = await r.json()
    assert body["status"] == "cancelled" and body["aborted_in_flight"] == 1
    with pytest.raises(openai.APIError) as e:
        await task
    # The stream ends with runcap's error event naming the cancel, not a cut connection.
    assert type(e.value) is openai.APIError and "cancel" in e.value.message.lower(), repr(e.value)
    for _ in range(50):
        if upstream.last.disconnected:
            break
        await asyncio.sleep(0.05)
    assert upstream.last.disconnected  # the upstream saw the connection drop
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], extra_headers=h
        )
    assert e.value.status_code == 410 and e.value.response.headers["x-should-retry"] == "false"
    run = await rc.run("cx")
    assert run["status"] == "cancelled" and run["reserved_usd"] == "0.000000000"
