"""Properties of the context policies over generated conversations in the three wire formats:
offload is deterministic, never mutates the agent's body, never touches the last N steps nor
anything but old large tool results, keeps every result's full bytes behind its handle, and
leaves a body without old large results alone; `runcap_fetch` returns exactly the bytes asked
for, on character boundaries; the summarised span never separates a call from its result.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.context import HANDLE_PREFIX, ContextSettings
from proxy.context.conversation import pairing, turn_starts
from proxy.context.fetch import read_handle
from proxy.context.offload import offload
from proxy.context.summarize import plan_span
from proxy.providers.anthropic_messages import MessagesAdapter
from proxy.providers.openai_chat import ChatCompletionsAdapter
from proxy.providers.openai_responses import ResponsesAdapter

ENDPOINTS = ("chat.completions", "responses", "messages")
ADAPTERS = {
    "chat.completions": ChatCompletionsAdapter(),
    "responses": ResponsesAdapter(),
    "messages": MessagesAdapter(),
}
_HANDLE = re.compile(r"runcap:sha256/([0-9a-f]{64})")

# Results: short or long, ASCII or not (multi-byte characters at the cut points).
texts = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda a, n, b: a * n + b,
        st.sampled_from(["x", "é", "日本", "🙂", "ab\n"]),
        st.integers(0, 3000),
        st.text(max_size=5),
    ),
)
turn = st.tuples(st.integers(0, 2), st.lists(texts, min_size=2, max_size=2), st.booleans())
conversations = st.lists(turn, max_size=7)
context_settings = st.builds(
    ContextSettings,
    keep_last_steps=st.integers(0, 3),
    offload_min_bytes=st.integers(1, 3000),
    head_bytes=st.integers(0, 600),
    tail_bytes=st.integers(0, 300),
)


def build(endpoint: str, turns: list[tuple[int, list[str], bool]], system: bool = False) -> dict[str, Any]:
    """A request body: a user message, then per turn an assistant turn with `n` tool calls (their
    results after it) or, with n = 0, text — and a user message when the flag is set."""
    items: list[Any] = []
    if system and endpoint != "messages":
        items.append({"role": "system", "content": "be brief"})
    items.append({"role": "user", "content": "start"})
    k = 0
    for n, results, user_after in turns:
        ids = [f"call_{k + j}" for j in range(n)]
        k += n
        if endpoint == "chat.completions":
            if n:
                items.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": i, "type": "function", "function": {"name": "t", "arguments": "{}"}}
                            for i in ids
                        ],
                    }
                )
                items.extend(
                    {"role": "tool", "tool_call_id": i, "content": results[j]} for j, i in enumerate(ids)
                )
            else:
                items.append({"role": "assistant", "content": results[0]})
        elif endpoint == "responses":
            if n:
                items.append({"type": "reasoning", "id": f"rs_{k}", "summary": []})
                items.extend(
                    {"type": "function_call", "call_id": i, "name": "t", "arguments": "{}"} for i in ids
                )
                items.extend(
                    {"type": "function_call_output", "call_id": i, "output": results[j]}
                    for j, i in enumerate(ids)
                )
            else:
                items.append({"role": "assistant", "content": results[0]})
        else:
            if n:
                items.append(
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": i, "name": "t", "input": {}} for i in ids],
                    }
                )
                items.append(
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": i, "content": results[j]}
                            for j, i in enumerate(ids)
                        ],
                    }
                )
            else:
                items.append({"role": "assistant", "content": [{"type": "text", "text": results[0]}]})
        if user_after or not n:
            items.append({"role": "user", "content": "go on"})
    if endpoint == "responses":
        return {"model": "gpt-4o-mini", "input": items, "tools": [{"type": "function", "name": "t"}]}
    if endpoint == "messages":
        return {
            "model": "claude-sonnet-4-5",
            "max_tokens": 64,
            "messages": items,
            "tools": [{"name": "t", "input_schema": {}}],
        }
    return {
        "model": "gpt-4o-mini",
        "messages": items,
        "tools": [{"type": "function", "function": {"name": "t"}}],
    }


def results_of(endpoint: str, item: Any) -> list[str]:
    if endpoint == "chat.completions":
        return [item["content"]] if item.get("role") == "tool" else []
    if endpoint == "responses":
        return [item["output"]] if item.get("type") == "function_call_output" else []
    if item.get("role") == "user" and isinstance(item.get("content"), list):
        return [b["content"] for b in item["content"] if b.get("type") == "tool_result"]
    return []


def items_of(endpoint: str, body: dict[str, Any]) -> list[Any]:
    return body["input"] if endpoint == "responses" else body["messages"]


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(endpoint=st.sampled_from(ENDPOINTS), turns=conversations, cfg=context_settings)
def test_offload_is_deterministic_and_touches_only_old_large_results(
    endpoint: str, turns: list[Any], cfg: ContextSettings
) -> None:
    body = build(endpoint, turns)
    before = orjson.dumps(body)
    done = offload(body, endpoint, cfg)
    assert orjson.dumps(body) == before  # the agent's body is never mutated
    again = offload(copy.deepcopy(body), endpoint, cfg)
    assert (done is None) == (again is None)

    items = items_of(endpoint, body)
    starts = turn_starts(items, endpoint)
    cutoff = (
        len(items)
        if cfg.keep_last_steps == 0
        else (starts[-cfg.keep_last_steps] if len(starts) >= cfg.keep_last_steps else 0)
    )
    old_large = [
        t
        for item in items[:cutoff]
        for t in results_of(endpoint, item)
        if len(t.encode("utf-8")) > cfg.offload_min_bytes
    ]
    if done is None:
        # Nothing old and large — or nothing its stub would shorten.
        assert all(len(t) <= 200 + cfg.head_bytes + cfg.tail_bytes for t in old_large)
        return
    assert again is not None and orjson.dumps(done.body) == orjson.dumps(again.body)  # deterministic
    assert done.handles == again.handles
    new_items = items_of(endpoint, done.body)
    assert len(new_items) == len(items)
    assert new_items[cutoff:] == items[cutoff:]  # the last N steps are untouched
    assert done.body["tools"][:-1] == body["tools"] and done.body["tools"][-1] is not None
    for old, new in zip(items, new_items, strict=True):
        old_results, new_results = results_of(endpoint, old), results_of(endpoint, new)
        if not old_results:
            assert new == old  # only tool results change
            continue
        for was, now in zip(old_results, new_results, strict=True):
            if now == was:
                continue
            data = was.encode("utf-8")
            assert len(data) > cfg.offload_min_bytes and len(now) < len(was)
            (digest,) = _HANDLE.findall(now)
            assert done.handles[digest] == data and hashlib.sha256(data).hexdigest() == digest
            head, _, tail = now.partition(f"\n[runcap: {len(data)} bytes offloaded")
            assert was.startswith(head) and len(head.encode()) <= cfg.head_bytes
            tail = tail.split("for more]\n", 1)[1]
            assert was.endswith(tail) and len(tail.encode()) <= cfg.tail_bytes
    # The request still reads as a valid request of its format.
    ADAPTERS[endpoint].parse_request(done.body)


@PROPERTY
@given(
    data=st.binary(max_size=2000).map(lambda b: b.decode("utf-8", "ignore") + "🙂é"),
    offset=st.integers(0, 2100),
    length=st.integers(1, 20_000),
)
def test_fetch_returns_exactly_the_bytes_asked_for_on_character_boundaries(
    data: str, offset: int, length: int
) -> None:
    raw = data.encode("utf-8")
    digest = hashlib.sha256(raw).hexdigest()
    handle = HANDLE_PREFIX + digest
    args = orjson.dumps({"handle": handle, "offset": offset, "length": length}).decode()
    text = read_handle(args, {digest: raw})
    if offset >= len(raw):
        assert "past the end" in text
        return
    header, _, body = text.partition("\n")
    start, end = (int(x) for x in re.search(r"bytes (\d+)-(\d+) of", header).groups())  # type: ignore[union-attr]
    assert offset <= start <= offset + 3 and end <= min(len(raw), offset + min(length, 16_384))
    assert end >= min(len(raw), offset + min(length, 16_384)) - 3
    assert body.encode("utf-8") == raw[start:end]


@PROPERTY
@given(
    endpoint=st.sampled_from(ENDPOINTS),
    turns=conversations,
    system=st.booleans(),
    keep_first=st.integers(0, 4),
    keep_last=st.integers(0, 6),
)
def test_the_summarised_span_never_splits_a_call_from_its_result(
    endpoint: str, turns: list[Any], system: bool, keep_first: int, keep_last: int
) -> None:
    body = build(endpoint, turns, system)
    items = items_of(endpoint, body)
    plan = plan_span(items, endpoint, keep_first, keep_last)
    if plan is None:
        return
    start, end = plan
    lead = 1 if system and endpoint != "messages" else 0
    assert lead + keep_first <= start and end <= len(items) - keep_last and end - start >= 2
    pairs = pairing(items, endpoint)
    for call_id, opened in pairs.calls.items():
        answered = pairs.results[call_id]
        assert (start <= opened < end) == (start <= answered < end)
    if endpoint == "responses":
        # A reasoning item stays with the call after it.
        assert not (start > 0 and items[start - 1].get("type") == "reasoning")
        assert not (items[end - 1].get("type") == "reasoning")
