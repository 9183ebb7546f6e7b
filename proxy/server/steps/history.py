"""Tighter input bounds for conversations that resend their history every call.

The tokenizer-free bound counts one token per byte of text, about four times what English really
costs; over a long run that alone would make a dollar cap refuse calls with a quarter of the
budget unspent. But each call of an agent loop resends the previous call's request plus a few
new messages, and the previous call's usage says exactly how many tokens that request was. So,
per run, this remembers the last settled call's context digest, the digests of its history items,
its input tokens and its answer; the next request whose context is the same and whose history
starts with the same items is bounded by

    previous input tokens (exact)
    + the previous answer, when the agent sent it back unchanged: its output tokens + a margin
      for the role/format tokens around it (the same text reads back as at most the tokens it was
      generated as; the margin covers how the provider renders tool calls)
    + every other new item at its byte bound.

Anything that does not match — another context, an edited history, an unknown run, a process that
did not see the previous call (another replica, a restart) — falls back to the byte bound, so the
bound is never looser than before, only tighter when the run's own usage proves it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.providers.base import Adapter, RequestInfo, ResponseInfo, Usage

# Role markers and separators around an answer sent back, plus per tool call the rendering of
# its name and id (tokens that were not part of the generated output).
ANSWER_MARGIN = 16
TOOL_CALL_MARGIN = 24


def _digest(item: Any) -> bytes:
    try:
        return hashlib.blake2b(orjson.dumps(item), digest_size=16).digest()
    except TypeError:
        return b""


@dataclass(slots=True)
class _Call:
    context: bytes
    items: list[bytes]  # digests of the history items the call sent
    input_tokens: int
    answer: bytes | None
    answer_tokens: int  # output tokens + margins


class ConversationMemory:
    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self._runs: OrderedDict[str, _Call] = OrderedDict()
        # Answers this process saw (OpenAI responses, Anthropic messages): id → the tokens a call
        # continuing it re-reads (its input and output, with the margins of an answer read
        # back), for `previous_response_id` and a continued Anthropic thread.
        self._responses: OrderedDict[str, int] = OrderedDict()
        # Output items of those answers (OpenAI responses) by id → the tokens one of them reads
        # back as at most (its answer's output), for `item_reference` input items.
        self._items: OrderedDict[str, int] = OrderedDict()
        # The last `_extended` answer: (request, the call it was checked against, the answer).
        self._last_match: tuple[RequestInfo, _Call, _Call | None] | None = None

    def stored_tokens(self, stored_context: str) -> int | None:
        """Tokens of provider-stored input a request extends, when this process knows them all."""
        total = 0
        for part in stored_context.split():
            kind, _, answer_id = part.partition(":")
            if kind in ("response", "message"):
                tokens = self._responses.get(answer_id)
            elif kind == "item":
                tokens = self._items.get(answer_id)
            else:
                tokens = None
            if tokens is None:
                return None
            total += tokens
        return total

    def _extended(self, run_id: str, info: RequestInfo) -> _Call | None:
        """The run's last call when this request's history starts with every item that call sent
        (same context); else None. The context step and the budget step both ask for each
        request: the items are digested once (the answer is kept for the same request and call)."""
        last = self._runs.get(run_id)
        if last is None or not info.context or last.context != info.context:
            return None
        if len(info.history) < len(last.items):
            return None
        seen = self._last_match
        if seen is not None and seen[0] is info and seen[1] is last:
            return seen[2]
        digests_match = all(_digest(item) == d for item, d in zip(info.history, last.items, strict=False))
        match = last if digests_match else None
        self._last_match = (info, last, match)
        return match

    def bound(self, run_id: str, adapter: Adapter, info: RequestInfo) -> int:
        last = self._extended(run_id, info)
        history = info.history
        if last is None or len(history) <= len(last.items):
            return info.input_token_bound
        prefix = len(last.items)
        bound = last.input_tokens
        for i, item in enumerate(history[prefix:]):
            item_bound, key = adapter.history_item(item)
            if i == 0 and key is not None and key == last.answer:
                item_bound = min(item_bound, last.answer_tokens)
            bound += item_bound
        return min(bound, info.input_token_bound)

    def known_prefix(self, run_id: str, info: RequestInfo) -> tuple[int, int] | None:
        """(the previous call's exact input tokens, how many history items it sent) when this
        request extends that call's history (same context, same first items); else None. The
        exact part of a lower bound: what the provider counted for that prefix last time
        (proxy/server/steps/context.py)."""
        last = self._extended(run_id, info)
        return None if last is None else (last.input_tokens, len(last.items))

    def remember(self, run_id: str, info: RequestInfo, usage: Usage, response: ResponseInfo) -> None:
        """A call settled with the provider's own usage: keep what the next call can build on."""
        if response.response_id and info.stored_context != "server-side":
            self._responses[response.response_id] = (
                usage.input_tokens
                + usage.output_tokens
                + ANSWER_MARGIN
                + TOOL_CALL_MARGIN * len(response.tool_calls)
            )
            self._responses.move_to_end(response.response_id)
            if len(self._responses) > self.limit:
                self._responses.popitem(last=False)
        answer = usage.output_tokens + ANSWER_MARGIN + TOOL_CALL_MARGIN * len(response.tool_calls)
        for item_id in response.output_item_ids:
            self._items[item_id] = answer
            self._items.move_to_end(item_id)
            if len(self._items) > self.limit:
                self._items.popitem(last=False)
        if not info.context or not info.history:
            return
        digests = [_digest(item) for item in info.history]
        if b"" in digests:
            return
        calls = len(response.tool_calls)
        self._runs[run_id] = _Call(
            info.context,
            digests,
            usage.input_tokens,
            response.turn,
            usage.output_tokens + ANSWER_MARGIN + TOOL_CALL_MARGIN * calls,
        )
        self._runs.move_to_end(run_id)
        if len(self._runs) > self.limit:
            self._runs.popitem(last=False)
