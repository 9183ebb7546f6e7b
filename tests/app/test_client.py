"""`proxy.client` for agent hosts: `RunHeaders` as runcap reads them, and runcap's real rejections —
through the official `openai` and `anthropic` clients and raw `/tools` answers — turned into typed
exceptions; the provider's and the tool's own errors are not."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from proxy.client import (
    NON_RETRYABLE_ERROR_TYPES,
    BudgetExceeded,
    DeadlineExceeded,
    InvalidRunRequest,
    OutcomeUnknown,
    RunCancelled,
    RuncapRejection,
    RunHeaders,
    ToolTimeout,
    raise_for_rejection,
    rejection_from_error,
    rejection_from_response,
)
from tests.conftest import REPO
from tests.support.tool_service import ToolService

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
USER = [{"role": "user", "content": "hi"}]


def tools_config(svc: ToolService) -> dict[str, Any]:
    return {
        "tools": {
            "refund": {"url": f"{svc.url}/refund", "side_effects": True},
            "slow": {"url": f"{svc.url}/slow", "side_effects": True, "timeout_s": 0.3},
        }
    }


async def post_tool(url: str, headers: dict[str, str], body: Any) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def oa(rc) -> openai.AsyncOpenAI:  # type: ignore[no-untyped-def]
    return openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)


# -- RunHeaders ----------------------------------------------------------------------------------


def test_run_headers_as_dict() -> None:
    h = RunHeaders(
        "ticket-4711", task="refunds", max_usd=0.5, max_tokens=10_000, max_steps=20, max_tool_calls=5,
        timeout_s=300, deadline=datetime(2026, 1, 2, 15, 4, 5, 123000, tzinfo=UTC),
        max_context_tokens=64_000, context_policy="offload,summarize",
    )  # fmt: skip
    assert h.as_dict() == {
        "X-Run-Id": "ticket-4711",
        "X-Run-Task": "refunds",
        "X-Run-Max-Usd": "0.5",
        "X-Run-Max-Tokens": "10000",
        "X-Run-Max-Steps": "20",
        "X-Run-Max-Tool-Calls": "5",
        "X-Run-Deadline": "2026-01-02T15:04:05.123Z",
        "X-Run-Timeout": "300",
        "X-Run-Max-Context-Tokens": "64000",
        "X-Run-Context-Policy": "offload,summarize",
    }
    assert RunHeaders("r", max_usd=Decimal("1.25")).max_usd == "1.25"
    assert RunHeaders("r", deadline=1767366245).as_dict()["X-Run-Deadline"] == "1767366245.000"
    call = h.for_call(operation_id="second-refund", idempotency_key="k-1").as_dict()
    assert call["X-Run-Operation-Id"] == "second-refund" and call["Idempotency-Key"] == "k-1"
    assert "X-Run-Operation-Id" not in h.as_dict()  # the run's headers are unchanged
    for bad in (
        {"run_id": "has space"}, {"run_id": "x" * 129}, {"run_id": "r", "max_usd": "lots"},
        {"run_id": "r", "max_usd": -1}, {"run_id": "r", "max_steps": -1}, {"run_id": "r", "max_steps": 2.5},
        {"run_id": "r", "timeout_s": 0}, {"run_id": "r", "deadline": datetime(2026, 1, 1)},
        {"run_id": "r", "max_context_tokens": -5}, {"run_id": "r", "context_policy": "compress"},
    ):  # fmt: skip
        with pytest.raises(ValueError):
            RunHeaders(**bad)


def test_importing_the_client_loads_no_sdk() -> None:
    code = (
        "import sys, proxy.client; "
        "print(sorted(m for m in ('openai', 'anthropic', 'aiohttp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_runcap_takes_the_headers_as_caps(runcap, upstream):  # type: ignore[no-untyped-def]
    deadline = datetime.now(UTC) + timedelta(minutes=5)
    h = RunHeaders("hdrs-1", task="refunds", max_usd="0.75", max_tokens=5000, max_steps=7, max_tool_calls=3,
                   deadline=deadline)  # fmt: skip
    c = openai.AsyncOpenAI(base_url=runcap.openai_url, api_key="k", default_headers=h.as_dict())
    await c.chat.completions.create(model="gpt-4o-mini", messages=USER)
    state = await runcap.run("hdrs-1")
    assert state["task"] == "refunds"
    assert state["caps"] == {
        "max_usd": "0.750000000", "max_tokens": 5000, "max_steps": 7, "max_tool_calls": 3,
        "deadline": deadline.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    }  # fmt: skip
    assert not any(k.startswith("x-run-") for k in upstream.last.headers)  # consumed by runcap


# -- rejections from the official clients --------------------------------------------------------


async def test_openai_rejections(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["essay"] = [{"text_tokens": 400}]
    c = oa(runcap)
    h = RunHeaders("oa-usd", max_usd="0.01").as_dict() | {"X-Mock-Script": "essay"}
    with pytest.raises(openai.APIStatusError) as e:
        for _ in range(50):
            await c.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=1000, extra_headers=h)
    r = rejection_from_error(e.value)
    assert isinstance(r, BudgetExceeded) and isinstance(r, RuncapRejection)
    assert (r.status, r.type, r.code, r.cap, r.run_id) == (
        402,
        "run_budget_exceeded",
        "max_usd",
        "max_usd",
        "oa-usd",
    )
    assert "X-Run-Max-Usd" in r.message and r.non_retryable
    assert r.as_details()["code"] == "max_usd"
    assert str(r).startswith("runcap 402 run_budget_exceeded/max_usd: X-Run-Max-Usd")

    # Steps: the last allowed step is answer-only, the next call is refused.
    h = RunHeaders("oa-steps", max_steps=1).as_dict()
    await c.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers=h)
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers=h)
    r = rejection_from_error(e.value)
    assert isinstance(r, BudgetExceeded) and r.cap == "max_steps"

    # Deadline: a stalled upstream is cut at the run's deadline.
    upstream.scripts["stall"] = [{"text": "late", "delay_s": 5}]
    h = RunHeaders("oa-deadline", timeout_s=0.5).as_dict() | {"X-Mock-Script": "stall"}
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers=h)
    assert isinstance(rejection_from_error(e.value), DeadlineExceeded)

    # Cancelled.
    admin = runcap.admin
    url = f"{runcap.url}/runs/oa-cancel/cancel"
    async with aiohttp.ClientSession() as s, s.post(url, headers=admin) as resp:
        assert resp.status == 200
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(
            model="gpt-4o-mini", messages=USER, extra_headers={"X-Run-Id": "oa-cancel"}
        )
    r = rejection_from_error(e.value)
    assert isinstance(r, RunCancelled) and r.status == 410

    # A malformed header is runcap's 400, naming the header.
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(
            model="gpt-4o-mini", messages=USER, extra_headers={"X-Run-Id": "oa-bad", "X-Run-Max-Steps": "ten"}
        )
    r = rejection_from_error(e.value)
    assert isinstance(r, InvalidRunRequest) and r.param == "X-Run-Max-Steps"


async def test_provider_errors_are_not_rejections(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["boom"] = [{"status": 500, "error": "upstream broke"}]
    upstream.scripts["bad"] = [{"status": 400, "error": "bad model input"}]
    c = oa(runcap)
    for script in ("boom", "bad"):
        with pytest.raises(openai.APIStatusError) as e:
            await c.chat.completions.create(
                model="gpt-4o-mini",
                messages=USER,
                extra_headers={"X-Run-Id": "prov", "X-Mock-Script": script},
            )
        assert rejection_from_error(e.value) is None  # the engine's retry policy decides
    assert rejection_from_error(ValueError("not an HTTP error")) is None


async def test_anthropic_rejections(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["essay"] = [{"text_tokens": 400}]
    c = anthropic.AsyncAnthropic(base_url=runcap.url, api_key="k", max_retries=0)
    h = RunHeaders("an-usd", max_usd="0.02").as_dict() | {"X-Mock-Script": "essay"}
    with pytest.raises(anthropic.APIStatusError) as e:
        for _ in range(50):
            await c.messages.create(
                model="claude-sonnet-4-5", max_tokens=1000, messages=USER, extra_headers=h
            )
    r = rejection_from_error(e.value)
    # The Anthropic shape has no code: the cap is read from the message, which names its header.
    assert isinstance(r, BudgetExceeded) and r.cap == "max_usd" and r.run_id == "an-usd"
    admin = runcap.admin
    url = f"{runcap.url}/runs/an-usd/cancel"
    async with aiohttp.ClientSession() as s, s.post(url, headers=admin) as resp:
        assert resp.status == 200
    with pytest.raises(anthropic.APIStatusError) as e:
        await c.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=USER, extra_headers=h)
    assert isinstance(rejection_from_error(e.value), RunCancelled)
    # a step over its context cap: the run goes on, the agent must shorten its context
    small = RunHeaders("an-context", max_context_tokens=3).as_dict()
    with pytest.raises(anthropic.APIStatusError) as e:
        await c.messages.create(
            model="claude-sonnet-4-5", max_tokens=10, extra_headers=small,
            messages=[{"role": "user", "content": "five words in this message"}],
        )  # fmt: skip
    r = rejection_from_error(e.value)
    assert isinstance(r, BudgetExceeded) and r.cap == "max_context_tokens" and r.run_id == "an-context"


# -- rejections from /tools ----------------------------------------------------------------------


async def test_tool_rejections(runcap_factory, tool):  # type: ignore[no-untyped-def]
    rc = await runcap_factory(tools_config(tool))
    run = RunHeaders("tools-1", max_tool_calls=3)
    url = f"{rc.url}/tools"

    # A tool timeout leaves the outcome unknown; the repeat is a 409 until it is reconciled.
    status, headers, body = await post_tool(f"{url}/slow", run.as_dict(), {"sleep_s": 5})
    r = rejection_from_response(status, body, headers)
    assert isinstance(r, ToolTimeout) and isinstance(r, OutcomeUnknown) and r.status == 504
    status, headers, body = await post_tool(f"{url}/slow", run.as_dict(), {"sleep_s": 5})
    r = rejection_from_response(status, body, headers)
    assert type(r) is OutcomeUnknown and r.status == 409 and r.run_id == "tools-1"
    assert r.idempotency_key is not None and r.idempotency_key == tool.hits[0].headers["idempotency-key"]
    with pytest.raises(OutcomeUnknown):
        raise_for_rejection(status, body, headers)

    # A tool's own error is its outcome, not a rejection.
    tool.status = 500
    status, headers, body = await post_tool(f"{url}/refund", run.as_dict(), {"order_id": "o-1"})
    assert status == 500 and rejection_from_response(status, body, headers) is None
    raise_for_rejection(status, body, headers)  # does not raise
    tool.status = 200

    # An intentional repeat is a new operation; past the tool-call cap: 402.
    await post_tool(f"{url}/refund", run.for_call(operation_id="again").as_dict(), {"order_id": "o-1"})
    status, headers, body = await post_tool(f"{url}/refund", run.as_dict(), {"order_id": "o-2"})
    r = rejection_from_response(status, body, headers)
    assert isinstance(r, BudgetExceeded) and r.cap == "max_tool_calls"
    assert tool.executions == 3

    admin = rc.admin
    async with aiohttp.ClientSession() as s, s.post(f"{rc.url}/runs/tools-1/cancel", headers=admin) as resp:
        assert resp.status == 200
    status, headers, body = await post_tool(f"{url}/refund", run.as_dict(), {"order_id": "o-3"})
    assert isinstance(rejection_from_response(status, json.loads(body), headers), RunCancelled)


def test_parsing_edge_cases() -> None:
    assert rejection_from_response(200, b'{"error": {"type": "run_cancelled"}}') is None
    assert rejection_from_response(502, b"<html>bad gateway</html>") is None
    assert rejection_from_response(502, {"error": {"type": "upstream_unavailable"}}) is None
    assert rejection_from_response(404, None) is None
    r = rejection_from_response(
        402,
        '{"type": "error", "error": {"type": "run_budget_exceeded", "message": "X-Run-Max-Tool-Calls: ..."}}',
    )
    assert isinstance(r, BudgetExceeded) and r.cap == "max_tool_calls"
    assert {"BudgetExceeded", "DeadlineExceeded", "RunCancelled", "OutcomeUnknown", "RuncapRejection"} <= set(
        NON_RETRYABLE_ERROR_TYPES
    )
