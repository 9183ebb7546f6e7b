"""What a request may be billed for beyond its tokens, read the same way for every wire format.

Priced or refused (DESIGN.md "Enforcement rules"): the adapters fill `RequestInfo`'s
`price_options` (the price variant `service_tier` / `speed` selects), `audio`, `hosted_tools`
(tools the provider runs for the model, their fee kind and limit) and `by_reference` (inputs the
body does not carry) from these readers, and `ResponseInfo.provider_tool_calls` / `Usage.tool_uses`
from the answer. The budget step prices and bounds them; nothing here knows about budgets.
"""

from __future__ import annotations

from typing import Any

from .base import BodyError, HostedTool, ToolCall
from .body import compact_json, text_of

PriceOptions = tuple[tuple[str, str], ...]
# Values that bill at the standard price.
STANDARD_VALUES = frozenset({"default", "standard"})

# OpenAI `service_tier`: what each value bills at, as genai-prices price-context candidates.
# "auto" is served at the project's tier, which runcap cannot see: every tier it may pick.
# "scale" is a prepaid commitment with no per-token price (`known_option` refuses it under a cap).
OPENAI_TIERS = ("auto", "default", "flex", "priority", "scale")
# Anthropic `speed` (fast mode): "fast" bills at its own price variant.
ANTHROPIC_SPEEDS = ("fast", "standard")


def openai_service_tier(body: dict[str, Any]) -> tuple[str, str] | None:
    """An OpenAI request's `service_tier` as a price-context pair (None: not set)."""
    return _price_variant(body, "service_tier", OPENAI_TIERS)


def anthropic_speed(body: dict[str, Any]) -> tuple[str, str] | None:
    return _price_variant(body, "speed", ANTHROPIC_SPEEDS)


def _price_variant(body: dict[str, Any], field: str, allowed: tuple[str, ...]) -> tuple[str, str] | None:
    """The request's `field`, one of `allowed`, as a price-context pair (None: not set)."""
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or value not in allowed:
        raise BodyError(f"{field} must be one of {', '.join(allowed)}, got {value!r}"[:200])
    return (field, value)


def served_tier(value: Any) -> PriceOptions | None:
    """The tier an OpenAI answer says it was served at (`service_tier`), None when it did not say."""
    if not isinstance(value, str) or value not in OPENAI_TIERS or value == "auto":
        return None
    return () if value == "default" else (("service_tier", value),)


# --- hosted tools ----------------------------------------------------------------------------

# OpenAI Responses: hosted tool type -> per-use fee kind (None: tokens only). `max_tool_calls`
# bounds their uses together. image_generation bills another model's image tokens: not priced.
_RESPONSES_HOSTED: dict[str, str | None] = {
    "web_search": "web_search",
    "web_search_preview": "web_search",
    "web_search_2025_08_26": "web_search",
    "web_search_preview_2025_03_11": "web_search",
    "file_search": "file_search",
    "code_interpreter": "code_execution",
    "mcp": None,
}
_RESPONSES_UNPRICED = frozenset({"image_generation"})

# Responses output item types of calls the provider executes -> (fee kind, name key, arguments key)
_RESPONSES_CALLS: dict[str, tuple[str | None, str | None, str]] = {
    "web_search_call": ("web_search", None, "action"),
    "file_search_call": ("file_search", None, "queries"),
    "code_interpreter_call": ("code_execution", None, "code"),
    "mcp_call": (None, "name", "arguments"),
    "image_generation_call": (None, None, "revised_prompt"),
}

# Anthropic server tools (type prefix) -> per-use fee kind; `max_uses` bounds each one's uses.
_ANTHROPIC_HOSTED: dict[str, str | None] = {"web_search_": "web_search", "web_fetch_": None}
# Server tools without a use limit runcap could set: their uses cannot be bounded.
_ANTHROPIC_UNBOUNDED = ("code_execution_", "mcp_toolset", "advisor_")


def responses_hosted_tools(tools: list[Any]) -> list[HostedTool]:
    hosted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind in _RESPONSES_HOSTED:
            hosted.append(HostedTool(str(kind), _RESPONSES_HOSTED[kind], None, i))
        elif kind in _RESPONSES_UNPRICED:
            hosted.append(HostedTool(str(kind), None, None, i, priced=False))
    return hosted


def anthropic_hosted_tools(tools: list[Any]) -> list[HostedTool]:
    hosted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            continue
        kind = tool["type"]
        for prefix, fee in _ANTHROPIC_HOSTED.items():
            if kind.startswith(prefix):
                limit = tool.get("max_uses")
                if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                    raise BodyError(f"tools[{i}].max_uses must be a positive integer, got {limit!r}"[:200])
                hosted.append(HostedTool(kind, fee, limit, i))
                break
        else:
            if kind.startswith(_ANTHROPIC_UNBOUNDED):
                hosted.append(HostedTool(kind, None, None, i, priced=False))
    return hosted


def set_anthropic_max_uses(body: dict[str, Any], hosted: list[HostedTool], uses: int) -> None:
    """Share `uses` among the server tools, round-robin, none above its own `max_uses`: the
    request's limits lowered, or set where it has none (a tool left with no use is removed:
    Anthropic takes no `max_uses: 0`)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return
    limited = [h for h in hosted if h.priced and 0 <= h.index < len(tools)]
    shares = dict.fromkeys((h.index for h in limited), 0)
    left = uses
    while left > 0:
        grew = False
        for h in limited:
            if left > 0 and (h.limit is None or shares[h.index] < h.limit):
                shares[h.index] += 1
                left -= 1
                grew = True
        if not grew:
            break
    for index, share in shares.items():
        if share > 0:
            tools[index]["max_uses"] = share
    drop = {index for index, share in shares.items() if share == 0}
    if drop:
        body["tools"] = [t for i, t in enumerate(tools) if i not in drop]


def responses_provider_calls(output: Any) -> tuple[list[ToolCall], dict[str, int]]:
    """Calls the provider executed (Responses output items) and the per-use fees they bill:
    one per search call; code interpreter per container session (calls sharing one count once)."""
    calls: list[ToolCall] = []
    uses: dict[str, int] = {}
    containers: set[str] = set()
    if not isinstance(output, list):
        return calls, uses
    for item in output:
        if not isinstance(item, dict):
            continue
        spec = _RESPONSES_CALLS.get(item.get("type"))  # type: ignore[arg-type]
        if spec is None:
            continue
        fee, name_key, args_key = spec
        kind = str(item["type"])
        name = text_of(item, name_key) if name_key else kind.removesuffix("_call")
        if kind == "mcp_call" and text_of(item, "server_label"):
            name = f"{text_of(item, 'server_label')}/{name}"
        args = item.get(args_key)
        arguments = args if isinstance(args, str) else compact_json(args)
        calls.append(ToolCall(text_of(item, "id"), name, arguments))
        if fee == "code_execution":
            container = text_of(item, "container_id") or text_of(item, "id")
            if container in containers:
                continue
            containers.add(container)
        if fee is not None:
            uses[fee] = uses.get(fee, 0) + 1
    return calls, uses


def anthropic_provider_calls(content: Any) -> list[ToolCall]:
    """`server_tool_use` / `mcp_tool_use` blocks of an Anthropic answer."""
    calls = []
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") in ("server_tool_use", "mcp_tool_use"):
                name = text_of(block, "name")
                if block.get("type") == "mcp_tool_use" and text_of(block, "server_name"):
                    name = f"{text_of(block, 'server_name')}/{name}"
                calls.append(ToolCall(text_of(block, "id"), name, compact_json(block.get("input"))))
    return calls


# --- inputs by reference -----------------------------------------------------------------------


def count_references(value: Any, is_reference: Any) -> int:
    """Parts of `value` (content blocks at any depth) for which `is_reference(part)` holds."""
    if isinstance(value, list):
        return sum(count_references(v, is_reference) for v in value)
    if isinstance(value, dict):
        if is_reference(value):
            return 1
        return sum(count_references(v, is_reference) for v in value.values() if isinstance(v, list | dict))
    return 0
