"""The context signal and cap (issue 14, first half): `X-Run-Context-Tokens` / `-Growth` on every
model answer, `X-Run-Max-Context-Tokens` refusing a step only when its input provably exceeds the
cap, the growth baseline kept by the ledger, and the record of it all — span attributes, the
payloads of a rewrite, `/metrics`, the `context_outgrown` query and `runcap run`.

Real parts only: runcap in-process in front of the scripted upstream (whose token count is
ceil(bytes / 4) per message, `chat_input_tokens`), the official openai and anthropic clients,
the SQLite and Redis ledgers, embedded chdb for spans.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from proxy.caps import RunCaps
from proxy.config import ConfigError, build_config
from proxy.ledger.base import Settlement
from proxy.queryfiles import bind, load_query
from proxy.readcli import _VIEWS, AdminSqlReader, table_lines
from proxy.scripted_upstream import chat_input_tokens, filler_text
from tests.support.ledgers import step

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "


def words(n: int) -> str:
    """n whitespace-separated words (about 6.5 bytes each: the scripted upstream counts ~1.6
    tokens a word, a real tokenizer at least one)."""
    return " ".join((WORDS * (n // 12 + 1)).split()[:n])


async def chat(
    rc: Any, messages: list[dict[str, Any]], headers: dict[str, str], **extra: Any
) -> tuple[int, Any, dict[str, Any]]:
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": messages, **extra})
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{rc.openai_url}/chat/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": "Bearer k", **headers},
        ) as r,
    ):
        return r.status, r.headers, await r.json()


# -- configuration and headers: a bad value names the header or setting ------------------------


def test_bad_settings_name_the_setting() -> None:
    good = build_config(
        {
            "caps": {"default_max_context_tokens": 8000, "ceiling_max_context_tokens": 100_000},
            "tasks": {"triage": {"max_context_tokens": 4000, "context_policy": ["offload"]}},
            "context": {"growth_alert": 3, "offload_min_bytes": 4096},
        }
    )
    assert good.caps.default_max_context_tokens == 8000 and good.context.growth_alert == 3.0
    assert good.caps.tasks["triage"].context_policy == ("offload",)
    for raw, setting in [
        ({"caps": {"ceiling_max_context_tokens": -1}}, "caps.ceiling_max_context_tokens"),
        ({"context": {"growth_alert": 0.5}}, "context.growth_alert"),
        ({"context": {"offload_min_bytes": "big"}}, "context.offload_min_bytes"),
        ({"context": {"keep_last": 2}}, "context.keep_last"),
        ({"tasks": {"t": {"context_policy": ["trim"]}}}, 'tasks."t".context_policy'),
        ({"tasks": {"t": {"context_policy": "summarize"}}}, "context.summary_model"),
    ]:
        with pytest.raises(ConfigError, match=f"^{setting.replace('.', '[.]')}"):
            build_config(raw)


async def test_bad_headers_are_400s_naming_the_header(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    msgs = [{"role": "user", "content": "hi"}]
    for header, value in [
        ("X-Run-Max-Context-Tokens", "lots"),
        ("X-Run-Max-Context-Tokens", "-5"),
        ("X-Run-Context-Policy", "trim"),
        ("X-Run-Context-Policy", " , "),
        ("X-Run-Context-Policy", "offload,summarize"),  # summarize: no [context] summary_model
    ]:
        status, _, body = await chat(runcap, msgs, {"X-Run-Id": "bad", header: value})
        assert status == 400, (header, value, body)
        assert body["error"]["param"] == header and header in body["error"]["message"]
    assert upstream.hits() == 0


# -- the signal -------------------------------------------------------------------------------


async def test_answers_carry_exact_context_tokens_and_growth(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    """Buffered answers report the provider's own input count; growth is against the run's first
    step; the agent's body is forwarded byte for byte (no policy: runcap never changes it)."""
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "grow-1"}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "look it up"}]
    seen = []
    for i in range(3):
        raw = await c.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs, extra_headers=h
        )
        reply = raw.parse()
        tokens = reply.usage.prompt_tokens
        assert tokens == chat_input_tokens(upstream.last.body)
        seen.append(tokens)
        assert raw.headers["x-run-context-tokens"] == str(tokens)
        assert raw.headers["x-run-context-growth"] == f"{tokens / seen[0]:.2f}"
        assert "x-run-context-tokens-estimated" not in raw.headers
        msgs += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"tool said: {filler_text(400 * (i + 1))}"},
        ]
    assert seen[0] < seen[1] < seen[2]

    # Byte-identical forwarding without a policy, also under a context cap that the step fits.
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs, "temperature": 0.5})
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{runcap.openai_url}/chat/completions",
            data=body,
            headers={
                "X-Run-Id": "grow-1",
                "X-Run-Max-Context-Tokens": "100000",
                "Content-Type": "application/json",
            },
        ) as r,
    ):
        assert r.status == 200
        assert float(r.headers["X-Run-Context-Growth"]) > 3
    assert upstream.last.raw == body


async def test_streams_say_their_tokens_are_an_estimate(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    """A stream's headers go out before its usage: the count is runcap's estimate, marked so, and
    lies between the lower bound and the byte bound; the Anthropic shape is the same."""
    c = anthropic.AsyncAnthropic(base_url=runcap.url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "stream-1"}
    text = words(300)
    async with c.messages.with_streaming_response.create(
        model="claude-sonnet-4-5", max_tokens=64, stream=True, extra_headers=h,
        messages=[{"role": "user", "content": text}],
    ) as r:  # fmt: skip
        async for _ in r.iter_bytes():
            pass
        estimate = int(r.headers["x-run-context-tokens"])
        assert r.headers["x-run-context-tokens-estimated"] == "true"
        assert r.headers["x-run-context-growth"] == "1.00"
    assert 300 <= estimate <= len(text)
    exact = upstream.last.usage.input_tokens
    # the next (buffered) call of the run grows against the exact first count, not the estimate
    reply = await c.messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=64, extra_headers=h,
        messages=[{"role": "user", "content": text + " " + text}],
    )  # fmt: skip
    tokens = (await reply.parse()).usage.input_tokens
    assert reply.headers["x-run-context-tokens"] == str(tokens)
    assert reply.headers["x-run-context-growth"] == f"{tokens / exact:.2f}"


async def test_responses_api_carries_the_signal_too(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "resp-1"}
    raw = await c.responses.with_raw_response.create(model="gpt-4o-mini", input=words(50), extra_headers=h)
    first = raw.parse().usage.input_tokens
    assert raw.headers["x-run-context-tokens"] == str(first) and raw.headers["x-run-context-growth"] == "1.00"
    raw = await c.responses.with_raw_response.create(model="gpt-4o-mini", input=words(500), extra_headers=h)
    assert raw.headers["x-run-context-growth"] == f"{raw.parse().usage.input_tokens / first:.2f}"


async def test_a_tasks_policy_applies_without_the_header(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    """`[tasks."NAME"] context_policy` is the run's policy when it sends none; the header wins."""
    rc = await runcap_factory(
        {"tasks": {"digest": {"context_policy": ["offload"]}}, "context": {"offload_min_bytes": 1024}}
    )
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(4):
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function",
             "function": {"name": "search", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": filler_text(1000) if i == 0 else "ok"},
        ]  # fmt: skip
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs, "tools": tools})
    sent = {}
    for label, headers in [
        ("task", {"X-Run-Task": "digest"}),
        ("none", {}),
        ("header", {"X-Run-Context-Policy": "offload"}),
    ]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{rc.openai_url}/chat/completions", data=body,
                   headers={"X-Run-Id": f"p-{label}", "Content-Type": "application/json", **headers}) as r,
        ):  # fmt: skip
            assert r.status == 200, await r.text()
        sent[label] = upstream.last.raw
    assert sent["none"] == body
    assert len(sent["task"]) < len(body) - 2000 and sent["task"] == sent["header"]


# -- the cap ----------------------------------------------------------------------------------


async def test_cap_never_refuses_a_step_that_fits(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    """Single steps of growing size under one cap: a step is refused only when its real input is
    over the cap, and every step whose words alone exceed the cap is refused — never forwarded,
    never retried, the run not ended by it."""
    cap = 1000
    for n in (100, 400, 600, 900, 1100, 2000):
        msgs = [{"role": "user", "content": words(n)}]
        real = chat_input_tokens({"messages": msgs})
        before = upstream.hits()
        status, headers, body = await chat(
            runcap, msgs, {"X-Run-Id": f"fits-{n}", "X-Run-Max-Context-Tokens": str(cap)}
        )
        if status == 402:
            assert real > cap, f"{n} words ({real} tokens) refused under a cap of {cap}"
            assert body["error"]["type"] == "run_budget_exceeded"
            assert body["error"]["code"] == "max_context_tokens"
            assert "X-Run-Max-Context-Tokens" in body["error"]["message"]
            assert headers["x-should-retry"] == "false"
            assert upstream.hits() == before
        else:
            assert status == 200, body
            assert real <= cap or n <= cap, f"{n} words forwarded although at least {n} tokens"
        if n > cap:
            assert status == 402
        if real <= cap:
            assert status == 200
    # The byte bound (what the budget reserves) of the 900-word step is far above the cap: it was
    # not what decided.
    assert len(words(900)) > 4 * cap


async def test_cap_uses_the_runs_exact_history(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    """A conversation that grows past the cap is refused at the step that crosses it, although
    its words alone would fit: the history the previous step sent counts at the provider's own
    count. The refusal leaves the run alive: a shorter request of the same run goes through."""
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "crossing", "X-Run-Max-Context-Tokens": "1500"}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": words(800)}]
    first = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, extra_headers=h)
    assert first.usage.prompt_tokens <= 1500
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": words(200)},
    ]
    total_words = 800 + 200 + len(first.choices[0].message.content.split())
    assert total_words < 1500  # the words alone fit...
    assert chat_input_tokens({"messages": msgs}) > 1500  # ...the real count does not
    hits = upstream.hits()
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, extra_headers=h)
    assert e.value.status_code == 402 and e.value.code == "max_context_tokens"
    assert upstream.hits() == hits  # refused before it cost anything, and not retried
    run = await runcap.run("crossing")
    assert run["status"] != "budget_exceeded" and run["steps"] == 1
    ok = await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "short again"}], extra_headers=h
    )
    assert ok.choices[0].message.content


async def test_task_default_cap_and_ceiling(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory(
        {
            "caps": {"ceiling_max_context_tokens": 500},
            "tasks": {"tight": {"max_context_tokens": 200}},
        }
    )
    msgs = [{"role": "user", "content": words(300)}]
    status, _, body = await chat(rc, msgs, {"X-Run-Id": "t1", "X-Run-Task": "tight"})
    assert (
        status == 402 and body["error"]["code"] == "max_context_tokens" and "200" in body["error"]["message"]
    )
    # a header may not raise the ceiling
    status, _, body = await chat(rc, [{"role": "user", "content": words(700)}],
                                 {"X-Run-Id": "t2", "X-Run-Max-Context-Tokens": "100000"})  # fmt: skip
    assert status == 402 and "500" in body["error"]["message"]
    status, _, _ = await chat(rc, msgs, {"X-Run-Id": "t3"})
    assert status == 200


# -- the growth baseline: the ledger's --------------------------------------------------------


async def test_growth_baseline_survives_a_restart(runcap_factory, upstream, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "kept"
    rc = await runcap_factory(data_dir=data)
    h = {"X-Run-Id": "restarted"}
    status, headers, first = await chat(rc, [{"role": "user", "content": words(100)}], h)
    assert status == 200
    base = first["usage"]["prompt_tokens"]
    await rc.runner.cleanup()
    rc2 = await runcap_factory(data_dir=data)  # a new process's memory: only the ledger knows
    status, headers, second = await chat(rc2, [{"role": "user", "content": words(900)}], h)
    assert status == 200
    assert headers["X-Run-Context-Growth"] == f"{second['usage']['prompt_tokens'] / base:.2f}"
    assert (await rc2.run("restarted"))["context_baseline_tokens"] == base


async def test_ledgers_keep_the_first_steps_tokens(make_ledger) -> None:  # type: ignore[no-untyped-def]
    """SQLite and Redis: the first settlement with a context count sets the baseline, later ones
    do not move it, and another instance on the same store reads it."""
    ledger = make_ledger()
    for tokens in (0, 1234, 99_999):  # 0: a call without a context reading (an embedding, a cut)
        res = await ledger.begin_step(step("base-run", RunCaps()))
        await ledger.settle(res, Settlement(input_tokens=10, context_tokens=tokens), time.time())
    state = await make_ledger().get_run("base-run")
    assert state is not None and state.context_baseline == 1234


# -- the record: spans, payloads of a rewrite, metrics, query, timeline -------------------------


async def test_spans_metrics_query_and_rewrite_record(runcap_factory, upstream, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": True, "context": {"growth_alert": 2, "offload_min_bytes": 1024}})
    h = {"X-Run-Id": "rec-1", "X-Run-Task": "ctx"}
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "find the refund policy"}]
    big = filler_text(1500)  # a large tool result: once old, what offload takes out of band
    for i in range(3):
        if i:
            msgs += [
                {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function",
                 "function": {"name": "search", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": big if i == 1 else f"result {i}"},
            ]  # fmt: skip
        status, headers, _ = await chat(rc, msgs, h, tools=tools)
        assert status == 200
    growth = float(headers["X-Run-Context-Growth"])
    assert growth > 2
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c3", "type": "function",
         "function": {"name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c3", "content": "result 3"},
    ]  # fmt: skip
    original = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs, "tools": tools})
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rc.openai_url}/chat/completions", data=original,
               headers={**h, "X-Run-Context-Policy": "offload", "Content-Type": "application/json"}) as r,
    ):  # fmt: skip
        assert r.status == 200, await r.text()
    forwarded = upstream.last.raw
    assert len(forwarded) < len(original) - 4000
    status, _, _ = await chat(rc, msgs, {**h, "X-Run-Max-Context-Tokens": "100"}, tools=tools)
    assert status == 402

    reader = AdminSqlReader(rc.url, rc.runtime.config.admin_token)

    async def q(sql: str) -> list[dict[str, Any]]:  # the reader blocks: off the server's loop
        cols, rows = await asyncio.to_thread(reader.query, sql)
        return [dict(zip(cols, row, strict=True)) for row in rows]

    async def named(name: str, **params: str) -> list[dict[str, Any]]:
        query = load_query(name)
        bound = await asyncio.to_thread(bind, query, params, reader)
        cols, rows = await asyncio.to_thread(reader.query, query.sql, bound)
        return [dict(zip(cols, row, strict=True)) for row in rows]

    deadline = time.monotonic() + 20
    while len(await q("SELECT 1 FROM runcap.spans WHERE run_id = 'rec-1' AND kind = 'model'")) < 5:
        assert time.monotonic() < deadline, "spans not shipped"
        await asyncio.sleep(0.1)
    spans = await q(
        "SELECT step, outcome, input_tokens, request_hash, attributes FROM runcap.spans "
        "WHERE run_id = 'rec-1' AND kind = 'model' ORDER BY started_at"
    )
    assert len(spans) == 5
    first, third, rewritten, refused = spans[0], spans[2], spans[3], spans[4]
    assert first["attributes"]["context.tokens"] == str(first["input_tokens"])
    assert first["attributes"]["context.growth"] == "1.000"
    assert float(third["attributes"]["context.growth"]) == pytest.approx(growth, abs=0.01)
    assert float(third["attributes"]["context.tool_output_share"]) > 0.5
    a = rewritten["attributes"]
    assert a["context.policy"] == "offload"
    assert a["context.original_request_hash"] == hashlib.sha256(original).hexdigest()
    assert rewritten["request_hash"] == hashlib.sha256(forwarded).hexdigest()
    assert int(a["context.removed_bytes"]) > 4000 and int(a["context.removed_tokens"]) > 0
    handles = a["context.handles"].split(",")
    assert refused["outcome"] == "budget_exceeded" and refused["attributes"]["context.max_tokens"] == "100"
    assert int(refused["attributes"]["context.tokens_lower"]) > 100

    # Both bodies of the rewrite, and the result taken out of band, are in the payload store.
    from proxy.spans.payloads import open_payload_store

    store = open_payload_store(None, rc.runtime.config.data_dir)
    wanted = {a["context.original_request_hash"]: original, rewritten["request_hash"]: forwarded}
    deadline = time.monotonic() + 20
    while True:
        try:
            got = {k: store.get(k) for k in [*wanted, *handles]}
            break
        except KeyError:
            assert time.monotonic() < deadline, "payloads not stored"
            await asyncio.sleep(0.1)
    assert all(got[k] == v for k, v in wanted.items())
    assert all(hashlib.sha256(got[k]).hexdigest() == k for k in handles)
    assert any(big.encode() in got[k] for k in handles)

    # The on-call query and the timeline `runcap run` prints.
    [row] = await named("context_outgrown", run_id="rec-1", growth="2")
    assert row["steps"] == 4 and row["rewrites"] == 1 and row["context_refusals"] == 1
    assert row["first_input_tokens"] == first["input_tokens"]
    assert float(row["growth"]) >= 2 and 0 < float(row["tool_output_share"]) <= 1
    assert await named("context_outgrown", run_id="rec-1", growth="1000") == []
    timeline = [r for r in await named("run_timeline", run_id="rec-1") if r["kind"] == "model"]
    assert timeline[3]["context"] == (
        f"offload -{a['context.removed_tokens']} tok, sent as {a['context.original_request_hash'][:12]}"
    )
    assert timeline[4]["context"] == "over max_context_tokens 100"
    assert [r["context"] for r in timeline[:3]] == ["", "", ""]
    # `runcap run`'s table shows it on the step (at a usual terminal width)
    rows = await named("run_timeline", run_id="rec-1")
    view = _VIEWS["run_timeline"]
    lines = table_lines(list(rows[0]), [list(r.values()) for r in rows], view=view, width=160)
    assert any("offload -" in line and " model " in line for line in lines), "\n".join(lines)
    reader.close()

    # /metrics: every answered step's context, and the run that grew past growth_alert, once.
    async with aiohttp.ClientSession() as s, s.get(f"{rc.url}/metrics") as r:
        text = await r.text()
    assert "runcap_context_tokens_count 4.0" in text
    assert "runcap_context_growth_alerts_total 1.0" in text
