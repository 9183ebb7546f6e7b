"""Priced or refused, as a property of each adapter (OpenAI chat, Responses, Anthropic messages).

Seeded generated requests draw on every billable option runcap documents — service tiers and
speed (`auto` included), audio output, hosted tools with and without their limit fields
(`max_tool_calls`, `max_uses`), documents and files by reference, Azure-style deployments,
streaming — under a random dollar and/or token cap, against the scripted upstream scripted to
bill the worst case the provider's documentation allows for that request: the whole output limit
(in audio when audio is asked for), every hosted-tool use the request allows each reading a full
context window, a reference filling the window, the dearest tier `auto` may pick.

For every example: the call is refused (402, nothing sent, nothing spent) or its run's settled
spend is within its caps and equals the upstream's bill exactly — the bill computed here with
genai-prices' `calc_price` on the usage the upstream reported (and the operator's declared fees
for what genai-prices lacks). One-step runs: the run's cost is its one span's cost.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from decimal import ROUND_CEILING, Decimal
from typing import Any

import aiohttp
import pytest
from genai_prices.data import providers as GENAI_PROVIDERS

from proxy.providers.base import Usage
from proxy.scripted_upstream import (
    ScriptedUpstream,
    anthropic_input_tokens,
    chat_input_tokens,
    responses_input_tokens,
)
from tests.support.genai_bill import genai_price

EXAMPLES = 170  # per adapter: 510 in all
SEED = 20
NANO = Decimal("1e-9")
CODE_EXECUTION_USD = Decimal("0.03")  # declared: genai-prices has no code interpreter session price
WEB_SEARCH_USD = Decimal("0.025")  # declared for the models genai-prices has no search price for
DEPLOYMENTS = {"dep-o1": "o1", "dep-4o": "gpt-4o", "dep-mini": "gpt-4o-mini"}
CONFIG = {
    "upstreams": {"azure": {"deployments": DEPLOYMENTS}},
    "prices": {
        "*": {"code_execution_usd": float(CODE_EXECUTION_USD), "web_search_usd": float(WEB_SEARCH_USD)}
    },
}


def window(provider: str, model: str) -> int:
    for p in GENAI_PROVIDERS:
        if p.id == provider:
            info = p.find_model(model)
            if info is not None and info.context_window:
                return info.context_window
    return 1_000_000


def bill(provider: str, model: str, usage: Usage, context: dict[str, str] | None) -> Decimal:
    """The provider's bill for what the upstream reported, by genai-prices, plus declared fees."""
    price = genai_price(provider, model, usage, context)
    total = price.total_price + usage.tool_uses.get("code_execution", 0) * CODE_EXECUTION_USD
    if usage.tool_uses.get("web_search") and price.model_price.web_searches_kcount is None:
        total += usage.tool_uses["web_search"] * WEB_SEARCH_USD
    return total.quantize(NANO, rounding=ROUND_CEILING)


def caps(rnd: random.Random) -> dict[str, str]:
    """A dollar and/or token cap: tight (log-uniform from $0.001 / 500 tokens) or, one time in
    three, roomy enough for a context window or two ($1-$20, 300k-3M tokens)."""
    which = rnd.choice(("usd", "tokens", "both"))
    roomy = rnd.random() < 0.35
    h = {}
    if which in ("usd", "both"):
        exponent = rnd.uniform(0, 1.3) if roomy else rnd.uniform(-3, 0.5)
        h["X-Run-Max-Usd"] = f"{Decimal(10) ** Decimal(exponent):.6f}"
    if which in ("tokens", "both"):
        h["X-Run-Max-Tokens"] = str(int(10 ** (rnd.uniform(5.5, 6.5) if roomy else rnd.uniform(2.7, 5.5))))
    return h


def tier(rnd: random.Random) -> str | None:
    return rnd.choice((None, None, "auto", "default", "flex", "priority"))


def served(requested: str | None) -> dict[str, str] | None:
    """The tier the upstream serves (the worst case for `auto`: priority), as price context."""
    t = "priority" if requested == "auto" else requested
    return {"service_tier": t} if t not in (None, "default") else None


def output_step(rnd: random.Random, audio: bool = False) -> dict[str, Any]:
    """An answer that fills whatever output limit the request goes with (in audio, if asked)."""
    if audio:
        return {"text_tokens": rnd.randint(0, 200), "audio_tokens": 10**7}
    return {"text_tokens": 10**7, "reasoning_tokens": rnd.choice((0, 0, 500))}


class Example:
    def __init__(self, path: str, body: dict[str, Any], step: dict[str, Any], provider: str, model: str,
                 context: dict[str, str] | None) -> None:  # fmt: skip
        self.path, self.body, self.step = path, body, step
        self.provider, self.model, self.context = provider, model, context


def chat_example(rnd: random.Random) -> Example:
    model = rnd.choice(("gpt-5", "gpt-4o-mini", "gpt-audio", "gpt-4o-search-preview"))
    path = "/v1/chat/completions"
    billed = model
    if rnd.random() < 0.2:
        dep = rnd.choice(sorted(DEPLOYMENTS))
        path, billed, model = (
            f"/u/azure/openai/deployments/{dep}/chat/completions",
            DEPLOYMENTS[dep],
            "gpt-4o-mini",
        )
    content: list[Any] = [{"type": "text", "text": "hello " * rnd.randint(1, 300)}]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}]}
    audio = billed == "gpt-audio" and rnd.random() < 0.7
    if audio:
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"voice": "alloy", "format": "wav"}
    if billed == "gpt-4o-search-preview":
        body["web_search_options"] = {}
    requested = tier(rnd)
    if requested is not None:
        body["service_tier"] = requested
    limit = rnd.choice((None, rnd.randint(1, 20000)))
    if limit is not None:
        body[rnd.choice(("max_tokens", "max_completion_tokens"))] = limit
    refs = rnd.random() < 0.25
    step = output_step(rnd, audio)
    step["service_tier"] = "priority" if requested == "auto" else requested or "default"
    if refs:
        content.append({"type": "file", "file": {"file_id": "file-abc123"}})
        step["reference_tokens"] = window("openai", billed) - chat_input_tokens(body)
    body["stream"] = rnd.random() < 0.3
    return Example(path, body, step, "openai", billed, served(requested))


RESPONSES_HOSTED = (
    {"type": "web_search"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {
        "type": "mcp",
        "server_label": "crm",
        "server_url": "https://crm.example/mcp",
        "require_approval": "never",
    },
    {"type": "code_interpreter", "container": {"type": "auto"}},
)


def responses_example(rnd: random.Random) -> Example:
    model = rnd.choice(("gpt-5", "gpt-4o-mini", "o3-deep-research"))
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "hi " * rnd.randint(1, 300)}]}
    ]
    body: dict[str, Any] = {"model": model, "input": items}
    tools = [t for t in RESPONSES_HOSTED if rnd.random() < 0.4]
    if tools:
        body["tools"] = tools
        if rnd.random() < 0.5:
            body["max_tool_calls"] = rnd.randint(1, 6)
    requested = tier(rnd)
    if requested is not None:
        body["service_tier"] = requested
    if rnd.random() < 0.6:
        body["max_output_tokens"] = rnd.randint(16, 30000)
    step = output_step(rnd)
    step["service_tier"] = "priority" if requested == "auto" else requested or "default"
    win = window("openai", model)
    if tools:
        step["hosted_uses"] = 10**6  # every use allowed, each reading a full window
        step["use_input_tokens"] = win
    if rnd.random() < 0.25:
        items[0]["content"].append({"type": "input_file", "file_id": "file-abc123"})
        step["reference_tokens"] = win - responses_input_tokens(body)
    body["stream"] = rnd.random() < 0.3
    return Example("/v1/responses", body, step, "openai", model, served(requested))


def messages_example(rnd: random.Random) -> Example:
    model = rnd.choice(("claude-sonnet-4-5", "claude-haiku-4-5", "claude-opus-4-8"))
    content: list[Any] = [{"type": "text", "text": "hey " * rnd.randint(1, 300)}]
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rnd.randint(1, 20000),
        "messages": [{"role": "user", "content": content}],
    }
    tools = []
    for kind, name in (("web_search_20250305", "web_search"), ("web_fetch_20250910", "web_fetch")):
        if rnd.random() < 0.4:
            tool: dict[str, Any] = {"type": kind, "name": name}
            if rnd.random() < 0.5:
                tool["max_uses"] = rnd.randint(1, 5)
            tools.append(tool)
    if tools:
        body["tools"] = tools
    context = None
    if model == "claude-opus-4-8" and rnd.random() < 0.6:
        body["speed"] = "fast"
        context = {"speed": "fast"}
    step = output_step(rnd)
    win = window("anthropic", model)
    if tools:
        step["hosted_uses"] = 10**6
        step["use_input_tokens"] = win
    if rnd.random() < 0.25:
        content.insert(0, {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}})
        step["reference_tokens"] = win - anthropic_input_tokens(body)
    step["cache_write_tokens"] = rnd.choice((0, anthropic_input_tokens(body) // 2))
    body["stream"] = rnd.random() < 0.3
    return Example("/anthropic/v1/messages", body, step, "anthropic", model, context)


GENERATORS = {"chat": chat_example, "responses": responses_example, "messages": messages_example}


@pytest.mark.parametrize("adapter", sorted(GENERATORS))
async def test_settled_spend_never_exceeds_the_cap_and_equals_the_bill(
    adapter: str, runcap_factory: Callable[..., Any], upstream: ScriptedUpstream
) -> None:
    upstream.deployments.update(DEPLOYMENTS)
    assert upstream.url is not None
    rc = await runcap_factory(
        {**CONFIG, "upstreams": {"azure": {"url": upstream.url, "deployments": DEPLOYMENTS}}}
    )
    rnd = random.Random(f"{SEED}-{adapter}")
    outcomes = {200: 0, 402: 0}
    seen: set[str] = set()
    async with aiohttp.ClientSession() as s:
        for i in range(EXAMPLES):
            ex = GENERATORS[adapter](rnd)
            run_id = f"{adapter}-{i}"
            upstream.scripts[run_id] = [ex.step]
            h = {"X-Run-Id": run_id, "X-Mock-Script": run_id, **caps(rnd)}
            async with s.post(f"{rc.url}{ex.path}", json=ex.body, headers=h) as r:
                status = r.status
                answer = await r.read()
            assert status in (200, 402), (run_id, status, answer[:500], ex.body)
            outcomes[status] += 1
            sent = [q for q in upstream.requests if q.script == run_id]
            async with s.get(f"{rc.url}/runs/{run_id}", headers=rc.admin) as r:
                # A call refused before the ledger (a feature runcap cannot price) opens no run.
                run = await r.json() if r.status == 200 else {"cost_usd": "0"}
            spent = Decimal(run["cost_usd"])
            if status == 402:
                assert sent == [] and spent == 0, (run_id, answer[:300])
                continue
            (rec,) = sent
            assert rec.usage is not None
            real = bill(ex.provider, ex.model, rec.usage, ex.context)
            assert spent == real, (run_id, ex.body, rec.body, rec.usage)
            if "X-Run-Max-Usd" in h:
                assert spent <= Decimal(h["X-Run-Max-Usd"]), (run_id, spent, h, rec.usage)
            if "X-Run-Max-Tokens" in h:
                used = run["input_tokens"] + run["output_tokens"]
                assert used <= int(h["X-Run-Max-Tokens"]), (run_id, used, h, rec.usage)
            seen.update(features(ex, rec.body, rec.usage))
    # The generator reaches both answers (calls that fit, calls that cannot be bounded) and, among
    # the calls forwarded, every billable dimension of the format.
    assert outcomes[200] > EXAMPLES // 5 and outcomes[402] > EXAMPLES // 10, outcomes
    assert seen >= WANTED[adapter], (WANTED[adapter] - seen, outcomes)


WANTED = {
    "chat": {"variant", "audio", "reference", "deployment", "fee", "stream"},
    "responses": {"variant", "reference", "fee", "limit_set", "limit_own", "stream"},
    "messages": {"variant", "reference", "fee", "limit_set", "limit_own", "stream"},
}


def features(ex: Example, sent: dict[str, Any], usage: Usage) -> set[str]:
    """The billable dimensions a forwarded call exercised."""
    out = set()
    if ex.context:
        out.add("variant")
    if usage.output_audio_tokens:
        out.add("audio")
    if "reference_tokens" in ex.step:
        out.add("reference")
    if "/deployments/" in ex.path:
        out.add("deployment")
    if usage.tool_uses:
        out.add("fee")
    if ex.body.get("stream"):
        out.add("stream")
    own = [t.get("max_uses") for t in ex.body.get("tools", ())] + [ex.body.get("max_tool_calls")]
    now = [t.get("max_uses") for t in sent.get("tools", ())] + [sent.get("max_tool_calls")]
    if usage.input_tokens and now != own:
        out.add("limit_set")  # runcap set or lowered the request's limit on hosted-tool uses
    elif any(own):
        out.add("limit_own")
    return out
