"""Offload: old, large tool results go out of band, behind a handle the model can fetch.

Every tool result (chat `tool` messages, Responses `*_output` items, Anthropic `tool_result`
blocks) older than the last `keep_last_steps` assistant turns and larger than
`offload_min_bytes` (UTF-8) is replaced by its head and tail around a note naming its size and
handle, `runcap:sha256/<sha256 of its UTF-8 bytes>`. The full text is returned in `handles`
(the payload store keeps it under the same hash) and `runcap_fetch` is added to the tools.

Deterministic by construction — the same body always gives the same bytes — so a provider's
prompt cache keeps hitting across steps: a result offloaded once is offloaded identically in
every later request. The agent's body is not mutated: changed items are copies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.context import FETCH_TOOL, HANDLE_PREFIX, ContextSettings
from proxy.context.conversation import items_key, items_of, text_content, turn_starts

FETCH_DESCRIPTION = (
    "Read part of a tool result that runcap shortened to save context. Shortened results show "
    "their start and end and a note with their handle (runcap:sha256/...) and size in bytes. "
    "Returns the UTF-8 text of bytes [offset, offset+length) of the full result."
)
FETCH_MAX_LENGTH = 16_384  # bytes one runcap_fetch call returns at most
FETCH_DEFAULT_LENGTH = 4_096
_FETCH_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "handle": {"type": "string", "description": "the handle, runcap:sha256/<hex>"},
        "offset": {"type": "integer", "description": "first byte to read (default 0)"},
        "length": {
            "type": "integer",
            "description": f"bytes to read (default {FETCH_DEFAULT_LENGTH}, at most {FETCH_MAX_LENGTH})",
        },
    },
    "required": ["handle"],
}


def fetch_tool_definition(endpoint: str) -> dict[str, Any]:
    if endpoint == "chat.completions":
        return {
            "type": "function",
            "function": {
                "name": FETCH_TOOL,
                "description": FETCH_DESCRIPTION,
                "parameters": _FETCH_PARAMETERS,
            },
        }
    if endpoint == "responses":
        return {
            "type": "function",
            "name": FETCH_TOOL,
            "description": FETCH_DESCRIPTION,
            "parameters": _FETCH_PARAMETERS,
            "strict": False,
        }
    return {"name": FETCH_TOOL, "description": FETCH_DESCRIPTION, "input_schema": _FETCH_PARAMETERS}


@dataclass(slots=True)
class Offloaded:
    body: dict[str, Any]  # a new body (the agent's is left as it was)
    handles: dict[str, bytes] = field(default_factory=dict)  # sha256 hex -> full result


def stub(text: str, settings: ContextSettings) -> tuple[str, str, bytes] | None:
    """The shortened form of a result: (replacement text, sha256 hex, full bytes), or None when
    the result stays whole (small, or no shorter than its stub)."""
    if len(text) <= settings.offload_min_bytes and text.isascii():
        return None  # fast path: an ASCII text's length is its size in bytes
    data = text.encode("utf-8", "surrogatepass")
    size = len(data)
    if size <= settings.offload_min_bytes:
        return None
    digest = hashlib.sha256(data).hexdigest()
    # Cut on UTF-8 boundaries: a partial character at the edge is dropped, never mangled.
    head = data[: settings.head_bytes].decode("utf-8", "ignore")
    head_end = len(head.encode("utf-8", "surrogatepass"))
    tail = (
        data[max(head_end, size - settings.tail_bytes) :].decode("utf-8", "ignore")
        if settings.tail_bytes
        else ""
    )
    tail_start = size - len(tail.encode("utf-8", "surrogatepass"))
    note = (
        f"\n[runcap: {size} bytes offloaded, bytes {head_end}-{tail_start} not shown; "
        f"handle {HANDLE_PREFIX}{digest}; call {FETCH_TOOL}(handle, offset, length) for more]\n"
    )
    replacement = head + note + tail
    if len(replacement) >= len(text):
        return None
    return replacement, digest, data


def offload(body: dict[str, Any], endpoint: str, settings: ContextSettings) -> Offloaded | None:
    """Offload `body`'s old large tool results; None when nothing qualifies (the body is then
    forwarded unchanged)."""
    items = items_of(body, endpoint)
    if not items:
        return None
    starts = turn_starts(items, endpoint)
    keep = settings.keep_last_steps
    if keep <= 0:
        cutoff = len(items)
    elif len(starts) < keep:
        return None
    else:
        cutoff = starts[-keep]  # results of the last `keep` turns come after this item
    handles: dict[str, bytes] = {}
    older = _copy_on_write(items[:cutoff], lambda item: _offload_item(item, endpoint, settings, handles))
    if older is None:
        return None
    new_body = dict(body)
    new_body[items_key(endpoint)] = [*older, *items[cutoff:]]
    new_body["tools"] = [*(body.get("tools") or ()), fetch_tool_definition(endpoint)]
    return Offloaded(new_body, handles)


def _copy_on_write(seq: list[Any], replace: Callable[[Any], Any | None]) -> list[Any] | None:
    """`seq` with every element `replace` gives a value for replaced by that value; None when
    there is none (the agent's body is never changed: a copy is made at the first replacement)."""
    out: list[Any] | None = None
    for i, value in enumerate(seq):
        replaced = replace(value)
        if replaced is not None:
            if out is None:
                out = list(seq)
            out[i] = replaced
    return out


def _offload_item(
    item: Any, endpoint: str, settings: ContextSettings, handles: dict[str, bytes]
) -> dict[str, Any] | None:
    if not isinstance(item, dict):
        return None
    if endpoint == "chat.completions":
        if item.get("role") != "tool":
            return None
        return _replace(item, "content", settings, handles)
    if endpoint == "responses":
        kind = item.get("type")
        if not (isinstance(kind, str) and kind.endswith("_call_output")):
            return None
        return _replace(item, "output", settings, handles)
    content = item.get("content")
    if item.get("role") != "user" or not isinstance(content, list):
        return None
    new_content = _copy_on_write(
        content,
        lambda block: _replace(block, "content", settings, handles)
        if isinstance(block, dict) and block.get("type") == "tool_result"
        else None,
    )
    if new_content is None:
        return None
    return {**item, "content": new_content}


def _replace(
    obj: dict[str, Any], key: str, settings: ContextSettings, handles: dict[str, bytes]
) -> dict[str, Any] | None:
    text = text_content(obj.get(key))
    if text is None:
        return None
    cut = stub(text, settings)
    if cut is None:
        return None
    replacement, digest, data = cut
    handles[digest] = data
    return {**obj, key: replacement}
