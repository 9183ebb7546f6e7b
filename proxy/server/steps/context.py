"""The context step: measure each model call's context, apply the run's context policy, and
enforce `X-Run-Max-Context-Tokens` — before the budget step reserves anything.

For every call to chat/completions, responses or messages — the agent's, and runcap's own
(`flow.inner`: a `runcap_fetch` continuation, a summary), which pass the same checks:

1. the policy — `X-Run-Context-Policy`, else the task's `context_policy` — is validated and
   applied to the agent's call (proxy/context/policy.py rewrites the body; without one the body is
   never touched; runcap's own calls are what a policy wrote);
2. the forwarded request is measured (`ContextReading`): a lower and an upper bound of its input
   tokens, an estimate, and the share of its messages that is tool output;
3. a step whose LOWER bound is above `X-Run-Max-Context-Tokens` is refused (402
   `max_context_tokens`), so no step that fits is ever refused;
4. the answer carries `X-Run-Context-Tokens` and `X-Run-Context-Growth`, and the reading goes on
   the span (proxy/server/steps/trace.py) and to /metrics;
5. when `offload` added `runcap_fetch` to the agent's call, its `answer` hook runs the fetch loop
   (proxy/context/fetch.py): runcap answers the model's fetches itself, continuing with the
   upstream through runcap's own calls (server/inner.py), and the agent gets only the final
   answer — as the stream it asked for, when it asked for one (proxy/context/stream.py).

The policies' own model calls (summaries, continuations) are made through `InnerCalls`, handed
to proxy/context/ as a `ModelCaller`; the summaries they write are kept here (`summaries`).

The lower bound (what the refusal relies on). No tokenizer is needed and none is guessed:

* the part of the history the run's previous call already sent (same model context, same first
  messages: `ConversationMemory.known_prefix`) counts at the input tokens the provider reported
  for that call — exact;
* every other text the model reads (message and tool-result text, the system prompt) counts one
  token per whitespace-separated word: a token never spans whitespace between two words in the
  tokenizers runcap meets (tiktoken's encodings split words before merging; SentencePiece and
  Llama-style BPE do too), so each word is at least one token;
* images, files, tool definitions, role markers and reasoning items count zero.

So the bound is below the real count; a step whose real count is above the cap but whose bound is
not (new text the words undercount: code, JSON, CJK) is forwarded, and the next step of the same
conversation — whose exact prefix is then above the cap — is refused.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson

from proxy.config import CapsConfig
from proxy.context import POLICIES, ContextReading, ContextSettings
from proxy.context.fetch import answer_fetches
from proxy.context.policy import apply_policies
from proxy.context.stream import sse_answer
from proxy.context.summarize import SummaryCache
from proxy.errors import BudgetExceeded, InvalidRequest
from proxy.server.flow import Flow, FlowStep
from proxy.server.inner import InnerCalls
from proxy.server.metrics import Metrics
from proxy.server.steps.history import ConversationMemory

log = logging.getLogger("runcap.context")

CONTEXT_ENDPOINTS = frozenset({"chat.completions", "responses", "messages"})
POLICY_HEADER = "X-Run-Context-Policy"
# Bytes per token for the estimate of text runcap has no exact count for (English prose is about
# four; the bound counts one token per byte).
ESTIMATE_BYTES_PER_TOKEN = 4
# Keys whose string values the model reads as text, and items it does not read as input.
_TEXT_KEYS = frozenset({"content", "text", "output", "system", "instructions"})
_UNREAD_TYPES = frozenset({"reasoning", "thinking", "redacted_thinking"})
_UNREAD_MARKERS = tuple(b'"type":"%s"' % t.encode() for t in _UNREAD_TYPES)
_MEMORY = 100_000  # runs whose first step this process remembers


def parse_policies(raw: str) -> tuple[str, ...]:
    """`X-Run-Context-Policy`: comma-separated policy names; a bad one is a 400 naming the header."""
    names = [part.strip() for part in raw.split(",")]
    if not any(names):
        raise InvalidRequest(
            f"{POLICY_HEADER}: empty; send one or more of {', '.join(POLICIES)} (comma-separated), "
            "or leave the header out",
            param=POLICY_HEADER,
        )
    for name in names:
        if name not in POLICIES:
            raise InvalidRequest(
                f"{POLICY_HEADER}: {name[:40]!r} is not a context policy (known: {', '.join(POLICIES)})",
                param=POLICY_HEADER,
            )
    return tuple(dict.fromkeys(names))


def text_words(value: Any, is_text: bool = False) -> int:
    """Whitespace-separated words in the text the model reads of `value` (a message, a list of
    them, a content block...): strings under `_TEXT_KEYS`; reasoning items are not read back."""
    if isinstance(value, str):
        return len(value.split()) if is_text else 0
    if isinstance(value, list):
        return sum(text_words(v, is_text) for v in value)
    if isinstance(value, dict):
        if value.get("type") in _UNREAD_TYPES:
            return 0
        return sum(text_words(v, k in _TEXT_KEYS) for k, v in value.items())
    return 0


def _has_unread(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_unread(v) for v in value)
    if isinstance(value, dict):
        return value.get("type") in _UNREAD_TYPES or any(_has_unread(v) for v in value.values())
    return False


def _json_len(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except TypeError:
        return 0


def measure(flow: Flow, memory: ConversationMemory) -> ContextReading:
    """The context of the request as it will be forwarded (after any policy)."""
    info, body, adapter, run = flow.info, flow.body_json, flow.adapter, flow.run
    assert info is not None and body is not None and adapter is not None and run is not None
    messages = body.get("input" if adapter.name == "responses" else "messages")

    upper = info.input_token_bound if run.generated else memory.bound(run.run_id, adapter, info)
    if info.stored_context:
        upper += memory.stored_tokens(info.stored_context) or 0  # unknown: not in the estimate

    raw = orjson.dumps(messages) if messages else b""
    known, new_items = 0, None
    prefix = None if run.generated or not info.history else memory.known_prefix(run.run_id, info)
    # Reasoning the provider counted last time may be dropped from context this time (Anthropic
    # drops earlier turns' thinking): such a prefix proves nothing. (The serialised messages rule
    # most requests out without walking them.)
    if prefix is not None and not (
        any(marker in raw for marker in _UNREAD_MARKERS) and _has_unread(info.history[: prefix[1]])
    ):
        known, new_items = prefix[0], info.history[prefix[1] :]
    if new_items is not None:
        lower = known + text_words(new_items)
    else:
        lower = (
            text_words(body.get("system"), True)
            + text_words(body.get("instructions"), True)
            + text_words(messages, isinstance(messages, str))
        )
    upper = max(upper, lower)
    estimate = min(upper, max(lower, known + (upper - known) // ESTIMATE_BYTES_PER_TOKEN))

    message_bytes = len(raw)
    tool_bytes = sum(_json_len(r.content) for r in info.tool_results)
    share = min(1.0, tool_bytes / message_bytes) if message_bytes else 0.0
    return ContextReading(lower=lower, upper=upper, estimate=estimate, tool_output_share=share)


class ContextStep(FlowStep):
    def __init__(
        self,
        settings: ContextSettings,
        caps: CapsConfig,
        memory: ConversationMemory,
        metrics: Metrics,
        inner: InnerCalls,
    ) -> None:
        self.settings = settings
        self.tasks = caps.tasks
        self.memory = memory  # the budget step's: the run's previous call and its exact usage
        self.metrics = metrics
        self.inner = inner  # the model calls a policy makes itself (summaries, continuations)
        self.summaries = SummaryCache()  # what the summarize policy wrote, per run and span
        # Per run, this process's record of its first step's input tokens — for runs the ledger
        # does not hold (a one-step run) — and whether its growth alert was counted.
        self._first: OrderedDict[str, int] = OrderedDict()
        self._alerted: OrderedDict[str, None] = OrderedDict()

    # -- request ------------------------------------------------------------------------------

    async def request(self, flow: Flow) -> None:
        if flow.adapter is None or flow.adapter.name not in CONTEXT_ENDPOINTS:
            return
        if flow.info is None or flow.body_json is None or flow.run is None:
            return
        # runcap's own calls (a `runcap_fetch` continuation, a summary) are measured and capped
        # like the agent's: they are steps of the run, and the provider bills their context.
        # Only the policy is the agent's call's alone (it wrote these calls already).
        policies = () if flow.inner else self.policies(flow.request.headers, flow.run.task)
        if policies:
            rewritten = await apply_policies(
                flow.adapter,
                flow.body_json,
                flow.info,
                flow.body,
                policies,
                self.settings,
                run_id=flow.run.run_id,
                summaries=self.summaries,
                call=self.inner.caller(flow),
            )
            if rewritten is not None:
                flow.body_json, flow.info, flow.rewrite = rewritten.body, rewritten.info, rewritten.rewrite
                flow.body_changed = True
        try:
            reading = measure(flow, self.memory)
        except RecursionError:
            raise InvalidRequest(
                "request body: nested deeper than runcap reads (messages and content blocks nest a "
                "few levels; this body nests hundreds)",
                param="body",
            ) from None
        reading.policies = policies
        reading.cap = flow.run.caps.max_context_tokens
        flow.context = reading
        if reading.cap is not None and reading.lower > reading.cap:
            raise BudgetExceeded("max_context_tokens", self._refusal(flow, reading))

    def policies(self, headers: Mapping[str, str], task: str) -> tuple[str, ...]:
        raw = headers.get(POLICY_HEADER)
        if raw is not None:
            policies = parse_policies(raw)
            if "summarize" in policies and not self.settings.summary_model:
                raise InvalidRequest(
                    f"{POLICY_HEADER}: summarize needs a model to write the summaries, and this "
                    "runcap has none ([context] summary_model); use offload, or ask the operator",
                    param=POLICY_HEADER,
                )
            return policies
        per_task = self.tasks.get(task) if task else None
        return per_task.context_policy if per_task is not None else ()

    @staticmethod
    def _refusal(flow: Flow, r: ContextReading) -> str:
        assert flow.run is not None
        after = f" after the {flow.rewrite.policy} policy" if flow.rewrite is not None else ""
        advice = (
            "shorten the conversation (drop or summarise old turns, trim tool results)"
            if r.policies
            else f"shorten the conversation, or send {POLICY_HEADER}: offload (or summarize) to let "
            "runcap do it"
        )
        return (
            f"X-Run-Max-Context-Tokens: this step of run {flow.run.run_id} reads at least {r.lower} "
            f"input tokens{after}, more than its cap of {r.cap}. It was not forwarded and cost "
            f"nothing; {advice}, then send it again."
        )

    # -- response -----------------------------------------------------------------------------

    async def response(self, flow: Flow) -> None:
        r = flow.context
        if r is None:
            return
        exact = self._exact(flow, r)
        tokens = r.tokens if exact else r.estimate
        r.growth = tokens / self._baseline(flow, tokens) if tokens else 1.0
        flow.reply_headers["X-Run-Context-Tokens"] = str(tokens)
        flow.reply_headers["X-Run-Context-Growth"] = f"{r.growth:.2f}"
        if not exact:
            # Not in DESIGN's list: the headers of a stream go out before its usage is known.
            flow.reply_headers["X-Run-Context-Tokens-Estimated"] = "true"

    async def answer(self, flow: Flow) -> None:
        """The `runcap_fetch` loop, when offload added the tool to the agent's call: the agent gets
        the final answer (`flow.answer`); a refused continuation raises its `Rejection`."""
        rewrite, adapter = flow.rewrite, flow.adapter
        if rewrite is None or not rewrite.fetch_tool or adapter is None or flow.body_json is None:
            return
        try:
            first = orjson.loads(flow.response_body or b"")
        except orjson.JSONDecodeError:
            return
        if not isinstance(first, dict):
            return
        answer = await answer_fetches(
            adapter, rewrite, flow.body_json, first, self.inner.caller(flow), flow.upstream.name
        )
        flow.reply_headers.update(answer.reply_headers)
        flow.status = answer.status
        out = (flow.response_body or b"") if answer.body is None else answer.body
        if answer.response is not None and rewrite.agent_stream:
            out = sse_answer(adapter.name, answer.response, include_usage=rewrite.agent_stream_usage)
            flow.reply_headers["Content-Type"] = "text/event-stream; charset=utf-8"
            flow.reply_headers["Cache-Control"] = "no-cache"
        flow.answer = out

    async def done(self, flow: Flow) -> None:
        r = flow.context
        if r is None or flow.run is None:
            return
        if not self._exact(flow, r):
            return
        run_id = flow.run.run_id
        r.growth = r.tokens / self._baseline(flow, r.tokens)
        if run_id not in self._first:
            self._first[run_id] = r.tokens
            if len(self._first) > _MEMORY:
                self._first.popitem(last=False)
        self.metrics.context_tokens.observe(r.tokens)
        if r.growth >= self.settings.growth_alert and run_id not in self._alerted:
            self._alerted[run_id] = None
            if len(self._alerted) > _MEMORY:
                self._alerted.popitem(last=False)
            self.metrics.context_growth_alerts.inc()

    @staticmethod
    def _exact(flow: Flow, r: ContextReading) -> bool:
        """The provider's count of this step's input, when it has said it (sets `r.tokens`)."""
        usage = flow.response_info.usage if flow.response_info is not None else None
        if usage is not None and usage.input_tokens and flow.upstream_status < 400:
            r.tokens = usage.input_tokens
        return r.tokens > 0

    def _baseline(self, flow: Flow, tokens: int) -> int:
        """The run's first answered step's input tokens: the ledger's (it survives restarts and is
        shared by replicas), else this process's, else this step is the first."""
        state = flow.state
        if state is not None and state.context_baseline:
            return state.context_baseline
        assert flow.run is not None
        return self._first.get(flow.run.run_id) or tokens or 1
