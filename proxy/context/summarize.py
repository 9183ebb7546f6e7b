"""Summarize: past a threshold, the middle of the conversation is replaced by a summary.

When a request's input-token bound passes `summarize_above_tokens`, the items between the first
`summary_keep_first` and the last `summary_keep_last` (leading system / developer messages are
always kept and not counted) are replaced by one user message holding a summary written by
`summary_model`. The span is widened to the nearest cuts that separate no tool call from its
result (and, Responses, no reasoning item from the call after it), so pairs are never split.

The summary call is one of runcap's own model calls (a `ModelCaller`; proxy/server/inner.py makes
it): a step of the run, reserved against its caps — a cap too small for it refuses the agent's
request with the usual 402 — and traced.

Made once per span: summaries are cached per run by the hash of the items they replace (each
item's canonical JSON hashed, the span hashed over those). An agent resends its whole history,
so the next step finds the span it summarised before as a prefix of its middle and reuses that
summary; only when the context passes the threshold again is a new summary made — of the previous
summary plus the items after it, cached under the hash of the whole span it then replaces.

Where the cache lives: in this process (`SummaryCache`, a bounded LRU the context step owns). A
run whose requests go to another replica, or that outlives a restart, has its next summary made
again there — one more summary call, charged and traced like the first, so it shows in the run's
spans and costs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.context import ContextSettings, ModelCaller
from proxy.context.conversation import items_key, items_of, pairing, preamble_length
from proxy.providers.base import Adapter

log = logging.getLogger("runcap.context")

SUMMARY_INSTRUCTION = (
    "You compress the middle of an AI agent's conversation so that the agent can continue its "
    "task without it. Summarize the messages below (JSON, one per line: user requests, the "
    "assistant's reasoning and tool calls, and tool results). Keep every fact, identifier, number, "
    "file name, decision and open question the agent may still need; drop repetition and "
    "boilerplate. Answer with the summary only."
)
SUMMARY_PREFIX = "[runcap: summary of {n} earlier conversation items, replaced to save context]\n"
_CACHE_ENTRIES = 10_000


class SummaryCache:
    """(run id, span hash) → summary text; least recently used first out."""

    def __init__(self, max_entries: int = _CACHE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], str] = OrderedDict()
        # Summaries being made now: a concurrent request of the same run and span waits for it.
        self._making: dict[tuple[str, str], asyncio.Event] = {}

    def making(self, run_id: str, span: str) -> asyncio.Event | None:
        return self._making.get((run_id, span))

    def begin(self, run_id: str, span: str) -> None:
        self._making[(run_id, span)] = asyncio.Event()

    def end(self, run_id: str, span: str) -> None:
        event = self._making.pop((run_id, span), None)
        if event is not None:
            event.set()

    def get(self, run_id: str, span: str) -> str | None:
        text = self._entries.get((run_id, span))
        if text is not None:
            self._entries.move_to_end((run_id, span))
        return text

    def put(self, run_id: str, span: str, text: str) -> None:
        self._entries[(run_id, span)] = text
        self._entries.move_to_end((run_id, span))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


def item_digest(item: Any) -> bytes:
    return hashlib.sha256(orjson.dumps(item, option=orjson.OPT_SORT_KEYS)).digest()


def span_hash(digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


def plan_span(items: list[Any], endpoint: str, keep_first: int, keep_last: int) -> tuple[int, int] | None:
    """The items [start, end) a summary may replace: after the preamble and the first
    `keep_first` items, before the last `keep_last`, widened inwards to cuts that split no tool
    call from its result. None when fewer than two items would be replaced."""
    n = len(items)
    lead = preamble_length(items, endpoint)
    ok = pairing(items, endpoint).cuttable(items, endpoint)
    start = lead + max(0, keep_first)
    while start <= n and not ok[start]:
        start += 1
    end = n - max(0, keep_last)
    while end > start and not ok[end]:
        end -= 1
    if end - start < 2:
        return None
    return start, end


@dataclass(slots=True)
class Summarized:
    body: dict[str, Any]
    replaced: int  # items replaced
    calls: int  # summary calls made for it (0: from the cache)


def summary_request(endpoint: str, settings: ContextSettings, transcript: str) -> dict[str, Any]:
    if endpoint == "chat.completions":
        return {
            "model": settings.summary_model,
            "messages": [
                {"role": "system", "content": SUMMARY_INSTRUCTION},
                {"role": "user", "content": transcript},
            ],
            "max_tokens": settings.summary_max_tokens,
        }
    if endpoint == "responses":
        return {
            "model": settings.summary_model,
            "instructions": SUMMARY_INSTRUCTION,
            "input": [{"role": "user", "content": transcript}],
            "max_output_tokens": settings.summary_max_tokens,
            "store": False,
        }
    return {
        "model": settings.summary_model,
        "system": SUMMARY_INSTRUCTION,
        "messages": [{"role": "user", "content": transcript}],
        "max_tokens": settings.summary_max_tokens,
    }


def summary_text(endpoint: str, response: dict[str, Any]) -> str:
    if endpoint == "chat.completions":
        choices = response.get("choices") or [{}]
        content = (choices[0].get("message") or {}).get("content")
        return content if isinstance(content, str) else ""
    if endpoint == "responses":
        return "".join(
            part.get("text", "")
            for item in response.get("output") or ()
            if isinstance(item, dict) and item.get("type") == "message"
            for part in item.get("content") or ()
            if isinstance(part, dict) and part.get("type") == "output_text"
        )
    return "".join(
        block.get("text", "")
        for block in response.get("content") or ()
        if isinstance(block, dict) and block.get("type") == "text"
    )


def summary_item(endpoint: str, text: str, replaced: int) -> dict[str, Any]:
    content = SUMMARY_PREFIX.format(n=replaced) + text
    if endpoint == "messages":
        return {"role": "user", "content": [{"type": "text", "text": content}]}
    return {"role": "user", "content": content}


def _transcript(items: list[Any], earlier: str | None) -> str:
    lines = []
    if earlier is not None:
        lines.append(orjson.dumps({"summary_of_earlier_items": earlier}).decode())
    lines.extend(orjson.dumps(item).decode() for item in items)
    return "\n".join(lines)


def _replace(body: dict[str, Any], endpoint: str, start: int, end: int, text: str) -> dict[str, Any]:
    key = items_key(endpoint)
    items = body[key]
    out = dict(body)
    out[key] = [*items[:start], summary_item(endpoint, text, end - start), *items[end:]]
    return out


async def summarize(
    adapter: Adapter,
    run_id: str,
    body: dict[str, Any],
    bound: int,
    settings: ContextSettings,
    cache: SummaryCache,
    call: ModelCaller,
) -> Summarized | None:
    """Summarise the middle of `body` (a request of run `run_id` to `adapter`'s endpoint, whose
    input-token bound is `bound`) when it passes the threshold; None when it does not, or there is
    no middle to replace. Raises the summary call's `Rejection` when the run cannot afford it."""
    if bound <= settings.summarize_above_tokens:
        return None
    endpoint = adapter.name
    items = items_of(body, endpoint)
    if not items:
        return None
    plan = plan_span(items, endpoint, settings.summary_keep_first, settings.summary_keep_last)
    if plan is None:
        return None
    start, end = plan
    digests = [item_digest(item) for item in items[start:end]]
    whole = span_hash(digests)
    cached = cache.get(run_id, whole)
    if cached is None and (making := cache.making(run_id, whole)) is not None:
        await making.wait()  # a concurrent request of the run is summarising the same span
        cached = cache.get(run_id, whole)
    if cached is not None:
        return Summarized(_replace(body, endpoint, start, end, cached), end - start, 0)
    # The longest span summarised before that this middle starts with.
    ok = pairing(items, endpoint).cuttable(items, endpoint)
    earlier: tuple[int, str] | None = None
    for stop in range(end - 1, start + 1, -1):
        if ok[stop] and (text := cache.get(run_id, span_hash(digests[: stop - start]))) is not None:
            earlier = (stop, text)
            break
    if earlier is not None:
        stop, text = earlier
        reused = _replace(body, endpoint, start, stop, text)
        if adapter.parse_request(reused).input_token_bound <= settings.summarize_above_tokens:
            return Summarized(reused, stop - start, 0)
        transcript = _transcript(items[stop:end], text)
    else:
        transcript = _transcript(items[start:end], None)
    cache.begin(run_id, whole)
    try:
        answer = await call(summary_request(endpoint, settings, transcript))
        text = summary_text(endpoint, answer.parsed) if answer.parsed is not None else ""
        if text:
            cache.put(run_id, whole, text)
    finally:
        cache.end(run_id, whole)
    if not text:
        # The summary call failed upstream (its span says why): the request goes on unsummarised.
        log.warning(
            "run %s: the summary call to %s failed (%s); forwarding without a summary",
            run_id, settings.summary_model, answer.error or "no text",
        )  # fmt: skip
        if earlier is not None:
            stop, text = earlier
            return Summarized(_replace(body, endpoint, start, stop, text), stop - start, 1)
        return None
    return Summarized(_replace(body, endpoint, start, end, text), end - start, 1)
