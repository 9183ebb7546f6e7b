"""PriceBook against hand-computed published rates and against genai-prices' own calc_price."""

from __future__ import annotations

import socket
import threading
from decimal import ROUND_CEILING, Decimal

import genai_prices
import pytest
from genai_prices import data_snapshot
from genai_prices import types as gp

from proxy.pricing import Cost, ModelPrice, PriceBook, max_output_tokens
from proxy.providers.base import Usage

M = Decimal(1_000_000)


@pytest.fixture(scope="module")
def book() -> PriceBook:
    return PriceBook()


def test_gpt_4o_mini_by_hand(book: PriceBook) -> None:
    # Published: $0.15 / M input, $0.075 / M cached input, $0.60 / M output (reasoning included).
    usage = Usage(input_tokens=1000, cache_read_tokens=400, output_tokens=500, reasoning_tokens=200)
    expected = (600 * Decimal("0.15") + 400 * Decimal("0.075") + 500 * Decimal("0.6")) / M
    assert book.cost("openai", "gpt-4o-mini", usage) == Cost(Decimal("0.000420000"), True)
    assert expected == Decimal("0.00042")
    # The dated snapshot name the API echoes back is priced the same.
    assert book.cost("openai", "gpt-4o-mini-2024-07-18", usage) == Cost(Decimal("0.000420000"), True)


def test_claude_3_5_haiku_cache_read_and_write_by_hand(book: PriceBook) -> None:
    # Published: $0.80 / M input, $0.08 / M cache read, $1.00 / M cache write (5 min), $4 / M output.
    # runcap's input_tokens counts ALL input: 1000 uncached + 6000 read + 3000 written.
    usage = Usage(input_tokens=10_000, cache_read_tokens=6000, cache_write_tokens=3000, output_tokens=700)
    expected = (1000 * Decimal("0.8") + 6000 * Decimal("0.08") + 3000 * Decimal("1") + 700 * Decimal("4")) / M
    got = book.cost("anthropic", "claude-3-5-haiku-20241022", usage)
    assert got == Cost(expected.quantize(Decimal("1e-9")), True)
    assert got.usd == Decimal("0.007080000")


def test_claude_sonnet_4_cache_read_and_write_by_hand(book: PriceBook) -> None:
    # Published: $3 / M input, $0.30 / M cache read, $3.75 / M cache write, $15 / M output.
    usage = Usage(input_tokens=50_000, cache_read_tokens=40_000, cache_write_tokens=8000, output_tokens=1234)
    expected = (
        2000 * Decimal("3") + 40_000 * Decimal("0.3") + 8000 * Decimal("3.75") + 1234 * Decimal("15")
    ) / M
    assert book.cost("anthropic", "claude-sonnet-4-20250514", usage).usd == expected.quantize(Decimal("1e-9"))
    assert expected == Decimal("0.06651")


def _genai_usage(u: Usage) -> genai_prices.Usage:
    return genai_prices.Usage(
        input_tokens=u.input_tokens,
        cache_read_tokens=u.cache_read_tokens,
        cache_write_tokens=u.cache_write_tokens,
        output_tokens=u.output_tokens,
        output_reasoning_tokens=u.reasoning_tokens,
    )


USAGES = [
    Usage(input_tokens=1000, output_tokens=500),
    Usage(input_tokens=123_457, cache_read_tokens=100_000, cache_write_tokens=3001, output_tokens=977),
    Usage(
        input_tokens=300_001,
        cache_read_tokens=50_000,
        cache_write_tokens=7,
        output_tokens=40_000,
        reasoning_tokens=30_000,
    ),
    Usage(input_tokens=1, output_tokens=1, reasoning_tokens=1),
    Usage(),
]


def test_matches_genai_prices_calc_price_for_every_model(book: PriceBook) -> None:
    """The flattened fast path gives genai-prices' own answer (rounded up to 1e-9)."""
    compared = 0
    for provider in data_snapshot.get_snapshot().providers:
        for model in provider.models:
            if not model.is_match(model.id):
                continue
            for usage in USAGES:
                theirs = genai_prices.calc_price(_genai_usage(usage), model.id, provider_id=provider.id)
                ours = book.cost(provider.id, model.id, usage)
                if not ours.known:
                    continue
                expected = theirs.total_price.quantize(Decimal("1e-9"), rounding=ROUND_CEILING)
                assert ours.usd == expected, (provider.id, model.id, usage, theirs)
                compared += 1
    assert compared > 5000


def test_openai_and_anthropic_models_are_all_priced(book: PriceBook) -> None:
    for pid in ("openai", "anthropic"):
        provider = next(p for p in data_snapshot.get_snapshot().providers if p.id == pid)
        for model in provider.models:
            if model.is_match(model.id) and "input_mtok" in str(model.prices) + repr(model.prices):
                assert book.is_priced(pid, model.id), model.id


def test_unknown_model_is_flagged_never_silent_zero(book: PriceBook) -> None:
    usage = Usage(input_tokens=10, output_tokens=10)
    assert book.cost("local", "my-own-llama", usage) == Cost(Decimal(0), False)
    assert book.worst_case_rates("local", "my-own-llama") is None
    assert not book.is_priced("local", "my-own-llama")
    assert not book.is_priced("openai", "gpt-unknown-model-xyz")
    # A model priced only per audio hour cannot price tokens: unknown, not $0.
    assert book.cost("openai", "gpt-live-1", usage).known is False


def test_configured_upstream_matches_model_across_providers(book: PriceBook) -> None:
    usage = Usage(input_tokens=1000, output_tokens=1000)
    assert book.cost("local", "gpt-4o-mini", usage) == book.cost("openai", "gpt-4o-mini", usage)
    assert book.cost("gateway", "claude-3-5-haiku-20241022", usage).usd == Decimal("0.004800000")
    # a claude model behind the OpenAI-style route (an OpenAI-compatible gateway) is still priced
    assert book.cost("openai", "claude-3-5-haiku-20241022", usage).usd == Decimal("0.004800000")


def test_override_exact_then_dated_snapshot() -> None:
    book = PriceBook({"my-finetune": ModelPrice(1.0, 2.0), "gpt-4o-mini": ModelPrice(Decimal(1), Decimal(2))})
    usage = Usage(input_tokens=1_000_000, output_tokens=1_000_000)
    assert book.cost("local", "my-finetune", usage) == Cost(Decimal("3.000000000"), True)
    assert book.cost("local", "my-finetune-2025-01-31", usage).usd == Decimal(3)
    assert book.cost("local", "my-finetune-20250131", usage).usd == Decimal(3)
    assert book.cost("local", "my-finetune-v2", usage).known is False
    # The override wins over genai-prices, for the undated and the dated name alike.
    assert book.cost("openai", "gpt-4o-mini", usage).usd == Decimal(3)
    assert book.cost("openai", "gpt-4o-mini-2024-07-18", usage).usd == Decimal(3)
    assert book.worst_case_rates("openai", "gpt-4o-mini") == (Decimal(1) / 10**6, Decimal(2) / 10**6)


def test_override_cache_rates_default_to_input() -> None:
    book = PriceBook(
        {
            "a": ModelPrice(Decimal(2), Decimal(8)),
            "b": ModelPrice(
                Decimal(2), Decimal(8), cache_read_mtok=Decimal("0.5"), cache_write_mtok=Decimal(5)
            ),
        }
    )
    usage = Usage(input_tokens=1000, cache_read_tokens=500, cache_write_tokens=200, output_tokens=100)
    assert book.cost("x", "a", usage).usd == Decimal("0.002800000")  # (1000*2 + 100*8) / 1e6
    assert book.cost("x", "b", usage).usd == (300 * 2 + Decimal(250) + 1000 + 800) / M
    assert book.worst_case_rates("x", "b") == (Decimal(5) / M, Decimal(8) / M)


def test_model_price_validation() -> None:
    assert ModelPrice(0.15, 0.6).input_mtok == Decimal("0.15")  # via str(), not the binary float
    with pytest.raises(ValueError, match="input_mtok"):
        ModelPrice(Decimal(-1), Decimal(1))
    with pytest.raises(ValueError, match="output_mtok"):
        ModelPrice(Decimal(1), "nan")  # type: ignore[arg-type]


def test_cost_rounds_up_to_nano_dollars() -> None:
    book = PriceBook({"tiny": ModelPrice(Decimal("0.0001"), Decimal("0.0001"))})
    got = book.cost("x", "tiny", Usage(input_tokens=1))  # 1e-10 USD
    assert got == Cost(Decimal("0.000000001"), True)
    assert got.usd.as_tuple().exponent == -9


def test_inconsistent_counts_are_charged_upwards(book: PriceBook) -> None:
    # cache parts larger than the total: the parts are charged, not a negative remainder
    odd = book.cost("anthropic", "claude-sonnet-4-0", Usage(input_tokens=10, cache_read_tokens=1000))
    assert odd.usd == (1000 * Decimal("0.3") / M).quantize(Decimal("1e-9"))


def test_worst_case_rates_take_the_highest_tier(book: PriceBook) -> None:
    # claude-sonnet-4-5: above 200k input tokens every rate doubles (output x1.5).
    tiers = book.worst_case_rates("anthropic", "claude-sonnet-4-5-20250929")
    assert tiers == (Decimal("7.5") / M, Decimal("22.5") / M)  # tier cache write, tier output
    flat = book.worst_case_rates("openai", "gpt-4o-mini")
    assert flat == (Decimal("0.15") / M, Decimal("0.6") / M)
    # And the reservation bounds the actual cost of a long-context call at any split.
    in_rate, out_rate = tiers
    for usage in USAGES:
        cost = book.cost("anthropic", "claude-sonnet-4-5", usage).usd
        assert cost <= usage.input_tokens * in_rate + usage.output_tokens * out_rate + Decimal("1e-9")


def test_worst_case_covers_time_of_day_prices(book: PriceBook) -> None:
    # deepseek prices change with the time of day; a reservation must hold in either window.
    provider = next(p for p in data_snapshot.get_snapshot().providers if p.id == "deepseek")
    model = provider.find_model("deepseek-chat")
    assert model is not None and not isinstance(model.prices, gp.ModelPrice)
    highest_out = max(Decimal(c.prices.output_mtok) for c in model.prices)
    rates = book.worst_case_rates("deepseek", "deepseek-chat")
    assert rates is not None and rates[1] == highest_out / M


def test_offline_and_pinned_to_bundled_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("pricing tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    # Even if another library in the process installed an updated (here: empty) snapshot,
    # runcap keeps pricing from the bundled data.
    data_snapshot.set_custom_snapshot(data_snapshot.DataSnapshot(providers=[], from_auto_update=True))
    try:
        book = PriceBook()
        assert book.cost("openai", "gpt-4o-mini", Usage(input_tokens=1_000_000)).usd == Decimal("0.15")
    finally:
        data_snapshot.set_custom_snapshot(None)
    assert not any(t.name.startswith("genai_prices") for t in threading.enumerate())


def test_lookup_cache_is_bounded() -> None:
    book = PriceBook(cache_size=8)
    for i in range(100):
        book.cost("local", f"random-model-{i}", Usage(input_tokens=1))
    assert book._resolve.cache_info().currsize == 8


# The PriceBook-vs-calc_price timing is a measurement: bench/pricing_bench.py.


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("gpt-4o", 16384),
        ("gpt-4o-2024-08-06", 16384),
        ("gpt-4o-mini-2024-07-18", 16384),
        ("gpt-4.1-mini-2025-04-14", 32768),
        ("o3-mini-2025-01-31", 100000),
        ("o1-mini", 65536),
        ("gpt-3.5-turbo-0125", 4096),
        ("gpt-4-turbo-2024-04-09", 4096),
        ("claude-3-5-haiku-20241022", 8192),
        ("claude-3-5-sonnet-latest", 8192),
        ("claude-3-opus-20240229", 4096),
        ("claude-3-haiku-20240307", 4096),
        ("claude-3-7-sonnet-20250219", 64000),
        ("claude-sonnet-4-20250514", 64000),
        ("claude-opus-4-20250514", 32000),
        ("my-own-llama", None),
        ("gpt-4o-search-preview", None),
    ],
)
def test_max_output_tokens(model: str, expected: int | None) -> None:
    assert max_output_tokens("openai", model) == expected


BILLED_USAGES = [
    Usage(input_tokens=4000, output_tokens=2500, input_audio_tokens=1500, output_audio_tokens=2000),
    Usage(input_tokens=250_000, cache_read_tokens=1000, output_tokens=900, tool_uses={"web_search": 7}),
    Usage(input_tokens=3000, output_tokens=10, tool_uses={"file_search": 3, "web_search": 1}),
]


def test_price_variants_audio_and_searches_match_genai_prices(book: PriceBook) -> None:
    """Every price variant (service tier, fast mode, batch...), audio tokens and search fees
    priced like genai-prices' `calc_price(..., price_context=...)`; the worst-case rates of a
    variant bound what it charges; a variant the model lacks is not `known_option`."""
    compared = 0
    for provider in data_snapshot.get_snapshot().providers:
        for model in provider.models:
            if not model.is_match(model.id):
                continue
            contexts = [{}] + [dict(v.when) for v in model.price_variants or ()]
            for context in contexts:
                options = tuple(sorted(context.items()))
                assert book.known_option(provider.id, model.id, options) or not book.is_priced(
                    provider.id, model.id
                )
                for usage in BILLED_USAGES:
                    ours = book.cost(provider.id, model.id, usage, options)
                    if not ours.known:
                        continue
                    u = genai_prices.Usage(
                        input_tokens=usage.input_tokens,
                        cache_read_tokens=usage.cache_read_tokens or None,
                        output_tokens=usage.output_tokens,
                        input_audio_tokens=usage.input_audio_tokens or None,
                        output_audio_tokens=usage.output_audio_tokens or None,
                        web_searches=usage.tool_uses.get("web_search"),
                        storage_searches=usage.tool_uses.get("file_search"),
                    )
                    theirs = genai_prices.calc_price(
                        u, model.id, provider_id=provider.id, price_context=context or None
                    )
                    expected = theirs.total_price.quantize(Decimal("1e-9"), rounding=ROUND_CEILING)
                    assert ours.usd == expected, (provider.id, model.id, context, usage, theirs)
                    assert sum((v for _, v in ours.parts), Decimal(0)) == theirs.total_price
                    compared += 1
    assert compared > 1000
    assert not book.known_option("openai", "gpt-4o-mini", (("service_tier", "flex"),))
    assert book.known_option("openai", "gpt-5", (("service_tier", "flex"),))


def test_worst_case_rates_cover_the_variant_and_audio(book: PriceBook) -> None:
    std = book.worst_case_rates("openai", "gpt-5")
    prio = book.worst_case_rates("openai", "gpt-5", (("service_tier", "priority"),))
    assert std is not None and prio is not None
    assert prio == (2 * std[0], 2 * std[1])  # $2.50 / $20 per M
    text = book.worst_case_rates("openai", "gpt-audio")
    audio = book.worst_case_rates("openai", "gpt-audio", audio=True)
    assert text == (Decimal("2.5") / 10**6, Decimal(10) / 10**6)
    assert audio == (Decimal(32) / 10**6, Decimal(64) / 10**6)


def test_declared_fees(book: PriceBook) -> None:
    declared = PriceBook(
        {
            "*": ModelPrice(None, None, code_execution_usd=Decimal("0.03"), web_search_usd=1, tokens=False),
            "gpt-4o": ModelPrice(None, None, web_search_usd=Decimal("0.05"), tokens=False),
        }
    )
    usage = Usage(input_tokens=10, output_tokens=10, tool_uses={"web_search": 2, "code_execution": 1})
    # gpt-5: genai-prices' $10/1k searches (the "*" table only fills what the table lacks)
    cost = declared.cost("openai", "gpt-5", usage)
    assert dict(cost.parts)["web_search"] == Decimal("0.02") and dict(cost.parts)[
        "code_execution"
    ] == Decimal("0.03")
    assert dict(declared.cost("openai", "gpt-4o", usage).parts)["web_search"] == Decimal("0.10")
    # Without a declaration, a fee nobody priced makes the cost unknown, never a silent $0.
    assert book.cost("openai", "gpt-5", usage).known is False
    assert book.fee("openai", "gpt-5", "code_execution") is None
