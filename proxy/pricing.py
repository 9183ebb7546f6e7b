"""Prices: what a finished model call cost, and the most an upcoming one could cost.

Settlement calls `PriceBook.cost()` with the provider-neutral `Usage` of a response; the budget
step calls `PriceBook.worst_case_rates()` to reserve an upper bound before forwarding a call.

Where prices come from, in order:

1. An operator override from the configuration (`[prices."model"]`), matched on the exact model
   name, then on the name without a dated-snapshot suffix (`my-model-2025-01-31`,
   `my-model-20250131`, `my-model@20250131`, `my-model-0613` all find `[prices."my-model"]`), so
   the dated name a provider echoes in its response settles at the same price the undated request
   name reserved at.
2. The data snapshot bundled with `genai-prices` (the `genai_prices.data` module, read as-is).
   runcap never calls `UpdatePrices`, so no price is ever fetched from the network; it also reads
   the bundled providers directly rather than `get_snapshot()`, so an `UpdatePrices` started by
   some other library in the process cannot change runcap's prices. genai-prices' own matching
   resolves dated snapshots (`gpt-4o-mini-2024-07-18`, `claude-sonnet-4-20250514`).
   The provider is found like genai-prices does: `openai`/`anthropic` (or an upstream named exactly
   like a genai-prices provider id) first; otherwise — and as a fallback, e.g. a `claude-*` model
   behind an OpenAI-compatible gateway — the provider whose model pattern matches the model name,
   which is what `calc_price(..., provider_id=None)` does.

Token accounting is the same in runcap and genai-prices: input tokens include cache reads and
writes (those are priced at their own rates, the rest at the input rate), output tokens include
reasoning tokens. genai-prices' `calc_price` takes ~80 µs a call; on the hot path we instead
flatten a resolved genai-prices price once into per-token rates (kept in an LRU per
(provider, model)) and do the same arithmetic in ~3 µs. `tests/test_pricing.py` checks the
result equals `genai_prices.calc_price` (rounded up) for every model in the bundled snapshot.

Not represented (known gaps): service-tier / batch price variants (runcap prices the standard
tier), Anthropic's 1-hour cache writes (our `Usage` has one cache-write count, priced at the
standard 5-minute rate), and non-token units (web
searches, audio seconds, images), which our `Usage` does not carry.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from typing import Any

from genai_prices import types as gp

from proxy.providers.base import Usage

__all__ = ["Cost", "ModelPrice", "PriceBook", "max_output_tokens"]

_MTOK = Decimal(1_000_000)
_USD_QUANTUM = Decimal("1e-9")  # spans.cost_usd is Decimal(18, 9)
_ZERO = Decimal(0)

# A dated-snapshot suffix: -2024-07-18, -20240718, @20240718, -0613 (old OpenAI snapshots).
_DATE_SUFFIX = re.compile(r"(?:[-@](?:20\d\d-\d\d-\d\d|20\d{6})|-\d{4})$")


@dataclass(frozen=True)
class ModelPrice:
    """An operator's price for one model, USD per million tokens (`[prices."model"]`)."""

    input_mtok: Decimal
    output_mtok: Decimal
    cache_read_mtok: Decimal | None = None  # None = same as input
    cache_write_mtok: Decimal | None = None  # None = same as input

    def __post_init__(self) -> None:
        # TOML gives floats/ints; money must not be a binary float, so go through str().
        for name in ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok"):
            value = getattr(self, name)
            if value is None and name.startswith("cache_"):
                continue
            if isinstance(value, bool) or not isinstance(value, Decimal | int | float | str):
                raise ValueError(f"price {name} must be a number, got {value!r}")
            try:
                dec = value if isinstance(value, Decimal) else Decimal(str(value))
            except ArithmeticError as exc:
                raise ValueError(f"price {name} must be a number, got {value!r}") from exc
            if not dec.is_finite() or dec < 0:
                raise ValueError(f"price {name} must be a finite non-negative number, got {value!r}")
            object.__setattr__(self, name, dec)


@dataclass(frozen=True, slots=True)
class Cost:
    """The price of one call. `known=False` means no price was found: `usd` is then 0 and the span
    must say `price_known = false` — it is never a silent $0."""

    usd: Decimal
    known: bool


UNKNOWN_COST = Cost(_ZERO, False)

# A per-million-token rate that may depend on the call's total input tokens (long-context tiers):
# ((start, rate), ...) ordered by start descending; the first entry with input > start applies
# (genai-prices' "cliff" model: crossing a tier prices ALL tokens at that tier). The base rate is
# stored with start -1 so it always applies last.
_Tiers = tuple[tuple[int, Decimal], ...]


@dataclass(frozen=True, slots=True)
class _Rates:
    input: _Tiers
    output: _Tiers
    cache_read: _Tiers
    cache_write: _Tiers
    reasoning: _Tiers | None  # None: reasoning tokens are output tokens at the output rate
    per_call: Decimal  # fixed USD per request (genai-prices `requests_kcount` / 1000)


def _rate(tiers: _Tiers, input_tokens: int) -> Decimal:
    for start, rate in tiers:
        if input_tokens > start:
            return rate
    return tiers[-1][1]


def _max_rate(tiers: _Tiers) -> Decimal:
    return max(rate for _, rate in tiers)


@dataclass(slots=True)
class _Resolved:
    """A (provider, model) resolved to its prices; cached in the PriceBook's LRU."""

    fixed: _Rates | None  # set when the price does not depend on the request time
    model: gp.ModelInfo | None  # genai-prices model whose price changes with time (or None)
    by_price: dict[int, _Rates | None]  # id(genai ModelPrice) -> rates, for time-dependent models
    worst_input: Decimal  # USD per token
    worst_output: Decimal  # USD per token

    def rates(self, now: datetime) -> _Rates | None:
        if self.fixed is not None:
            return self.fixed
        assert self.model is not None
        price = self.model.get_prices(now)
        key = id(price)  # the ModelPrice objects live in self.model.prices, so ids are stable
        if key not in self.by_price:
            self.by_price[key] = _flatten(price)
        return self.by_price[key]


class PriceBook:
    """Prices model calls from operator overrides and the bundled genai-prices snapshot."""

    def __init__(self, overrides: dict[str, ModelPrice] | None = None, *, cache_size: int = 4096) -> None:
        from genai_prices.data import providers  # the bundled snapshot; ~0.2 s to import

        self._overrides = dict(overrides or {})
        self._providers: list[gp.Provider] = providers
        self._by_id = {p.id: p for p in providers}
        # Bounded: model names come from clients, so an unbounded cache would be a memory leak.
        self._resolve = functools.lru_cache(maxsize=cache_size)(self._resolve_uncached)

    def cost(self, provider: str, model: str, usage: Usage) -> Cost:
        """USD cost of one call, rounded up to 1e-9 so a run is never under-charged."""
        resolved = self._resolve(provider, model)
        if resolved is None:
            return UNKNOWN_COST
        rates = resolved.rates(datetime.now(UTC)) if resolved.fixed is None else resolved.fixed
        if rates is None:
            return UNKNOWN_COST
        cache_read = usage.cache_read_tokens
        cache_write = usage.cache_write_tokens
        # Inconsistent counts from an upstream are resolved upwards, never downwards.
        input_tokens = max(usage.input_tokens, cache_read + cache_write)
        reasoning = usage.reasoning_tokens
        output_tokens = max(usage.output_tokens, reasoning)
        total = (
            (input_tokens - cache_read - cache_write) * _rate(rates.input, input_tokens)
            + cache_read * _rate(rates.cache_read, input_tokens)
            + cache_write * _rate(rates.cache_write, input_tokens)
        )
        if rates.reasoning is None:
            total += output_tokens * _rate(rates.output, input_tokens)
        else:
            total += (output_tokens - reasoning) * _rate(rates.output, input_tokens)
            total += reasoning * _rate(rates.reasoning, input_tokens)
        usd = total / _MTOK + rates.per_call
        return Cost(usd.quantize(_USD_QUANTUM, rounding=ROUND_CEILING), True)

    def worst_case_rates(self, provider: str, model: str) -> tuple[Decimal, Decimal] | None:
        """(USD per input token, USD per output token) upper bounds for a reservation: the highest
        of the input, cache-write and cache-read rates, and of the output and reasoning rates, over
        every long-context tier and every time-of-day or scheduled price — the rates `cost()` can
        charge. None when the model has no known price.

        A per-request fee (a few genai-prices models have one; no OpenAI/Anthropic chat model does)
        is not part of these rates.
        """
        resolved = self._resolve(provider, model)
        if resolved is None:
            return None
        return resolved.worst_input, resolved.worst_output

    def is_priced(self, provider: str, model: str) -> bool:
        return self._resolve(provider, model) is not None

    def catalog_name(self, provider: str, model: str) -> str | None:
        """The public name a model is known by — an operator's `[prices]` key, else the
        genai-prices model id (`gpt-4o-mini-2024-07-18` → `gpt-4o-mini`) — or None: a name only
        its caller knows (a fine-tune, a private deployment). For tenant-free metric labels."""
        if model in self._overrides:
            return model
        info = self._find_model(provider, model)
        return info.id if info is not None else None

    # -- resolution ---------------------------------------------------------------------------

    def _resolve_uncached(self, provider: str, model: str) -> _Resolved | None:
        override = self._overrides.get(model)
        if override is None:
            undated = _DATE_SUFFIX.sub("", model)
            if undated != model:
                override = self._overrides.get(undated)
        if override is not None:
            return _from_override(override)
        info = self._find_model(provider, model)
        if info is None:
            return None
        return _from_genai(info)

    def context_window(self, provider: str, model: str) -> int | None:
        """The model's context window in tokens (genai-prices' data), None when unknown: the most
        input a call can be billed for when its input is not in the request body."""
        info = self._find_model(provider, model)
        window = getattr(info, "context_window", None) if info is not None else None
        return window if isinstance(window, int) and window > 0 else None

    def _find_model(self, provider: str, model: str) -> gp.ModelInfo | None:
        ref = model.lower()
        named = self._by_id.get(provider.lower())
        if named is not None:
            found = named.find_model(ref, all_providers=self._providers)
            if found is not None:
                return found
        # genai-prices with provider_id=None: the first provider whose model pattern matches.
        for candidate in self._providers:
            if candidate.model_match is not None and candidate.model_match.is_match(ref):
                if candidate is named:
                    return None
                return candidate.find_model(ref, all_providers=self._providers)
        return None


def _flat(rate: Decimal) -> _Tiers:
    return ((-1, rate),)


def _from_override(price: ModelPrice) -> _Resolved:
    cache_read = price.input_mtok if price.cache_read_mtok is None else price.cache_read_mtok
    cache_write = price.input_mtok if price.cache_write_mtok is None else price.cache_write_mtok
    rates = _Rates(
        input=_flat(price.input_mtok),
        output=_flat(price.output_mtok),
        cache_read=_flat(cache_read),
        cache_write=_flat(cache_write),
        reasoning=None,
        per_call=_ZERO,
    )
    return _Resolved(
        fixed=rates,
        model=None,
        by_price={},
        worst_input=max(price.input_mtok, cache_read, cache_write) / _MTOK,
        worst_output=price.output_mtok / _MTOK,
    )


# The price keys `cost()` charges; the worst case is taken over exactly these, so a reservation
# bounds what settlement can charge.
_INPUT_KEYS = ("input_mtok", "cache_read_mtok", "cache_write_mtok")
_OUTPUT_KEYS = ("output_mtok", "output_reasoning_mtok")


def _tiers(value: Decimal | gp.TieredPrices) -> _Tiers:
    if isinstance(value, gp.TieredPrices):
        tiers = [(tier.start, tier.price) for tier in value.tiers]
        tiers.sort(key=lambda t: t[0], reverse=True)
        return (*tiers, (-1, value.base))
    return _flat(value)


def _price_items(price: gp.ModelPrice) -> dict[str, Any]:
    return {k: v for k, v in price.__dict__.items() if not k.startswith("_") and v is not None}


def _flatten(price: gp.ModelPrice) -> _Rates | None:
    """Per-token rates of a genai-prices price, or None when it cannot price tokens.

    An empty price means the model is free ($0, known). A price with only non-token units
    (audio hours, pages, characters) cannot price a token usage: unknown, never a silent $0.
    """
    items = _price_items(price)
    token_keys = [k for k in items if k.endswith("_mtok")]
    if items and not token_keys:
        return None
    if items and "input_mtok" not in items and "output_mtok" not in items:
        return None
    zero = _flat(_ZERO)
    base_input = _tiers(items["input_mtok"]) if "input_mtok" in items else zero
    reasoning = items.get("output_reasoning_mtok")
    requests_kcount = items.get("requests_kcount")
    per_call = _ZERO
    if isinstance(requests_kcount, Decimal):
        per_call = requests_kcount / 1000
    return _Rates(
        input=base_input,
        output=_tiers(items["output_mtok"]) if "output_mtok" in items else zero,
        # Unpriced cache reads/writes are ordinary input tokens (genai-prices does the same).
        cache_read=_tiers(items["cache_read_mtok"]) if "cache_read_mtok" in items else base_input,
        cache_write=_tiers(items["cache_write_mtok"]) if "cache_write_mtok" in items else base_input,
        reasoning=_tiers(reasoning) if reasoning is not None else None,
        per_call=per_call,
    )


def _worst_case_prices(info: gp.ModelInfo, now: datetime) -> list[gp.ModelPrice]:
    """The prices a call starting now could be charged at: the current one, any scheduled for a
    later date, and every time-of-day price (a call may cross into another window)."""
    if isinstance(info.prices, gp.ModelPrice):
        return [info.prices]
    prices = [info.get_prices(now)]
    for conditional in info.prices:
        constraint = conditional.constraint
        if isinstance(constraint, gp.TimeOfDateConstraint) or (
            isinstance(constraint, gp.StartDateConstraint) and constraint.start_date > now.date()
        ):
            prices.append(conditional.prices)
    return prices


def _from_genai(info: gp.ModelInfo) -> _Resolved | None:
    now = datetime.now(UTC)
    worst_in = worst_out = _ZERO
    for price in _worst_case_prices(info, now):
        if _flatten(price) is None:
            return None
        items = _price_items(price)
        for key in _INPUT_KEYS:
            if key in items:
                worst_in = max(worst_in, _max_rate(_tiers(items[key])))
        for key in _OUTPUT_KEYS:
            if key in items:
                worst_out = max(worst_out, _max_rate(_tiers(items[key])))
    if isinstance(info.prices, gp.ModelPrice):
        fixed = _flatten(info.prices)
        return _Resolved(fixed, None, {}, worst_in / _MTOK, worst_out / _MTOK)
    return _Resolved(None, info, {}, worst_in / _MTOK, worst_out / _MTOK)


# Maximum output tokens of well-known models (genai-prices has context windows, not output
# limits). Looked up by exact name, then without a dated-snapshot or "-latest" suffix.
_MAX_OUTPUT_TOKENS: dict[str, int] = {
    # OpenAI
    "gpt-3.5-turbo": 4096,
    "gpt-3.5-turbo-16k": 4096,
    "gpt-4": 8192,
    "gpt-4-turbo": 4096,
    "gpt-4-turbo-preview": 4096,
    "gpt-4-1106-preview": 4096,
    "gpt-4-0125-preview": 4096,
    "gpt-4o": 16384,
    "gpt-4o-2024-05-13": 4096,  # the first gpt-4o snapshot had the old 4k output limit
    "gpt-4o-mini": 16384,
    "chatgpt-4o": 16384,
    "gpt-4.1": 32768,
    "gpt-4.1-mini": 32768,
    "gpt-4.1-nano": 32768,
    "gpt-4.5-preview": 16384,
    "gpt-5": 128000,
    "gpt-5-mini": 128000,
    "gpt-5-nano": 128000,
    "gpt-5-chat": 16384,
    "o1": 100000,
    "o1-pro": 100000,
    "o1-mini": 65536,
    "o1-preview": 32768,
    "o3": 100000,
    "o3-pro": 100000,
    "o3-mini": 100000,
    "o4-mini": 100000,
    # Anthropic
    "claude-3-haiku": 4096,
    "claude-3-sonnet": 4096,
    "claude-3-opus": 4096,
    "claude-3-5-haiku": 8192,
    "claude-3-5-sonnet": 8192,
    "claude-3-7-sonnet": 64000,  # 128k only with the output-128k beta header
    "claude-sonnet-4": 64000,
    "claude-sonnet-4-0": 64000,
    "claude-opus-4": 32000,
    "claude-opus-4-0": 32000,
    "claude-opus-4-1": 32000,
    "claude-sonnet-4-5": 64000,
    "claude-haiku-4-5": 64000,
    "claude-opus-4-5": 64000,
    "claude-sonnet-4-6": 128000,
    "claude-opus-4-6": 128000,
}

_LATEST_SUFFIX = re.compile(r"-latest$")


def max_output_tokens(provider: str, model: str) -> int | None:
    """The model's maximum output tokens, or None for a model not in the table.

    Dated snapshots find their family (`claude-3-5-haiku-20241022` -> `claude-3-5-haiku`,
    `gpt-4o-mini-2024-07-18` -> `gpt-4o-mini`); `provider` is accepted for symmetry with
    `PriceBook` (the names are unambiguous across OpenAI and Anthropic).
    """
    del provider
    name = model.lower()
    found = _MAX_OUTPUT_TOKENS.get(name)
    if found is not None:
        return found
    stripped = _LATEST_SUFFIX.sub("", _DATE_SUFFIX.sub("", name))
    return _MAX_OUTPUT_TOKENS.get(stripped)
