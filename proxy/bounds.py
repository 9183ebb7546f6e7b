"""How large each number and name runcap reads may be: one table, one checker.

Every number a client sends — a model request's `max_tokens` / `n` / `best_of`, a run header, a
top-up body, an admin query's parameters, an MCP message's fields — ends up in arithmetic, in a
ledger column (SQLite and Redis keep 64-bit integers) or in a Prometheus label. A value beyond what
any real call needs is refused here, at the edge, as a 400 naming the field and the bound, instead
of overflowing somewhere deeper (an `OverflowError` from SQLite was a bare 500).

The bounds are far above any real use and far below 2**63 even when multiplied together
(`MAX_OUTPUT_TOKENS * MAX_CHOICES` tokens priced at any model's price stays below 2**63 nano-dollars),
so sums over many calls of a run cannot overflow either.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

# A request's output-token limit (`max_tokens`, `max_completion_tokens`, `max_output_tokens`):
# the largest model outputs are a few hundred thousand tokens.
MAX_OUTPUT_TOKENS = 2**31 - 1
# `n` / `best_of`: generations per call (OpenAI documents at most 128).
MAX_CHOICES = 128
# A run's count caps (X-Run-Max-Tokens / -Steps / -Tool-Calls / -Context-Tokens, top-up fields).
MAX_CAP = 10**15
# A run's dollar cap (X-Run-Max-Usd, top-up `max_usd`); in nano-dollars it is 10**18 < 2**63.
MAX_USD = Decimal(1_000_000_000)
# A model name (request `model`): provider names are well below 100 characters; the name is a
# Prometheus label, a price-cache key and a span column.
MAX_MODEL_NAME = 256
# A token count an upstream reports in its usage: larger values are clipped to this (an upstream
# body never raises, but it must not overflow the ledger either).
MAX_REPORTED_TOKENS = 2**40
# JSON integers runcap passes on (admin SQL parameters, JSON-RPC ids): what a 64-bit column holds.
INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1


# Numbers written as text (run headers, top-up dollars) are ASCII (DESIGN.md "Run headers"):
# `[0-9]` rather than `\d`, which also reads Arabic-Indic and fullwidth digits; no `_`
# separators, exponents, signs, `inf` or `nan`.
ASCII_INT = re.compile(r"[0-9]+")
PLAIN_DECIMAL = re.compile(r"[0-9]+(\.[0-9]+)?")


class OutOfBounds(ValueError):
    """A value beyond its bound; the message names the field and the bound."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def whole_number(value: Any, field: str, *, minimum: int = 0, maximum: int) -> int:
    """`value` as an int in [minimum, maximum]; anything else (bool, float, str) raises
    `OutOfBounds` naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OutOfBounds(
            field, f"{field}: expected a whole number from {minimum} to {maximum}, got {_shown(value)}"
        )
    if value < minimum:
        raise OutOfBounds(field, f"{field}: {_shown(value)} is below {minimum}")
    if value > maximum:
        raise OutOfBounds(
            field, f"{field}: {_shown(value)} is above the largest value runcap accepts ({maximum})"
        )
    return value


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
        return text if len(text) <= 24 else f"a {len(text)}-digit number"
    if isinstance(value, float):
        return repr(value) if abs(value) < 1e15 else "a very large number"
    if isinstance(value, str):
        return repr(value[:40])
    if value is None:
        return "null"
    return type(value).__name__
