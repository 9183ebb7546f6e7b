"""Money as integer nano-dollars (1e-9 USD), the resolution of the spans' Decimal(18, 9) column.

The ledger adds and compares integers only, so a reservation and its settlement never drift by
binary-float rounding, and a Redis Lua script or SQLite row holds the same exact numbers.
Prices stay exact Decimals in USD per million tokens; a cost in nano-dollars rounds up, never
down, so a reservation is never smaller than what the call can cost.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

NANOS_PER_USD = 1_000_000_000
_NANO = Decimal("0.000000001")


def usd_to_nanos(usd: Decimal) -> int:
    """A cap or price given in dollars → nano-dollars, rounded down (a cap is never raised)."""
    return int((usd * NANOS_PER_USD).to_integral_value(rounding=ROUND_FLOOR))


def nanos_to_usd(nanos: int) -> Decimal:
    return (Decimal(nanos) / NANOS_PER_USD).quantize(_NANO)


def format_usd(nanos: int) -> str:
    """Money on the wire: a decimal string with 9 places, never a binary float."""
    return f"{nanos_to_usd(nanos):f}"


def tokens_cost_nanos(tokens: int, usd_per_mtok: Decimal) -> int:
    """Cost of `tokens` at a rate in USD per million tokens, rounded up to a nano-dollar."""
    if tokens <= 0 or not usd_per_mtok:
        return 0
    return int((Decimal(tokens) * usd_per_mtok * 1000).to_integral_value(rounding=ROUND_CEILING))


def tokens_affordable(nanos: int, usd_per_mtok: Decimal) -> int:
    """How many tokens `nanos` buys at a rate in USD per million tokens (rounded down)."""
    if not usd_per_mtok:
        return 1 << 62
    if nanos <= 0:
        return 0
    n = int((Decimal(nanos) / (usd_per_mtok * 1000)).to_integral_value(rounding=ROUND_FLOOR))
    # Rounding up per call in tokens_cost_nanos can make n tokens cost one nano more than nanos.
    while n > 0 and tokens_cost_nanos(n, usd_per_mtok) > nanos:
        n -= 1
    return n
