"""Every step becomes a span in ClickHouse (embedded chdb, and a ClickHouse HTTP endpoint through
clickhouse-connect), every body a payload under its sha256 — asserted exactly, from agent runs
made with the official clients."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from decimal import Decimal
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from proxy.money import usd_to_nanos
from proxy.pricing import PriceBook
from proxy.providers.base import Usage
from tests.support.clickhouse import ARGS, SCRIPT, TOOLS, ClickHouseProcess, chat_run, sql, wait_rows

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PRICES = PriceBook()
ARGS_HASH = hashlib.sha256(b'{"amount":5,"order_id":"A1"}').hexdigest()
ANTHROPIC_TOOLS = [{"name": "refund", "input_schema": {"type": "object"}}]


@pytest.fixture(params=["chdb", "http"])
async def traced(request, runcap_factory, tmp_path):  # type: ignore[no-untyped-def]
    extra: dict[str, Any] = {"tracing": True}
    ch = None
    if request.param == "http":
        ch = ClickHouseProcess(tmp_path / "ch")
        ch.start()
        extra["clickhouse_url"] = ch.url
    rc = await runcap_factory(extra)
    yield rc
    if ch is not None:
        await rc.runner.cleanup()
        ch.stop()


def nanos(provider: str, model: str, u: Usage) -> int:
    return usd_to_nanos(PRICES.cost(provider, model, u).usd)


async def anthropic_run(rc, upstream, run_id: str, stream: bool):  # type: ignore[no-untyped-def]
    upstream.scripts["refund"] = SCRIPT
    c = anthropic.AsyncAnthropic(base_url=rc.url, api_key="k")
    h = {"X-Run-Id": run_id, "X-Run-Task": "refunds", "X-Mock-Script": "refund"}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "refund A1"}]
    usages = []
    for _ in range(2):
        kw = dict(
            model="claude-sonnet-4-5", max_tokens=200, messages=msgs, tools=ANTHROPIC_TOOLS, extra_headers=h
        )
        if stream:
            async with c.messages.stream(**kw) as s:
                m = await s.get_final_message()
        else:
            m = await c.messages.create(**kw)
        usages.append(Usage(m.usage.input_tokens, m.usage.output_tokens))
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        uses = [b for b in m.content if b.type == "tool_use"]
        if uses:
            msgs.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "ok"}],
                }
            )
    return usages


SPANS = (
    "SELECT kind, step, provider, model, endpoint, status_code, outcome, input_tokens, output_tokens, "
    "toString(cost_usd) AS cost, price_known, tool_name, tool_call_id, args_hash, result_hash, task, "
    "request_hash, response_hash, ttft_ms, trace_id, span_id, parent_span_id "
    "FROM runcap.spans WHERE run_id = '{run}' ORDER BY step, started_at, kind"
)


async def two_step_spans(rc, run_id: str, usages: list[Usage], provider: str, model: str) -> list[Any]:  # type: ignore[no-untyped-def]
    """The spans of a two-step run with one tool call, in order (model, tool_call, tool_result,
    model); each model span with the tokens the upstream reported and their price."""
    rows = await wait_rows(rc, SPANS.format(run=run_id), 4)
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("model", 1), ("tool_call", 1), ("tool_result", 1), ("model", 2),
    ]  # fmt: skip
    for m, u in ((rows[0], usages[0]), (rows[3], usages[1])):
        assert (m["input_tokens"], m["output_tokens"]) == (u.input_tokens, u.output_tokens)
        assert Decimal(m["cost"]) * 10**9 == nanos(provider, model, u)
    return rows


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_run_spans_exact(traced, upstream, stream):  # type: ignore[no-untyped-def]
    rc = traced
    run_id = f"spans-chat-{stream}"
    usages = await chat_run(rc, upstream, run_id, stream)
    rows = await two_step_spans(rc, run_id, usages, "openai", "gpt-4o-mini")
    m1, call, result, m2 = rows
    for m in (m1, m2):
        assert (
            m["provider"] == "openai" and m["model"] == "gpt-4o-mini" and m["endpoint"] == "chat.completions"
        )
        assert m["status_code"] == 200 and m["outcome"] == "ok" and m["price_known"] is True
        assert m["task"] == "refunds"
        assert (m["ttft_ms"] is not None) == stream
    assert call["tool_name"] == "refund" and call["args_hash"] == ARGS_HASH
    assert call["parent_span_id"] == m1["span_id"]
    assert result["tool_call_id"] == call["tool_call_id"] and result["tool_name"] == "refund"
    assert result["result_hash"] == hashlib.sha256(b'{"ok":true}').hexdigest()
    assert result["parent_span_id"] == m2["span_id"]  # seen in the request of step 2
    assert len({r["trace_id"] for r in rows}) == 1  # one trace per run

    # The run's latest state, deduplicated the way queries must. The sink inserts a batch's spans,
    # then its run snapshots (spans/clickhouse.py): wait until the run's last one is in.
    query = (
        "SELECT argMax(status, updated_at) AS status, argMax(steps, updated_at) AS steps, "
        "argMax(tool_calls, updated_at) AS tool_calls, toString(argMax(cost_usd, updated_at)) AS cost "
        "FROM runcap.runs WHERE run_id = {run:String} GROUP BY run_id"
    )
    deadline = time.monotonic() + 20
    while not (runs := await sql(rc, query, {"run": run_id})) or runs[0]["status"] != "completed":
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    total = Decimal(m1["cost"]) + Decimal(m2["cost"])
    assert [{**r, "cost": Decimal(r["cost"])} for r in runs] == [
        {"status": "completed", "steps": 2, "tool_calls": 1, "cost": total}
    ]

    # Payloads: the request as sent upstream and the response as received, byte-identical.
    store = rc.runtime.spans.payloads
    sent = [r.body for r in upstream.requests if r.path == "/v1/chat/completions"]
    for m, body in ((m1, sent[0]), (m2, sent[1])):
        req = store.get(m["request_hash"])
        assert hashlib.sha256(req).hexdigest() == m["request_hash"]
        assert json.loads(req) == body
        resp = store.get(m["response_hash"])
        assert hashlib.sha256(resp).hexdigest() == m["response_hash"]
        if stream:
            assert resp.startswith(b"data: ") and resp.rstrip().endswith(b"data: [DONE]")
        else:
            assert json.loads(resp)["object"] == "chat.completion"


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_run_spans_exact(runcap_factory, upstream, stream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": True})
    run_id = f"spans-anth-{stream}"
    usages = await anthropic_run(rc, upstream, run_id, stream)
    m1, call, result, m2 = await two_step_spans(rc, run_id, usages, "anthropic", "claude-sonnet-4-5")
    for m in (m1, m2):
        assert m["provider"] == "anthropic" and m["endpoint"] == "messages"
    assert call["tool_name"] == "refund" and call["args_hash"] == ARGS_HASH
    assert result["result_hash"] == hashlib.sha256(b"ok").hexdigest()  # not JSON: the raw bytes


async def test_args_hash_ignores_key_order_and_whitespace(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": True})
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")
    variants = ['{"order_id":"A1","amount":5}', '{ "amount": 5.0,\n  "order_id": "A1" }']
    for i, raw in enumerate(variants):
        upstream.scripts[f"v{i}"] = [{"tool_calls": [{"name": "refund", "arguments": raw}]}]
        await c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
            extra_headers={"X-Run-Id": f"order-{i}", "X-Mock-Script": f"v{i}"},
        )  # fmt: skip
    rows = await wait_rows(
        rc, "SELECT run_id, args_hash FROM runcap.spans WHERE kind = 'tool_call' ORDER BY run_id", 2
    )
    assert [r["args_hash"] for r in rows] == [ARGS_HASH, ARGS_HASH]


async def test_tool_results_recorded_once_per_call(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    """History that every later request resends is not counted again."""
    rc = await runcap_factory({"tracing": True})
    upstream.scripts["loop"] = [{"tool_calls": [{"name": "refund", "arguments": ARGS}]}] * 3 + [
        {"text": "done"}
    ]
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")
    h = {"X-Run-Id": "once", "X-Mock-Script": "loop"}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "x"}]
    for _ in range(4):
        r = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=TOOLS, extra_headers=h)
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        for call in r.choices[0].message.tool_calls or []:
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": "done"})
    rows = await wait_rows(
        rc, "SELECT kind, count() AS n FROM runcap.spans WHERE run_id = 'once' GROUP BY kind ORDER BY kind", 3
    )
    await asyncio.sleep(0.3)
    rows = await sql(
        rc, "SELECT kind, count() AS n FROM runcap.spans WHERE run_id = 'once' GROUP BY kind ORDER BY kind"
    )
    assert {r["kind"]: r["n"] for r in rows} == {"model": 4, "tool_call": 3, "tool_result": 3}


async def test_refused_call_is_a_span(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": True})
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "refused", "X-Run-Max-Steps": "1"}
    await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], extra_headers=h
    )
    with pytest.raises(openai.APIStatusError):
        await c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], extra_headers=h
        )
    rows = await wait_rows(
        rc,
        "SELECT step, outcome, status_code FROM runcap.spans WHERE run_id = 'refused' ORDER BY started_at",
        2,
    )
    assert rows == [
        {"step": 1, "outcome": "ok", "status_code": 200},
        {"step": 2, "outcome": "budget_exceeded", "status_code": 402},
    ]


async def test_cancel_shows_in_the_runs_table_at_once(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    """`runcap runs` says cancelled when the run is cancelled, not at its next call."""
    rc = await runcap_factory({"tracing": True})
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "cx-row"}
    messages = [{"role": "user", "content": "x"}]
    await c.chat.completions.create(model="gpt-4o-mini", messages=messages, extra_headers=h)
    async with aiohttp.ClientSession() as s, s.post(f"{rc.url}/runs/cx-row/cancel", headers=rc.admin) as r:
        assert r.status == 200
    query = "SELECT status FROM runcap.runs WHERE run_id = 'cx-row' ORDER BY updated_at DESC LIMIT 1"
    deadline = time.monotonic() + 20
    while (rows := await sql(rc, query)) != [{"status": "cancelled"}] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert rows == [{"status": "cancelled"}]


async def test_passthrough_calls_are_spans(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    """Endpoints runcap does not meter are still step events: passed through or refused."""
    rc = await runcap_factory({"tracing": True})
    async with aiohttp.ClientSession() as s:
        h = {"X-Run-Id": "pt", "X-Run-Task": "pt-task"}
        async with s.get(f"{rc.openai_url}/models?limit=2", headers=h) as r:
            status = r.status
            size = len(await r.read())
        h["X-Run-Max-Usd"] = "1"
        async with s.post(f"{rc.openai_url}/images/generations", json={"prompt": "x"}, headers=h) as r:
            assert r.status == 402
    rows = await wait_rows(
        rc,
        "SELECT kind, endpoint, task, status_code, outcome, price_known, attributes['passthrough'] AS pt, "
        "attributes['http.method'] AS method, attributes['response.bytes'] AS bytes "
        "FROM runcap.spans WHERE run_id = 'pt' ORDER BY started_at",
        2,
    )
    assert rows == [
        {"kind": "model", "endpoint": "/v1/models", "task": "pt-task", "status_code": status,
         "outcome": "ok" if status < 400 else "error", "price_known": False, "pt": "true", "method": "GET",
         "bytes": str(size)},
        {"kind": "model", "endpoint": "/v1/images/generations", "task": "pt-task", "status_code": 402,
         "outcome": "budget_exceeded", "price_known": False, "pt": "true", "method": "POST", "bytes": "0"},
    ]  # fmt: skip


async def test_admin_sql_is_read_only_and_cannot_reach_files(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": True})
    async with aiohttp.ClientSession() as s:
        for bad in (
            "SELECT * FROM file('/etc/hostname', 'LineAsString')",
            "INSERT INTO runcap.spans (run_id) VALUES ('x')",
            "DROP TABLE runcap.spans",
        ):
            async with s.post(f"{rc.url}/admin/sql", json={"sql": bad}, headers=rc.admin) as r:
                assert r.status == 400, bad
                assert "query failed" in (await r.json())["error"]["message"]
        async with s.post(
            f"{rc.url}/admin/sql", json={"sql": "SELECT {n:UInt8} AS n", "params": {"n": 7}}, headers=rc.admin
        ) as r:
            assert await r.json() == {"columns": ["n"], "rows": [[7]]}
