"""Priced or refused: every dimension a call may be billed for, bounded before it is forwarded.

The budget step (budget.py) asks `quote()` what a call may cost beyond its input and output
tokens, and `settle_price()` what it did cost. DESIGN.md "Enforcement rules":

* the model: the body's, or — on a route whose model is not in the body (an Azure-style
  `/openai/deployments/{name}/...`) — the one `[upstreams.NAME] deployments` says it serves; an
  undeclared deployment under a dollar cap is refused. Settlement prices that same model;
* price variants (`service_tier`, `speed`): reserved at the price each may select — `auto`, which
  the provider resolves, at the dearest of them — and settled at the one the answer reports;
* audio: the audio token rates when the call may read or write audio;
* hosted tools (the provider's web search, file search, code execution, MCP calls): each use is
  an internal model call that reads at most the model's context window, plus the tool's per-use
  fee (genai-prices, or `[prices]` `web_search_usd`...); their number is the request's own limit,
  lowered to — or, where it sets none, set to — what the run's caps leave (the ledger decides:
  `proxy.ledger.base._hosted_uses`);
* inputs by reference (a document by URL, a file by id): the call's input is bounded by the
  model's context window, not by the body.

A dimension runcap cannot bound under a dollar or token cap (a fee nobody priced, a tier without
a price, a hosted tool whose uses have no limit field) is a 402 `unpriced_feature` naming the
feature and the setting that would price it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal

from proxy.caps import RunCaps
from proxy.errors import BudgetExceeded
from proxy.money import NANOS_PER_USD, tokens_cost_nanos
from proxy.pricing import FEE_KINDS, Cost, PriceBook, PriceOptions
from proxy.providers.base import RequestInfo, Usage
from proxy.providers.billable import STANDARD_VALUES
from proxy.server.flow import Flow

# Input bound for provider-stored context (or an input by reference) of a model whose context
# window is unknown.
UNKNOWN_CONTEXT_TOKENS = 1_000_000
_MTOK = Decimal(1_000_000)
_DEPLOYMENT = re.compile(r"/deployments/([^/]+)/")


@dataclass(frozen=True, slots=True)
class Quote:
    """What a call may be billed, for its `StepRequest`."""

    model: str  # the model it is priced as
    options: tuple[PriceOptions, ...]  # the price variants it may be served at
    rates: tuple[Decimal, Decimal] | None  # worst USD per input / output token over them
    # The model's context window (the most one internal call reads; 0 when the call needs none).
    window: int
    input_tokens_bound: int  # the body's bound, raised to the window for inputs by reference
    fixed_usd_nanos: int = 0
    hosted_tools: bool = False
    use_tokens: int = 0
    use_usd_nanos: int = 0
    uses_wanted: int | None = None


def unpriced(feature: str, setting: str, flow: Flow, advice: str) -> BudgetExceeded:
    run = flow.run.run_id if flow.run else ""
    rej = BudgetExceeded(
        "unpriced_feature",
        f"{feature}: runcap cannot bound what this costs, and run {run} has a dollar or token "
        f"cap, so the call was not forwarded. {advice}",
    )
    rej.param = setting
    return rej


def priced_model(flow: Flow, info: RequestInfo, caps: RunCaps) -> str:
    """The model the call is priced as: a declared deployment's, else the body's."""
    found = _DEPLOYMENT.search(flow.target.path)
    if found is None:
        return info.model
    name = found.group(1)
    served = flow.upstream.deployments.get(name)
    if served is not None:
        return served
    if caps.max_usd_nanos is not None:
        setting = f"[upstreams.{flow.upstream.name}] deployments"
        raise unpriced(
            f"deployment {name!r}",
            setting,
            flow,
            f"The deployment serves a model of its own, which the body's model ({info.model!r}) "
            f'need not be; declare it: {setting} = {{ {name!r} = "MODEL" }}.',
        )
    return info.model


def price_options(
    flow: Flow, info: RequestInfo, prices: PriceBook, provider: str, model: str
) -> tuple[PriceOptions, ...]:
    """The price variants the call may be served at (`((),)`: the standard price only)."""
    option = info.price_option
    if option is None and flow.adapter is not None and flow.flavor == "openai":
        tier = flow.upstream.service_tier
        option = None if tier == "default" else ("service_tier", tier)
    if option is None or option[1] in STANDARD_VALUES:
        return ((),)
    key, value = option
    if value == "auto":  # the provider picks: every tier it prices, and the standard one
        picks = [v for v in prices.option_values(provider, model, key) if v not in STANDARD_VALUES]
        return ((), *(((key, v),) for v in picks))
    return (((key, value),),)


def quote(flow: Flow, prices: PriceBook, provider: str, caps: RunCaps, bound: int) -> Quote:
    info = flow.info
    assert info is not None
    model = priced_model(flow, info, caps)
    options = price_options(flow, info, prices, provider, model)
    money = caps.max_usd_nanos is not None
    limited = money or caps.max_tokens is not None
    if money and prices.is_priced(provider, model):
        for opt in options:
            if opt and not prices.known_option(provider, model, opt):
                label = "=".join(opt[0])
                raise unpriced(
                    f"{label} on {model}",
                    f'[prices."{model}"]',
                    flow,
                    f"The price table has no {label} price for {model}; send the request without it, "
                    f'or have the operator price the model ([prices."{model}"] input_mtok, '
                    "output_mtok: applied to every tier).",
                )
    rates = _worst(prices, provider, model, options, info.audio)
    if not (info.by_reference or info.hosted_tools or info.stored_context):
        return Quote(model, options, rates, 0, bound)  # the plain call: no window lookup
    window = prices.context_window(provider, model) or UNKNOWN_CONTEXT_TOKENS
    if info.by_reference:
        # A document or file the provider fetches: the call reads at most its context window.
        bound = max(bound, window)
    if not info.hosted_tools:
        return Quote(model, options, rates, window, bound)
    in_rate = rates[0] * _MTOK if rates else Decimal(0)
    fixed = 0
    use_fee = 0
    wanted: int | None = 0
    for tool in info.hosted_tools:
        if not tool.priced:
            if limited:
                raise unpriced(
                    f"hosted tool {tool.type!r}",
                    "tools",
                    flow,
                    "The provider runs it for the model as often as it likes, and bills each run; "
                    "runcap has no limit field to bound it with. Remove the tool, or run without a "
                    "dollar/token cap.",
                )
            continue
        fee = _fee_nanos(flow, prices, provider, model, options, tool.fee, money)
        if tool.always:
            fixed += fee * (tool.limit or 1)
        use_fee = max(use_fee, fee)
        if tool.limit is None or wanted is None:
            wanted = None
        else:
            wanted += tool.limit
    if info.hosted_limit is not None:
        wanted = info.hosted_limit if wanted is None else min(wanted, info.hosted_limit)
    return Quote(
        model,
        options,
        rates,
        window,
        bound,
        fixed_usd_nanos=fixed,
        hosted_tools=True,
        use_tokens=window,
        use_usd_nanos=tokens_cost_nanos(window, in_rate) + use_fee,
        uses_wanted=wanted,
    )


def _worst(
    prices: PriceBook, provider: str, model: str, options: tuple[PriceOptions, ...], audio: bool
) -> tuple[Decimal, Decimal] | None:
    worst: tuple[Decimal, Decimal] | None = None
    for opt in options:
        rates = prices.worst_case_rates(provider, model, opt, audio=audio)
        if rates is None:
            return None
        worst = rates if worst is None else (max(worst[0], rates[0]), max(worst[1], rates[1]))
    return worst


def _fee_nanos(
    flow: Flow,
    prices: PriceBook,
    provider: str,
    model: str,
    options: tuple[PriceOptions, ...],
    kind: str | None,
    money: bool,
) -> int:
    """The dearest per-use fee of `kind` over the variants, in nano-dollars (0: tokens only)."""
    if kind is None:
        return 0
    fees = [prices.fee(provider, model, kind, opt) for opt in options]
    if any(fee is None for fee in fees):
        if not money or not prices.is_priced(provider, model):
            return 0  # no dollar cap, or an unpriced model (refused or allowed as such)
        setting = f'[prices."{model}"] {FEE_KINDS[kind][2]}'
        raise unpriced(
            f"{kind.replace('_', ' ')} fee on {model}",
            setting,
            flow,
            f"The price table has no per-use price for it; have the operator declare it ({setting} "
            f'= USD per use, or [prices."*"] for every model), or remove the tool.',
        )
    return max(_nanos_up(fee) for fee in fees if fee is not None)


def _nanos_up(usd: Decimal) -> int:
    """Dollars to nano-dollars, rounded up: a reservation is never below what it bounds."""
    return int((usd * NANOS_PER_USD).to_integral_value(rounding=ROUND_CEILING))


def settle_price(flow: Flow, prices: PriceBook, provider: str, usage: Usage) -> Cost:
    """What the call cost: the model it was reserved as, at the price variant the answer says it
    was served at (else the one requested; else, for `auto`, the dearest it may have picked)."""
    info, resp = flow.info, flow.response_info
    model = flow.priced_model or (info.model if info else "")
    if info is not None:
        for tool in info.hosted_tools:
            if tool.always and tool.fee is not None and not usage.tool_uses.get(tool.fee):
                usage.tool_uses = {**usage.tool_uses, tool.fee: tool.limit or 1}
    served = resp.price_options if resp is not None else None
    candidates = (served,) if served is not None else flow.price_options
    cost: Cost | None = None
    for opt in candidates:
        c = prices.cost(provider, model, usage, opt)
        if cost is None or (c.known and (not cost.known or c.usd > cost.usd)):
            cost = c
    assert cost is not None
    if not cost.known and resp is not None and resp.model and resp.model != model:
        # Nothing was reserved by price for an unknown model: the answering model's price, if known.
        alt = prices.cost(provider, resp.model, usage, candidates[0])
        if alt.known:
            cost = alt
    return cost
