"""The budget step's edges that the cap tests (tests/app/test_caps.py) do not reach, through the app:
the operator's passthrough allow-list (segments, `*`, paths below an entry, trailing slashes),
what counts as a write under a cap, and a settlement the ledger could not take — the agent gets
its answer, the reservation holds the worst case, the background retry settles it at what was
used. Fast (one runcap in-process each, a SQLite ledger); the mutation target `budget` runs
this file."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import aiohttp
import pytest

from proxy.scripted_upstream import ScriptedUpstream
from tests.conftest import Runcap
from tests.support.stub_upstream import send, stub_config
from tests.support.tool_service import ToolService

CAPPED = {"X-Run-Id": "allow", "X-Run-Max-Usd": "1"}


def unsettled(rc: Runcap) -> float:
    for line in rc.runtime.metrics.render().decode().splitlines():
        if line.startswith("runcap_unsettled_reservations "):
            return float(line.split()[1])
    raise AssertionError("runcap_unsettled_reservations is not exported")


async def allow_list(runcap_factory: Any, svc: ToolService, patterns: list[str]) -> Runcap:
    cfg = stub_config(svc)
    cfg["upstreams"]["openai"]["passthrough_allow"] = patterns
    rc: Runcap = await runcap_factory(cfg, env={"LOCAL_KEY": "k"})
    return rc


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/v1/files", 200),  # the entry itself
        ("/v1/files/", 200),  # ... with a trailing slash
        ("/v1/files/f1/content", 200),  # below it
        ("/v1/filesystem", 402),  # a segment, not a prefix
        ("/v1/threads/t1/messages", 200),  # `*` is one segment
        ("/v1/threads/t1/messages/m1", 200),
        ("/v1/threads/messages", 402),  # `*` is a segment, not nothing
        ("/v1/threads/t1", 402),  # shorter than the pattern
        ("/v1/threads/t1/runs", 402),
        ("/v1/batches", 200),  # an entry written with a trailing slash
        ("/v1/vector_stores", 402),  # in no entry
    ],
)
async def test_passthrough_allow_list_by_segments(runcap_factory, stub, path: str, status: int) -> None:  # type: ignore[no-untyped-def]
    rc = await allow_list(
        runcap_factory, stub, ["/oa/v1/files", "/oa/v1/threads/*/messages", "/oa/v1/batches/"]
    )
    got, _, body = await send(rc.url + path, headers=CAPPED)
    assert got == status, (path, body)
    assert stub.executions == (1 if status == 200 else 0)


async def test_unmetered_refusal_names_the_cap_and_the_upstream(runcap_factory, stub) -> None:  # type: ignore[no-untyped-def]
    rc = await allow_list(runcap_factory, stub, [])
    for cap, name in (("X-Run-Max-Usd", "1"), ("X-Run-Max-Tokens", "1000")):
        status, _, body = await send(
            f"{rc.url}/v1/images/generations", headers={"X-Run-Id": f"u-{cap}", cap: name}
        )
        assert status == 402, body
        message = body["error"]["message"]
        assert message.startswith("POST /oa/v1/images/generations: runcap cannot meter this endpoint"), (
            message
        )
        assert f"upstream 'openai', and run u-{cap} has a {cap} cap" in message, message
        assert "([upstreams.openai] passthrough_allow)" in message, message
    # Under a step cap only, nothing to meter: it passes.
    status, _, _ = await send(
        f"{rc.url}/v1/images/generations", headers={"X-Run-Id": "s", "X-Run-Max-Steps": "3"}
    )
    assert status == 200 and stub.executions == 1


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE"])
async def test_writes_other_than_post_are_metered_or_refused(runcap_factory, stub, method: str) -> None:  # type: ignore[no-untyped-def]
    rc = await allow_list(runcap_factory, stub, [])
    status, _, _ = await send(f"{rc.url}/v1/fine_tuning/jobs/j1", method, headers=CAPPED, body=None)
    # A DELETE without a body is a read here; a PUT or PATCH is a write, with a body or not.
    assert status == (200 if method == "DELETE" else 402)
    status, _, _ = await send(f"{rc.url}/v1/fine_tuning/jobs/j1", method, headers=CAPPED, body={"x": 1})
    assert status == 402


async def test_a_settlement_the_ledger_cannot_take_is_retried_until_it_does(  # type: ignore[no-untyped-def]
    runcap_factory, upstream: ScriptedUpstream, tmp_path, caplog
):
    upstream.scripts["slow"] = [{"text_tokens": 40, "delay_s": 0.5}]
    rc = await runcap_factory({"ledger_timeout_s": 0.3}, data_dir=tmp_path / "d")
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "go"}], "max_tokens": 200}
    headers = {"X-Run-Id": "unsettled", "X-Run-Max-Usd": "5", "X-Mock-Script": "slow"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        call = asyncio.create_task(s.post(f"{rc.url}/v1/chat/completions", json=body, headers=headers))
        end = time.monotonic() + 30  # liveness guard only
        while upstream.in_flight < 1:
            assert time.monotonic() < end, "the call never reached the upstream"
            await asyncio.sleep(0.01)
        # The ledger is locked while the call is with the upstream: its settlement times out.
        lock = sqlite3.connect(tmp_path / "d" / "ledger.sqlite3", isolation_level=None)
        try:
            lock.execute("BEGIN EXCLUSIVE")
            async with await call as r:
                assert r.status == 200, await r.text()  # the paid-for answer comes all the same
                await r.read()
            assert unsettled(rc) == 1
            assert "settlement not taken" in caplog.text and "retrying it in the background" in caplog.text
        finally:
            lock.rollback()
            lock.close()
    end = time.monotonic() + 30  # liveness guard only: the retry runs about every second
    while unsettled(rc) != 0:
        assert time.monotonic() < end, "the settlement was never retried"
        await asyncio.sleep(0.05)
    state = await rc.ledger.get_run("unsettled")
    assert state is not None and state.reserved_usd_nanos == 0 and state.reserved_tokens == 0
    assert state.output_tokens == 40 and state.steps == 1  # what was used, once
