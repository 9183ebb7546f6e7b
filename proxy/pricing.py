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
(provider, model)) and do the same arithmetic in ~3 µs. `tests/unit/test_pricing.py` checks the
result equals `genai_prices.calc_price` (rounded up) for every model in the bundled snapshot.

Priced or refused (DESIGN.md "Enforcement rules"): a call is priced in every dimension its usage
reports —

* price-selecting request options (`service_tier`, `speed`) select genai-prices'
  `price_variants` (`PriceOptions`, e.g. `(("service_tier", "priority"),)`); `known_option()`
  says whether a model has a price for an option, so the budget step can refuse one it has not;
* audio tokens (`Usage.input_audio_tokens`, `output_audio_tokens`) at genai-prices'
  `input_audio_mtok` / `output_audio_mtok` (the text rate when the model has none);
* per-use fees of tools the provider runs (`Usage.tool_uses`: web searches, file searches, code
  execution), from genai-prices (`web_searches_kcount`, `storage_searches_kcount`) or declared by
  the operator (`[prices."MODEL"]` / `[prices."*"]` `web_search_usd`, `file_search_usd`,
  `code_execution_usd`); `fee()` is None for a fee nobody declared.

Not represented (known gaps): batch price variants (the Batch API is an unmetered endpoint) and
Anthropic's 1-hour cache writes (our `Usage` has one cache-write count, priced at the standard
5-minute rate).
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from typing import Any

from genai_prices import types as gp

from proxy.providers.base import Usage

__all__ = ["FEE_KINDS", "Cost", "ModelPrice", "PriceBook", "PriceOptions", "max_output_tokens"]

# A genai-prices price context, as sorted (key, value) pairs: `(("service_tier", "priority"),)`.
PriceOptions = tuple[tuple[str, str], ...]
STANDARD: PriceOptions = ()

# Per-use fees of provider-run tools: runcap's kind -> (genai-prices price key, its `per`, the
# `[prices]` key an operator declares it with, USD per use).
FEE_KINDS: dict[str, tuple[str | None, int, str]] = {
    "web_search": ("web_searches_kcount", 1000, "web_search_usd"),
    "file_search": ("storage_searches_kcount", 1000, "file_search_usd"),
    "code_execution": ("code_executions_kcount", 1000, "code_execution_usd"),
}
FEE_SETTINGS = tuple(setting for _, _, setting in FEE_KINDS.values())

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
    input_audio_mtok: Decimal | None = None  # None = same as input
    output_audio_mtok: Decimal | None = None  # None = same as output
    # Per-use fees of provider-run tools, USD per use (None: not declared here).
    web_search_usd: Decimal | None = None
    file_search_usd: Decimal | None = None
    code_execution_usd: Decimal | None = None
    # False: the table declares fees only (`[prices."*"]`, or a model genai-prices prices):
    # its token prices are not an override.
    tokens: bool = True

    def __post_init__(self) -> None:
        # TOML gives floats/ints; money must not be a binary float, so go through str().
        for name in _PRICE_FIELDS:
            value = getattr(self, name)
            if value is None and (name not in ("input_mtok", "output_mtok") or not self.tokens):
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

    def fee(self, kind: str) -> Decimal | None:
        return getattr(self, FEE_KINDS[kind][2])


_PRICE_FIELDS = (
    "input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok", "input_audio_mtok",
    "output_audio_mtok", "web_search_usd", "file_search_usd", "code_execution_usd",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Cost:
    """The price of one call. `known=False` means no price was found: `usd` is then 0 and the span
    must say `price_known = false` — it is never a silent $0."""

    usd: Decimal
    known: bool
    # What made up `usd`, by kind (input, cache_read, cache_write, output, reasoning, input_audio,
    # output_audio; request and a fee kind per provider-run tool): token kinds in USD per million
    # (`tokens`, divided only when `parts` is read: the span wants them, settlement does not),
    # fees in USD. Not part of equality.
    tokens: tuple[tuple[str, Decimal], ...] = field(default=(), compare=False)
    fees: tuple[tuple[str, Decimal], ...] = field(default=(), compare=False)

    @property
    def parts(self) -> tuple[tuple[str, Decimal], ...]:
        """USD by kind, zero parts left out (for the span: `attributes['cost.*']`)."""
        out = [(kind, v / _MTOK) for kind, v in self.tokens if v]
        return (*out, *((kind, v) for kind, v in self.fees if v))


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
    input_audio: _Tiers | None = None  # None: audio input tokens at the input rate
    output_audio: _Tiers | None = None  # None: audio output tokens at the output rate
    fees: tuple[tuple[str, Decimal], ...] = ()  # fee kind -> USD per use (genai-prices)


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

    fixed: _Rates | None  # an operator's price (the same for every option and time)
    model: gp.ModelInfo | None  # the genai-prices model (None for an operator's price)
    # (id(genai standard price), options) -> rates; the standard ModelPrice objects live in
    # self.model.prices, so their ids are stable, and options are validated by the adapters.
    by_price: dict[tuple[int, PriceOptions], _Rates | None]
    # options -> worst (input, output, audio input, audio output) USD per token
    worst: dict[PriceOptions, tuple[Decimal, Decimal, Decimal, Decimal] | None]
    declared: ModelPrice | None = None  # the operator's fees for this model (`[prices]`)
    static: bool = False  # one price whatever the time (its variants aside)

    def rates(self, now: datetime, options: PriceOptions = STANDARD) -> _Rates | None:
        if self.model is None or (not options and self.fixed is not None):
            return self.fixed  # an operator's price, or a price that does not change
        if self.static:
            # The one price of the model with a variant applied: computed once per variant.
            key = (0, options)
            if key not in self.by_price:
                self.by_price[key] = _flatten(
                    _with_variant(self.model, self.model.get_prices(now), now, options)
                )
            return self.by_price[key]
        price = self.model.get_prices(now)
        key = (id(price), options)
        if key not in self.by_price:
            self.by_price[key] = _flatten(_with_variant(self.model, price, now, options))
        return self.by_price[key]


class PriceBook:
    """Prices model calls from operator overrides and the bundled genai-prices snapshot."""

    def __init__(self, overrides: dict[str, ModelPrice] | None = None, *, cache_size: int = 4096) -> None:
        from genai_prices.data import providers  # the bundled snapshot; ~0.2 s to import

        self._overrides = {m: p for m, p in (overrides or {}).items() if p.tokens}
        self._fee_tables = {m: p for m, p in (overrides or {}).items() if not p.tokens}
        self._providers: list[gp.Provider] = providers
        self._by_id = {p.id: p for p in providers}
        # Bounded: model names come from clients, so an unbounded cache would be a memory leak.
        self._resolve = functools.lru_cache(maxsize=cache_size)(self._resolve_uncached)

    def cost(self, provider: str, model: str, usage: Usage, options: PriceOptions = STANDARD) -> Cost:
        """USD cost of one call, rounded up to 1e-9 so a run is never under-charged. `options`:
        the price variant the call was served at (`service_tier`, `speed`). A tool use whose fee
        nobody priced makes the cost unknown (never a silent $0 for it)."""
        resolved = self._resolve(provider, model)
        if resolved is None:
            return UNKNOWN_COST
        if resolved.fixed is not None and (not options or resolved.model is None):
            rates: _Rates | None = resolved.fixed
        else:
            rates = resolved.rates(datetime.now(UTC), options)
        if rates is None:
            return UNKNOWN_COST
        cache_read = usage.cache_read_tokens
        cache_write = usage.cache_write_tokens
        # Inconsistent counts from an upstream are resolved upwards, never downwards.
        input_tokens = max(usage.input_tokens, cache_read + cache_write)
        reasoning = usage.reasoning_tokens
        output_tokens = max(usage.output_tokens, reasoning)
        plain_in = input_tokens - cache_read - cache_write
        tokens: list[tuple[str, Decimal]] = []
        if rates.input_audio is not None and usage.input_audio_tokens:
            audio_in = min(usage.input_audio_tokens, plain_in)
            plain_in -= audio_in
            tokens.append(("input_audio", audio_in * _rate(rates.input_audio, input_tokens)))
        tokens.append(("input", plain_in * _rate(rates.input, input_tokens)))
        if cache_read:
            tokens.append(("cache_read", cache_read * _rate(rates.cache_read, input_tokens)))
        if cache_write:
            tokens.append(("cache_write", cache_write * _rate(rates.cache_write, input_tokens)))
        plain_out = output_tokens
        if rates.reasoning is not None:
            plain_out -= reasoning
            tokens.append(("reasoning", reasoning * _rate(rates.reasoning, input_tokens)))
        if rates.output_audio is not None and usage.output_audio_tokens:
            audio_out = min(usage.output_audio_tokens, plain_out)
            plain_out -= audio_out
            tokens.append(("output_audio", audio_out * _rate(rates.output_audio, input_tokens)))
        tokens.append(("output", plain_out * _rate(rates.output, input_tokens)))
        usd = sum((v for _, v in tokens), _ZERO) / _MTOK + rates.per_call
        fees: list[tuple[str, Decimal]] = [("request", rates.per_call)] if rates.per_call else []
        known = True
        for kind, uses in usage.tool_uses.items():
            if uses <= 0:
                continue
            fee = self._fee(resolved, rates, model, kind)
            if fee is None:
                known = False
                continue
            fees.append((kind, uses * fee))
            usd += uses * fee
        return Cost(usd.quantize(_USD_QUANTUM, rounding=ROUND_CEILING), known, tuple(tokens), tuple(fees))

    def worst_case_rates(
        self, provider: str, model: str, options: PriceOptions = STANDARD, *, audio: bool = False
    ) -> tuple[Decimal, Decimal] | None:
        """(USD per input token, USD per output token) upper bounds for a reservation: the highest
        of the input, cache-write and cache-read rates, and of the output and reasoning rates, over
        every long-context tier and every time-of-day or scheduled price — the rates `cost()` can
        charge — at the price variant `options` selects; with `audio`, the audio rates too (a call
        that may read or write audio). None when the model has no known price.

        A per-request fee (a few genai-prices models have one; no OpenAI/Anthropic chat model does)
        is not part of these rates.
        """
        resolved = self._resolve(provider, model)
        if resolved is None:
            return None
        if options not in resolved.worst:
            if len(resolved.worst) > 16:  # options are validated values: a handful per model
                resolved.worst.clear()
            resolved.worst[options] = _worst_rates(resolved, options)
        worst = resolved.worst[options]
        if worst is None:
            return None
        if audio:
            return max(worst[0], worst[2]), max(worst[1], worst[3])
        return worst[0], worst[1]

    def known_option(self, provider: str, model: str, options: PriceOptions) -> bool:
        """The model has a price for the variant `options` selects: an operator's price (it
        applies to every tier), or a genai-prices price variant matching it exactly."""
        resolved = self._resolve(provider, model)
        if resolved is None or resolved.model is None or not options:
            return resolved is not None
        assert resolved.model is not None
        wanted = dict(options)
        return any(v.when == wanted for v in resolved.model.price_variants or ())

    def option_values(self, provider: str, model: str, key: str) -> tuple[str, ...]:
        """The values of one option (`service_tier`) the model has price variants for."""
        resolved = self._resolve(provider, model)
        if resolved is None or resolved.model is None:
            return ()
        found = [v.when[key] for v in resolved.model.price_variants or () if set(v.when) == {key}]
        return tuple(dict.fromkeys(found))

    def fee(self, provider: str, model: str, kind: str, options: PriceOptions = STANDARD) -> Decimal | None:
        """USD per use of a provider-run tool (`FEE_KINDS`), None when nobody priced it."""
        resolved = self._resolve(provider, model)
        if resolved is None:
            return None
        rates = resolved.rates(datetime.now(UTC), options)
        return self._fee(resolved, rates, model, kind)

    def _fee(self, resolved: _Resolved, rates: _Rates | None, model: str, kind: str) -> Decimal | None:
        # The operator's price for this model, then the price table's, then the operator's
        # price for every model (`[prices."*"]`: fees the table lacks).
        if resolved.declared is not None and resolved.declared.fee(kind) is not None:
            return resolved.declared.fee(kind)
        if rates is not None:
            for name, fee in rates.fees:
                if name == kind:
                    return fee
        fallback = self._fee_tables.get("*")
        return fallback.fee(kind) if fallback is not None else None

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
        declared = self._fee_tables.get(model) or self._fee_tables.get(_DATE_SUFFIX.sub("", model))
        resolved: _Resolved | None
        if override is not None:
            resolved = _from_override(override)
        else:
            info = self._find_model(provider, model)
            if info is None:
                return None
            resolved = _from_genai(info)
        if resolved is not None:
            resolved.declared = override or declared
        return resolved

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
    audio_in = price.input_mtok if price.input_audio_mtok is None else price.input_audio_mtok
    audio_out = price.output_mtok if price.output_audio_mtok is None else price.output_audio_mtok
    rates = _Rates(
        input=_flat(price.input_mtok),
        output=_flat(price.output_mtok),
        cache_read=_flat(cache_read),
        cache_write=_flat(cache_write),
        reasoning=None,
        per_call=_ZERO,
        input_audio=_flat(audio_in),
        output_audio=_flat(audio_out),
    )
    worst = (
        max(price.input_mtok, cache_read, cache_write) / _MTOK,
        price.output_mtok / _MTOK,
        audio_in / _MTOK,
        audio_out / _MTOK,
    )
    return _Resolved(fixed=rates, model=None, by_price={}, worst=dict.fromkeys([STANDARD], worst))


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
    fees = tuple(
        (kind, items[key] / per)
        for kind, (key, per, _) in FEE_KINDS.items()
        if key is not None and isinstance(items.get(key), Decimal)
    )
    return _Rates(
        input=base_input,
        output=_tiers(items["output_mtok"]) if "output_mtok" in items else zero,
        # Unpriced cache reads/writes are ordinary input tokens (genai-prices does the same).
        cache_read=_tiers(items["cache_read_mtok"]) if "cache_read_mtok" in items else base_input,
        cache_write=_tiers(items["cache_write_mtok"]) if "cache_write_mtok" in items else base_input,
        reasoning=_tiers(reasoning) if reasoning is not None else None,
        per_call=per_call,
        input_audio=_tiers(items["input_audio_mtok"]) if "input_audio_mtok" in items else None,
        output_audio=_tiers(items["output_audio_mtok"]) if "output_audio_mtok" in items else None,
        fees=fees,
    )


def _with_variant(
    info: gp.ModelInfo, standard: gp.ModelPrice, now: datetime, options: PriceOptions
) -> gp.ModelPrice:
    """`standard` with the price variants `options` selects applied, like genai-prices'
    `ModelInfo.get_prices(..., price_context)` (first matching variant wins, per price key)."""
    if not options or not info.price_variants:
        return standard
    context = dict(options)
    overrides: dict[str, Any] = {}
    for variant in info.price_variants:
        if variant.constraint is not None and not variant.constraint.active(now):
            continue
        if not all(context.get(k) == v for k, v in variant.when.items()):
            continue
        for key, price in variant.prices.__dict__.items():
            if price is not None:
                overrides.setdefault(key, price)
    if not overrides:
        return standard
    resolved = copy.copy(standard)
    resolved.__dict__.update(overrides)
    return resolved


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


def _worst_rates(
    resolved: _Resolved, options: PriceOptions
) -> tuple[Decimal, Decimal, Decimal, Decimal] | None:
    if resolved.model is None:
        return resolved.worst.get(STANDARD)
    now = datetime.now(UTC)
    worst_in = worst_out = audio_in = audio_out = _ZERO
    for standard in _worst_case_prices(resolved.model, now):
        price = _with_variant(resolved.model, standard, now, options)
        if _flatten(price) is None:
            return None
        items = _price_items(price)
        for key in _INPUT_KEYS:
            if key in items:
                worst_in = max(worst_in, _max_rate(_tiers(items[key])))
        for key in _OUTPUT_KEYS:
            if key in items:
                worst_out = max(worst_out, _max_rate(_tiers(items[key])))
        if "input_audio_mtok" in items:
            audio_in = max(audio_in, _max_rate(_tiers(items["input_audio_mtok"])))
        if "output_audio_mtok" in items:
            audio_out = max(audio_out, _max_rate(_tiers(items["output_audio_mtok"])))
    return worst_in / _MTOK, worst_out / _MTOK, audio_in / _MTOK, audio_out / _MTOK


def _from_genai(info: gp.ModelInfo) -> _Resolved | None:
    resolved = _Resolved(fixed=None, model=info, by_price={}, worst={})
    worst = _worst_rates(resolved, STANDARD)
    if worst is None:
        return None
    resolved.worst[STANDARD] = worst
    if isinstance(info.prices, gp.ModelPrice):
        resolved.fixed = _flatten(info.prices)  # the standard price; variants via rates()
        resolved.static = True
    return resolved


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
