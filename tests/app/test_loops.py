"""Loops that stop themselves, through runcap with the official clients: a scripted agent whose
model repeats one tool call, one whose model ping-pongs between two, and one that resends the same
request — at `X-Run-Max-Repeats: 2`, on both ledgers (SQLite, and Redis shared by two replicas);
and a run that repeats nothing, never touched. The rule itself against an oracle:
tests/unit/ledger/test_repeats.py."""

from __future__ import annotations

import secrets
from typing import Any

import anthropic
import openai
import pytest

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("refund", "lookup")
]
ANTHROPIC_TOOLS = [{"name": name, "input_schema": {"type": "object"}} for name in ("refund", "lookup")]
REFUND = {"name": "refund", "arguments": {"order_id": "A1", "amount": 5}}
LOOKUP = {"name": "lookup", "arguments": {"order_id": "A1"}}


def rid(name: str) -> str:
    return f"{name}-{secrets.token_hex(4)}"


def err(e: openai.APIStatusError) -> dict[str, Any]:
    body = e.response.json()
    return body["error"]  # type: ignore[no-any-return]


@pytest.fixture(params=["sqlite", "redis"])
async def replicas(request, runcap_factory, tmp_path):  # type: ignore[no-untyped-def]
    """Two runcaps on one ledger: one SQLite file (one replica), or Redis shared by two."""
    if request.param == "sqlite":
        one = await runcap_factory()
        return one, one
    url = request.getfixturevalue("redis_server").url
    return (await runcap_factory({"redis_url": url}, data_dir=tmp_path / "a"),
            await runcap_factory({"redis_url": url}, data_dir=tmp_path / "b"))  # fmt: skip


async def openai_turns(replicas, upstream, script, headers, turns):  # type: ignore[no-untyped-def]
    """An agent loop on the OpenAI client, alternating replicas: each tool call the model asks
    for is answered with the same result; returns each turn's raw response."""
    clients = [openai.AsyncOpenAI(base_url=r.openai_url, api_key="k", max_retries=0) for r in replicas]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "refund order A1"}]
    out = []
    for turn in range(turns):
        raw = await clients[turn % 2].chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs, tools=TOOLS, extra_headers=headers  # type: ignore[arg-type]
        )
        out.append(raw)
        msg = raw.parse().choices[0].message
        msgs.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": "pending"})
    return out, msgs


async def test_a_repeated_call_gets_an_answer_only_step(replicas, upstream):  # type: ignore[no-untyped-def]
    """The model asks for refund(A1, 5) every turn: its third identical request for that tool is
    followed by an answer-only step (tools stripped, `X-Run-Final-Step-Reason: max_repeats`), and
    the run's next call is a 402 naming the cap."""
    upstream.scripts["stuck"] = [{"tool_calls": [REFUND]}]
    run = rid("stuck")
    h = {"X-Run-Id": run, "X-Run-Max-Repeats": "2", "X-Mock-Script": "stuck"}
    raws, msgs = await openai_turns(replicas, upstream, "stuck", h, 4)
    finals = [(r.headers.get("x-run-final-step"), r.headers.get("x-run-final-step-reason")) for r in raws]
    assert finals == [(None, None)] * 3 + [("true", "max_repeats")]
    assert [len(r.parse().choices[0].message.tool_calls or []) for r in raws] == [1, 1, 1, 0]
    assert "tools" not in upstream.last.body and raws[3].parse().choices[0].message.content
    state = await replicas[0].run(run)
    assert state["status"] == "repeats_exceeded" and state["final_step_reason"] == "max_repeats"
    assert state["repeats"]["stopped"].startswith("repeat: refund ") and state["repeats"]["stopped_step"] == 3
    assert list(state["repeats"]["calls"].values()) == [3]
    c = openai.AsyncOpenAI(base_url=replicas[1].openai_url, api_key="k", max_retries=2)
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=TOOLS, extra_headers=h)  # type: ignore[arg-type]
    assert e.value.status_code == 402 and err(e.value)["code"] == "max_repeats"
    assert err(e.value)["message"].startswith(f"X-Run-Max-Repeats: run {run} already had its answer-only")
    assert e.value.response.headers["x-should-retry"] == "false"


async def test_a_ping_pong_on_anthropic_streams_is_caught_the_same_way(replicas, upstream):  # type: ignore[no-untyped-def]
    """refund, lookup, refund, lookup (streamed, Anthropic messages): each call only twice — no
    repeat at N = 2 — but the alternation came round twice: the fifth step is answer-only."""
    upstream.scripts["pingpong"] = [{"tool_calls": [REFUND]}, {"tool_calls": [LOOKUP]}] * 4
    run = rid("pp")
    h = {"X-Run-Id": run, "X-Run-Max-Repeats": "2", "X-Mock-Script": "pingpong"}
    clients = [
        anthropic.AsyncAnthropic(base_url=r.url + "/anthropic", api_key="k", max_retries=0) for r in replicas
    ]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "refund order A1"}]
    finals, tools_sent = [], []
    for turn in range(5):
        async with clients[turn % 2].messages.stream(
            model="claude-sonnet-4-5", max_tokens=256, messages=msgs, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
            extra_headers=h,
        ) as stream:  # fmt: skip
            message = await stream.get_final_message()
        finals.append(stream.response.headers.get("x-run-final-step-reason"))
        # answer-only on Anthropic: tool_choice none (its history holds tool_use blocks)
        tools_sent.append(upstream.last.body.get("tool_choice") != {"type": "none"})
        uses = [b for b in message.content if b.type == "tool_use"]
        msgs.append({"role": "assistant", "content": [b.model_dump() for b in message.content]})
        if uses:
            msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "ok"} for u in uses
            ]})  # fmt: skip
    assert finals == [None, None, None, None, "max_repeats"]
    assert tools_sent == [True, True, True, True, False]
    state = await replicas[1].run(run)
    assert state["repeats"]["stopped"].startswith("cycle: refund ") and state["repeats"]["stopped_step"] == 4
    assert state["status"] == "repeats_exceeded"


async def test_the_same_request_answered_twice_is_refused_the_third_time(replicas, upstream):  # type: ignore[no-untyped-def]
    run = rid("resend")
    h = {"X-Run-Id": run, "X-Run-Max-Repeats": "2"}
    same = [{"role": "user", "content": "what is the status of A1?"}]
    clients = [openai.AsyncOpenAI(base_url=r.openai_url, api_key="k", max_retries=2) for r in replicas]
    for c in clients:
        await c.chat.completions.create(model="gpt-4o-mini", messages=same, extra_headers=h)  # type: ignore[arg-type]
    hits = upstream.hits()
    with pytest.raises(openai.APIStatusError) as e:
        await clients[0].chat.completions.create(model="gpt-4o-mini", messages=same, extra_headers=h)  # type: ignore[arg-type]
    assert e.value.status_code == 402 and err(e.value)["code"] == "max_repeats"
    assert "sent this same model request (byte for byte) 2 times" in err(e.value)["message"]
    assert upstream.hits() == hits  # refused before the upstream, and not retried by the SDK
    # The run goes on with another request.
    other = [*same, {"role": "user", "content": "and of A2?"}]
    await clients[1].chat.completions.create(model="gpt-4o-mini", messages=other, extra_headers=h)  # type: ignore[arg-type]
    assert (await replicas[0].run(run))["status"] == "completed"


async def test_a_run_that_repeats_nothing_is_never_touched(runcap, upstream):  # type: ignore[no-untyped-def]
    """Eight calls, each with its own arguments, and each tool twice at most in a row: no
    answer-only step, no refusal, every tool call goes to the model's agent."""
    upstream.scripts["varied"] = [
        {"tool_calls": [{"name": "refund" if i % 3 else "lookup", "arguments": {"order_id": f"A{i}"}}]}
        for i in range(8)
    ] + [{"text": "All done."}]
    run = rid("varied")
    raws, _ = await openai_turns((runcap, runcap), upstream, "varied", {
        "X-Run-Id": run, "X-Run-Max-Repeats": "2", "X-Mock-Script": "varied"}, 9)  # fmt: skip
    assert [r.headers.get("x-run-final-step") for r in raws] == [None] * 9
    assert all("tools" in req.body for req in upstream.requests if req.path.endswith("/completions"))
    state = await runcap.run(run)
    assert state["status"] == "completed" and state["repeats"]["stopped"] is None
    assert state["repeats"]["calls"] == {}


async def test_loops_query_and_timeline_show_where_runcap_stopped_the_run(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    """queries/loops.sql on the spans of a stuck run, a ping-pong and a run that asked for one
    call twice (not a loop at min_repeats 3): which tool and arguments, at which step runcap saw
    it, which step answered without tools, the 402s, the status; `runcap run`'s timeline notes
    the repeats. Embedded chdb, through /admin/sql."""
    from proxy.hashing import args_hash, canonical_json
    from proxy.queryfiles import bind, load_query
    from proxy.readcli import AdminSqlReader
    from tests.support.clickhouse import wait_rows

    rc = await runcap_factory({"tracing": True})
    upstream.scripts["stuck"] = [{"tool_calls": [REFUND]}]
    upstream.scripts["pingpong"] = [{"tool_calls": [REFUND]}, {"tool_calls": [LOOKUP]}] * 3
    upstream.scripts["twice"] = [{"tool_calls": [REFUND]}, {"tool_calls": [REFUND]}, {"text": "Done."}]
    runs = {name: rid(name) for name in ("stuck", "pingpong", "twice")}
    for name, turns in (("stuck", 4), ("twice", 3), ("pingpong", 5)):
        h = {"X-Run-Id": runs[name], "X-Run-Max-Repeats": "2", "X-Mock-Script": name}
        if name == "twice":  # its last step is answer-only too, for another cap
            h["X-Run-Max-Steps"] = "3"
        _, msgs = await openai_turns((rc, rc), upstream, name, h, turns)
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": runs["pingpong"], "X-Mock-Script": "pingpong"}
    with pytest.raises(openai.APIStatusError):  # after its answer-only step: refused
        await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, extra_headers=h)  # type: ignore[arg-type]
    await wait_rows(rc, "SELECT 1 FROM runcap.spans WHERE kind = 'model'", 4 + 6 + 3)

    reader = AdminSqlReader(rc.url, rc.runtime.config.admin_token)

    def named(name: str, **params: str) -> list[dict[str, Any]]:
        query = load_query(name)
        cols, rows = reader.query(query.sql, bind(query, params, reader))
        return [dict(zip(cols, row, strict=True)) for row in rows]

    import asyncio

    rows = await asyncio.to_thread(named, "loops", min_repeats="3")
    refund = args_hash(canonical_json(REFUND["arguments"]))
    lookup = args_hash(canonical_json(LOOKUP["arguments"]))
    got = [(r["run_id"], r["tool"], r["args_hash"], r["requests"], r["steps"], r["stopped_step"],
            r["answer_only_step"], r["refused"], r["status"]) for r in rows]  # fmt: skip
    assert got == [
        (runs["stuck"], "refund", refund, 3, [1, 2, 3], 3, 4, 0, "repeats_exceeded"),
        (runs["pingpong"], "lookup", lookup, 2, [2, 4], 4, 5, 1, "repeats_exceeded"),
        (runs["pingpong"], "refund", refund, 2, [1, 3], 4, 5, 1, "repeats_exceeded"),
    ]
    assert rows[0]["stopped_reason"].startswith("repeat: refund ")
    assert rows[1]["stopped_reason"].startswith("cycle: refund ")
    (twice,) = await asyncio.to_thread(named, "loops", run_id=runs["twice"], min_repeats="2")
    assert (twice["requests"], twice["stopped_step"], twice["answer_only_step"], twice["status"]) == (
        2, 0, 0, "steps_exceeded"
    )
    assert await asyncio.to_thread(named, "loops") == [*rows, twice]  # min_repeats 2 by default
    stopped = await asyncio.to_thread(named, "runs", status="repeats_exceeded")
    assert sorted((r["run_id"], r["cap_hit"]) for r in stopped) == sorted(
        (runs[n], "X-Run-Max-Repeats") for n in ("stuck", "pingpong")
    )
    (hits,) = [r for r in await asyncio.to_thread(named, "cap_hits") if r["cap"] == "repeats_exceeded"]
    assert (hits["runs_stopped"], hits["refused_calls"], hits["headers"]) == (2, 1, ["X-Run-Max-Repeats"])
    timeline = await asyncio.to_thread(named, "run_timeline", run_id=runs["stuck"])
    notes = [(r["step"], r["kind"], r["detail"]) for r in timeline if r["detail"]]
    assert notes == [
        (2, "tool_call", "asked 2x"),
        (3, "model", f"loop: {rows[0]['stopped_reason']} — the next step answers without tools"),
        (3, "tool_call", "asked 3x"),
        (4, "model", f"answer-only (X-Run-Max-Repeats): {rows[0]['stopped_reason']}"),
    ]


@pytest.mark.parametrize(
    ("value", "said"),
    [("0", "0 would stop a run at its first tool call"), ("two", "is not a whole number"),
     ("2.5", "is not a whole number"), ("1e3", "is not a whole number")],
)  # fmt: skip
async def test_a_bad_repeat_cap_is_a_400_naming_the_header(runcap, upstream, value, said):  # type: ignore[no-untyped-def]
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Run-Id": rid("bad"), "X-Run-Max-Repeats": value},
        )  # fmt: skip
    assert err(e.value)["param"] == "X-Run-Max-Repeats"
    assert err(e.value)["message"].startswith("X-Run-Max-Repeats: ") and said in err(e.value)["message"]
    assert upstream.hits() == 0


def test_repeat_settings_default_and_clamp_and_are_checked() -> None:
    from proxy.caps import parse_run_headers
    from proxy.config import ConfigError, build_config

    caps = build_config({"caps": {"default_max_repeats": 3, "ceiling_max_repeats": 5}}).caps
    assert parse_run_headers({"X-Run-Id": "r"}, caps).caps.max_repeats == 3
    assert parse_run_headers({"X-Run-Id": "r", "X-Run-Max-Repeats": "9"}, caps).caps.max_repeats == 5
    assert parse_run_headers({"X-Run-Id": "r", "X-Run-Max-Repeats": "2"}, caps).caps.max_repeats == 2
    for bad in ({"default_max_repeats": 0}, {"ceiling_max_repeats": "3"}):
        with pytest.raises(ConfigError) as e:
            build_config({"caps": bad})
        assert str(e.value).startswith(f"caps.{next(iter(bad))}"), e.value
