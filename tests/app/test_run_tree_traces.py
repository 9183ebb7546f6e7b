"""A run tree made through the proxy (`X-Run-Parent`, issue 22) is recorded as a tree: every span
and run row names its parent and its root, the whole tree is one trace, and over OTLP each
sub-agent's `invoke_agent` span is the child of its parent's. Driven with the official OpenAI
client against the scripted upstream; spans read back from the embedded ClickHouse through
/admin/sql and from a real OTLP/HTTP receiver."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tests.support.clickhouse import wait_rows
from tests.support.otlp_receiver import OTLPReceiver, ReceivedSpan

USER = [{"role": "user", "content": "hi"}]
TREE = {"planner": "", "researcher": "planner", "reader": "researcher"}  # run → its parent


@pytest.fixture
async def receiver() -> AsyncIterator[OTLPReceiver]:
    r = OTLPReceiver().start()
    yield r
    r.stop()


def agents(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {
        s.attributes["runcap.run_id"]: s
        for s in spans
        if s.attributes.get("gen_ai.operation.name") == "invoke_agent"
    }


async def test_a_sub_agent_tree_is_one_trace_with_each_run_under_its_parent(  # type: ignore[no-untyped-def]
    runcap_factory, upstream, receiver
) -> None:
    upstream.scripts["hello"] = [{"text": "Hello."}]
    rc = await runcap_factory({"tracing": True, "otlp_endpoint": receiver.endpoint})
    oa = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    for run_id, parent in TREE.items():  # each answered: the run completes, its agent span is sent
        headers = {
            "X-Run-Id": run_id,
            "X-Mock-Script": "hello",
            **({"X-Run-Parent": parent} if parent else {}),
        }
        await oa.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers=headers)

    expected = {(run, parent, "planner") for run, parent in TREE.items()}
    for table, kind in (("spans", " AND kind = 'model'"), ("runs", "")):
        rows = await wait_rows(
            rc, f"SELECT DISTINCT run_id, parent_run_id, root_run_id FROM runcap.{table} WHERE 1{kind}", 3
        )
        assert {(r["run_id"], r["parent_run_id"], r["root_run_id"]) for r in rows} == expected, table
    traces = await wait_rows(rc, "SELECT DISTINCT trace_id FROM runcap.spans", 1)
    assert len(traces) == 1, traces  # the tree is one trace: its root's

    got: dict[str, ReceivedSpan] = {}
    for _ in range(400):
        got = agents(list(receiver.spans))
        if len(got) == 3:
            break
        await asyncio.sleep(0.05)
    assert set(got) == set(TREE), [s.name for s in receiver.spans]
    assert got["planner"].parent_span_id in ("", "0" * 16)  # the root's agent span is the trace's root
    assert got["researcher"].parent_span_id == got["planner"].span_id
    assert got["reader"].parent_span_id == got["researcher"].span_id
    model_spans: list[Any] = [
        s for s in receiver.spans if s.attributes.get("gen_ai.operation.name") == "chat"
    ]
    assert {s.trace_id for s in [*got.values(), *model_spans]} == {got["planner"].trace_id}
    # Each step stays under its own run's agent span.
    for s in model_spans:
        assert s.parent_span_id == got[s.attributes["runcap.run_id"]].span_id, s.name
