"""What a side-effecting tool call's idempotency key is derived from (DESIGN.md "Idempotent tool
calls"): the key itself is `proxy.hashing.idempotency_key`; each gateway names the operation
(`/tools`: method and sub-path; MCP: `mcp:{server}/{tool}`) and both restrict the arguments here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def key_args(arguments: Any, key_fields: Sequence[str] | None) -> Any:
    """The arguments that identify the operation: only the tool's `key_fields` when it has them
    (and the arguments are an object), else all of them."""
    if key_fields is None or not isinstance(arguments, dict):
        return arguments
    return {k: arguments[k] for k in key_fields if k in arguments}
