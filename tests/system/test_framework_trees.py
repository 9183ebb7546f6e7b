"""Run trees driven by the agent frameworks that have sub-agents (issue 22), unchanged, through runcap.

The host gives every agent a model client of its own whose base URL or default headers carry the
agent's run id and its parent's (`X-Run-Parent`, or the path form `/r/{run}/p/{parent}/...`) —
one sub-agent of each tree sets it one way, the other the other way:

* OpenAI Agents SDK: a triage agent that hands off to a specialist (`handoffs`), and an
  orchestrator that calls two sub-agents as tools (`Agent.as_tool`);
* LangGraph: a parent graph whose planner node is the parent run and whose compiled subgraph
  node (a ReAct agent on langchain-anthropic) is the child run;
* Pydantic AI: agent delegation, a tool of the parent agent that runs another agent.

For each tree, checked against runcap's own records and the scripted upstream's:

* the tree is recorded: `GET /runs/{id}` names each child's parent and root and the parent's
  children, each run's spend is what the upstream billed for its calls and the parent's subtree
  is their sum; the spans in the embedded chdb and the `runcap.runs` rows behind
  `runcap run ROOT --tree` carry the same parent, root and spend;
* the parent's cap holds: with a dollar cap on the parent only (children uncapped), children that
  never stop calling their tool are ended by the parent's cap — the tree's settled spend is at
  most the cap and is exactly what the upstream billed, the refused call never reached the
  upstream, the framework raises the SDK's own error type (402 `run_budget_exceeded`, naming the
  parent; `error.run` in the OpenAI shape) and runcap was asked that call once (no retry).

The README's "Sub-agents with the OpenAI Agents SDK / LangGraph / Pydantic AI" says what each
framework needs from the host; this module is its evidence.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import anthropic
import openai
import pydantic_ai  # its tools' annotations are resolved in this module's namespace
import pytest

from proxy.money import usd_to_nanos
from proxy.pricing import PriceBook
from tests.conftest import REPO
from tests.support.framework_stack import Stack

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # LangGraph's create_react_agent
]

PRICES = PriceBook()
OPENAI_MODEL = "gpt-4o-mini"
ANTHROPIC_MODEL = "claude-sonnet-4-5"
QUESTION = "Refund order A1."
ANSWER = "Refunded A1."
DOC = "order A1: " + "d" * 2000  # each lookup adds ~2 KB to the child's next request
MAX_TURNS = 40  # the framework's own loop limit, far above what the cap allows: the cap ends the loop

LOOKUP = {"name": "lookup", "arguments": {"query": "A1"}}
DELEGATE = {"name": "delegate", "arguments": {"query": "refund A1"}}
LOOPS = [{"tool_calls": [LOOKUP]}]  # a child that never stops looking up: only a cap ends it


def lookup(query: str) -> str:
    """Look up an order."""
    return f"found {query}: {DOC}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("framework-trees") / "data").start()
    yield s
    s.stop()


# --------------------------------------------------------------------------- what the host sets


def header_form(
    stack: Stack, run_id: str, parent: str, steps: list[dict[str, Any]]
) -> tuple[str, dict[str, str]]:
    """An agent's OpenAI base URL and default headers with its run identity in headers."""
    headers = stack.script(run_id, steps)
    if parent:
        headers["X-Run-Parent"] = parent
    return f"{stack.url}/v1", headers


def path_form(
    stack: Stack, run_id: str, parent: str, steps: list[dict[str, Any]]
) -> tuple[str, dict[str, str]]:
    """The same in the path (`/r/{run}/p/{parent}`), for a host that sets only a base URL (the
    script header is the scripted upstream's, not the run's)."""
    stack.script(run_id, steps)
    return f"{stack.url}/r/{run_id}/p/{parent}/v1", {"X-Mock-Script": run_id}


def parent_form(
    stack: Stack, run_id: str, steps: list[dict[str, Any]], cap: str | None
) -> tuple[str, dict[str, str]]:
    """The parent agent's: its run in headers, with the tree's dollar cap when given."""
    url, headers = header_form(stack, run_id, "", steps)
    if cap is not None:
        headers["X-Run-Max-Usd"] = cap
    return url, headers


def openai_client(base_url: str, headers: dict[str, str]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="sk-test", default_headers=headers)


@contextlib.asynccontextmanager
async def closing(*clients: openai.AsyncOpenAI) -> AsyncIterator[tuple[openai.AsyncOpenAI, ...]]:
    """The agents' clients, closed after the run."""
    try:
        yield clients
    finally:
        for c in clients:
            await c.close()


# --------------------------------------------------------------------------- the frameworks
#
# Each driver runs its tree once and returns the final answer, or raises the framework's error.


@dataclass(frozen=True)
class TreeRun:
    """One run of a tree: the parent's run id and its children's, the parent's dollar cap (None:
    no cap) and the children's script."""

    stack: Stack
    parent: str
    children: tuple[str, ...]
    cap: str | None
    child_steps: list[dict[str, Any]]


def agents_model(client: openai.AsyncOpenAI) -> Any:
    from agents import OpenAIResponsesModel

    return OpenAIResponsesModel(model=OPENAI_MODEL, openai_client=client)


async def agents_handoff(run: TreeRun) -> str:
    """Triage (headers) hands off to a billing specialist (path form)."""
    from agents import Agent, Runner, function_tool, set_tracing_disabled

    (child,) = run.children
    set_tracing_disabled(True)  # the SDK's own traces would go to OpenAI
    triage_steps = [
        {"text": "Passing you to billing.", "tool_calls": [{"name": "transfer_to_billing", "arguments": {}}]}
    ]
    url, headers = parent_form(run.stack, run.parent, triage_steps, run.cap)
    clients = (
        openai_client(url, headers),
        openai_client(*path_form(run.stack, child, run.parent, run.child_steps)),
    )
    async with closing(*clients) as (triage_client, billing_client):
        specialist = Agent(
            name="billing",
            instructions="Refund the order.",
            tools=[function_tool(lookup)],
            model=agents_model(billing_client),
        )
        triage = Agent(
            name="triage",
            instructions="Route to billing.",
            handoffs=[specialist],
            model=agents_model(triage_client),
        )
        result = await Runner.run(triage, QUESTION, max_turns=MAX_TURNS)
    return str(result.final_output)


async def agents_as_tools(run: TreeRun) -> str:
    """An orchestrator (headers) calls a researcher (headers) and a writer (path form) as tools, in
    one turn. `failure_error_function=None`: a sub-agent's error is raised, not handed to the
    orchestrator's model as the tool's text (the SDK's default)."""
    from agents import Agent, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = [
        {"name": "research", "arguments": {"input": "A1"}},
        {"name": "write", "arguments": {"input": "A1"}},
    ]
    url, headers = parent_form(run.stack, run.parent, [{"tool_calls": calls}, {"text": ANSWER}], run.cap)
    clients = (
        openai_client(url, headers),
        openai_client(*header_form(run.stack, run.children[0], run.parent, run.child_steps)),
        openai_client(*path_form(run.stack, run.children[1], run.parent, run.child_steps)),
    )
    async with closing(*clients) as (orchestrator_client, *child_clients):
        researcher, writer = (
            Agent(
                name=name, instructions="Do your part.", tools=[function_tool(lookup)], model=agents_model(c)
            )
            for name, c in zip(("researcher", "writer"), child_clients, strict=True)
        )
        orchestrator = Agent(
            name="orchestrator",
            instructions="Research, then write.",
            tools=[
                researcher.as_tool(
                    "research", "Research an order.", max_turns=MAX_TURNS, failure_error_function=None
                ),
                writer.as_tool(
                    "write", "Write the answer.", max_turns=MAX_TURNS, failure_error_function=None
                ),
            ],
            model=agents_model(orchestrator_client),
        )
        result = await Runner.run(orchestrator, QUESTION, max_turns=MAX_TURNS)
    return str(result.final_output)


async def langgraph_subgraph(run: TreeRun) -> str:
    """A parent graph: a planner node on ChatOpenAI (the parent run, headers), then a compiled
    ReAct subgraph on ChatAnthropic (the child run, path form) sharing the messages."""
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import create_react_agent

    (child,) = run.children
    url, headers = parent_form(
        run.stack, run.parent, [{"text": "Plan: look A1 up, then refund it."}], run.cap
    )
    planner = ChatOpenAI(model=OPENAI_MODEL, base_url=url, api_key="sk-test", default_headers=headers)  # type: ignore[arg-type]
    child_url, child_headers = path_form(run.stack, child, run.parent, run.child_steps)
    worker = ChatAnthropic(
        model=ANTHROPIC_MODEL,
        base_url=child_url.removesuffix("/v1"),
        api_key="sk-test",
        default_headers=child_headers,
    )  # type: ignore[call-arg]

    async def plan(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await planner.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("plan", plan)
    graph.add_node("work", create_react_agent(worker, [lookup]))
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "work")
    graph.add_edge("work", END)
    out = await graph.compile().ainvoke(
        {"messages": [("user", QUESTION)]}, {"recursion_limit": 2 * MAX_TURNS}
    )
    return str(out["messages"][-1].content)


async def pydantic_ai_delegation(run: TreeRun) -> str:
    """Pydantic AI's agent delegation: a support agent (headers) whose `delegate` tool runs a
    billing agent (path form) and returns its output."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    (child,) = run.children
    url, headers = parent_form(run.stack, run.parent, [{"tool_calls": [DELEGATE]}, {"text": ANSWER}], run.cap)
    clients = (
        openai_client(url, headers),
        openai_client(*path_form(run.stack, child, run.parent, run.child_steps)),
    )
    async with closing(*clients):
        support, billing = (
            Agent(OpenAIChatModel(OPENAI_MODEL, provider=OpenAIProvider(openai_client=c)), instructions=text)
            for c, text in zip(clients, ("Delegate refunds to billing.", "Refund the order."), strict=True)
        )
        billing.tool_plain(lookup)

        @support.tool
        async def delegate(ctx: pydantic_ai.RunContext[None], query: str) -> str:
            """Hand a refund to the billing agent (its usage counted in the support agent's)."""
            return (await billing.run(query, usage=ctx.usage)).output

        return (await support.run(QUESTION)).output


# --------------------------------------------------------------------------- the trees


def _pydantic_ai_error() -> type[BaseException]:
    """Pydantic AI raises a 402 as its ModelHTTPError that is also a ModelQuotaExceededError (one
    class made for the pair: both `except`s catch it)."""
    from pydantic_ai.exceptions import ModelHTTPError, ModelQuotaExceededError

    return type(
        ModelHTTPError.for_category(ModelQuotaExceededError, status_code=402, model_name=OPENAI_MODEL)
    )


def _agents_user_error() -> type[BaseException]:
    from agents.exceptions import UserError

    return UserError


@dataclass(frozen=True)
class Tree:
    name: str
    drive: Callable[[TreeRun], Awaitable[str]]
    children: int
    # The parent's assistant turns in a child's first request (a handoff passes the triage's
    # on): the scripted model plays the step after that many turns.
    inherited_turns: int
    # The parent's dollar cap in the cap test: a handful of its children's calls, each resending
    # the child's growing history (a few times what one child call may reserve, for siblings).
    cap: str
    # The exception the framework raises at the parent's cap (exactly this type), and how to
    # reach the provider's error in it.
    error: Callable[[], type[BaseException]]
    wrapped: bool = False  # the SDK wraps the provider's error (`raise ... from e`)

    def ids(self, test: str) -> tuple[str, tuple[str, ...]]:
        parent = f"{test}-{self.name}"
        return parent, tuple(f"{parent}.c{i}" for i in range(self.children))

    def provider_error(self, error: BaseException) -> openai.APIStatusError | anthropic.APIStatusError:
        cause = error.__cause__ if self.wrapped else error
        assert isinstance(cause, openai.APIStatusError | anthropic.APIStatusError), repr(error)
        return cause


TREES = [
    Tree("agents-handoff", agents_handoff, 1, 1, "0.005", lambda: openai.APIStatusError),
    Tree("agents-as-tools", agents_as_tools, 2, 0, "0.02", _agents_user_error, wrapped=True),
    Tree("langgraph-subgraph", langgraph_subgraph, 1, 0, "0.10", lambda: anthropic.PaymentRequiredError),
    Tree("pydantic-ai-delegation", pydantic_ai_delegation, 1, 0, "0.005", _pydantic_ai_error, wrapped=True),
]


@pytest.fixture(params=TREES, ids=[t.name for t in TREES])
def tree(request: pytest.FixtureRequest) -> Tree:
    return request.param  # type: ignore[no-any-return]


def looks_up_once(inherited_turns: int) -> list[dict[str, Any]]:
    """A child's script: one lookup, then the answer (after the turns it inherited)."""
    return [{"tool_calls": [LOOKUP]}] * (inherited_turns + 1) + [{"text": ANSWER}]


def billed_nanos(calls: list[Any]) -> int:
    """What the scripted provider billed for these calls (each priced by its own wire format's
    provider and model)."""
    total = 0
    for c in calls:
        if c.usage:
            provider = "anthropic" if c.path.endswith("/messages") else "openai"
            total += usd_to_nanos(PRICES.cost(provider, c.body["model"], c.usage).usd)
    return total


# --------------------------------------------------------------------------- runcap's records


async def poll(what: str, probe: Callable[[], Awaitable[Any]], done: Callable[[Any], bool]) -> Any:
    """`probe()` once `done` holds of it (the span shipper writes behind the calls), 20 s at most."""
    deadline = time.monotonic() + 20
    while True:
        got = await probe()
        if done(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still {got}")
        await asyncio.sleep(0.1)


async def run_rows(stack: Stack, root: str, ledger: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """The newest `runcap.runs` row of each run of the tree (parent, root) once every run's row
    shows the spend the ledger settled."""
    query = (
        "SELECT run_id, argMax((parent_run_id, root_run_id, toString(cost_usd)), (updated_at, steps)) "
        "FROM runcap.runs WHERE root_run_id = {root:String} GROUP BY run_id"
    )

    async def rows() -> dict[str, tuple[str, str, str]]:
        return {run: tuple(newest) for run, newest in await stack.sql(query, {"root": root})}

    def caught_up(got: dict[str, tuple[str, str, str]]) -> bool:
        return set(got) == set(ledger) and all(
            Decimal(got[r][2]) == Decimal(s["cost_usd"]) for r, s in ledger.items()
        )

    got = await poll(f"runcap.runs of tree {root}", rows, caught_up)
    return {run: (parent, root_id) for run, (parent, root_id, _) in got.items()}


async def span_trees(
    stack: Stack, root: str, model_calls: Callable[[], dict[str, int]]
) -> dict[str, tuple[str, str, int]]:
    """Per run of the tree: the parent and root its model spans carry (each one value) and how
    many of them runcap refused for a cap — once each run has `model_calls()` model spans."""
    query = (
        "SELECT run_id, groupUniqArray(parent_run_id), groupUniqArray(root_run_id), count(), "
        "countIf(outcome = 'budget_exceeded') FROM runcap.spans "
        "WHERE root_run_id = {root:String} AND kind = 'model' GROUP BY run_id"
    )

    async def rows() -> dict[str, tuple[list[str], list[str], int, int]]:
        got = await stack.sql(query, {"root": root})
        return {run: (parents, roots, int(n), int(refused)) for run, parents, roots, n, refused in got}

    got = await poll(
        f"model spans of tree {root}", rows, lambda got: {r: v[2] for r, v in got.items()} == model_calls()
    )
    return {run: (*parents, *roots, refused) for run, (parents, roots, _, refused) in got.items()}


async def assert_recorded(stack: Stack, parent: str, children: tuple[str, ...]) -> dict[str, Any]:
    """The tree `parent` → `children` as the ledger, the spans and `runcap.runs` show it; each
    run's spend what the upstream billed for its calls. Returns the ledger's states."""
    runs = (parent, *children)
    statuses = {r: (await stack.settled(r))["status"] for r in runs}
    # a model span for every call of every run that reached the upstream, and for each refusal
    # (a call the framework gave up on in flight still ends — and is billed — at runcap: its span
    # is the sign it did)
    refused = {r: int(r != parent and statuses[r].endswith("budget_exceeded")) for r in runs}
    spans = await span_trees(stack, parent, lambda: {r: len(stack.calls(r)) + refused[r] for r in runs})
    assert spans == {parent: ("", parent, 0)} | {c: (parent, parent, refused[c]) for c in children}

    ledger = {r: await stack.settled(r) for r in runs}
    root = ledger[parent]
    assert root["parent"] is None and root["root"] == parent and root["ancestors"] == []
    assert sorted(root["children"]) == sorted(children) and root["children_count"] == len(children)
    for c in children:
        assert (ledger[c]["parent"], ledger[c]["root"], ledger[c]["ancestors"]) == (parent, parent, [parent])
    for r in runs:
        assert usd_to_nanos(Decimal(ledger[r]["cost_usd"])) == billed_nanos(stack.calls(r)), r
    assert Decimal(root["subtree"]["cost_usd"]) == sum(Decimal(s["cost_usd"]) for s in ledger.values())
    assert Decimal(root["subtree"]["reserved_usd"]) == 0
    # the newest runcap.runs row of each run: the same tree, the same spend
    assert await run_rows(stack, parent, ledger) == {parent: ("", parent)} | {
        c: (parent, parent) for c in children
    }
    return ledger


async def assert_cli_tree(stack: Stack, parent: str, ledger: dict[str, dict[str, Any]]) -> None:
    """`runcap run PARENT --tree` against the running runcap (`--url`, the admin token from the
    env): the parent, then its children indented under it, each with its own and subtree spend."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNCAP_") and k != "COLUMNS"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "run", parent, "--tree", "--url", stack.url, cwd=REPO,
        env={**clean, "RUNCAP_ADMIN_TOKEN": stack.admin_token},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode(errors="replace")
    lines = out.decode().splitlines()
    subtree = Decimal(ledger[parent]["subtree"]["cost_usd"])
    assert lines[0] == f"run tree {parent}: {len(ledger)} runs, ${subtree:.9f}"
    header = lines[2].split()
    own, below = header.index("cost_usd"), header.index("subtree_usd")
    children = sorted(set(ledger) - {parent})
    body = lines[4:]
    assert [line.split()[0] for line in body] == [parent, *children]
    assert body[0].startswith(parent + " ") and all(
        line.startswith("  " + c + " ") for line, c in zip(body[1:], children, strict=True)
    )
    for line in body:
        cells = line.split()
        state = ledger[cells[0]]
        assert Decimal(cells[own]) == Decimal(state["cost_usd"])
        assert Decimal(cells[below]) == Decimal(state["subtree"]["cost_usd"])


# --------------------------------------------------------------------------- the tests


async def test_the_tree_is_recorded(stack: Stack, tree: Tree) -> None:
    parent, children = tree.ids("done")
    steps = looks_up_once(tree.inherited_turns)
    answer = await tree.drive(TreeRun(stack, parent, children, None, steps))
    assert ANSWER in answer
    ledger = await assert_recorded(stack, parent, children)
    # (a handoff's triage run ends on its handoff call: to runcap it stays active)
    assert all(ledger[c]["status"] == "completed" for c in children)
    assert all(ledger[c]["steps"] == 2 and ledger[c]["tool_calls"] == 1 for c in children)
    assert Decimal(ledger[parent]["subtree"]["cost_usd"]) > Decimal(ledger[parent]["cost_usd"]) > 0
    await assert_cli_tree(stack, parent, ledger)


async def test_the_parents_cap_holds_while_children_loop(stack: Stack, tree: Tree) -> None:
    """Children without caps that never stop calling their tool: the parent's cap ends them."""
    parent, children = tree.ids("cap")
    cap = Decimal(tree.cap)
    error_type = tree.error()
    with pytest.raises(error_type) as info:
        await tree.drive(TreeRun(stack, parent, children, tree.cap, LOOPS))
    assert type(info.value) is error_type, repr(info.value)
    refusal = tree.provider_error(info.value)
    assert refusal.status_code == 402 and refusal.response.headers["x-should-retry"] == "false"
    error = refusal.response.json()["error"]
    assert error["type"] == "run_budget_exceeded"
    if isinstance(refusal, openai.APIStatusError):  # the OpenAI shape names the cap and the run it binds
        assert (error["code"], error["run"]) == ("max_usd", parent)
    assert "X-Run-Max-Usd" in error["message"] and f"its ancestor {parent}'s cap" in error["message"]
    [stopped] = [c for c in children if f"run {c} is bounded" in error["message"]]

    ledger = await assert_recorded(stack, parent, children)  # one refusal span per stopped child
    calls = [c for r in (parent, *children) for c in stack.calls(r)]
    assert all(c.status == 200 for c in calls)  # the refused calls never reached the upstream
    spent = Decimal(ledger[parent]["subtree"]["cost_usd"])
    assert usd_to_nanos(spent) == billed_nanos(calls) and spent <= cap  # what the upstream billed
    assert ledger[parent]["status"] == "budget_exceeded"
    assert ledger[stopped]["status"] == "ancestor_budget_exceeded"
    # A sibling still looping when the SDK raised the stopped child's error is cancelled by it:
    # refused as well, or left between two calls.
    assert all(ledger[c]["status"] in ("ancestor_budget_exceeded", "active") for c in children)
    # every child looped (a call after each of its lookups) until the cap or its sibling's error
    assert all(len(stack.calls(c)) >= 3 for c in children)
