"""Shared readers of JSON bodies for the provider adapters.

Two things every wire format needs and none should re-implement: typed access to request fields
that raises `BodyError` naming the field, and the tokenizer-free input-token bound.

Why bytes bound tokens: every tokenizer the providers use is a byte-level BPE (or has byte
fallback), so each token the model reads from a text covers at least one UTF-8 byte of it; the
token count of a text is therefore at most its byte count. What the provider adds around the
texts (role markers, message separators, the tool-use preamble) is not in the body, so each
message adds `MESSAGE_OVERHEAD`, each request `BASE_OVERHEAD`, and a request with tools
`TOOL_PROMPT_BOUND` (Anthropic documents a tool-use system prompt of a few hundred tokens).
Structures the model reads as JSON (tool definitions, tool-call inputs, schemas) count the bytes
of their compact serialization. Keys of content objects are counted too: that over-counts a few
bytes per part, but makes any free-form object the model may read a bound without knowing it.

Media are not text: an image or a file referenced by URL or id costs what the provider renders
it to, which is bounded by `MEDIA_TOKEN_BOUND` (images top out at a few thousand tokens);
inline base64 counts its bytes, but at least `MEDIA_TOKEN_BOUND`, because a tiny image can be
upscaled to a full tile grid (a 1x2 PNG is ~100 bytes and ~1100 tokens at OpenAI high detail).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from proxy.bounds import MAX_MODEL_NAME, MAX_OUTPUT_TOKENS, MAX_REPORTED_TOKENS

from .base import NO_USES, BodyError, Usage

# A fixed bound for one non-text part (image, audio, a file by reference). Images are at most a
# few thousand tokens on every current model; multi-page documents can exceed it.
MEDIA_TOKEN_BOUND = 6000
# Per message/item: role markers and separators of the chat template.
MESSAGE_OVERHEAD = 8
# Per request: the template's start and the assistant priming.
BASE_OVERHEAD = 16
# Added once when tools are present: the provider's hidden tool-use preamble.
TOOL_PROMPT_BOUND = 1200
# Per provider-defined tool whose definition is not in the body (web search, computer use, ...).
BUILTIN_TOOL_BOUND = 2000

# A format's own bounds for objects that are not plain text (media parts, structured tool inputs
# read as JSON), by their "type"; every other object counts its keys and values.
PartBounds = Mapping[str, Callable[[dict[str, Any]], int]]


def text_bytes(text: str) -> int:
    """UTF-8 length of `text` (without copying it when it is ASCII, the common case)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def json_bytes(value: Any) -> int:
    """Length of the compact JSON serialization of `value` (orjson writes UTF-8, no escapes)."""
    try:
        return len(orjson.dumps(value))
    except TypeError:  # not serializable as-is (lone surrogates, huge ints): walk it instead
        return content_bound(value, {})


def inline_media_bound(data: Any) -> int:
    """Bound for a media part carried inline (base64 or data: URL)."""
    if isinstance(data, str):
        return max(MEDIA_TOKEN_BOUND, text_bytes(data))
    return MEDIA_TOKEN_BOUND


def url_media_bound(url: Any) -> int:
    """Bound for a media part given by URL: inline when it is a data: URL, fixed otherwise."""
    if isinstance(url, str) and url.startswith("data:"):
        return inline_media_bound(url)
    return MEDIA_TOKEN_BOUND


def content_bound(value: Any, parts: PartBounds) -> int:
    """Bound on the tokens of a JSON value the model reads: bytes of every key and string,
    digits of numbers, and `parts[type](obj)` for each object of a type the format bounds."""
    if isinstance(value, str):
        return text_bytes(value)
    if isinstance(value, list):
        return sum([content_bound(item, parts) for item in value])
    if isinstance(value, dict):
        special = parts.get(value.get("type"))  # type: ignore[arg-type]
        if special is not None:
            return special(value)
        total = 0
        for key, item in value.items():
            total += text_bytes(key) + content_bound(item, parts)
        return total
    if value is None or isinstance(value, bool):
        return 5  # null/true/false
    return len(str(value))


class ContentBound:
    """A format's input-token bound for content: `content_bound` with the format's part bounds.

    Fast path: the compact JSON of the content is a bound too (it holds every string and key,
    plus punctuation), and orjson writes it far faster than Python walks it, so the walk only
    runs when the JSON holds a media part, which must not count its bytes. A media part always
    serializes as `"type":"<media type>"`; text that merely quotes one is escaped
    (`\\"type\\":...`) and does not match, so it costs no walk.
    """

    __slots__ = ("_markers", "parts")

    def __init__(self, parts: PartBounds, media: tuple[str, ...]) -> None:
        self.parts = parts
        self._markers = tuple(b'"type":"' + kind.encode() + b'"' for kind in media)

    def __call__(self, value: Any) -> int:
        return self.with_json(value)[0]

    def with_json(self, value: Any) -> tuple[int, bytes]:
        """The bound, and the compact JSON it was read from (b"" when it could not be written),
        for a caller that looks for markers in it too (proxy/providers/billable.py)."""
        try:
            blob = orjson.dumps(value)
        except TypeError:
            return content_bound(value, self.parts), b""
        for marker in self._markers:
            if marker in blob:
                return content_bound(value, self.parts), blob
        return len(blob), blob


# --- request fields -------------------------------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return repr(value) if abs(value) < 1e15 else "a number"
    if isinstance(value, str):
        return "a string" if value else "an empty string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def request_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BodyError(f"request body must be a JSON object, got {_kind(body)}")
    return body


def model_field(body: dict[str, Any], required: bool = True) -> str:
    model = body.get("model")
    if isinstance(model, str) and model:
        if len(model) > MAX_MODEL_NAME:
            # The name is a Prometheus label, a price-cache key and a span column.
            raise BodyError(
                f"model: {len(model)} characters, beyond the {MAX_MODEL_NAME} runcap accepts", field="model"
            )
        return model
    if model is None and not required:
        return ""
    if model is None:
        raise BodyError("model is required")
    raise BodyError(f"model must be a non-empty string, got {_kind(model)}")


def bool_field(body: dict[str, Any], name: str) -> bool:
    """An optional boolean; absent or null is False."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BodyError(f"{name} must be a boolean, got {_kind(value)}")
    return value


def limit_field(
    body: dict[str, Any], name: str, required: bool = False, maximum: int = MAX_OUTPUT_TOKENS
) -> int | None:
    """An optional positive integer up to `maximum` (a token limit, `n`); absent or null is None."""
    value = body.get(name)
    if value is None:
        if required:
            raise BodyError(f"{name} is required", field=name)
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BodyError(f"{name} must be a positive integer, got {_kind(value)}", field=name)
    if value > maximum:
        raise BodyError(
            f"{name}: {_kind(value)} is above the largest value runcap accepts ({maximum})", field=name
        )
    return value


def list_field(body: dict[str, Any], name: str, required: bool = False) -> list[Any]:
    """An array field; absent or null is an empty list unless required."""
    value = body.get(name)
    if value is None:
        if required:
            raise BodyError(f"{name} is required")
        return []
    if not isinstance(value, list):
        raise BodyError(f"{name} must be an array, got {_kind(value)}")
    return value


def object_item(value: Any, where: str) -> dict[str, Any]:
    """An element of an array that must be an object (`where` names it, e.g. "messages[2]")."""
    if not isinstance(value, dict):
        raise BodyError(f"{where} must be an object, got {_kind(value)}")
    return value


# --- response fields (lenient: an upstream body never raises) ---------------------------------


def count(obj: Any, name: str) -> int:
    """A token count from a usage object; anything but a non-negative int reads as 0, and a
    count beyond any real call is clipped (it must not overflow the ledger)."""
    if isinstance(obj, dict):
        value = obj.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, MAX_REPORTED_TOKENS)
    return 0


def openai_style_usage(
    usage: Any, input_key: str, output_key: str, tool_uses: Mapping[str, int] = NO_USES
) -> Usage | None:
    """An OpenAI usage object: `{input_key}` (cached tokens included) and `{output_key}`, with
    their `_details` (cached, cache-write, reasoning and audio tokens). None: no usage object."""
    if not isinstance(usage, dict):
        return None
    details = usage.get(f"{input_key}_details")
    out_details = usage.get(f"{output_key}_details")
    return Usage(
        input_tokens=count(usage, input_key),
        output_tokens=count(usage, output_key),
        cache_read_tokens=count(details, "cached_tokens"),
        cache_write_tokens=count(details, "cache_write_tokens"),
        reasoning_tokens=count(out_details, "reasoning_tokens"),
        input_audio_tokens=count(details, "audio_tokens"),
        output_audio_tokens=count(out_details, "audio_tokens"),
        tool_uses=tool_uses,
    )


def text_of(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    return value if isinstance(value, str) else ""


def compact_json(value: Any) -> str:
    """Compact JSON text of a structured tool input (as `ToolCall.arguments`)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return ""
