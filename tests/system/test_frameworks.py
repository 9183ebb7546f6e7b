"""Agent frameworks, unchanged, through runcap.

Each framework runs the same small agent — one tool (`lookup`), three steps (look up A1, look up
B2, answer) — against runcap, whose upstream is the scripted model. For each one:

* the loop completes, and runcap's run shows exactly the steps, tokens and cost the scripted
  upstream reported; tool_call and tool_result spans exist;
* a step cap (`X-Run-Max-Steps: 2`) ends the framework's loop with the answer-only final step
  (every framework here takes the tool-less answer as the end of its loop — the README's
  "Frameworks" table says so);
* a dollar cap surfaces as the framework's own error: the model asks for a tool whose result is
  a 100 KB document, and the call that would send it back cannot fit the cap — refused with 402
  `max_usd`, the upstream reached once (the first step) and runcap asked once (no retry).

One scripted upstream and one traced runcap serve the whole module (`tests.support.framework_stack`:
on an event loop of their own in a background thread); each run has a script of its own, named
after the run, so that the upstream's records of a run can be told apart. Run trees driven by the
frameworks that have sub-agents: tests/system/test_framework_trees.py.

The Vercel AI SDK runs in node (`tests/node/`, installed by `scripts/setup.sh`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from unittest import mock

import anthropic
import openai
import pytest

from proxy.money import usd_to_nanos
from proxy.pricing import PriceBook
from proxy.scripted_upstream import FALLBACK_TEXT
from tests.conftest import REPO
from tests.support.framework_stack import Stack
from tests.support.parts import missing

# One event loop for the module: some clients (langchain-openai's, LiteLLM's) cache their HTTP
# client across calls, and a client bound to a previous test's closed loop would fail.
pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    # LangGraph's create_react_agent (moved to langchain.agents in LangGraph 1.0, still shipped),
    # and pydantic notes from LiteLLM's import: the frameworks' business, not the test's.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning"),
]

PRICES = PriceBook()
NODE_DIR = REPO / "tests" / "node"

QUESTION = "Refund orders A1 and B2."
ANSWER = "Refunded A1 and B2."
MANUAL = "the whole manual"
MANUAL_CHARS = 100_000  # a tool result of ~100 KB: ≥ 100k tokens by runcap's byte bound
TOOL_DOC = "Look up an order or a document."

# one tool, three steps; the model says what it does before its first tool call
AGENT_SCRIPT = [
    {"text": "Let me look up A1.", "tool_calls": [{"name": "lookup", "arguments": {"query": "A1"}}]},
    {"tool_calls": [{"name": "lookup", "arguments": {"query": "B2"}}]},
    {"text": ANSWER},
]
# the same without that preamble, for Pydantic AI's `run_stream`: it ends the run at the first
# text the model streams (its documented behaviour), so a preamble would be taken as the answer
QUIET_SCRIPT = [{"tool_calls": AGENT_SCRIPT[0]["tool_calls"]}, *AGENT_SCRIPT[1:]]
# the model wants the whole manual: sending it back does not fit the dollar cap
MANUAL_SCRIPT = [
    {"tool_calls": [{"name": "lookup", "arguments": {"query": MANUAL}}]},
    {"text": "The manual says nothing about refunds."},
]
OPENAI_MODEL = "gpt-4o-mini"
ANTHROPIC_MODEL = "claude-sonnet-4-5"
# Dollar caps worth ~20,000 input tokens of each model: the first call fits (its byte bound is
# a few thousand tokens), the second — carrying the 100 KB manual — cannot.
DOLLAR_CAP = {OPENAI_MODEL: "0.003", ANTHROPIC_MODEL: "0.06"}


def lookup(query: str) -> str:
    """Look up an order or a document."""
    if query == MANUAL:
        return "manual: " + "x" * MANUAL_CHARS
    return f"found {query}"


# --------------------------------------------------------------------------- the servers


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("frameworks") / "data").start()
    yield s
    s.stop()


# --------------------------------------------------------------------------- the frameworks
#
# Each driver runs the agent once and returns its final answer, or raises the framework's error.


async def openai_agents(
    stack: Stack, headers: dict[str, str], *, api: str, stream: bool, chained: bool
) -> str:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the SDK's own traces would go to OpenAI
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="sk-test")
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="support",
        instructions="Refund the orders the user names.",
        tools=[function_tool(lookup)],
        model=model_class(model=OPENAI_MODEL, openai_client=client),
        model_settings=ModelSettings(extra_headers=headers),
    )
    try:
        if stream:
            streamed = Runner.run_streamed(agent, QUESTION, auto_previous_response_id=chained)
            async for _event in streamed.stream_events():
                pass
            return str(streamed.final_output)
        result = await Runner.run(agent, QUESTION, auto_previous_response_id=chained)
        return str(result.final_output)
    finally:
        await client.close()


async def langgraph_react(stack: Stack, headers: dict[str, str], *, provider: str) -> str:
    from langgraph.prebuilt import create_react_agent

    llm: Any
    if provider == "openai":
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(
            model=OPENAI_MODEL, base_url=f"{stack.url}/v1", api_key="sk-test", default_headers=headers
        )
    else:
        from langchain_anthropic import ChatAnthropic

        llm = ChatAnthropic(
            model=ANTHROPIC_MODEL, base_url=stack.url, api_key="sk-test", default_headers=headers
        )  # type: ignore[call-arg]
    agent = create_react_agent(llm, [lookup])
    out = await agent.ainvoke({"messages": [("user", QUESTION)]})
    return str(out["messages"][-1].content)


async def pydantic_ai_agent(stack: Stack, headers: dict[str, str], *, provider: str, stream: bool) -> str:
    from pydantic_ai import Agent

    client: Any
    if provider == "openai":
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="sk-test")
        model: Any = OpenAIChatModel(OPENAI_MODEL, provider=OpenAIProvider(openai_client=client))
    else:
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="sk-test")
        model = AnthropicModel(ANTHROPIC_MODEL, provider=AnthropicProvider(anthropic_client=client))
    agent = Agent(
        model,
        tools=[lookup],
        instructions="Refund the orders the user names.",
        model_settings={"extra_headers": headers},
    )
    try:
        if stream:
            async with agent.run_stream(QUESTION) as result:
                return str(await result.get_output())
        return str((await agent.run(QUESTION)).output)
    finally:
        await client.close()


async def anthropic_tool_runner(stack: Stack, headers: dict[str, str], *, stream: bool) -> str:
    @anthropic.beta_async_tool(name="lookup")
    async def lookup_tool(query: str) -> str:
        """Look up an order or a document."""
        return lookup(query)

    client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="sk-test", default_headers=headers)
    runner = client.beta.messages.tool_runner(
        model=ANTHROPIC_MODEL,
        max_tokens=1024,
        tools=[lookup_tool],
        messages=[{"role": "user", "content": QUESTION}],
        stream=stream,
    )
    last: Any = None
    try:
        async for item in runner:
            last = await item.get_final_message() if stream else item
    finally:
        await client.close()
    return "".join(block.text for block in last.content if block.type == "text")


LITELLM_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": TOOL_DOC,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


@contextlib.contextmanager
def litellm_offline() -> Iterator[None]:
    """LiteLLM fetches its model price map from the network unless told not to, and reads the
    variable at import and later: set for the LiteLLM calls only, restored after (no leak)."""
    with mock.patch.dict(os.environ, {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}):
        yield


async def litellm_client(stack: Stack, headers: dict[str, str]) -> str:
    with litellm_offline():
        return await _litellm_loop(stack, headers)


async def _litellm_loop(stack: Stack, headers: dict[str, str]) -> str:
    import litellm

    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for _ in range(6):
        response = await litellm.acompletion(
            model=f"openai/{OPENAI_MODEL}",
            api_base=f"{stack.url}/v1",
            api_key="sk-test",
            messages=messages,
            tools=LITELLM_TOOLS,
            extra_headers=headers,
        )
        message = response.choices[0].message  # type: ignore[union-attr]
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return str(message.content)
        for call in message.tool_calls:
            result = lookup(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise AssertionError("the LiteLLM loop did not end")


class VercelError(Exception):
    """The error the Vercel AI SDK threw (as the node script reports it)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report.get("message"))
        self.report = report


async def vercel_ai(stack: Stack, headers: dict[str, str], *, api: str) -> str:
    config = {"baseURL": f"{stack.url}/v1", "headers": headers, "api": api, "manualChars": MANUAL_CHARS}
    proc = await asyncio.create_subprocess_exec(
        "node", str(NODE_DIR / "vercel_agent.mjs"), json.dumps(config),
        cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    if not report["ok"]:
        raise VercelError(report)
    return str(report["text"])


# --------------------------------------------------------------------------- the table


def _status(error: BaseException) -> int | None:
    """The HTTP status a framework's error carries, however it spells it."""
    if isinstance(error, VercelError):
        return error.report.get("statusCode")
    for name in ("status_code", "status"):
        value = getattr(error, name, None)
        if isinstance(value, int):
            return value
    return None


@dataclass(frozen=True)
class Framework:
    name: str
    model: str
    drive: Callable[[Stack, dict[str, str]], Awaitable[str]]
    # The error type the framework raises at a dollar cap (what an agent host catches), or a
    # function importing it (LiteLLM and Pydantic AI are imported only when their tests run).
    cap_error: type[BaseException] | Callable[[], type[BaseException]]
    needs_node: bool = False
    script: tuple[dict[str, Any], ...] = tuple(AGENT_SCRIPT)

    @property
    def provider(self) -> str:
        return "anthropic" if self.model == ANTHROPIC_MODEL else "openai"

    @property
    def error_type(self) -> type[BaseException]:
        error = self.cap_error
        return error if isinstance(error, type) else error()


def _fw(
    name: str,
    model: str,
    drive: Callable[..., Awaitable[str]],
    cap_error: type[BaseException] | Callable[[], type[BaseException]],
    **kw: Any,
) -> Framework:
    node = kw.pop("needs_node", False)
    script = tuple(QUIET_SCRIPT if kw.get("stream") and drive is pydantic_ai_agent else AGENT_SCRIPT)

    async def bound(stack: Stack, headers: dict[str, str]) -> str:
        return await drive(stack, headers, **kw)

    return Framework(name, model, bound, cap_error, node, script)


def _litellm_error() -> type[BaseException]:
    with litellm_offline():
        import litellm

    return litellm.exceptions.APIError  # type: ignore[no-any-return]


def _pydantic_ai_error() -> type[BaseException]:
    from pydantic_ai.exceptions import ModelAPIError

    return ModelAPIError


FRAMEWORKS = [
    _fw("openai-agents-responses", OPENAI_MODEL, openai_agents, openai.APIStatusError,
        api="responses", stream=False, chained=False),
    _fw("openai-agents-responses-stream", OPENAI_MODEL, openai_agents, openai.APIStatusError,
        api="responses", stream=True, chained=False),
    _fw("openai-agents-responses-chained", OPENAI_MODEL, openai_agents, openai.APIStatusError,
        api="responses", stream=False, chained=True),
    _fw("openai-agents-responses-chained-stream", OPENAI_MODEL, openai_agents, openai.APIStatusError,
        api="responses", stream=True, chained=True),
    _fw("openai-agents-chat", OPENAI_MODEL, openai_agents, openai.APIStatusError,
        api="chat", stream=False, chained=False),
    _fw("openai-agents-chat-stream", OPENAI_MODEL, openai_agents, openai.APIStatusError,
        api="chat", stream=True, chained=False),
    _fw("langgraph-chatopenai", OPENAI_MODEL, langgraph_react, openai.APIStatusError, provider="openai"),
    _fw("langgraph-chatanthropic", ANTHROPIC_MODEL, langgraph_react, anthropic.APIStatusError,
        provider="anthropic"),
    _fw("pydantic-ai-openai", OPENAI_MODEL, pydantic_ai_agent, _pydantic_ai_error,
        provider="openai", stream=False),
    _fw("pydantic-ai-openai-stream", OPENAI_MODEL, pydantic_ai_agent, _pydantic_ai_error,
        provider="openai", stream=True),
    _fw("pydantic-ai-anthropic", ANTHROPIC_MODEL, pydantic_ai_agent, _pydantic_ai_error,
        provider="anthropic", stream=False),
    _fw("pydantic-ai-anthropic-stream", ANTHROPIC_MODEL, pydantic_ai_agent, _pydantic_ai_error,
        provider="anthropic", stream=True),
    _fw("anthropic-tool-runner", ANTHROPIC_MODEL, anthropic_tool_runner, anthropic.APIStatusError,
        stream=False),
    _fw("anthropic-tool-runner-stream", ANTHROPIC_MODEL, anthropic_tool_runner, anthropic.APIStatusError,
        stream=True),
    _fw("litellm", OPENAI_MODEL, litellm_client, _litellm_error),
    _fw("vercel-ai-responses", OPENAI_MODEL, vercel_ai, VercelError, api="responses", needs_node=True),
    _fw("vercel-ai-chat", OPENAI_MODEL, vercel_ai, VercelError, api="chat", needs_node=True),
]  # fmt: skip


@pytest.fixture(params=FRAMEWORKS, ids=[f.name for f in FRAMEWORKS])
def framework(request: pytest.FixtureRequest) -> Framework:
    fw: Framework = request.param
    if fw.needs_node:
        if shutil.which("node") is None:
            missing(
                "SKIPPED LOUDLY: node is not installed — scripts/setup.sh installs nodejs for the test extra"
            )
        if not (NODE_DIR / "node_modules" / "ai").is_dir():
            missing("SKIPPED LOUDLY: the Vercel AI SDK is not installed in tests/node — run scripts/setup.sh")
    return fw


def billed_nanos(fw: Framework, calls: list[Any]) -> int:
    """What the scripted provider billed for these calls."""
    return sum(usd_to_nanos(PRICES.cost(fw.provider, fw.model, c.usage).usd) for c in calls if c.usage)


# --------------------------------------------------------------------------- the tests


async def test_loop_completes_and_costs_what_the_provider_reported(
    stack: Stack, framework: Framework
) -> None:
    run_id = f"fw-done-{framework.name}"
    headers = stack.script(run_id, list(framework.script))
    answer = await framework.drive(stack, headers)
    assert ANSWER in answer

    calls = stack.calls(run_id)
    assert [c.status for c in calls] == [200, 200, 200]
    assert [c.step for c in calls] == [0, 1, 2]  # each request carried the turns before it
    state = await stack.settled(run_id)
    assert state["status"] == "completed" and state["steps"] == 3
    assert state["input_tokens"] == sum(c.usage.input_tokens for c in calls)
    assert state["output_tokens"] == sum(c.usage.output_tokens for c in calls)
    assert usd_to_nanos(Decimal(state["cost_usd"])) == billed_nanos(framework, calls) > 0

    spans = await stack.spans(run_id, {"model:ok": 3, "tool_call": 2, "tool_result": 2})
    assert spans == {"model:ok": 3, "tool_call": 2, "tool_result": 2}


async def test_step_cap_ends_the_loop_with_an_answer(stack: Stack, framework: Framework) -> None:
    """X-Run-Max-Steps: 2 — the second call goes out without (live) tools; the framework takes
    the answer as the end of its loop."""
    run_id = f"fw-steps-{framework.name}"
    headers = {**stack.script(run_id, list(framework.script)), "X-Run-Max-Steps": "2"}
    answer = await framework.drive(stack, headers)
    assert answer == FALLBACK_TEXT  # what the scripted model says when it may not call tools

    first, final = stack.calls(run_id)
    assert first.body.get("tools") and first.status == final.status == 200
    body = final.body
    assert not body.get("tools") or body.get("tool_choice") in ("none", {"type": "none"})
    state = await stack.settled(run_id)
    assert state["status"] == "steps_exceeded" and state["steps"] == 2
    spans = await stack.spans(run_id, {"model:ok": 2, "tool_call": 1, "tool_result": 1})
    assert spans["model:ok"] == 2 and spans["tool_call"] == 1 and spans["tool_result"] == 1


async def test_dollar_cap_is_the_frameworks_error_without_a_retry(stack: Stack, framework: Framework) -> None:
    run_id = f"fw-usd-{framework.name}"
    cap = DOLLAR_CAP[framework.model]
    headers = {**stack.script(run_id, MANUAL_SCRIPT), "X-Run-Max-Usd": cap}
    with pytest.raises(framework.error_type) as info:
        await framework.drive(stack, headers)
    assert _status(info.value) == 402, repr(info.value)
    assert "X-Run-Max-Usd" in str(info.value)

    calls = stack.calls(run_id)
    assert len(calls) == 1 and calls[0].status == 200  # the first step; the refused one never left
    state = await stack.settled(run_id)
    assert state["status"] == "budget_exceeded" and state["steps"] == 1
    assert usd_to_nanos(Decimal(state["cost_usd"])) == billed_nanos(framework, calls)
    assert Decimal(state["cost_usd"]) <= Decimal(cap)
    # runcap refused exactly one call: the framework did not retry it
    spans = await stack.spans(run_id, {"model:ok": 1, "model:budget_exceeded": 1})
    assert spans.get("model:budget_exceeded") == 1 and spans.get("model:ok") == 1
