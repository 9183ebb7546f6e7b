"""A call cut short says which of its figures are the provider's and which the reservation's
(issue 25, item 2).

The ceiling charges a cut call its reservation where the provider may have billed more — right —
but the span must not pass that off as reported usage: `attributes['usage.input']` /
`['usage.output']` say `reported` or `reserved`, `usage.seen_*_tokens` keep what the provider had
reported when the call was cut, and `runcap run` shows it. With the official clients, a cancelled
stream (OpenAI, Anthropic) and a non-streamed call aborted at its deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from proxy.queryfiles import bind, load_query
from tests.support.clickhouse import wait_rows


async def model_span(rc, run_id: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    (row,) = await wait_rows(
        rc,
        "SELECT input_tokens, output_tokens, outcome, attributes['usage.input'] AS usage_input, "
        "attributes['usage.output'] AS usage_output, attributes['usage.seen_input_tokens'] AS seen_in, "
        "attributes['usage.seen_output_tokens'] AS seen_out FROM runcap.spans "
        f"WHERE run_id = '{run_id}' AND kind = 'model'",
        1,
    )
    return row


async def timeline_detail(rc, run_id: str) -> str:  # type: ignore[no-untyped-def]
    store = rc.runtime.spans.store
    query = load_query("run_timeline")
    loop = asyncio.get_running_loop()
    columns, rows = await loop.run_in_executor(
        None, lambda: store.query(query.sql, bind(query, {"run_id": run_id}, store))
    )
    return " | ".join(row[columns.index("detail")] for row in rows)


async def cancel(rc, run_id: str) -> None:  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s, s.post(f"{rc.url}/runs/{run_id}/cancel", headers=rc.admin) as r:
        assert r.status == 200


async def test_cancelled_openai_stream_is_on_record_as_reserved(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["slow"] = [{"text": "word " * 200, "chunk_delay_s": 0.05}]
    rc = await runcap_factory({"tracing": True})
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "cut-openai", "X-Run-Max-Usd": "1", "X-Mock-Script": "slow"}
    stream = await c.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=500,
        extra_headers=h,
    )  # fmt: skip
    chunks = 0
    with pytest.raises(openai.APIError):
        async for _ in stream:
            chunks += 1
            if chunks == 20:
                await cancel(rc, "cut-openai")
    span = await model_span(rc, "cut-openai")
    assert span["outcome"] == "cancelled" and span["output_tokens"] == 500
    assert (span["usage_input"], span["usage_output"]) == ("reserved", "reserved")
    assert (span["seen_in"], span["seen_out"]) == ("0", "0")  # chat streams report usage at the end
    assert "cut short: in_tok+out_tok charged at the reservation" in await timeline_detail(rc, "cut-openai")


async def test_cancelled_anthropic_stream_keeps_the_input_it_reported(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["slow"] = [{"text": "word " * 200, "chunk_delay_s": 0.05}]
    rc = await runcap_factory({"tracing": True})
    c = anthropic.AsyncAnthropic(base_url=f"{rc.url}/anthropic", api_key="k", max_retries=0)
    h = {"X-Run-Id": "cut-anthropic", "X-Run-Max-Usd": "1", "X-Mock-Script": "slow"}
    events = 0
    with pytest.raises(anthropic.APIError):
        async with c.messages.stream(
            model="claude-sonnet-4-5", max_tokens=500, messages=[{"role": "user", "content": "hi"}],
            extra_headers=h,
        ) as stream:  # fmt: skip
            async for _ in stream:
                events += 1
                if events == 20:
                    await cancel(rc, "cut-anthropic")
    span = await model_span(rc, "cut-anthropic")
    reported = upstream.requests[-1].usage.input_tokens  # message_start's input_tokens
    assert span["input_tokens"] == reported and span["usage_input"] == "reported", span
    assert span["usage_output"] == "reserved" and span["output_tokens"] == 500
    assert span["seen_in"] == str(reported) and int(span["seen_out"]) < 500
    assert "cut short: out_tok charged at the reservation" in await timeline_detail(rc, "cut-anthropic")


async def test_a_call_aborted_at_its_deadline_is_on_record_as_reserved(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["hang"] = [{"text": "late", "delay_s": 10}]
    rc = await runcap_factory({"tracing": True})
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "cut-deadline", "X-Run-Timeout": "1", "X-Run-Max-Usd": "1", "X-Mock-Script": "hang"}
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=300, extra_headers=h
        )
    assert e.value.status_code == 504
    span = await model_span(rc, "cut-deadline")
    assert span["outcome"] == "deadline_exceeded" and span["output_tokens"] == 300
    assert (span["usage_input"], span["usage_output"], span["seen_in"]) == ("reserved", "reserved", "0")


async def test_a_complete_call_says_nothing(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["ok"] = [{"text": "fine"}]
    rc = await runcap_factory({"tracing": True})
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k")
    await c.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Run-Id": "whole", "X-Mock-Script": "ok"},
    )  # fmt: skip
    span = await model_span(rc, "whole")
    assert (span["usage_input"], span["usage_output"]) == ("", "")
