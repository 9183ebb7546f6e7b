"""The provider's bill for a usage, computed independently of runcap with genai-prices' own
`calc_price`: what the priced-or-refused tests compare runcap's settled spend with."""

from __future__ import annotations

import genai_prices
from genai_prices.types import PriceCalculation

from proxy.providers.base import Usage


def genai_price(provider: str, model: str, usage: Usage, context: dict[str, str] | None) -> PriceCalculation:
    """genai-prices' price of `usage` (as the upstream reported it) for `model` at `provider`."""
    u = genai_prices.Usage(
        input_tokens=usage.input_tokens,
        cache_read_tokens=usage.cache_read_tokens or None,
        cache_write_tokens=usage.cache_write_tokens or None,
        output_tokens=usage.output_tokens,
        input_audio_tokens=usage.input_audio_tokens or None,
        output_audio_tokens=usage.output_audio_tokens or None,
        web_searches=usage.tool_uses.get("web_search") or None,
        storage_searches=usage.tool_uses.get("file_search") or None,
    )
    return genai_prices.calc_price(u, model, provider_id=provider, price_context=context)
