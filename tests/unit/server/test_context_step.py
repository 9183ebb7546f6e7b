"""The context step's measure and cap on its own, without a server: the words the bound counts
(text keys only, reasoning never), the exact prefix of the run's previous call and when it proves
nothing, the upper bound and the estimate between the two, the tool-output share, and which calls
the request hook measures, rewrites or refuses (issue 28: the mutants of context.py)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.config import CapsConfig
from proxy.config.sections import TaskCaps
from proxy.context import ContextSettings
from proxy.errors import BudgetExceeded, InvalidRequest
from proxy.providers.base import RequestInfo, ToolResult
from proxy.server.flow import Flow
from proxy.server.inner import InnerCalls
from proxy.server.metrics import Metrics
from proxy.server.outbound import OutboundClient
from proxy.server.steps.context import ContextStep, _has_unread, measure, parse_policies, text_words
from proxy.server.steps.history import ConversationMemory
from tests.support.flows import tflow

# -- the words the lower bound counts ------------------------------------------------------------


def test_a_string_is_words_only_where_the_model_reads_text() -> None:
    assert text_words("one two  three\n\nfour") == 0  # not under a text key
    assert text_words("one two  three\n\nfour", True) == 4  # any whitespace separates words
    assert text_words("", True) == 0
    assert text_words(["a b", "c"], True) == 3  # a list inherits the key it is under
    assert text_words(["a b", "c"]) == 0
    assert text_words(17, True) == 0 and text_words(None, True) == 0


def test_only_the_text_keys_of_a_dict_count() -> None:
    message = {"role": "user words", "name": "x y", "content": "a b c"}
    assert text_words(message) == 3
    for key in ("content", "text", "output", "system", "instructions"):
        assert text_words({key: "a b"}) == 2, key
    # nested: the key a value sits under decides, at every level
    blocks = {"content": [{"type": "text", "text": "one two"}, "three four five", {"id": "six"}]}
    assert text_words(blocks) == 5
    assert text_words([{"content": "a"}, {"content": "b c"}]) == 3


def test_reasoning_items_are_not_read_back() -> None:
    for kind in ("reasoning", "thinking", "redacted_thinking"):
        assert text_words({"type": kind, "text": "a b c"}) == 0, kind
        assert text_words({"content": [{"type": kind, "text": "a b"}, {"type": "text", "text": "c"}]}) == 1
    assert text_words({"type": "text", "text": "a b c"}) == 3


def test_unread_items_are_found_at_any_depth() -> None:
    for kind in ("reasoning", "thinking", "redacted_thinking"):
        assert _has_unread({"type": kind})
        assert _has_unread([{"role": "assistant", "content": [{"type": "text"}, {"type": kind}]}])
        assert _has_unread({"a": {"b": [{"type": kind}]}})
    assert not _has_unread([{"role": "assistant", "content": [{"type": "text", "text": "reasoning"}]}])
    assert not _has_unread({"type": "text", "reasoning": "thinking"})
    assert not _has_unread("reasoning") and not _has_unread([]) and not _has_unread(None)
    assert not _has_unread([[], {}, "thinking", 3])


# -- measure ------------------------------------------------------------------------------------


class Memory(ConversationMemory):
    """A memory whose answers are set by the test, recording what it was asked."""

    def __init__(self, bound: int = 0, prefix: tuple[int, int] | None = None, stored: int | None = None):
        super().__init__()
        self._bound, self._prefix, self._stored = bound, prefix, stored
        self.asked: list[str] = []

    def bound(self, run_id: str, adapter: Any, info: RequestInfo) -> int:
        self.asked.append("bound" if run_id == "t-run" else f"bound of {run_id!r}")
        return self._bound

    def known_prefix(self, run_id: str, info: RequestInfo) -> tuple[int, int] | None:
        self.asked.append("prefix" if run_id == "t-run" else f"prefix of {run_id!r}")
        return self._prefix

    def stored_tokens(self, stored_context: str) -> int | None:
        self.asked.append("stored " + stored_context)
        return self._stored


def flow_of(body: dict[str, Any], run_id: str | None = "t-run", **info: Any) -> Flow:
    flow = tflow(body, run_id=run_id)
    assert flow.info is not None
    for key, value in info.items():
        setattr(flow.info, key, value)
    return flow


MESSAGES = [
    {"role": "user", "content": "one two three"},
    {"role": "assistant", "content": "four five"},
    {"role": "user", "content": "six seven eight nine"},
]


def test_without_a_prefix_the_bound_counts_system_instructions_and_messages() -> None:
    body = {"model": "m", "system": "s1 s2", "instructions": "i1 i2 i3", "messages": MESSAGES}
    memory = Memory(bound=100)
    r = measure(flow_of(body, history=[]), memory)
    # 2 + 3 + (3 + 2 + 4); the estimate is a quarter of the bound, above the lower bound
    assert (r.lower, r.upper, r.estimate) == (14, 100, 25)
    assert memory.asked == ["bound"]  # no history: no prefix asked for


def test_the_upper_bound_is_never_below_the_lower_one_nor_the_estimate_outside_them() -> None:
    body = {"model": "m", "messages": MESSAGES}
    r = measure(flow_of(body, history=[]), Memory(bound=5))
    assert (r.lower, r.upper, r.estimate) == (9, 9, 9)
    r = measure(flow_of(body, history=[]), Memory(bound=39))
    assert (r.lower, r.upper, r.estimate) == (9, 39, 9)  # 39 // 4 = 9: the lower bound
    r = measure(flow_of(body, history=[]), Memory(bound=43))
    assert (r.lower, r.upper, r.estimate) == (9, 43, 10)


def test_a_string_input_is_text() -> None:
    flow = tflow({"model": "gpt-4o-mini", "input": "a b c d e"}, path=["v1", "responses"])
    assert flow.adapter is not None and flow.adapter.name == "responses"
    r = measure(flow, Memory(bound=80))
    assert (r.lower, r.upper, r.estimate) == (5, 80, 20)


def test_the_responses_input_is_its_messages() -> None:
    body = {"model": "gpt-4o-mini", "input": MESSAGES, "messages": [{"content": "x " * 50}]}
    r = measure(tflow(body, path=["v1", "responses"]), Memory(bound=80))
    assert r.lower == 9


def test_a_generated_run_is_bounded_by_its_own_body_and_has_no_prefix() -> None:
    body = {"model": "m", "messages": MESSAGES}
    memory = Memory(bound=1000, prefix=(50, 1))
    flow = flow_of(body, run_id=None, history=MESSAGES, input_token_bound=77)
    assert flow.run is not None and flow.run.generated
    r = measure(flow, memory)
    assert (r.lower, r.upper) == (9, 77)
    assert memory.asked == []


def test_stored_context_adds_its_tokens_when_known() -> None:
    body = {"model": "m", "messages": MESSAGES}
    memory = Memory(bound=100, stored=30)
    r = measure(flow_of(body, history=[], stored_context="response:abc"), memory)
    assert r.upper == 130 and memory.asked == ["bound", "stored response:abc"]
    r = measure(flow_of(body, history=[], stored_context="response:abc"), Memory(bound=100, stored=None))
    assert r.upper == 100  # unknown: not in the bound
    r = measure(flow_of(body, history=[]), Memory(bound=100, stored=30))
    assert r.upper == 100


def test_the_previous_calls_prefix_counts_at_its_exact_tokens() -> None:
    body = {"model": "m", "messages": MESSAGES}
    memory = Memory(bound=200, prefix=(40, 1))
    r = measure(flow_of(body, history=MESSAGES), memory)
    # 40 exact, then the words of the two new messages (2 + 4)
    assert (r.lower, r.upper) == (46, 200)
    assert r.estimate == 40 + (200 - 40) // 4
    assert memory.asked == ["bound", "prefix"]
    r = measure(flow_of(body, history=MESSAGES), Memory(bound=60, prefix=(40, 2)))
    assert (r.lower, r.upper, r.estimate) == (44, 60, 45)


def test_a_prefix_of_everything_counts_its_tokens_alone() -> None:
    body = {"model": "m", "messages": MESSAGES}
    r = measure(flow_of(body, history=MESSAGES), Memory(bound=50, prefix=(30, 3)))
    assert (r.lower, r.upper, r.estimate) == (30, 50, 35)


def test_a_prefix_holding_reasoning_proves_nothing() -> None:
    thinking = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "x"}, {"type": "text", "text": "t u"}],
    }
    history = [MESSAGES[0], thinking, MESSAGES[2]]
    body = {"model": "m", "messages": history}
    # the reasoning in the prefix: the prefix is not used, the whole body is counted
    r = measure(flow_of(body, history=history), Memory(bound=200, prefix=(40, 2)))
    assert r.lower == 3 + 2 + 4 and r.estimate == 50
    # the reasoning after it: the prefix holds
    r = measure(flow_of(body, history=history), Memory(bound=200, prefix=(40, 1)))
    assert r.lower == 40 + 2 + 4


def test_reasoning_elsewhere_in_the_body_does_not_void_the_prefix() -> None:
    # the serialised messages name a reasoning type, but not in the prefix the memory vouches for
    history = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "reasoning"}, "b c"]}]
    body = {"model": "m", "messages": history}
    r = measure(flow_of(body, history=history), Memory(bound=200, prefix=(40, 1)))
    assert r.lower == 40 + 2  # not 1 + 2: the prefix holds
    # and a prefix with reasoning but messages that do not spell its marker (not the history sent)
    r = measure(
        flow_of({"model": "m", "messages": MESSAGES}, history=[{"type": "reasoning"}, *MESSAGES[1:]]),
        Memory(bound=200, prefix=(40, 1)),
    )
    assert r.lower == 46


def test_the_tool_output_share_is_of_the_messages_bytes() -> None:
    body = {"model": "m", "messages": [{"role": "tool", "tool_call_id": "c", "content": "x" * 14}]}
    flow = flow_of(body, history=[], tool_results=[ToolResult("c1", "x" * 5)])  # "xxxxx": 7 bytes
    assert measure(flow, Memory(bound=10)).tool_output_share == pytest.approx(
        7 / 63
    )  # of 63 bytes of messages
    two = [ToolResult("c1", "x" * 5), ToolResult("c2", ["y"])]  # 7 + 5 bytes
    assert measure(flow_of(body, tool_results=two), Memory()).tool_output_share == pytest.approx(12 / 63)
    big = [ToolResult("c1", "x" * 100)]
    assert measure(flow_of(body, tool_results=big), Memory()).tool_output_share == 1.0
    empty = flow_of({"model": "m", "messages": []}, tool_results=[ToolResult("c1", "x")])
    r = measure(empty, Memory(bound=3))
    assert (r.tool_output_share, r.lower, r.upper, r.estimate) == (0.0, 0, 3, 0)
    assert measure(flow_of(body, tool_results=[]), Memory()).tool_output_share == 0.0


# -- the request hook ---------------------------------------------------------------------------


def step(caps: CapsConfig | None = None, settings: ContextSettings | None = None) -> ContextStep:
    client = OutboundClient(keepalive_timeout_s=1, connect_timeout_s=1)  # never started: no call made
    return ContextStep(
        settings or ContextSettings(), caps or CapsConfig(), Memory(bound=1000), Metrics(), InnerCalls(client)
    )


WORDS = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "w " * 20}]}


async def test_calls_the_step_does_not_read_are_left_alone() -> None:
    s = step()
    embeddings = tflow({"model": "text-embedding-3-small", "input": "a " * 50}, path=["v1", "embeddings"],
                       headers={"X-Run-Max-Context-Tokens": "1"})  # fmt: skip
    await s.request(embeddings)
    assert embeddings.context is None
    get = tflow(method="GET", headers={"X-Run-Max-Context-Tokens": "1"})
    await s.request(get)
    assert get.context is None
    for missing in ("info", "body_json", "run"):
        flow = tflow(WORDS, headers={"X-Run-Max-Context-Tokens": "1"})
        setattr(flow, missing, None)
        await s.request(flow)
        assert flow.context is None, missing


async def test_the_cap_refuses_only_a_lower_bound_above_it() -> None:
    s = step()
    at = tflow(WORDS, headers={"X-Run-Max-Context-Tokens": "20"})
    await s.request(at)
    assert at.context is not None and (at.context.lower, at.context.cap, at.context.policies) == (20, 20, ())
    over = tflow(WORDS, headers={"X-Run-Max-Context-Tokens": "19"})
    with pytest.raises(BudgetExceeded) as e:
        await s.request(over)
    assert e.value.code == "max_context_tokens"
    assert "run t-run reads at least 20 input tokens, more than its cap of 19" in e.value.message
    assert "send X-Run-Context-Policy: offload" in e.value.message
    assert over.context is not None and over.context.lower == 20  # measured before the refusal
    uncapped = tflow(WORDS)
    await s.request(uncapped)
    assert uncapped.context is not None and uncapped.context.cap is None and uncapped.context.lower == 20


async def test_a_body_nested_too_deep_is_a_400_naming_the_body() -> None:
    deep: Any = "x"
    for _ in range(2000):
        deep = {"content": [deep]}
    flow = tflow(dict(WORDS))
    assert flow.body_json is not None
    flow.body_json["system"] = deep  # (not in the messages: orjson refuses those at 255 levels)
    with pytest.raises(InvalidRequest) as e:
        await step().request(flow)
    assert e.value.param == "body" and e.value.message == (
        "request body: nested deeper than runcap reads (messages and content blocks nest a few levels; "
        "this body nests hundreds)"
    )


def test_measure_needs_a_parsed_call_of_a_run() -> None:
    for missing in ("info", "body_json", "adapter", "run"):
        flow = tflow(dict(WORDS))
        setattr(flow, missing, None)
        with pytest.raises(AssertionError):
            measure(flow, Memory())


async def test_the_policies_get_the_run_its_summaries_and_a_caller_of_this_flow(monkeypatch) -> None:
    s = step()
    asked: list[Any] = []

    class Inner:
        def caller(self, flow: Flow) -> object:
            asked.append(flow)
            return "the caller"

    s.inner = Inner()  # type: ignore[assignment]
    seen: dict[str, Any] = {}
    new_body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "short"}]}

    class Rewritten:
        body = new_body
        info = RequestInfo(history=[])
        rewrite = "the rewrite"

    async def apply(*args: Any, **kwargs: Any) -> Rewritten:
        seen["args"], seen["kwargs"] = args, kwargs
        return Rewritten()

    monkeypatch.setattr("proxy.server.steps.context.apply_policies", apply)
    flow = tflow(dict(WORDS), headers={"X-Run-Context-Policy": "offload"})
    sent_body, sent_info, sent_bytes = flow.body_json, flow.info, flow.body
    await s.request(flow)
    assert asked == [flow]
    assert seen["kwargs"] == {"run_id": "t-run", "summaries": s.summaries, "call": "the caller"}
    assert seen["kwargs"]["summaries"] is s.summaries
    assert seen["args"][1:] == (sent_body, sent_info, sent_bytes, ("offload",), s.settings)
    assert seen["args"][0] is flow.adapter
    assert flow.body_json is new_body and flow.info is Rewritten.info and flow.rewrite == "the rewrite"
    assert flow.body_changed
    assert flow.context is not None and flow.context.lower == 1  # the rewritten body, measured


async def test_the_policy_header_is_checked_and_applied_to_the_agents_call_only() -> None:
    s = step()
    bad = tflow(WORDS, headers={"X-Run-Context-Policy": "shrink"})
    with pytest.raises(InvalidRequest) as e:
        await s.request(bad)
    assert e.value.param == "X-Run-Context-Policy"
    # runcap's own call: the agent's header is not read again
    own = tflow(WORDS, headers={"X-Run-Context-Policy": "shrink"}, inner=True)
    await s.request(own)
    assert own.context is not None and own.context.policies == ()
    ok = tflow(WORDS, headers={"X-Run-Context-Policy": "offload"})
    await s.request(ok)
    assert ok.context is not None and ok.context.policies == ("offload",)
    assert not ok.body_changed  # nothing old and large to offload


async def test_offload_rewrites_old_large_tool_results_and_the_reading_is_of_the_rewrite() -> None:
    big = "result " * 1000
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(4):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": big},
        ]
    body = {
        "model": "gpt-4o-mini",
        "messages": messages,
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    s = step()
    plain = tflow(body)
    await s.request(plain)
    flow = tflow(body, headers={"X-Run-Context-Policy": "offload"})
    await s.request(flow)
    assert flow.body_changed and flow.rewrite is not None and flow.rewrite.policy == "offload"
    assert flow.body_json is not body and flow.info is not None
    assert flow.context is not None and plain.context is not None
    assert flow.context.lower < plain.context.lower  # measured after the policy


async def test_summarize_needs_a_summary_model() -> None:
    with pytest.raises(InvalidRequest) as e:
        await step().request(tflow(WORDS, headers={"X-Run-Context-Policy": "summarize"}))
    assert e.value.param == "X-Run-Context-Policy" and "summary_model" in e.value.message
    flow = tflow(WORDS, headers={"X-Run-Context-Policy": "summarize"})
    await step(settings=ContextSettings(summary_model="gpt-4o-mini")).request(flow)
    assert flow.context is not None and flow.context.policies == ("summarize",)


async def test_a_task_policy_applies_without_the_header_and_the_header_wins() -> None:
    caps = CapsConfig(tasks={"triage": TaskCaps(context_policy=("offload",))})
    s = step(caps)
    flow = tflow(WORDS, headers={"X-Run-Task": "triage"})
    await s.request(flow)
    assert flow.context is not None and flow.context.policies == ("offload",)
    other = tflow(WORDS, headers={"X-Run-Task": "other"})
    await s.request(other)
    assert other.context is not None and other.context.policies == ()
    header = tflow(WORDS, headers={"X-Run-Task": "triage", "X-Run-Context-Policy": "offload, offload"})
    await s.request(header)
    assert header.context is not None and header.context.policies == ("offload",)
    assert s.policies({}, "") == ()


def test_parse_policies() -> None:
    assert parse_policies(" offload ,summarize") == ("offload", "summarize")
    for raw in ("", " , "):
        with pytest.raises(InvalidRequest, match="empty"):
            parse_policies(raw)
