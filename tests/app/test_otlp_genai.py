"""The OTLP export of whole runs through runcap, decoded by a real OTLP/HTTP receiver: agents on
the official `openai` and `anthropic` clients, the scripted upstream reporting cache and reasoning
tokens, a `/tools` call, an operator's cancel. Each run is one `invoke_agent` span (named by its
`X-Run-Task`) over its steps, sent once; every span carries `gen_ai.conversation.id` = the run id;
ClickHouse keeps its own parent ids."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PbStatus

from proxy.spans.model import trace_id_for_run
from proxy.spans.otlp import agent_span_id
from tests.support.clickhouse import wait_rows
from tests.support.otlp_receiver import OTLPReceiver, ReceivedSpan

TOOLS = [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}]
ARGS = {"order_id": "A1", "amount": 5}
TRIAGE = [
    {
        "tool_calls": [{"name": "refund", "arguments": ARGS}],
        "cache_read_tokens": 64,
        "cache_write_tokens": 32,
        "reasoning_tokens": 16,
    },
    {"text": "Refunded A1."},
]


@pytest.fixture
async def receiver() -> AsyncIterator[OTLPReceiver]:
    r = OTLPReceiver().start()
    yield r
    r.stop()


async def wait_spans(receiver: OTLPReceiver, done: Any, what: str) -> list[ReceivedSpan]:
    """The spans received once `done(spans)` holds (the receiver keeps whole export requests)."""
    for _ in range(400):
        spans = list(receiver.spans)
        if done(spans):
            return spans
        await asyncio.sleep(0.05)
    raise AssertionError(f"OTLP receiver: no {what} in {[s.name for s in receiver.spans]}")


def of_run(spans: list[ReceivedSpan], run_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.attributes.get("runcap.run_id") == run_id]


def one(spans: list[ReceivedSpan], **attrs: Any) -> ReceivedSpan:
    found = [s for s in spans if all(s.attributes.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (attrs, [(s.name, s.attributes.get("runcap.step")) for s in spans])
    return found[0]


async def test_runs_export_as_agent_invocations_over_their_steps(  # type: ignore[no-untyped-def]
    runcap_factory, upstream, tool, receiver
):
    upstream.scripts["triage"] = TRIAGE
    upstream.scripts["cached"] = [{"text": "Hello.", "cache_read_tokens": 40, "cache_write_tokens": 20}]
    rc = await runcap_factory({
        "tracing": True,
        "otlp_endpoint": receiver.endpoint,
        "tools": {"refund": {"url": f"{tool.url}/refund", "side_effects": True}},
    })  # fmt: skip
    oa = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    run_a = {"X-Run-Id": "agent-a", "X-Run-Task": "refund-triage", "X-Mock-Script": "triage"}

    # Run A, with a task: model → tool call executed through /tools → model answers.
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "refund A1"}]
    first = await oa.chat.completions.create(
        model="gpt-4o-mini",
        messages=msgs,
        tools=TOOLS,
        extra_headers=run_a,  # type: ignore[arg-type]
    )
    (call,) = first.choices[0].message.tool_calls or []
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rc.url}/tools/refund", json=ARGS, headers={"X-Run-Id": "agent-a"}) as r,
    ):
        assert r.status == 200, await r.text()
        result = await r.text()
    msgs += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = await oa.chat.completions.create(
        model="gpt-4o-mini",
        messages=msgs,
        tools=TOOLS,
        extra_headers=run_a,  # type: ignore[arg-type]
    )
    assert answer.choices[0].finish_reason == "stop"
    spans = await wait_spans(receiver, lambda got: len(of_run(got, "agent-a")) == 6, "run A's 6 spans")
    agent_a = one(spans, **{"runcap.run_id": "agent-a", "gen_ai.operation.name": "invoke_agent"})

    # The same run goes on (another turn) and ends again: its agent span is not sent twice.
    msgs += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "thanks"}]
    await oa.chat.completions.create(model="gpt-4o-mini", messages=msgs, extra_headers=run_a)  # type: ignore[arg-type]

    # Run B, without a task, on the Anthropic client: one call served partly from the cache.
    an = anthropic.AsyncAnthropic(base_url=rc.url, api_key="k", max_retries=0)
    await an.messages.create(
        model="claude-sonnet-4-5", max_tokens=100, messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Run-Id": "agent-b", "X-Mock-Script": "cached"},
    )  # fmt: skip

    # Run C: a step that asks for a tool, then an operator cancels the run (a record with no span).
    run_c = {"X-Run-Id": "agent-c", "X-Run-Task": "billing", "X-Mock-Script": "triage"}
    await oa.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "refund"}], tools=TOOLS,  # type: ignore[arg-type]
        extra_headers=run_c,
    )  # fmt: skip
    async with aiohttp.ClientSession() as s, s.post(f"{rc.url}/runs/agent-c/cancel", headers=rc.admin) as r:
        assert r.status == 200, await r.text()

    def complete(got: list[ReceivedSpan]) -> bool:
        names = [s.name for s in got]
        return (
            "invoke_agent billing" in names
            and "invoke_agent" in names
            and any(s.attributes.get("runcap.step") == 3 for s in of_run(got, "agent-a"))
        )

    spans = await wait_spans(receiver, complete, "runs B and C, and run A's third step")
    a, b, c = of_run(spans, "agent-a"), of_run(spans, "agent-b"), of_run(spans, "agent-c")
    assert len(spans) == len(a) + len(b) + len(c) == 7 + 2 + 3  # nothing else, nothing twice

    # Every span: the run is the conversation, one trace per run.
    for span in spans:
        run_id = span.attributes["runcap.run_id"]
        assert span.attributes["gen_ai.conversation.id"] == run_id
        assert span.trace_id == trace_id_for_run(run_id)

    # Run A: invoke_agent refund-triage, the parent of its model calls and of the /tools call.
    assert [s.name for s in a].count("invoke_agent refund-triage") == 1
    assert agent_a.span_id == agent_span_id("agent-a") and agent_a.parent_span_id == ""
    assert agent_a.kind == PbSpan.SPAN_KIND_INTERNAL and agent_a.status_code == PbStatus.STATUS_CODE_UNSET
    assert agent_a.attributes["gen_ai.agent.name"] == "refund-triage"
    assert agent_a.attributes["gen_ai.provider.name"] == "openai"
    assert agent_a.attributes["runcap.run.status"] == "completed"
    assert agent_a.attributes["runcap.run.steps"] == 2  # as the run stood when it first ended
    step1, step2, step3 = (one(a, **{"runcap.kind": "model", "runcap.step": n}) for n in (1, 2, 3))
    assert {step1.parent_span_id, step2.parent_span_id, step3.parent_span_id} == {agent_a.span_id}
    assert agent_a.attributes["gen_ai.usage.input_tokens"] == (
        step1.attributes["gen_ai.usage.input_tokens"] + step2.attributes["gen_ai.usage.input_tokens"]
    )
    # From the run's first request (admitted by the ledger during step 1) past its end.
    assert step1.start_time_unix_nano <= agent_a.start_time_unix_nano <= step1.end_time_unix_nano
    assert agent_a.end_time_unix_nano >= step2.end_time_unix_nano

    # Usage as the provider reported it, under the current registry names; cost (provisional).
    assert step1.name == "chat gpt-4o-mini" and step1.kind == PbSpan.SPAN_KIND_CLIENT
    assert step1.attributes["gen_ai.usage.cache_read.input_tokens"] == 64
    assert step1.attributes["gen_ai.usage.cache_creation.input_tokens"] == 32
    assert step1.attributes["gen_ai.usage.reasoning.output_tokens"] == 16
    assert step1.attributes["gen_ai.usage.input_tokens"] >= 64 + 32  # includes the cached parts
    for model in (step1, step2, step3):
        cost = Decimal(model.attributes["runcap.cost_usd"])
        assert cost > 0 and model.attributes["gen_ai.usage.cost.amount"] == float(cost)
        assert model.attributes["gen_ai.usage.cost.currency"] == "USD"
        assert model.attributes["gen_ai.usage.cost.source"] == "local"

    # Tools: the model's request and the agent's result under their model calls, the execution
    # through /tools under the run.
    requested = one(a, **{"runcap.kind": "tool_call"})
    returned = one(a, **{"runcap.kind": "tool_result"})
    executed = one(a, **{"runcap.kind": "tool"})
    assert requested.name == returned.name == executed.name == "execute_tool refund"
    call_ids = {requested.attributes["gen_ai.tool.call.id"], returned.attributes["gen_ai.tool.call.id"]}
    assert call_ids == {call.id}
    assert requested.parent_span_id == step1.span_id and returned.parent_span_id == step2.span_id
    assert executed.parent_span_id == agent_a.span_id and executed.kind == PbSpan.SPAN_KIND_INTERNAL
    assert json.loads(result) and executed.attributes["runcap.idempotency_key"]

    # Run B: no task, so the span is named `invoke_agent` and has no agent name.
    agent_b = one(b, **{"gen_ai.operation.name": "invoke_agent"})
    chat_b = one(b, **{"runcap.kind": "model"})
    assert agent_b.name == "invoke_agent" and "gen_ai.agent.name" not in agent_b.attributes
    assert chat_b.name == "chat claude-sonnet-4-5" and chat_b.parent_span_id == agent_b.span_id
    assert chat_b.attributes["gen_ai.provider.name"] == "anthropic"
    assert agent_b.attributes["gen_ai.provider.name"] == "anthropic"
    assert chat_b.attributes["gen_ai.usage.cache_read.input_tokens"] == 40
    assert chat_b.attributes["gen_ai.usage.cache_creation.input_tokens"] == 20

    # Run C: cancelled, an error of the agent invocation.
    agent_c = one(c, **{"gen_ai.operation.name": "invoke_agent"})
    assert agent_c.name == "invoke_agent billing"
    assert agent_c.status_code == PbStatus.STATUS_CODE_ERROR
    assert agent_c.attributes["error.type"] == "cancelled"
    assert one(c, **{"runcap.kind": "model"}).parent_span_id == agent_c.span_id

    # ClickHouse: the same step spans, with the parents it always had (no row for the run's span).
    rows = await wait_rows(
        rc, "SELECT span_id, parent_span_id, kind FROM runcap.spans WHERE run_id = 'agent-a'", 6
    )
    assert {r["span_id"] for r in rows} == {s.span_id for s in a} - {agent_a.span_id}
    assert {r["parent_span_id"] for r in rows if r["kind"] in ("model", "tool")} == {""}


async def test_an_mcp_call_is_exported_by_the_mcp_conventions(runcap_factory, servers, receiver):  # type: ignore[no-untyped-def]
    """A `tools/call` through runcap (the official MCP SDK on both sides) arrives as the MCP
    conventions say: a CLIENT span `tools/call refund` with the session, protocol version and
    JSON-RPC id of that call, under the run's agent span."""
    from tests.support.mcp_agent import mcp_config, rid, session

    server = servers("stateful-sse")
    rc = await runcap_factory({**mcp_config(server), "tracing": True, "otlp_endpoint": receiver.endpoint})
    run = rid("mcp-otlp")
    async with session(f"{rc.url}/mcp/crm", run) as s:
        await s.call_tool("refund", {"order_id": rid("o"), "amount": 3})
    spans = await wait_spans(
        receiver, lambda got: any(x.name == "tools/call refund" for x in got), "MCP span"
    )
    (call,) = [x for x in of_run(spans, run) if x.attributes.get("runcap.kind") == "tool"]
    assert call.name == "tools/call refund" and call.kind == PbSpan.SPAN_KIND_CLIENT
    a = call.attributes
    assert a["mcp.method.name"] == "tools/call" and a["gen_ai.operation.name"] == "execute_tool"
    assert a["gen_ai.tool.name"] == "refund" and a["jsonrpc.request.id"].isdigit()
    assert a["mcp.session.id"] and a["mcp.protocol.version"] >= "2025-06-18"
    transport = (a["jsonrpc.protocol.version"], a["network.transport"], a["network.protocol.name"])
    assert transport == ("2.0", "tcp", "http")
    assert call.parent_span_id == agent_span_id(run) and call.trace_id == trace_id_for_run(run)
