"""`/tools/{name}`: at-most-once side effects, deadlines and cancels that reach the tool, the
Redis ledger shared by replicas, and `runcap reconcile` after a crash."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from datetime import datetime
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.conftest import RuncapProcess, reconcile
from tests.support.redis_server import wait_subscribed
from tests.support.tool_agent import call, tools_config, wait_for


def rid(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


# -- idempotency -------------------------------------------------------------------------------


async def test_same_call_twice_executes_once(runcap_factory, tool):  # type: ignore[no-untyped-def]
    tool.status = 201
    rc = await runcap_factory(tools_config(tool))
    url = f"{rc.url}/tools/refund"
    run = rid("twice")
    s1, h1, b1 = await call(url, run, {"order_id": "o-1", "amount": 12.0, "reason": "late"})
    assert s1 == 201 and "X-Idempotent-Replay" not in h1
    # Same arguments, other key order and whitespace, integral float as integer: a replay.
    raw = b'{ "reason" : "late",\n "amount": 12, "order_id":"o-1" }'
    s2, h2, b2 = await call(url, run, raw=raw)
    assert (s2, b2) == (s1, b1) and h2["X-Idempotent-Replay"] == "true"
    assert h2["Content-Type"].startswith("application/json")
    assert tool.executions == 1
    hit = tool.hits[0]
    assert hit.headers["x-run-id"] == run
    assert (
        len(hit.headers["idempotency-key"]) == 32 and hit.headers["idempotency-key"] == h1["Idempotency-Key"]
    )
    assert hit.path == "/refund" and json.loads(hit.body)["order_id"] == "o-1"
    state = await rc.run(run)
    assert state["tool_calls_executed"] == 1 and state["tool_calls"] == 1


async def test_key_fields_operation_id_and_callers_key(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    url = f"{rc.url}/tools/refund"
    run = rid("kf")
    _, _, b1 = await call(url, run, {"order_id": "o-2", "amount": 5, "reason": "Item arrived broken."})
    # The model reworded the free text on its retry: same order and amount → replay.
    _, h2, b2 = await call(url, run, {"order_id": "o-2", "amount": 5, "reason": "The item was damaged."})
    assert h2.get("X-Idempotent-Replay") == "true" and b2 == b1 and tool.executions == 1
    # An intentional second refund of the same amount: a new operation.
    _, h3, b3 = await call(
        url, run, {"order_id": "o-2", "amount": 5}, headers={"X-Run-Operation-Id": "second"}
    )
    assert "X-Idempotent-Replay" not in h3 and b3["execution"] == 2 and tool.executions == 2
    # Another amount is another call.
    await call(url, run, {"order_id": "o-2", "amount": 6})
    assert tool.executions == 3
    # The caller's own key replaces the derived one, is forwarded, and is namespaced by run.
    own = {"Idempotency-Key": "caller-key-1"}
    await call(url, run, {"order_id": "x", "amount": 1}, headers=own)
    _, h5, _ = await call(url, run, {"order_id": "x", "amount": 1, "reason": "reworded"}, headers=own)
    assert h5["X-Idempotent-Replay"] == "true" and tool.executions == 4
    assert tool.hits[-1].headers["idempotency-key"] == "caller-key-1"
    # The same key for another operation (other arguments, other method or path) is refused,
    # never replayed: the caller would be told it ran when it did not (Stripe's 422).
    for kwargs in (
        {"body": {"order_id": "y", "amount": 2}},
        {"body": {"order_id": "x", "amount": 1}, "method": "DELETE"},
    ):
        s7, h7, b7 = await call(url, run, headers=own, **kwargs)  # type: ignore[arg-type]
        assert s7 == 422 and b7["error"]["type"] == "idempotency_key_reused", b7
        assert "X-Idempotent-Replay" not in h7 and h7["x-should-retry"] == "false"
    args = {"order_id": "x", "amount": 1}
    s8, _, b8 = await call(f"{url}/accounts/42", run, args, method="DELETE", headers=own)
    assert s8 == 422 and b8["error"]["type"] == "idempotency_key_reused"
    assert tool.executions == 4
    _, h6, _ = await call(url, rid("other-run"), {"order_id": "x", "amount": 1}, headers=own)
    assert "X-Idempotent-Replay" not in h6 and tool.executions == 5


async def test_twenty_concurrent_copies_execute_once(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    run = rid("conc")
    body = {"order_id": "o-3", "amount": 7, "sleep_s": 0.3}
    results = await asyncio.gather(*(call(f"{rc.url}/tools/refund", run, body) for _ in range(20)))
    assert tool.executions == 1
    assert {r[0] for r in results} == {200}
    assert all(r[2] == results[0][2] for r in results)
    assert sum(r[1].get("X-Idempotent-Replay") == "true" for r in results) == 19


async def test_side_effects_by_method_and_tool_call_cap(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    run = rid("cap")
    h = {"X-Run-Max-Tool-Calls": "3"}
    # GET has no side effects: no record, executed each time, still counted.
    for _ in range(2):
        s, hdrs, _ = await call(f"{rc.url}/tools/notify/status?x=1", run, method="GET", headers=h)
        assert s == 200 and "Idempotency-Key" not in hdrs
    assert [(x.method, x.path, x.query) for x in tool.hits] == [("GET", "/notify/status", "x=1")] * 2
    assert "idempotency-key" not in tool.hits[0].headers
    s, hdrs, _ = await call(f"{rc.url}/tools/notify", run, {"msg": "hi"}, headers=h)  # POST: recorded
    assert s == 200 and hdrs["X-Run-Remaining-Tool-Calls"] == "0"
    s, hdrs, body = await call(f"{rc.url}/tools/notify", run, {"msg": "again"}, headers=h)
    assert (
        s == 402
        and body["error"]["type"] == "run_budget_exceeded"
        and body["error"]["code"] == "max_tool_calls"
    )
    assert hdrs["x-should-retry"] == "false" and tool.executions == 3
    # A replay of a completed call still answers (it executes nothing).
    s, hdrs, _ = await call(f"{rc.url}/tools/notify", run, {"msg": "hi"}, headers=h)
    assert s == 200 and hdrs["X-Idempotent-Replay"] == "true"
    state = await rc.run(run)
    assert state["tool_calls_executed"] == 3 and state["status"] == "tool_calls_exceeded"
    # Sub-paths with different ids are different operations even with the same (empty) body.
    await call(f"{rc.url}/tools/notify/orders/1", run, method="DELETE")
    s, _, body = await call(f"{rc.url}/tools/notify/orders/2", rid("cap2"), method="DELETE")
    assert s == 200
    status, _, body = await call(f"{rc.url}/tools/nope", run, {})
    assert status == 404 and "notify, refund, slow" in body["error"]["message"]


async def test_executing_the_calls_the_model_requested_is_not_counted_twice(runcap_factory, tool, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    upstream.scripts["one"] = [
        {"tool_calls": [{"name": "refund", "arguments": {"order_id": "M1", "amount": 2}}]}
    ]
    run = rid("both")
    h = {"X-Run-Max-Tool-Calls": "1"}
    oa = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")
    r = await oa.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "refund M1"}],
        tools=[{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}],
        extra_headers={**h, "X-Run-Id": run, "X-Mock-Script": "one"},
    )  # fmt: skip
    assert len(r.choices[0].message.tool_calls) == 1
    # The agent executes the call the model asked for: used = max(requested, executed) = 1.
    s, _, _ = await call(f"{rc.url}/tools/refund", run, {"order_id": "M1", "amount": 2}, headers=h)
    assert s == 200 and tool.executions == 1
    s, _, body = await call(f"{rc.url}/tools/refund", run, {"order_id": "M2", "amount": 2}, headers=h)
    assert s == 402 and body["error"]["code"] == "max_tool_calls" and tool.executions == 1
    state = await rc.run(run)
    assert (state["tool_calls_requested"], state["tool_calls_executed"], state["tool_calls"]) == (1, 1, 1)


async def test_side_effecting_call_needs_a_run_id(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(
                f"{rc.url}/tools/refund", json={"order_id": "N1"}, headers={"Idempotency-Key": "k1"}
            ) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "X-Run-Id"
    assert tool.executions == 0


async def test_metrics_count_tool_calls(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    run = rid("m")
    for _ in range(2):
        await call(f"{rc.url}/tools/refund", run, {"order_id": "m", "amount": 1})
    async with aiohttp.ClientSession() as s, s.get(f"{rc.url}/metrics") as r:
        text = await r.text()
    assert 'runcap_tool_calls_total{outcome="ok",tool="refund"} 1.0' in text
    assert 'runcap_tool_calls_total{outcome="replayed",tool="refund"} 1.0' in text
    assert 'runcap_tool_replays_total{tool="refund"} 1.0' in text


# -- deadline and timeouts ---------------------------------------------------------------------


async def test_tool_past_the_deadline_gets_the_error_at_the_deadline(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    run = rid("dl")
    t0, sent_at = time.monotonic(), time.time()
    s, h, body = await call(
        f"{rc.url}/tools/refund",
        run,
        {"order_id": "d", "amount": 1, "sleep_s": 30},
        headers={"X-Run-Timeout": "1"},
    )
    elapsed, answered_at = time.monotonic() - t0, time.time()
    # Cut by the run's deadline (the type says so; the tool sees the disconnect below), not before
    # it; the upper bound is a liveness guard at 10x the deadline (the tool sleeps 30 s).
    assert s == 504 and body["error"]["type"] == "run_deadline_exceeded" and h["x-should-retry"] == "false"
    assert 0.8 <= elapsed < 10
    hit = tool.hits[0]
    remaining_ms = int(hit.headers["x-run-remaining-ms"])
    assert 0 < remaining_ms <= 1000
    deadline = datetime.fromisoformat(hit.headers["x-run-deadline"].replace("Z", "+00:00"))
    assert hit.headers["x-run-deadline"].endswith("Z") and "." in hit.headers["x-run-deadline"]
    # The deadline forwarded is the run's: 1 s after runcap got the call, which was in between.
    assert sent_at + 1 - 0.001 <= deadline.timestamp() <= answered_at + 1 + 0.001
    await wait_for(lambda: hit.disconnected)  # the tool saw the connection drop
    assert (await rc.run(run))["status"] == "deadline_exceeded"


async def test_tool_timeout_then_409_until_reconciled(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    run = rid("to")
    # Cut by the tool's timeout (0.5 s): the type says so; the tool would answer 200 after 10 s.
    s, _, body = await call(f"{rc.url}/tools/slow", run, {"sleep_s": 10})
    assert s == 504 and body["error"]["type"] == "tool_timeout"
    await wait_for(lambda: tool.hits[0].disconnected)
    s, h, body = await call(f"{rc.url}/tools/slow", run, {"sleep_s": 10})
    assert (
        s == 409 and body["error"]["type"] == "idempotency_outcome_unknown" and h["x-should-retry"] == "false"
    )
    assert tool.executions == 1
    async with aiohttp.ClientSession() as sess:
        async with sess.get(f"{rc.url}/admin/idempotency?state=unknown", headers=rc.admin) as r:
            unknown = await r.json()
        assert [(u["run_id"], u["tool"], u["state"]) for u in unknown] == [(run, "slow", "unknown")]
        key = unknown[0]["key"]
        async with sess.post(
            f"{rc.url}/admin/idempotency/{key}/resolve", json={"outcome": "not_done"}, headers=rc.admin
        ) as r:
            assert r.status == 200 and (await r.json())["previous_state"] == "unknown"
    tool.sleep_s = 0
    s, h, _ = await call(f"{rc.url}/tools/slow", run, {"sleep_s": 0})
    assert s == 200 and "X-Idempotent-Replay" not in h  # other args: not the same call anyway
    s, h, _ = await call(f"{rc.url}/tools/slow", run, {"sleep_s": 0.01})
    assert s == 200


# -- cancel ------------------------------------------------------------------------------------


async def _cancel_scenario(rc_call, rc_cancel, tool, upstream, run: str) -> None:  # type: ignore[no-untyped-def]
    """A model stream and a tool call of `run` in flight on `rc_call`; the cancel goes to
    `rc_cancel`. Both upstream connections close promptly, later calls get 410."""
    upstream.scripts["slow"] = [{"text": "word " * 200, "chunk_delay_s": 0.05}]
    c = openai.AsyncOpenAI(base_url=rc_call.openai_url, api_key="k", max_retries=0)
    stream = await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], stream=True,
        extra_headers={"X-Run-Id": run, "X-Mock-Script": "slow"},
    )  # fmt: skip

    async def consume() -> None:
        async for _ in stream:
            pass

    streaming = asyncio.create_task(consume())
    tool_call = asyncio.create_task(
        call(f"{rc_call.url}/tools/refund", run, {"order_id": run, "amount": 1, "sleep_s": 30})
    )
    await wait_for(lambda: tool.executions == 1)
    admin = rc_cancel.admin
    async with aiohttp.ClientSession() as s, s.post(f"{rc_cancel.url}/runs/{run}/cancel", headers=admin) as r:
        assert r.status == 200 and (await r.json())["status"] == "cancelled"
    status, _, body = await asyncio.wait_for(tool_call, 5)
    assert status == 410 and body["error"]["type"] == "run_cancelled"
    with pytest.raises(openai.APIError) as e:
        await asyncio.wait_for(streaming, 5)
    # The stream ends with runcap's error event naming the cancel, not a cut connection.
    assert type(e.value) is openai.APIError and "cancel" in e.value.message.lower(), repr(e.value)
    await wait_for(lambda: tool.hits[0].disconnected, 3)
    # Promptly: the waits above are liveness guards (the tool sleeps 30 s, the stream lasts 10 s);
    # that the cancel came by the pub/sub push, not the poll, the cross-replica test asserts.
    await wait_for(lambda: upstream.last.disconnected, 3)
    for rc in (rc_call, rc_cancel):
        s, _, body = await call(f"{rc.url}/tools/refund", run, {"order_id": "new", "amount": 2})
        assert s == 410
        with pytest.raises(openai.APIStatusError) as e:
            await openai.AsyncOpenAI(
                base_url=rc.openai_url, api_key="k", max_retries=0
            ).chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "x"}],
                extra_headers={"X-Run-Id": run},
            )
        assert e.value.status_code == 410
    assert tool.executions == 1
    assert (await rc_cancel.run(run))["status"] == "cancelled"
    # The aborted side effect is unknown (the tool may have acted).
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{rc_cancel.url}/admin/idempotency?state=unknown&run_id={run}", headers=rc_cancel.admin) as r,
    ):
        assert [u["tool"] for u in await r.json()] == ["refund"]


async def test_cancel_aborts_tool_call_and_model_stream(runcap_factory, tool, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    await _cancel_scenario(rc, rc, tool, upstream, rid("cx"))


async def test_cancel_reaches_another_worker_on_the_same_sqlite_file(
    runcap_factory, tool, upstream, tmp_path
):  # type: ignore[no-untyped-def]
    # Two processes of `serve --workers 2` share one ledger file: the cancel flag is polled.
    a = await runcap_factory(tools_config(tool), data_dir=tmp_path / "shared")
    b = await runcap_factory(tools_config(tool), data_dir=tmp_path / "shared")
    await _cancel_scenario(b, a, tool, upstream, rid("cxw"))


# -- Redis: replicas -----------------------------------------------------------------------------


async def test_a_childs_tool_call_is_cut_at_its_parents_deadline(runcap_factory, tool):  # type: ignore[no-untyped-def]
    """A sub-run's tool call is bounded by its parent's deadline, earlier than its own: the tool
    is told that deadline, the call is cut at it, and the child is left
    `ancestor_deadline_exceeded` (not terminal: an extension of the parent lets it go on)."""
    rc = await runcap_factory(tools_config(tool))
    parent, child = rid("p"), rid("c")
    s, _, body = await call(f"{rc.url}/tools/refund", parent, {"order_id": parent, "amount": 1},
                            headers={"X-Run-Timeout": "1"})  # fmt: skip
    assert s == 200, body
    s, _, body = await call(
        f"{rc.url}/tools/refund", child, {"order_id": child, "amount": 1, "sleep_s": 30},
        headers={"X-Run-Parent": parent, "X-Run-Timeout": "3600"},
    )  # fmt: skip
    assert s == 504 and body["error"]["type"] == "run_deadline_exceeded", body
    assert 0 < int(tool.hits[-1].headers["x-run-remaining-ms"]) <= 1000  # the parent's, not an hour
    assert (await rc.run(child))["status"] == "ancestor_deadline_exceeded"


async def test_two_replicas_sharing_redis(runcap_factory, tool, redis_server, tmp_path):  # type: ignore[no-untyped-def]
    cfg = tools_config(tool, redis_url=redis_server.url)
    a = await runcap_factory(cfg, data_dir=tmp_path / "a")
    b = await runcap_factory(cfg, data_dir=tmp_path / "b")
    assert a.ledger.name == "redis"
    run = rid("rep")
    body = {"order_id": "r-1", "amount": 3}
    s1, _, b1 = await call(f"{a.url}/tools/refund", run, body)
    s2, h2, b2 = await call(f"{b.url}/tools/refund", run, body)
    assert (s2, b2) == (s1, b1) and h2["X-Idempotent-Replay"] == "true" and tool.executions == 1
    # Concurrent copies spread over both replicas while the first is in flight.
    body = {"order_id": "r-2", "amount": 3, "sleep_s": 0.3}
    results = await asyncio.gather(*(call(f"{(a, b)[i % 2].url}/tools/refund", run, body) for i in range(20)))
    assert tool.executions == 2
    assert all(r[2] == results[0][2] for r in results)
    assert sum(r[1].get("X-Idempotent-Replay") == "true" for r in results) == 19


async def test_cancel_on_one_replica_aborts_calls_on_another(
    runcap_factory, tool, upstream, redis_server, tmp_path, caplog
):  # type: ignore[no-untyped-def]
    cfg = tools_config(tool, redis_url=redis_server.url)
    a = await runcap_factory(cfg, data_dir=tmp_path / "a")
    b = await runcap_factory(cfg, data_dir=tmp_path / "b")
    await wait_subscribed(redis_server.url, b.ledger.backend.cancel_channel, 2)  # both replicas listen
    run = rid("cxr")
    with caplog.at_level(logging.INFO, logger="runcap.cancel"):
        await _cancel_scenario(b, a, tool, upstream, run)
    # The cancel reached b by the pub/sub push, not by the slow poll that backs it up.
    via = [r.getMessage() for r in caplog.records if r.name == "runcap.cancel" and run in r.getMessage()]
    assert via and all('"via": "pubsub"' in m for m in via), via


async def test_cancel_on_one_replica_aborts_calls_on_another_on_a_redis_cluster(
    runcap_factory, tool, upstream, redis_cluster, tmp_path, caplog
):  # type: ignore[no-untyped-def]
    """The same on a 3-master Redis Cluster: the cancel travels by sharded pub/sub."""
    cfg = tools_config(tool, redis_url=redis_cluster.url, redis_cluster=True)
    a = await runcap_factory(cfg, data_dir=tmp_path / "a")
    b = await runcap_factory(cfg, data_dir=tmp_path / "b")
    channel = b.ledger.backend.cancel_channel
    await wait_subscribed(redis_cluster.url, channel, 2, sharded=True)  # both replicas listen
    run = rid("cxc")
    with caplog.at_level(logging.INFO, logger="runcap.cancel"):
        await _cancel_scenario(b, a, tool, upstream, run)
    via = [r.getMessage() for r in caplog.records if r.name == "runcap.cancel" and run in r.getMessage()]
    assert via and all('"via": "pubsub"' in m for m in via), via


# -- kill -9 and reconcile ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_kill9_during_tool_call_then_reconcile(backend, tool, tmp_path: Path, request):  # type: ignore[no-untyped-def]
    config = tmp_path / "runcap.toml"
    text = "log_requests = false\ntracing = false\n"
    if backend == "redis":
        # Database 1 of the session's server: the other tests use database 0.
        server = request.getfixturevalue("redis_server")
        text += f'redis_url = "redis://127.0.0.1:{server.port}/1"\n'
    config.write_text(text + f'[tools.refund]\nurl = "{tool.url}/refund"\nside_effects = true\n')
    proc = RuncapProcess(config, tmp_path / "data")
    run = rid("crash")  # Redis database 1 outlives the test: a run id of its own
    proc.start()
    try:
        url = f"{proc.url}/tools/refund"
        in_flight = [
            asyncio.create_task(call(url, run, {"order_id": o, "amount": 1, "sleep_s": 30}))
            for o in ("A", "B")
        ]
        await wait_for(lambda: tool.executions == 2)
        proc.kill9()
        for t in in_flight:
            with pytest.raises(aiohttp.ClientError):
                await t
        proc.start()  # same data dir / same Redis
        # SQLite: the restarted process finds the dead owner's lock free at start-up. Redis: the
        # repeat waits (the call looks in flight) until the dead replica's heartbeat expires.
        for order in ("A", "B"):
            s, h, body = await call(url, run, {"order_id": order, "amount": 1, "sleep_s": 30})
            assert s == 409 and body["error"]["type"] == "idempotency_outcome_unknown"
            assert h["x-should-retry"] == "false"
        assert tool.executions == 2

        # The admin token: the one the server generated in its data directory.
        at = ("--url", proc.url, "--config", str(config), "--data-dir", str(proc.data_dir))
        listed = reconcile(*at, "--json")
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)
        assert {r["state"] for r in rows} == {"unknown"} and len(rows) == 2
        assert all(r["run_id"] == run and r["tool"] == "refund" and len(r["args_hash"]) == 64 for r in rows)
        table = reconcile(*at)
        assert "run_id" in table.stdout and "unknown" in table.stdout
        # The tool saw each call's key.
        keys = {json.loads(h.body)["order_id"]: h.headers["idempotency-key"] for h in tool.hits}
        done = reconcile(*at, keys["A"], "--done", "--status", "200",
                   "--body", '{"refund": "r-A"}')  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "unknown → done" in done.stdout
        not_done = reconcile(*at, keys["B"], "--not-done")
        assert not_done.returncode == 0, not_done.stderr
        again = reconcile(*at, keys["B"], "--not-done")
        assert again.returncode == 1

        # A replays the operator's outcome; B (same arguments as the crashed call) executes now.
        s, h, body = await call(url, run, {"order_id": "A", "amount": 1, "sleep_s": 30})
        assert s == 200 and h["X-Idempotent-Replay"] == "true" and body == {"refund": "r-A"}
        tool.max_sleep_s = 0
        s, h, body = await call(url, run, {"order_id": "B", "amount": 1, "sleep_s": 30})
        assert s == 200 and "X-Idempotent-Replay" not in h and body["execution"] == 3
        assert tool.executions == 3 and json.loads(tool.hits[-1].body)["order_id"] == "B"
    finally:
        proc.stop()
    # Direct access, no server: the CLI opens the SQLite ledger itself.
    offline = ("--data-dir", str(tmp_path / "data"), "--config", str(config))
    direct = reconcile(*offline, "--json", "--state", "all")
    assert direct.returncode == 0, direct.stderr
    states = {r["key"]: r["state"] for r in json.loads(direct.stdout)}
    assert states[keys["A"]] == "completed"


# -- spans -------------------------------------------------------------------------------------


async def test_each_tool_call_is_a_tool_span(runcap_factory, tool, upstream):  # type: ignore[no-untyped-def]
    from tests.support.clickhouse import wait_rows

    rc = await runcap_factory(tools_config(tool, tracing=True))
    run = rid("span")
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")
    await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], extra_headers={"X-Run-Id": run}
    )
    args = {"order_id": "s-1", "amount": 2}
    _, h, _ = await call(f"{rc.url}/tools/refund", run, args)
    await call(f"{rc.url}/tools/refund", run, {"amount": 2.0, "order_id": "s-1"})
    await call(f"{rc.url}/tools/slow", run, {"sleep_s": 5})
    rows = await wait_rows(
        rc,
        "SELECT kind, step, status_code, outcome, tool_name, args_hash, result_hash, idempotency_key, error "
        f"FROM runcap.spans WHERE run_id = '{run}' AND kind = 'tool' ORDER BY started_at",
        3,
    )
    assert [(r["kind"], r["step"], r["status_code"], r["outcome"], r["tool_name"]) for r in rows] == [
        ("tool", 1, 200, "ok", "refund"),
        ("tool", 1, 200, "replayed", "refund"),
        ("tool", 1, 504, "unknown", "slow"),
    ]
    body = json.dumps({"execution": 1, "path": "/refund", "args": args}, separators=(",", ":"))
    from proxy.hashing import args_hash, result_hash

    assert rows[0]["args_hash"] == rows[1]["args_hash"] == args_hash(json.dumps(args))
    assert rows[0]["result_hash"] == rows[1]["result_hash"] == result_hash(body.encode())
    assert rows[0]["idempotency_key"] == h["Idempotency-Key"]
    assert "timeout_s" in rows[2]["error"]
