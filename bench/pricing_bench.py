"""PriceBook.cost against genai-prices' own calc_price, per call (moved out of tests/unit/test_pricing.py:
a timing ratio is a measurement, not a test — issue 28).

    .venv/bin/python -m bench.pricing_bench [--calls 300] [--repeats 3]

Prints the best per-call time of each over `repeats` rounds of `calls` calls, and their ratio.
The PriceBook's flattened fast path is meant to be at least 3x cheaper.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import genai_prices

from proxy.pricing import PriceBook
from proxy.providers.base import Usage

MODEL = "claude-sonnet-4-20250514"


def per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    book = PriceBook()
    usage = Usage(input_tokens=5000, cache_read_tokens=4000, cache_write_tokens=500, output_tokens=300)
    g_usage = genai_prices.Usage(
        input_tokens=usage.input_tokens, cache_read_tokens=usage.cache_read_tokens,
        cache_write_tokens=usage.cache_write_tokens, output_tokens=usage.output_tokens,
    )  # fmt: skip
    ours = per_call(lambda: book.cost("anthropic", MODEL, usage), args.calls, args.repeats)
    theirs = per_call(
        lambda: genai_prices.calc_price(g_usage, MODEL, provider_id="anthropic"), args.calls, args.repeats
    )
    print(f"PriceBook.cost      {ours * 1e6:8.2f} µs/call")
    print(f"genai calc_price    {theirs * 1e6:8.2f} µs/call")
    print(f"ratio               {theirs / ours:8.1f}x (target ≥ 3x)")


if __name__ == "__main__":
    main()
