"""`X-Run-Max-Context-Tokens` against a tokenizer that is not runcap's (issue 28).

The scripted upstream's default count, ceil(bytes / 4), is also runcap's own estimate: with it
as the oracle, refusing on the estimate instead of the lower bound goes unnoticed. Here the
upstream counts each word on its own (`InputTokenizer.per_word`): one token a word with no role
markers (the lower bound is then exact, so a cap equal to it is the edge), ~1 token a word
(sparser than bytes / 4) and ~3.5 tokens a word (denser). Multi-step conversations sit at the
cap, where counting the run's known prefix twice or refusing on `>=` shows, and every step of
generated conversations keeps `lower bound ≤ the provider's count`.

The readings are taken from the flow as it is forwarded, by a step appended to runcap's own
steps (`Readings`); nothing of runcap is replaced.
"""

from __future__ import annotations

import random
from typing import Any

import anthropic
import openai
import pytest

from proxy.context import ContextReading
from proxy.scripted_upstream import InputTokenizer, anthropic_input_tokens, chat_input_tokens
from proxy.server.flow import Flow

# Exactly one token a word and nothing else: runcap's word count is then the true count.
ONE_A_WORD = InputTokenizer.words(10**6)
# Real tokenizers' shapes around the bytes/4 estimate, with role markers.
SPARSE = InputTokenizer.words(12, base=3, per_message=4)
DENSE = InputTokenizer.words(2, base=3, per_message=4)

VOCABULARY = (
    'refund order customer ticket the a of to and is 42 2026-12-01 {"id":7} naïve 東京 '
    "supercalifragilistic x y z ok réunion déjà-vu https://example.test/a/b?c=d 🙂"
).split()


def words(n: int, rng: random.Random | None = None) -> str:
    if rng is None:
        return " ".join(VOCABULARY[i % 6] for i in range(n))  # short ASCII words
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


class Readings:
    """A flow step that keeps each model call's context reading (after the context step)."""

    def __init__(self) -> None:
        self.seen: list[ContextReading] = []

    async def request(self, flow: Flow) -> None:
        return None

    async def response(self, flow: Flow) -> None:
        return None

    async def done(self, flow: Flow) -> None:
        if flow.context is not None:
            self.seen.append(flow.context)


def watch(rc: Any) -> Readings:
    readings = Readings()
    assert rc.runtime.forwarder is not None
    rc.runtime.forwarder.steps.append(readings)
    return readings


def chat_client(rc: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)


# -- the edge: a step whose lower bound equals the cap fits ------------------------------------


async def test_a_step_exactly_at_the_cap_is_forwarded_one_word_more_is_refused(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    upstream.tokenizer = ONE_A_WORD
    readings = watch(runcap)
    c = chat_client(runcap)
    for n in (40, 700):
        cap = {"X-Run-Max-Context-Tokens": str(n)}
        msgs = [{"role": "user", "content": words(n)}]
        assert chat_input_tokens({"messages": msgs}, ONE_A_WORD) == n
        ok = await c.chat.completions.create(
            model="gpt-4o-mini", messages=msgs, extra_headers={"X-Run-Id": f"edge-{n}", **cap}
        )
        assert ok.usage is not None and ok.usage.prompt_tokens == n
        assert readings.seen[-1].lower == n == readings.seen[-1].tokens
        # runcap's byte estimate of this step is well above the cap: the estimate did not decide.
        assert readings.seen[-1].estimate > n
        hits = upstream.hits()
        with pytest.raises(openai.APIStatusError) as e:
            await c.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": words(n + 1)}],
                extra_headers={"X-Run-Id": f"over-{n}", **cap},
            )  # fmt: skip
        assert e.value.status_code == 402 and e.value.code == "max_context_tokens"
        assert f"reads at least {n + 1} input tokens, more than its cap of {n}" in e.value.message
        assert upstream.hits() == hits


async def test_sparse_tokenizer_steps_at_their_true_count_are_never_refused(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    """A tokenizer sparser than bytes / 4: the cap set at each step's true count lets it through
    (the estimate would refuse all of them)."""
    upstream.tokenizer = SPARSE
    readings = watch(runcap)
    c = chat_client(runcap)
    rng = random.Random(28)
    for i in range(8):
        msgs = [{"role": "user", "content": words(rng.randint(30, 600), rng)}]
        true = chat_input_tokens({"messages": msgs}, SPARSE)
        ok = await c.chat.completions.create(
            model="gpt-4o-mini", messages=msgs,
            extra_headers={"X-Run-Id": f"sparse-{i}", "X-Run-Max-Context-Tokens": str(true)},
        )  # fmt: skip
        assert ok.usage is not None and ok.usage.prompt_tokens == true
        r = readings.seen[-1]
        assert r.lower <= true < r.estimate, (r.lower, true, r.estimate)


# -- multi-step conversations at the cap -------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_a_conversation_grows_to_exactly_the_cap_and_no_further(runcap, upstream, api: str) -> None:  # type: ignore[no-untyped-def]
    """Each step's lower bound is the previous step's exact count plus the new words — equal to
    the true count under this tokenizer — so the step that reaches the cap exactly is forwarded
    and the one after it is refused."""
    upstream.tokenizer = ONE_A_WORD
    upstream.scripts["answers"] = [{"text": words(30)}]
    readings = watch(runcap)
    user_turns = [words(200), words(90), words(120), words(60)]

    def body(history: list[dict[str, Any]]) -> dict[str, Any]:
        return {"messages": history}

    def true_count(history: list[dict[str, Any]]) -> int:
        count = chat_input_tokens if api == "chat" else anthropic_input_tokens
        return count(body(history), ONE_A_WORD)

    # The final step's true count is the cap: every earlier step is below it.
    final: list[dict[str, Any]] = []
    for i, text in enumerate(user_turns):
        if i:
            final.append({"role": "assistant", "content": words(30)})
        final.append({"role": "user", "content": text})
    cap = true_count(final)
    headers = {"X-Run-Id": f"grow-{api}", "X-Run-Max-Context-Tokens": str(cap), "X-Mock-Script": "answers"}

    history: list[dict[str, Any]] = []
    oa = chat_client(runcap)
    an = anthropic.AsyncAnthropic(base_url=runcap.url + "/anthropic", api_key="k", max_retries=0)

    async def send(history: list[dict[str, Any]]) -> str:
        if api == "chat":
            r = await oa.chat.completions.create(model="gpt-4o-mini", messages=history, extra_headers=headers)
            assert r.usage is not None and r.usage.prompt_tokens == true_count(history)
            return r.choices[0].message.content or ""
        m = await an.messages.create(
            model="claude-sonnet-4-5", max_tokens=200, messages=history, extra_headers=headers
        )
        assert m.usage.input_tokens == true_count(history)
        return "".join(b.text for b in m.content if b.type == "text")

    for i, text in enumerate(user_turns):
        history.append({"role": "user", "content": text})
        answer = await send(history)
        reading = readings.seen[-1]
        assert reading.lower == reading.tokens == true_count(history), (i, reading)
        history.append({"role": "assistant", "content": answer})
    assert readings.seen[-1].tokens == cap  # the last step was exactly at the cap

    history.append({"role": "user", "content": "one"})
    hits = upstream.hits()
    error = openai.APIStatusError if api == "chat" else anthropic.APIStatusError
    with pytest.raises(error) as e:
        await send(history)
    assert e.value.status_code == 402
    assert f"reads at least {cap + 31} input tokens, more than its cap of {cap}" in str(e.value)
    assert upstream.hits() == hits


async def test_dense_tokenizer_the_step_after_the_crossing_is_refused_on_its_exact_prefix(
    runcap, upstream
) -> None:  # type: ignore[no-untyped-def]
    """Denser than bytes / 4: a step whose words fit is forwarded although its true count does
    not (the bound is a lower bound); the next step's prefix alone is then provably over the cap,
    counted at the provider's own number."""
    upstream.tokenizer = DENSE
    readings = watch(runcap)
    c = chat_client(runcap)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": words(300)}]
    true = chat_input_tokens({"messages": msgs}, DENSE)
    cap = 600
    assert 300 <= cap < true
    h = {"X-Run-Id": "dense", "X-Run-Max-Context-Tokens": str(cap)}
    first = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, extra_headers=h)
    assert first.usage is not None and first.usage.prompt_tokens == true > cap
    assert readings.seen[-1].lower <= cap
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "ok"},
    ]
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="gpt-4o-mini", messages=msgs, extra_headers=h)
    assert e.value.status_code == 402 and e.value.code == "max_context_tokens"
    assert f"reads at least {true + len(first.choices[0].message.content.split()) + 1} " in e.value.message


# -- the property: lower bound ≤ true count, every step ----------------------------------------

CONVERSATIONS = 6  # per tokenizer; fixed, not a time budget
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("tokenizer", [ONE_A_WORD, SPARSE, DENSE], ids=["one-a-word", "sparse", "dense"])
async def test_the_lower_bound_never_exceeds_the_providers_count(runcap, upstream, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Generated chat conversations (user turns, tool calls and their results, answers sent back;
    words short and long, ASCII, accented, CJK, emoji, JSON, URLs), each step measured and then
    counted by the upstream's tokenizer."""
    upstream.tokenizer = tokenizer
    rng = random.Random(f"lower-{tokenizer.bytes_per_token}-{tokenizer.per_message}")
    readings = watch(runcap)
    c = chat_client(runcap)
    steps = 0
    for conv in range(CONVERSATIONS):
        script = f"gen-{conv}"
        upstream.scripts[script] = [
            {"tool_calls": [{"name": "lookup", "arguments": {"q": words(rng.randint(1, 8), rng)}}]}
            if rng.random() < 0.5
            else {"text": words(rng.randint(1, 60), rng)}
            for _ in range(5)
        ]
        h = {"X-Run-Id": f"prop-{conv}", "X-Mock-Script": script}
        msgs: list[dict[str, Any]] = [{"role": "user", "content": words(rng.randint(1, 300), rng)}]
        if rng.random() < 0.5:
            msgs.insert(0, {"role": "system", "content": words(rng.randint(1, 40), rng)})
        for _ in range(5):
            r = await c.chat.completions.create(
                model="gpt-4o-mini", messages=msgs, tools=[TOOL], extra_headers=h
            )
            assert r.usage is not None
            reading = readings.seen[-1]
            assert (
                reading.tokens
                == r.usage.prompt_tokens
                == chat_input_tokens({"messages": msgs, "tools": [TOOL]}, tokenizer)
            )
            assert reading.lower <= reading.tokens, (conv, msgs, reading)
            steps += 1
            message = r.choices[0].message
            msgs.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or ():
                msgs.append(
                    {"role": "tool", "tool_call_id": call.id, "content": words(rng.randint(1, 200), rng)}
                )
            if not message.tool_calls:
                msgs.append({"role": "user", "content": words(rng.randint(1, 80), rng)})
    assert steps == CONVERSATIONS * 5
    # The known prefix was used (later steps' bounds are not just word counts).
    assert sum(1 for r in readings.seen if r.lower > 0) == steps
