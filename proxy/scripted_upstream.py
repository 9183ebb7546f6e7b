"""A scripted, offline stand-in for the model providers runcap sits in front of.

`ScriptedUpstream` is a small aiohttp server that speaks the real wire formats of OpenAI chat
completions, the OpenAI Responses API, legacy completions, embeddings and Anthropic messages —
streaming and not — exactly as the official `openai` and `anthropic` clients expect them. What the
"model" answers comes from a script: a named list of steps, chosen per request by the
`X-Mock-Script` header. runcap's tests, its demo and its throughput benchmarks run against it, and
agent authors can use it (`runcap mock-upstream`) to test agents without a provider.

Step selection is stateless so that concurrent conversations never interfere: the step played is
the number of assistant turns already present in the request's history (chat / Anthropic:
assistant messages; Responses: runs of consecutive `function_call` / assistant `message` /
`reasoning` items of the whole conversation, stored items included). Past the end of a script, its
last step repeats. Legacy completions and embeddings have no history: they always
play the script's first step.

Like the real chat API, chat requests with `tools: []`, or with `tool_choice` /
`parallel_tool_calls` but no tools, get a 400: a proxy that strips tools must strip those too.

Token accounting is deterministic so that tests can assert exact usage (see `count_tokens`):

* input  = 3 + Σ over messages (4 + count_tokens(the message's text)) + count_tokens(tools JSON),
  where a message's text is all its text content, tool-call names and arguments and tool results
  concatenated (an image adds 85); `system` (Anthropic) and `instructions` (Responses) count as one
  message each; legacy completions count only the prompt; embeddings count each input.
  A step's `input_tokens` replaces this; a step's cache tokens raise it when they exceed it.
* output = reasoning tokens + count_tokens(text) + Σ count_tokens(tool-call arguments JSON), at
  least 1. The output-token limit of the request is honoured by truncating the answer.
* `tokenizer=InputTokenizer(...)` counts input otherwise: ceil(bytes / 4) is runcap's own
  estimate, so a test whose oracle must not be the code under test counts each word on its own,
  denser or sparser than that (`InputTokenizer.per_word`).

Steps (dicts in scripts, validated into `Step`):

    text: str                 answer text
    text_tokens: int          answer of exactly N output tokens of filler text
    tool_calls: [{name, arguments: dict | str}]   several = parallel calls; answered with text
                              instead when the request has no tools or tool choice "none"
    status: int, error: str, error_type: str, error_code: str   an error response
    headers: {name: value}    extra response headers (e.g. retry-after)
    delay_s: float            wait before answering (before the response headers)
    stall_s: float            streams: stall after the first content event (non-stream: adds to delay)
    chunk_delay_s: float      streams: pause between events
    drop_after_events: int    streams: close the connection abruptly after N events (a provider
                              failure mid-stream); 0 drops it before any response
    end_after_events: int     streams: end the response cleanly after N events, without the rest
                              (no closing event); negative: all but the last -N events
    end_mid_event: bool       with end_after_events: also send the first half of the next event
    error_after_events: int   streams: after N events send the format's mid-stream error event
                              (`error_type`, default overloaded_error / server_error; `error`
                              message) and end the response cleanly
    oversized_event_bytes: int   streams: after the first event, an SSE comment event of N bytes
                              (clients ignore it), before the rest of the stream
    omit_usage: bool          the answer reports no usage (a server that does not): no `usage` in
                              Anthropic answers and stream events, no usage in chat/completions
                              answers nor a usage chunk in their streams, `usage: null` in Responses
    input_tokens: int         report this many input tokens instead of the computed count
    fetch: {handle, offset, length} or a list of them   call runcap's `runcap_fetch` tool (before
                              any `tool_calls`): `handle` is an index into the distinct
                              `runcap:sha256/<hex>` handles the request's text shows, in order of
                              appearance (past the end: a handle that matches nothing), or a
                              literal handle string; `offset` and `length` are passed as given
    cache_read_tokens, cache_write_tokens, reasoning_tokens: int

Billing beyond text tokens, as the providers document it (the worst case where a step says so):

    service_tier: str         the tier an OpenAI answer reports it was served at (default: the
                              request's, `auto` and none served at "default")
    audio_tokens: int         output audio tokens, when the request asks for audio (chat
                              `modalities: ["audio"]`); part of the output, within its limit
    hosted_uses: int          uses of the request's hosted tools the "model" makes (Responses
                              web_search / file_search / code_interpreter / mcp items; Anthropic
                              web_search / web_fetch `server_tool_use` blocks), never more than the
                              request allows (`max_tool_calls`; each tool's `max_uses`); each is an
                              internal call adding `use_input_tokens` (default 1000) input tokens;
                              web searches are reported (Anthropic `usage.server_tool_use`)
    reference_tokens: int     input tokens each input by reference costs (a file by id, a
                              document or image by URL), rendered at the provider
Input audio parts (chat `input_audio`) count one audio input token per 3 bytes of their data,
reported in `prompt_tokens_details.audio_tokens`. Anthropic `speed` is echoed in `usage.speed`.

Stored Responses, as the provider keeps them: a response not created with `store: false` keeps
its conversation (what it continued, its input, its output) under its id and each output item
under the item's id. `previous_response_id` continues that conversation and an `item_reference`
input item stands for the stored item; either is answered — and billed — as if the stored items
had been sent (instructions and tools are the request's own, as on the real API). Refused like the
real API (400): an unknown response or item, a `function_call_output` without its
`function_call`, a `function_call` without its output.

Anthropic message threads (beta `message-threads-2026-08-12`, the `anthropic` SDK's tool runner):
a request with `thread: {"type": "create"}` has its conversation (system, tools, messages and the
answer) kept under the answer's id; `thread: {"type": "continue", "previous_message_id": id}`
sends only the new messages, and is answered — and billed — as if it had sent the kept system,
tools and history (the kept tools stay live); it may not repeat `system` or `tools`. An ended stream
still keeps the whole answer, as the provider holds it. Without the beta header `thread` is a 400.

For tests, the server records every request (`requests`, `last`, `hits()`: method, path, lower-cased
headers, parsed body, step played, usage answered, and whether a stream completed, was left by the
client, dropped or ended early by the server) and counts requests in flight (`in_flight`, `max_in_flight`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import itertools
import math
import re
import secrets
import struct
import time
import tomllib
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import orjson
from aiohttp import web

from proxy.providers.base import Usage

SCRIPT_HEADER = "X-Mock-Script"
DEFAULT_SCRIPT = "default"
DEFAULT_TEXT = "Hello! This is a scripted answer from runcap's mock upstream."
# The answer given when a step asks for tool calls the request does not allow.
FALLBACK_TEXT = "I cannot call tools now, so here is my final answer."
EMBEDDING_DIMENSIONS = 8
# Legacy completions default `max_tokens` to 16, as the real API does.
LEGACY_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MODELS = ("gpt-4o-mini", "gpt-4.1", "o4-mini", "text-embedding-3-small", "claude-sonnet-4-5")

# Bounds the memory of Responses ids kept for `previous_response_id` (and of Anthropic threads)
# in long benchmarks.
_MAX_REMEMBERED_RESPONSES = 100_000
# The Anthropic beta that lets a request carry `thread` (server-held conversation state).
MESSAGE_THREADS_BETA = "message-threads-2026-08-12"

BASE_INPUT_TOKENS = 3
TOKENS_PER_MESSAGE = 4
TOKENS_PER_IMAGE = 85

# Filler for `text_tokens` steps: ASCII, so N tokens are exactly 4*N bytes.
_FILLER_UNIT = "lorem ipsum dolor sit amet, consectetur adipiscing elit; sed do eiusmod tempor. "
_FILLER = _FILLER_UNIT * 200


def count_tokens(text: str) -> int:
    """Tokens of `text` as this server counts them: ceil(UTF-8 bytes / 4)."""
    return (len(text.encode()) + 3) // 4


def filler_text(tokens: int) -> str:
    """Text of exactly `tokens` tokens (by `count_tokens`)."""
    n = 4 * tokens
    if n <= len(_FILLER):
        return _FILLER[:n]
    return (_FILLER * (n // len(_FILLER) + 1))[:n]


def truncate_to_tokens(text: str, tokens: int) -> str:
    """The longest prefix of `text` (on a character boundary) within `tokens` tokens."""
    return text.encode()[: 4 * tokens].decode(errors="ignore")


# --------------------------------------------------------------------------- scripts


@dataclass(frozen=True, slots=True)
class ScriptedToolCall:
    name: str
    arguments: str  # the JSON text the "model" produces (may deliberately not parse)
    input: dict[str, Any]  # the same as an object, for Anthropic's tool_use.input


@dataclass(frozen=True, slots=True)
class Step:
    """One scripted model turn. Build from a dict with `Step.from_dict`."""

    text: str | None = None
    text_tokens: int | None = None
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    status: int | None = None
    error: str | None = None
    error_type: str | None = None
    error_code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    delay_s: float = 0.0
    stall_s: float = 0.0
    chunk_delay_s: float = 0.0
    drop_after_events: int | None = None
    end_after_events: int | None = None
    end_mid_event: bool = False
    error_after_events: int | None = None
    oversized_event_bytes: int = 0
    omit_usage: bool = False
    input_tokens: int | None = None
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    service_tier: str | None = None
    audio_tokens: int = 0
    hosted_uses: int = 0
    use_input_tokens: int = 1000
    reference_tokens: int = 0
    # `runcap_fetch` calls to make: (handle index or literal, offset, length)
    fetch: tuple[tuple[int | str, int | None, int | None], ...] = ()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Step:
        unknown = set(raw) - _STEP_KEYS
        if unknown:
            raise ValueError(f"unknown step key(s) {sorted(unknown)}; known: {sorted(_STEP_KEYS)}")
        calls = []
        for call in raw.get("tool_calls") or ():
            if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
                raise ValueError(f"tool_calls entry needs a string 'name': {call!r}")
            args = call.get("arguments", {})
            if isinstance(args, str):
                try:
                    obj = orjson.loads(args)
                except orjson.JSONDecodeError:
                    obj = {}
                calls.append(ScriptedToolCall(call["name"], args, obj if isinstance(obj, dict) else {}))
            elif isinstance(args, Mapping):
                calls.append(ScriptedToolCall(call["name"], orjson.dumps(args).decode(), dict(args)))
            else:
                raise ValueError(f"tool_calls[].arguments must be an object or a JSON string: {args!r}")
        status = raw.get("status")
        if status is not None and not (isinstance(status, int) and 400 <= status <= 599):
            raise ValueError(f"step 'status' must be an HTTP error status 400-599: {status!r}")
        for key in (
            "drop_after_events",
            "error_after_events",
            "oversized_event_bytes",
            "text_tokens",
            "input_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "reasoning_tokens",
            "audio_tokens",
            "hosted_uses",
            "use_input_tokens",
            "reference_tokens",
        ):
            value = raw.get(key)
            if value is not None and not (isinstance(value, int) and value >= 0):
                raise ValueError(f"step {key!r} must be a non-negative integer: {value!r}")
        end = raw.get("end_after_events")
        if end is not None and (isinstance(end, bool) or not isinstance(end, int)):
            raise ValueError(f"step 'end_after_events' must be an integer: {end!r}")
        fetches = raw.get("fetch") or ()
        if isinstance(fetches, Mapping):
            fetches = (fetches,)
        fetch = []
        for spec in fetches:
            handle = spec.get("handle", 0) if isinstance(spec, Mapping) else None
            if not isinstance(handle, int | str) or isinstance(handle, bool):
                raise ValueError(f"step 'fetch' needs a handle index or string: {spec!r}")
            fetch.append((handle, spec.get("offset"), spec.get("length")))
        return cls(
            text=raw.get("text"),
            text_tokens=raw.get("text_tokens"),
            tool_calls=tuple(calls),
            status=status,
            error=raw.get("error"),
            error_type=raw.get("error_type"),
            error_code=raw.get("error_code"),
            headers=tuple((str(k), str(v)) for k, v in (raw.get("headers") or {}).items()),
            delay_s=float(raw.get("delay_s", 0.0)),
            stall_s=float(raw.get("stall_s", 0.0)),
            chunk_delay_s=float(raw.get("chunk_delay_s", 0.0)),
            drop_after_events=raw.get("drop_after_events"),
            end_after_events=end,
            end_mid_event=bool(raw.get("end_mid_event", False)),
            error_after_events=raw.get("error_after_events"),
            oversized_event_bytes=raw.get("oversized_event_bytes") or 0,
            omit_usage=bool(raw.get("omit_usage", False)),
            input_tokens=raw.get("input_tokens"),
            cache_read_tokens=raw.get("cache_read_tokens", 0),
            cache_write_tokens=raw.get("cache_write_tokens", 0),
            reasoning_tokens=raw.get("reasoning_tokens", 0),
            service_tier=raw.get("service_tier"),
            audio_tokens=raw.get("audio_tokens", 0),
            hosted_uses=raw.get("hosted_uses", 0),
            use_input_tokens=raw.get("use_input_tokens", 1000),
            reference_tokens=raw.get("reference_tokens", 0),
            fetch=tuple(fetch),
        )


_STEP_KEYS = frozenset(
    {
        "text",
        "text_tokens",
        "tool_calls",
        "status",
        "error",
        "error_type",
        "error_code",
        "headers",
        "delay_s",
        "stall_s",
        "chunk_delay_s",
        "drop_after_events",
        "end_after_events",
        "end_mid_event",
        "error_after_events",
        "oversized_event_bytes",
        "omit_usage",
        "input_tokens",
        "cache_read_tokens",
        "cache_write_tokens",
        "reasoning_tokens",
        "service_tier",
        "audio_tokens",
        "hosted_uses",
        "use_input_tokens",
        "reference_tokens",
        "fetch",
    }
)

_DEFAULT_STEP = Step(text=DEFAULT_TEXT)


def _parse_scripts(scripts: Mapping[str, Iterable[Step | Mapping[str, Any]]]) -> dict[str, list[Step]]:
    parsed: dict[str, list[Step]] = {}
    for name, steps in scripts.items():
        out = []
        for i, step in enumerate(steps):
            if isinstance(step, Step):
                out.append(step)
                continue
            if not isinstance(step, Mapping):
                raise ValueError(f"script {name!r} step {i}: a step is a table/object, got {step!r}")
            try:
                out.append(Step.from_dict(step))
            except ValueError as e:
                raise ValueError(f"script {name!r} step {i}: {e}") from None
        parsed[name] = out
    return parsed


def load_scripts(path: str) -> dict[str, list[dict[str, Any]]]:
    """Read scripts from a JSON or TOML file (by suffix; `.toml` is TOML, anything else JSON).

    The file maps script names to lists of steps, optionally under a top-level `scripts` key.
    In TOML a script is an array of tables: `[[refund]]` then `tool_calls = [...]`.
    Steps are validated here, so a typo fails with a message naming the script and step.
    """
    data = Path(path).read_bytes()
    raw = tomllib.loads(data.decode()) if path.endswith(".toml") else orjson.loads(data)
    if isinstance(raw, dict) and isinstance(raw.get("scripts"), dict):
        raw = raw["scripts"]
    if not isinstance(raw, dict) or not all(isinstance(v, list) for v in raw.values()):
        raise ValueError(f"{path}: expected a table of scripts, each a list of steps")
    _parse_scripts(raw)
    return raw


# --------------------------------------------------------------------------- observability


@dataclass(slots=True)
class RecordedRequest:
    """One request the server received. Header names are lower-cased."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or None
    script: str = DEFAULT_SCRIPT
    step: int | None = None  # index of the step played (None when no step was played)
    stream: bool = False
    status: int = 200
    completed: bool = False  # the whole response was sent
    disconnected: bool = False  # the client went away before the end
    dropped: bool = False  # the server dropped the connection (a `drop_after_events` step)
    # The server ended the stream before its end (an `end_after_events` / `error_after_events` step).
    ended_early: bool = False
    # The usage the answer carries, normalised like runcap's own `Usage` (input includes cache
    # reads/writes). Set even when the stream was cut before the usage was sent; None for errors.
    usage: Usage | None = None
    received_at: float = field(default_factory=time.time)
    raw: bytes = b""  # the body's bytes as received

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


# --------------------------------------------------------------------------- the answer


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: str
    input: dict[str, Any]
    partial: bool  # cut by the output-token limit


@dataclass(frozen=True, slots=True)
class _Thread:
    """What an Anthropic thread holds after one answer: the fields a `continue` takes from it."""

    system: Any
    tools: Any
    messages: list[Any]  # the whole history, the answer included


@dataclass(slots=True)
class _Answer:
    """What the "model" says for one request, after applying the output-token limit."""

    text: str
    calls: list[_Call]
    reasoning_tokens: int
    output_tokens: int
    truncated: bool
    input_tokens: int  # all input tokens, cache reads and writes included
    cache_read_tokens: int
    cache_write_tokens: int
    audio_tokens: int = 0  # output audio tokens (part of output_tokens)
    input_audio_tokens: int = 0  # part of input_tokens
    hosted: tuple[_HostedUse, ...] = ()  # hosted-tool uses made, in order


@dataclass(frozen=True, slots=True)
class _HostedUse:
    tool: str  # the request's tool type ("web_search", "web_search_20250305", "mcp"...)
    label: str  # an MCP tool's server label ("" otherwise)


# Hosted tool types the "model" uses (Responses; Anthropic server tools by type prefix).
_RESPONSES_HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter", "mcp")
_ANTHROPIC_HOSTED = ("web_search_", "web_fetch_")


def _hosted_uses(step: Step, body: dict[str, Any], anthropic: bool) -> tuple[_HostedUse, ...]:
    """The hosted-tool uses a step makes: `step.hosted_uses`, shared round-robin among the
    request's hosted tools, never past what the request allows (Responses `max_tool_calls` for
    all of them; an Anthropic tool's `max_uses` for it)."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    slots: list[list[Any]] = []  # [tool type, server label, uses left]
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            continue
        if anthropic and kind.startswith(_ANTHROPIC_HOSTED):
            left = tool.get("max_uses")
            slots.append([kind, "", left if isinstance(left, int) else 1 << 30])
        elif not anthropic and kind in _RESPONSES_HOSTED:
            slots.append([kind, str(tool.get("server_label") or ""), 1 << 30])
    total = step.hosted_uses
    if not anthropic and isinstance(body.get("max_tool_calls"), int):
        total = min(total, body["max_tool_calls"])
    uses: list[_HostedUse] = []
    while len(uses) < total and any(slot[2] > 0 for slot in slots):
        for slot in slots:
            if len(uses) < total and slot[2] > 0:
                slot[2] -= 1
                uses.append(_HostedUse(slot[0], slot[1]))
    return tuple(uses)


def _references(body: Any) -> int:
    """Inputs by reference: a file by id (chat `file.file_id`, Responses `input_file` /
    `input_image` by `file_id` or `file_url`), an Anthropic document or image by URL or file."""
    if isinstance(body, list):
        return sum(_references(v) for v in body)
    if not isinstance(body, dict):
        return 0
    kind = body.get("type")
    if kind == "file" and isinstance(body.get("file"), dict) and body["file"].get("file_id"):
        return 1
    if kind in ("input_file", "input_image") and (body.get("file_id") or body.get("file_url")):
        return 1
    source = body.get("source")
    if kind in ("document", "image") and isinstance(source, dict) and source.get("type") in ("url", "file"):
        return 1
    return sum(_references(v) for v in body.values() if isinstance(v, list | dict))


def _input_audio_tokens(body: Any) -> int:
    if isinstance(body, list):
        return sum(_input_audio_tokens(v) for v in body)
    if not isinstance(body, dict):
        return 0
    if body.get("type") == "input_audio" and isinstance(body.get("input_audio"), dict):
        data = body["input_audio"].get("data")
        return len(data) // 3 if isinstance(data, str) else 0
    return sum(_input_audio_tokens(v) for v in body.values() if isinstance(v, list | dict))


# --------------------------------------------------------------------------- input counting


def _text_of(content: Any, parts: list[str]) -> int:
    """Append the text of message content to `parts`; return the image count."""
    if content is None:
        return 0
    if isinstance(content, str):
        parts.append(content)
        return 0
    images = 0
    if isinstance(content, list):
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict):
                kind = block.get("type")
                if isinstance(block.get("text"), str):
                    parts.append(block["text"])
                elif kind in ("image", "image_url", "input_image"):
                    images += 1
                elif kind == "tool_use":
                    parts.append(block.get("name") or "")
                    parts.append(orjson.dumps(block.get("input") or {}).decode())
                elif kind == "tool_result":
                    images += _text_of(block.get("content"), parts)
    return images


@dataclass(frozen=True, slots=True)
class InputTokenizer:
    """How the server counts input tokens. The default — ceil(UTF-8 bytes / 4) of a message's
    text, 3 per request, 4 per message — is also runcap's own estimate. `per_word` counts every
    whitespace-separated word of each text part as ceil(bytes / `bytes_per_token`) tokens, at
    least one (tiktoken and SentencePiece never merge across the space between two words): with
    2 bytes a token it is denser than the estimate, with a large one it is one token a word."""

    bytes_per_token: int = 4
    per_word: bool = False
    base: int = BASE_INPUT_TOKENS
    per_message: int = TOKENS_PER_MESSAGE

    @classmethod
    def words(cls, bytes_per_token: int, *, base: int = 0, per_message: int = 0) -> InputTokenizer:
        return cls(bytes_per_token, per_word=True, base=base, per_message=per_message)

    def text(self, text: str) -> int:
        n = self.bytes_per_token
        if not self.per_word:
            return (len(text.encode()) + n - 1) // n
        return sum((len(word.encode()) + n - 1) // n for word in text.split())

    def message(self, parts: list[str], images: int) -> int:
        text = sum(self.text(p) for p in parts) if self.per_word else self.text("".join(parts))
        return self.per_message + text + TOKENS_PER_IMAGE * images

    def tools(self, tools: Any) -> int:
        return self.text(orjson.dumps(tools).decode()) if tools else 0


BYTES_4 = InputTokenizer()


def chat_input_tokens(body: dict[str, Any], tok: InputTokenizer = BYTES_4) -> int:
    total = tok.base + tok.tools(body.get("tools"))
    for msg in body.get("messages") or ():
        parts: list[str] = []
        images = _text_of(msg.get("content"), parts)
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            parts.append(fn.get("name") or "")
            parts.append(fn.get("arguments") or "")
        total += tok.message(parts, images)
    return total


def responses_input_tokens(body: dict[str, Any], tok: InputTokenizer = BYTES_4) -> int:
    total = tok.base + tok.tools(body.get("tools"))
    if body.get("instructions"):
        total += tok.message([body["instructions"]], 0)
    items = body.get("input")
    if isinstance(items, str):
        return total + tok.message([items], 0)
    for item in items or ():
        parts: list[str] = []
        images = 0
        kind = item.get("type")
        if kind == "function_call":
            parts.append(item.get("name") or "")
            parts.append(item.get("arguments") or "")
        elif kind == "function_call_output":
            images = _text_of(item.get("output"), parts)
        else:
            images = _text_of(item.get("content"), parts)
        total += tok.message(parts, images)
    return total


def anthropic_input_tokens(body: dict[str, Any], tok: InputTokenizer = BYTES_4) -> int:
    """All input tokens of a messages request (before splitting off cache reads and writes)."""
    total = tok.base + tok.tools(body.get("tools"))
    if body.get("system"):
        parts: list[str] = []
        _text_of(body["system"], parts)
        total += tok.message(parts, 0)
    for msg in body.get("messages") or ():
        parts = []
        images = _text_of(msg.get("content"), parts)
        total += tok.message(parts, images)
    return total


def _prompt_tokens(value: Any) -> int:
    """Tokens of a legacy-completions prompt or an embeddings input (text or token arrays)."""
    if isinstance(value, str):
        return count_tokens(value)
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)
        return sum(_prompt_tokens(v) for v in value)
    return 0


# --------------------------------------------------------------------------- runcap_fetch

FETCH_TOOL = "runcap_fetch"
_HANDLE = re.compile(rb"runcap:sha256/[0-9a-f]{64}")
_UNKNOWN_HANDLE = "runcap:sha256/" + "0" * 64


def handles_in(body: Any) -> list[str]:
    """The distinct `runcap:sha256/<hex>` handles a request's text shows, in order."""
    seen: dict[str, None] = {}
    for match in _HANDLE.findall(orjson.dumps(body)):
        seen.setdefault(match.decode(), None)
    return list(seen)


def _with_fetches(step: Step, body: Any) -> Step:
    """`step` with its `fetch` entries turned into `runcap_fetch` calls on handles of `body`."""
    if not step.fetch:
        return step
    handles = handles_in(body)
    calls = []
    for ref, offset, length in step.fetch:
        if isinstance(ref, int):
            handle = handles[ref] if -len(handles) <= ref < len(handles) else _UNKNOWN_HANDLE
        else:
            handle = ref
        args: dict[str, Any] = {"handle": handle}
        if offset is not None:
            args["offset"] = offset
        if length is not None:
            args["length"] = length
        calls.append(ScriptedToolCall(FETCH_TOOL, orjson.dumps(args).decode(), args))
    return dataclasses.replace(step, tool_calls=(*calls, *step.tool_calls))


# --------------------------------------------------------------------------- turn counting


def _chat_turns(body: dict[str, Any]) -> int:
    return sum(1 for m in body.get("messages") or () if isinstance(m, dict) and m.get("role") == "assistant")


def _anthropic_turns(body: dict[str, Any]) -> int:
    msgs = [m for m in body.get("messages") or () if isinstance(m, dict)]
    turns = sum(1 for m in msgs if m.get("role") == "assistant")
    if msgs and msgs[-1].get("role") == "assistant":
        turns -= 1  # a trailing assistant message is a prefill, not a finished turn
    return turns


_ASSISTANT_ITEMS = frozenset({"function_call", "reasoning"})


def _responses_turns(items: Any) -> int:
    """Runs of consecutive assistant output items (parallel calls are one turn)."""
    if not isinstance(items, list):
        return 0
    turns = 0
    in_turn = False
    for item in items:
        if not isinstance(item, dict):
            in_turn = False
            continue
        assistant = item.get("type") in _ASSISTANT_ITEMS or item.get("role") == "assistant"
        if assistant and not in_turn:
            turns += 1
        in_turn = assistant
    return turns


# --------------------------------------------------------------------------- wire helpers

_JSON = "application/json"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}

_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
}
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def _sse_data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _sse_event(name: bytes, obj: Any) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _openai_stream_error(step: Step) -> bytes:
    """The error chunk OpenAI sends when a chat/completions stream fails midway."""
    error = {
        "message": step.error or "The server had an error while processing your request.",
        "type": step.error_type or "server_error",
        "param": None,
        "code": step.error_code,
    }
    return _sse_data({"error": error})


def _openai_error_body(
    status: int, message: str, etype: str | None, param: Any = None, code: Any = None
) -> bytes:
    etype = etype or _OPENAI_ERROR_TYPES.get(status, "server_error")
    return orjson.dumps({"error": {"message": message, "type": etype, "param": param, "code": code}})


def _anthropic_error_body(status: int, message: str, etype: str | None, request_id: str) -> bytes:
    etype = etype or _ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return orjson.dumps(
        {"type": "error", "error": {"type": etype, "message": message}, "request_id": request_id}
    )


def _limit(body: dict[str, Any], *names: str, default: int | None = None) -> int | None:
    """The output-token limit: the first of `names` present in the body."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _BadRequest(
                f"Invalid '{name}': expected an integer >= 1, got {value!r}.", name, "invalid_value"
            )
        return value
    return default


def _check_chat_tools(body: dict[str, Any]) -> None:
    """Reject what the real chat API rejects, so a proxy that strips tools carelessly is caught."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and tools):
        raise _BadRequest(
            "Invalid 'tools': empty array. Expected an array with minimum length 1, but got an empty array "
            "instead.",
            "tools",
            "empty_array",
        )
    if not tools:
        for name in ("tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise _BadRequest(
                    f"Invalid value for '{name}': '{name}' is only allowed when 'tools' are specified.",
                    name,
                )


# Large events are written in pieces of this size, as a provider's server would send them.
_WRITE_BYTES = 64 * 1024


def _end_early(step: Step, events: list[bytes], error_event: bytes) -> list[bytes]:
    """The events a stream that ends early sends: cut after `end_after_events` (with half of the
    next event when `end_mid_event`) or `error_after_events` (then the error event)."""
    if step.error_after_events is not None:
        return [*events[: step.error_after_events], error_event]
    if step.end_after_events is None:
        return list(events)
    cut = step.end_after_events if step.end_after_events >= 0 else max(0, len(events) + step.end_after_events)
    kept = events[:cut]
    if step.end_mid_event and cut < len(events):
        kept.append(events[cut][: len(events[cut]) // 2])
    return kept


def _oversized_comment(size: int) -> bytes:
    """An SSE comment event of `size` bytes: one long line that SSE clients ignore."""
    return b": " + b"x" * max(0, size - 4) + b"\n\n"


async def _pause(step: Step, stream: bool) -> None:
    """A step's wait before the response starts (a non-stream answer also takes its stall)."""
    wait = step.delay_s + (0.0 if stream else step.stall_s)
    if wait:
        await asyncio.sleep(wait)


def _pieces(text: str, size: int) -> list[str]:
    if not text:
        return []
    # At most ~64 pieces, so long answers do not turn into thousands of tiny events.
    size = max(size, math.ceil(len(text) / 64))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _embedding(text: str, dims: int) -> list[float]:
    raw = hashlib.shake_128(text.encode()).digest(2 * dims)
    vec = [v / 32767.5 - 1.0 for v in struct.unpack(f"<{dims}H", raw)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [round(v / norm, 6) for v in vec]


# --------------------------------------------------------------------------- the server


class ScriptedUpstream:
    """A fake OpenAI/Anthropic upstream that plays scripts. See the module docstring.

    Typical async fixture::

        upstream = ScriptedUpstream({"refund": [{"tool_calls": [...]}, {"text": "Done."}]})
        url = await upstream.start()
        yield upstream            # OpenAI base_url = f"{url}/v1"; Anthropic base_url = url
        await upstream.stop()

    `scripts` may be changed while running (`upstream.scripts["x"] = [{...}, ...]`; dict steps are
    validated when played). `record=False` turns off request recording (for long benchmarks).
    `chunk_chars` is the size of streamed text/argument pieces.
    """

    def __init__(
        self,
        scripts: Mapping[str, Iterable[Step | Mapping[str, Any]]] | None = None,
        *,
        record: bool = True,
        chunk_chars: int = 16,
        tokenizer: InputTokenizer = BYTES_4,
    ) -> None:
        self.tokenizer = tokenizer  # may be changed while running
        self.scripts: dict[str, list[Step | Mapping[str, Any]]] = {DEFAULT_SCRIPT: [_DEFAULT_STEP]}
        self.scripts.update(_parse_scripts(scripts or {}))
        self.requests: list[RecordedRequest] = []
        self.record = record
        self.chunk_chars = max(1, chunk_chars)
        self.in_flight = 0
        self.max_in_flight = 0
        # Azure-style deployments (`/openai/deployments/{name}/chat/completions`): name -> the
        # model it serves, whatever the body says (an unknown name serves the body's model).
        self.deployments: dict[str, str] = {}
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._id_prefix = secrets.token_hex(6)
        self._seq = itertools.count(1)
        # Stored Responses (`store` not false): the conversation behind each response id — its
        # input with what it continued, then its output — for `previous_response_id`; and each
        # stored output item by id, for `item_reference` input items.
        self._stored_responses: dict[str, list[Any]] = {}
        self._stored_items: dict[str, dict[str, Any]] = {}
        # Anthropic threads by the id of their latest answer, for `thread: continue`.
        self._threads: dict[str, _Thread] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0 = any free port); return the base URL `http://host:port`."""
        # A short shutdown timeout: stop() must not wait for stalled streams to play out.
        runner = web.AppRunner(
            make_app(self), handler_cancellation=True, access_log=None, shutdown_timeout=0.1
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        bound_host, bound_port = runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScriptedUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def clear(self) -> None:
        """Forget recorded requests (scripts are kept)."""
        self.requests.clear()
        self.max_in_flight = self.in_flight

    # ------------------------------------------------------------------ observability helpers

    def hits(self, path: str | None = None) -> int:
        """How many requests arrived (for `path` only, when given)."""
        if path is None:
            return len(self.requests)
        return sum(1 for r in self.requests if r.path == path)

    @property
    def last(self) -> RecordedRequest:
        return self.requests[-1]

    # ------------------------------------------------------------------ internals

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{self._id_prefix}{next(self._seq):010d}"

    def _step(self, script: str, index: int) -> Step:
        steps = self.scripts[script]
        if not steps:
            return _DEFAULT_STEP
        index = min(index, len(steps) - 1)
        step = steps[index]
        if isinstance(step, Step):
            return step
        try:
            return Step.from_dict(step)
        except ValueError as e:
            raise _BadRequest(f"{SCRIPT_HEADER}: script {script!r} step {index}: {e}") from None

    def _answer(
        self,
        rec: RecordedRequest,
        step: Step,
        input_tokens: int,
        limit: int | None,
        tools_allowed: bool,
        call_prefix: str,
        *,
        hosted: tuple[_HostedUse, ...] = (),
        audio: bool = False,
        input_audio: int = 0,
    ) -> _Answer:
        if step.input_tokens is not None:
            input_tokens = step.input_tokens
        # Billed beyond the body's text: each hosted-tool use is an internal call reading more
        # input, each input by reference its rendering, input audio its audio tokens.
        input_tokens += len(hosted) * step.use_input_tokens + input_audio
        input_tokens += _references(rec.body) * step.reference_tokens
        # Scripted cache numbers are honoured as given: they raise the input when larger than it.
        input_tokens = max(input_tokens, step.cache_read_tokens + step.cache_write_tokens)
        budget = limit if limit is not None else 1 << 62
        reasoning = min(step.reasoning_tokens, budget)
        truncated = reasoning < step.reasoning_tokens
        budget -= reasoning
        if step.text_tokens is not None:
            text = filler_text(min(step.text_tokens, budget))
            truncated = truncated or step.text_tokens > budget
        else:
            if step.text is not None:
                text = step.text
            elif step.tool_calls:
                text = "" if tools_allowed else FALLBACK_TEXT
            else:
                text = DEFAULT_TEXT
            if count_tokens(text) > budget:
                text = truncate_to_tokens(text, budget)
                truncated = True
        used = count_tokens(text)
        budget -= used
        audio_out = min(step.audio_tokens, budget) if audio else 0
        budget -= audio_out
        output = reasoning + used + audio_out
        calls: list[_Call] = []
        if tools_allowed and not truncated:
            for spec in step.tool_calls:
                need = count_tokens(spec.arguments)
                if need > budget:
                    truncated = True
                    if budget > 0:
                        args = truncate_to_tokens(spec.arguments, budget)
                        calls.append(_Call(self._new_id(call_prefix), spec.name, args, spec.input, True))
                        output += count_tokens(args)
                    break
                calls.append(_Call(self._new_id(call_prefix), spec.name, spec.arguments, spec.input, False))
                budget -= need
                output += need
        if output == 0:
            output = 1  # a turn always emits at least one (end-of-turn) token
        # What the uses bill per use: searches, and code interpreter container sessions (all of a
        # response's calls share one container: one session).
        billed = {
            "web_search": sum(1 for h in hosted if h.tool.startswith("web_search")),
            "file_search": sum(1 for h in hosted if h.tool == "file_search"),
            "code_execution": 1 if any(h.tool == "code_interpreter" for h in hosted) else 0,
        }
        rec.usage = Usage(
            input_tokens=input_tokens,
            output_tokens=output,
            cache_read_tokens=step.cache_read_tokens,
            cache_write_tokens=step.cache_write_tokens,
            reasoning_tokens=reasoning,
            input_audio_tokens=input_audio,
            output_audio_tokens=audio_out,
            tool_uses={kind: n for kind, n in billed.items() if n},
        )
        return _Answer(
            text=text,
            calls=calls,
            reasoning_tokens=reasoning,
            output_tokens=output,
            truncated=truncated,
            input_tokens=input_tokens,
            cache_read_tokens=step.cache_read_tokens,
            cache_write_tokens=step.cache_write_tokens,
            audio_tokens=audio_out,
            input_audio_tokens=input_audio,
            hosted=hosted,
        )

    async def _begin(self, request: web.Request) -> tuple[RecordedRequest, Any]:
        raw = await request.read()
        body: Any = None
        parse_error = False
        if raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parse_error = True
        rec = RecordedRequest(
            method=request.method,
            path=request.path,
            query=request.query_string,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=body,
            script=request.headers.get(SCRIPT_HEADER, DEFAULT_SCRIPT),
            raw=raw,
        )
        if self.record:
            self.requests.append(rec)
        if parse_error or (request.method == "POST" and not isinstance(body, dict)):
            raise _BadRequest(
                "We could not parse the JSON body of your request. The body must be a JSON object."
            )
        return rec, body

    def _pick_step(self, rec: RecordedRequest, turns: int) -> Step:
        if rec.script not in self.scripts:
            raise _BadRequest(
                f"{SCRIPT_HEADER}: unknown script {rec.script!r}; known: {sorted(self.scripts)}",
                SCRIPT_HEADER,
            )
        rec.step = turns
        return _with_fetches(self._step(rec.script, turns), rec.body)

    async def _run(self, rec: RecordedRequest, coro: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """Track in-flight requests and client disconnects around one handler body."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await coro
        except (TypeError, AttributeError, KeyError, ValueError) as e:
            # A field of a type the provider would refuse (`"instructions": 1`): a 400 as the
            # provider answers it, not a crash of the test upstream (a 500 runcap would relay).
            raise _BadRequest(f"Invalid request body: {type(e).__name__}: {e}") from None
        except asyncio.CancelledError:
            # With handler cancellation on, a client that goes away cancels the handler.
            if not rec.dropped:
                rec.disconnected = True
            raise
        finally:
            self.in_flight -= 1

    async def _stream(
        self,
        request: web.Request,
        rec: RecordedRequest,
        step: Step,
        events: list[bytes],
        stall_at: int,
        headers: dict[str, str],
        error_event: bytes,
    ) -> web.StreamResponse:
        """Play a stream's events; `error_event` is the format's mid-stream error."""
        if step.drop_after_events == 0:
            self._drop(request, rec)
        events = _end_early(step, events, error_event)
        if step.oversized_event_bytes and events:
            events.insert(1, _oversized_comment(step.oversized_event_bytes))
            if stall_at >= 1:
                stall_at += 1
        ended_early = step.end_after_events is not None or step.error_after_events is not None
        resp = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **headers, **dict(step.headers)})
        await resp.prepare(request)
        try:
            last = len(events) - 1
            for i, event in enumerate(events):
                for start in range(0, len(event), _WRITE_BYTES):
                    await resp.write(event[start : start + _WRITE_BYTES])
                if step.drop_after_events == i + 1:
                    self._drop(request, rec)
                if i == stall_at and step.stall_s:
                    await asyncio.sleep(step.stall_s)
                elif step.chunk_delay_s and i < last:
                    await asyncio.sleep(step.chunk_delay_s)
            await resp.write_eof()
        except ConnectionError:
            rec.disconnected = True
            return resp
        rec.ended_early = ended_early
        rec.completed = not ended_early
        return resp

    def _drop(self, request: web.Request, rec: RecordedRequest) -> NoReturn:
        """Close the connection without finishing the response, like a provider that failed."""
        rec.dropped = True
        if request.transport is not None:
            request.transport.close()  # flushes what was written, then closes (no final chunk)
        # aiohttp treats a cancelled handler as a gone connection: nothing more is written or logged.
        raise asyncio.CancelledError

    def _reply(
        self, request: web.Request, rec: RecordedRequest, step: Step, body: bytes, headers: dict[str, str]
    ) -> web.Response:
        """A successful non-stream answer (or the connection dropped, when the step says so)."""
        if step.drop_after_events is not None:
            self._drop(request, rec)
        return self._json(rec, 200, body, headers)

    def _json(self, rec: RecordedRequest, status: int, body: bytes, headers: dict[str, str]) -> web.Response:
        rec.status = status
        rec.completed = True
        return web.Response(status=status, body=body, content_type=_JSON, headers=headers)

    # ================================================================== OpenAI

    def _openai_headers(self, step: Step | None) -> dict[str, str]:
        headers = {"x-request-id": self._new_id("req_"), "openai-processing-ms": "1"}
        if step is not None and step.headers:
            headers.update(step.headers)
        return headers

    def _openai_fail(self, rec: RecordedRequest | None, e: _BadRequest, status: int = 400) -> web.Response:
        body = _openai_error_body(status, e.message, None, e.param, e.code)
        if rec is None:
            return web.Response(status=status, body=body, content_type=_JSON)
        return self._json(rec, status, body, self._openai_headers(None))

    def _openai_step_error(self, rec: RecordedRequest, step: Step) -> web.Response:
        assert step.status is not None
        body = _openai_error_body(
            step.status,
            step.error or "The server had an error while processing your request.",
            step.error_type,
            None,
            step.error_code,
        )
        return self._json(rec, step.status, body, self._openai_headers(step))

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        rec: RecordedRequest | None = None
        try:
            rec, body = await self._begin(request)
            return await self._run(rec, self._chat(request, rec, body))
        except _BadRequest as e:
            return self._openai_fail(rec, e)

    async def _chat(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        if not isinstance(body.get("messages"), list):
            raise _BadRequest(
                "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
            )
        if not isinstance(body.get("model"), str):
            raise _BadRequest("Missing required parameter: 'model'.", "model", "missing_required_parameter")
        _check_chat_tools(body)
        limit = _limit(body, "max_completion_tokens", "max_tokens")
        step = self._pick_step(rec, _chat_turns(body))
        rec.stream = bool(body.get("stream"))
        await _pause(step, rec.stream)
        if step.status:
            return self._openai_step_error(rec, step)
        tools_allowed = bool(body.get("tools") or body.get("functions")) and body.get("tool_choice") != "none"
        modalities = body.get("modalities")
        ans = self._answer(
            rec,
            step,
            chat_input_tokens(body, self.tokenizer),
            limit,
            tools_allowed,
            "call_",
            audio=isinstance(modalities, list) and "audio" in modalities,
            input_audio=_input_audio_tokens(body.get("messages")),
        )
        if body.get("web_search_options") is not None and rec.usage is not None:
            rec.usage.tool_uses = {"web_search": 1}  # a search model searches on every call
        finish = "length" if ans.truncated else "tool_calls" if ans.calls else "stop"
        usage = _openai_usage(ans)
        tier = _served_tier(step, body)
        model = self.deployments.get(request.match_info.get("deployment", ""), body["model"])
        rid = self._new_id("chatcmpl-")
        created = int(time.time())
        headers = self._openai_headers(step)
        if not rec.stream:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": ans.text if ans.text or not ans.calls else None,
                "refusal": None,
                "annotations": [],
            }
            if ans.calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in ans.calls
                ]
            out = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage,
                "service_tier": tier,
                "system_fingerprint": "fp_runcapmock",
            }
            if step.omit_usage:
                del out["usage"]
            return self._reply(request, rec, step, orjson.dumps(out), headers)

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        base: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "service_tier": tier,
            "system_fingerprint": "fp_runcapmock",
        }
        if include_usage:
            base["usage"] = None

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return _sse_data({**base, "choices": [choice]})

        events: list[bytes] = []
        pieces = _pieces(ans.text, self.chunk_chars)
        if pieces or not ans.calls:
            events.append(chunk({"role": "assistant", "content": "", "refusal": None}))
            events.extend(chunk({"content": p}) for p in pieces)
        for index, c in enumerate(ans.calls):
            head: dict[str, Any] = {
                "index": index,
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": ""},
            }
            if events:
                events.append(chunk({"tool_calls": [head]}))
            else:  # like OpenAI: the role rides on the first tool-call delta
                events.append(
                    chunk({"role": "assistant", "content": None, "tool_calls": [head], "refusal": None})
                )
            events.extend(
                chunk({"tool_calls": [{"index": index, "function": {"arguments": p}}]})
                for p in _pieces(c.arguments, self.chunk_chars)
            )
        events.append(chunk({}, finish))
        if include_usage and not step.omit_usage:
            events.append(_sse_data({**base, "choices": [], "usage": usage}))
        events.append(_SSE_DONE)
        return await self._stream(
            request, rec, step, events, min(1, len(events) - 1), headers, _openai_stream_error(step)
        )

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        rec: RecordedRequest | None = None
        try:
            rec, body = await self._begin(request)
            return await self._run(rec, self._completions(request, rec, body))
        except _BadRequest as e:
            return self._openai_fail(rec, e)

    async def _completions(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        if "prompt" not in body:
            raise _BadRequest("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
        limit = _limit(body, "max_tokens", default=LEGACY_COMPLETIONS_DEFAULT_MAX_TOKENS)
        step = self._pick_step(rec, 0)
        rec.stream = bool(body.get("stream"))
        await _pause(step, rec.stream)
        if step.status:
            return self._openai_step_error(rec, step)
        ans = self._answer(rec, step, _prompt_tokens(body.get("prompt")), limit, False, "call_")
        finish = "length" if ans.truncated else "stop"
        usage = _openai_usage(ans)
        base: dict[str, Any] = {
            "id": self._new_id("cmpl-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "system_fingerprint": "fp_runcapmock",
        }
        headers = self._openai_headers(step)
        if not rec.stream:
            choice = {"text": ans.text, "index": 0, "logprobs": None, "finish_reason": finish}
            out = {**base, "choices": [choice], "usage": usage}
            if step.omit_usage:
                del out["usage"]
            return self._reply(request, rec, step, orjson.dumps(out), headers)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if include_usage:
            base["usage"] = None
        events = [
            _sse_data({**base, "choices": [{"text": p, "index": 0, "logprobs": None, "finish_reason": None}]})
            for p in _pieces(ans.text, self.chunk_chars)
        ]
        events.append(
            _sse_data(
                {**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": finish}]}
            )
        )
        if include_usage and not step.omit_usage:
            events.append(_sse_data({**base, "choices": [], "usage": usage}))
        events.append(_SSE_DONE)
        return await self._stream(request, rec, step, events, 0, headers, _openai_stream_error(step))

    async def handle_embeddings(self, request: web.Request) -> web.StreamResponse:
        rec: RecordedRequest | None = None
        try:
            rec, body = await self._begin(request)
            return await self._run(rec, self._embeddings(request, rec, body))
        except _BadRequest as e:
            return self._openai_fail(rec, e)

    async def _embeddings(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        value = body.get("input")
        if value is None:
            raise _BadRequest("Missing required parameter: 'input'.", "input", "missing_required_parameter")
        step = self._pick_step(rec, 0)
        await _pause(step, False)
        if step.status:
            return self._openai_step_error(rec, step)
        if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
            inputs: list[Any] = [value]
        else:
            inputs = list(value)
        dims = body.get("dimensions") or EMBEDDING_DIMENSIONS
        if not isinstance(dims, int) or not 1 <= dims <= 4096:
            raise _BadRequest(f"Invalid 'dimensions': {dims!r}.", "dimensions", "invalid_value")
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        for i, item in enumerate(inputs):
            vec = _embedding(item if isinstance(item, str) else orjson.dumps(item).decode(), dims)
            embedding: Any = base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode() if as_base64 else vec
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = step.input_tokens if step.input_tokens is not None else _prompt_tokens(inputs)
        rec.usage = Usage(input_tokens=tokens)
        out = {
            "object": "list",
            "data": data,
            "model": body.get("model"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return self._reply(request, rec, step, orjson.dumps(out), self._openai_headers(step))

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        model_id = request.match_info.get("model")
        if model_id is not None:
            body = {"id": model_id, "object": "model", "created": 1_700_000_000, "owned_by": "runcap-mock"}
        else:
            data = [
                {"id": m, "object": "model", "created": 1_700_000_000, "owned_by": "runcap-mock"}
                for m in MODELS
            ]
            body = {"object": "list", "data": data}
        if self.record:
            self.requests.append(
                RecordedRequest(
                    request.method,
                    request.path,
                    request.query_string,
                    {k.lower(): v for k, v in request.headers.items()},
                    None,
                    completed=True,
                )
            )
        return web.Response(body=orjson.dumps(body), content_type=_JSON)

    # ================================================================== OpenAI Responses

    async def handle_responses(self, request: web.Request) -> web.StreamResponse:
        rec: RecordedRequest | None = None
        try:
            rec, body = await self._begin(request)
            return await self._run(rec, self._responses(request, rec, body))
        except _BadRequest as e:
            return self._openai_fail(rec, e)

    async def _responses(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        items = body.get("input")
        if not isinstance(items, (str, list)):
            raise _BadRequest("Missing required parameter: 'input'.", "input", "missing_required_parameter")
        if not isinstance(body.get("model"), str):
            raise _BadRequest("Missing required parameter: 'model'.", "model", "missing_required_parameter")
        limit = _limit(body, "max_output_tokens")
        # Answered — and billed — as if the stored conversation and the referenced items had been
        # sent: the input the model reads is the whole conversation.
        conversation = self._responses_conversation(body)
        body = {**body, "input": conversation}
        turns = _responses_turns(conversation)
        step = self._pick_step(rec, turns)
        rec.stream = bool(body.get("stream"))
        await _pause(step, rec.stream)
        if step.status:
            return self._openai_step_error(rec, step)
        tools = body.get("tools") or []
        tools_allowed = bool(tools) and body.get("tool_choice") != "none"
        hosted = _hosted_uses(step, body, anthropic=False) if tools_allowed else ()
        ans = self._answer(
            rec, step, responses_input_tokens(body, self.tokenizer), limit, tools_allowed, "call_",
            hosted=hosted,
        )
        rid = self._new_id("resp_")
        headers = self._openai_headers(step)

        output: list[dict[str, Any]] = []
        container = self._new_id("cntr_")
        for use in ans.hosted:
            output.append(self._hosted_item(use, container))
        if ans.reasoning_tokens:
            output.append({"id": self._new_id("rs_"), "type": "reasoning", "summary": []})
        if ans.text or not ans.calls:
            status = "incomplete" if ans.truncated and not ans.calls else "completed"
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ans.text}
            output.append(
                {
                    "id": self._new_id("msg_"),
                    "type": "message",
                    "status": status,
                    "content": [part],
                    "role": "assistant",
                }
            )
        for c in ans.calls:
            output.append(
                {
                    "id": self._new_id("fc_"),
                    "type": "function_call",
                    "status": "incomplete" if c.partial else "completed",
                    "arguments": c.arguments,
                    "call_id": c.id,
                    "name": c.name,
                }
            )
        if body.get("store", True) is not False:
            self._store_response(rid, conversation, output)
        now = int(time.time())
        final = {
            "id": rid,
            "object": "response",
            "created_at": now,
            "status": "incomplete" if ans.truncated else "completed",
            "background": False,
            "completed_at": None if ans.truncated else now,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if ans.truncated else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": limit,
            "max_tool_calls": body.get("max_tool_calls"),
            "model": body["model"],
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "service_tier": _served_tier(step, body),
            "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": tools,
            "top_p": body.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None if step.omit_usage else _responses_usage(ans),
            "user": None,
            "metadata": body.get("metadata") or {},
        }
        if not rec.stream:
            return self._reply(request, rec, step, orjson.dumps(final), headers)

        seq = itertools.count()
        events: list[bytes] = []

        def emit(name: str, payload: dict[str, Any]) -> None:
            payload = {"type": name, "sequence_number": next(seq), **payload}
            events.append(_sse_event(name.encode(), payload))

        pending = {
            **final,
            "status": "in_progress",
            "completed_at": None,
            "incomplete_details": None,
            "output": [],
            "usage": None,
        }
        emit("response.created", {"response": pending})
        emit("response.in_progress", {"response": pending})
        stall_at: int | None = None  # stall after the first delta of the first item
        for index, item in enumerate(output):
            kind = item["type"]
            if kind == "message":
                item_id = item["id"]
                text = item["content"][0]["text"]
                emit(
                    "response.output_item.added",
                    {"output_index": index, "item": {**item, "status": "in_progress", "content": []}},
                )
                empty_part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
                emit(
                    "response.content_part.added",
                    {"item_id": item_id, "output_index": index, "content_index": 0, "part": empty_part},
                )
                if stall_at is None:
                    stall_at = len(events)
                for p in _pieces(text, self.chunk_chars):
                    emit(
                        "response.output_text.delta",
                        {
                            "item_id": item_id,
                            "output_index": index,
                            "content_index": 0,
                            "delta": p,
                            "logprobs": [],
                        },
                    )
                emit(
                    "response.output_text.done",
                    {
                        "item_id": item_id,
                        "output_index": index,
                        "content_index": 0,
                        "text": text,
                        "logprobs": [],
                    },
                )
                emit(
                    "response.content_part.done",
                    {
                        "item_id": item_id,
                        "output_index": index,
                        "content_index": 0,
                        "part": item["content"][0],
                    },
                )
            elif kind == "function_call":
                item_id = item["id"]
                emit(
                    "response.output_item.added",
                    {"output_index": index, "item": {**item, "status": "in_progress", "arguments": ""}},
                )
                if stall_at is None:
                    stall_at = len(events)
                for p in _pieces(item["arguments"], self.chunk_chars):
                    emit(
                        "response.function_call_arguments.delta",
                        {"item_id": item_id, "output_index": index, "delta": p},
                    )
                emit(
                    "response.function_call_arguments.done",
                    {"item_id": item_id, "output_index": index, "arguments": item["arguments"]},
                )
            else:
                emit("response.output_item.added", {"output_index": index, "item": item})
            emit("response.output_item.done", {"output_index": index, "item": item})
        # A response cut by max_output_tokens ends with `response.incomplete`, as on the real API.
        emit("response.incomplete" if ans.truncated else "response.completed", {"response": final})
        stall_at = 2 if stall_at is None else stall_at
        error = {
            "type": "error",
            "sequence_number": len(events),
            "code": step.error_code or step.error_type or "server_error",
            "message": step.error or "The server had an error while processing your request.",
            "param": None,
        }
        return await self._stream(request, rec, step, events, stall_at, headers, _sse_event(b"error", error))

    def _hosted_item(self, use: _HostedUse, container: str) -> dict[str, Any]:
        """The output item of one hosted-tool use the provider executed (Responses)."""
        kind = use.tool
        if kind.startswith("web_search"):
            action = {"type": "search", "query": "runcap mock search"}
            item_id = self._new_id("ws_")
            return {"id": item_id, "type": "web_search_call", "status": "completed", "action": action}
        if kind == "file_search":
            return {
                "id": self._new_id("fs_"),
                "type": "file_search_call",
                "status": "completed",
                "queries": ["runcap mock query"],
                "results": None,
            }
        if kind == "code_interpreter":
            return {
                "id": self._new_id("ci_"),
                "type": "code_interpreter_call",
                "status": "completed",
                "code": "print(1)",
                "container_id": container,
                "outputs": None,
            }
        return {
            "id": self._new_id("mcp_"),
            "type": "mcp_call",
            "status": "completed",
            "server_label": use.label,
            "name": "refund",
            "arguments": '{"order_id":"A1"}',
            "output": "refunded",
            "error": None,
        }

    def _responses_conversation(self, body: dict[str, Any]) -> list[Any]:
        """The input items the model reads: the stored conversation `previous_response_id` names,
        then the request's input with each `item_reference` replaced by the stored item. Refused
        like the real API: an unknown response or item, a tool output without its call, a call
        without its output."""
        items = body["input"]
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        conversation: list[Any] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self._stored_responses.get(previous) if isinstance(previous, str) else None
            if stored is None:
                raise _BadRequest(
                    f"Previous response with id '{previous}' not found.",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            conversation.extend(stored)
        for item in items:
            if isinstance(item, dict) and item.get("type") == "item_reference":
                ref = item.get("id")
                stored_item = self._stored_items.get(ref) if isinstance(ref, str) else None
                if stored_item is None:
                    raise _BadRequest(f"Item with id '{ref}' not found.", "input", "item_not_found")
                item = stored_item
            conversation.append(item)
        kinds = [(i.get("type"), i.get("call_id")) for i in conversation if isinstance(i, dict)]
        calls = [call_id for kind, call_id in kinds if kind == "function_call"]
        outputs = [call_id for kind, call_id in kinds if kind == "function_call_output"]
        orphans = [call_id for call_id in outputs if call_id not in calls]
        if orphans:
            raise _BadRequest(
                f"No tool call found for function call output with call_id {orphans[0]}.", "input"
            )
        unanswered = [call_id for call_id in calls if call_id not in outputs]
        if unanswered:
            raise _BadRequest(f"No tool output found for function call {unanswered[0]}.", "input")
        return conversation

    def _store_response(self, rid: str, conversation: list[Any], output: list[dict[str, Any]]) -> None:
        """Keep a stored response's conversation and output items (bounded: the oldest go)."""
        self._stored_responses[rid] = [*conversation, *output]
        for item in output:
            self._stored_items[item["id"]] = item
        while len(self._stored_responses) > _MAX_REMEMBERED_RESPONSES:
            del self._stored_responses[next(iter(self._stored_responses))]
        while len(self._stored_items) > 4 * _MAX_REMEMBERED_RESPONSES:
            del self._stored_items[next(iter(self._stored_items))]

    # ================================================================== Anthropic

    def _anthropic_headers(self, step: Step | None) -> dict[str, str]:
        headers = {"request-id": self._new_id("req_")}
        if step is not None and step.headers:
            headers.update(step.headers)
        return headers

    def _anthropic_fail(
        self, rec: RecordedRequest | None, message: str, status: int = 400, etype: str | None = None
    ) -> web.Response:
        headers = self._anthropic_headers(None)
        body = _anthropic_error_body(status, message, etype, headers["request-id"])
        if rec is None:
            return web.Response(status=status, body=body, content_type=_JSON, headers=headers)
        return self._json(rec, status, body, headers)

    async def handle_messages(self, request: web.Request) -> web.StreamResponse:
        rec: RecordedRequest | None = None
        try:
            rec, body = await self._begin(request)
            return await self._run(rec, self._messages(request, rec, body))
        except _BadRequest as e:
            return self._anthropic_fail(rec, e.message)

    async def handle_count_tokens(self, request: web.Request) -> web.StreamResponse:
        rec: RecordedRequest | None = None
        try:
            rec, body = await self._begin(request)
        except _BadRequest as e:
            return self._anthropic_fail(rec, e.message)
        tokens = anthropic_input_tokens(body, self.tokenizer)
        return self._json(rec, 200, orjson.dumps({"input_tokens": tokens}), self._anthropic_headers(None))

    async def _messages(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        for name in ("model", "messages", "max_tokens"):
            if name not in body:
                raise _BadRequest(f"{name}: Field required")
        if not isinstance(body["messages"], list):
            raise _BadRequest("messages: Input should be a valid list")
        limit = body["max_tokens"]
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise _BadRequest("max_tokens: Input should be greater than or equal to 1")
        thread = body.get("thread")
        if thread is not None:
            kept = self._thread_of(rec, thread, body)
            if isinstance(kept, web.Response):
                return kept
            if kept is not None:  # answered as if the kept system, tools and history were sent
                body = {
                    **body,
                    "system": kept.system,
                    "tools": kept.tools,
                    "messages": [*kept.messages, *body["messages"]],
                }
        step = self._pick_step(rec, _anthropic_turns(body))
        rec.stream = bool(body.get("stream"))
        await _pause(step, rec.stream)
        if step.status:
            headers = self._anthropic_headers(step)
            message = step.error or "Internal server error"
            err = _anthropic_error_body(step.status, message, step.error_type, headers["request-id"])
            return self._json(rec, step.status, err, headers)
        tool_choice = body.get("tool_choice") or {}
        tools_allowed = bool(body.get("tools")) and tool_choice.get("type") != "none"
        hosted = _hosted_uses(step, body, anthropic=True) if tools_allowed else ()
        ans = self._answer(
            rec, step, anthropic_input_tokens(body, self.tokenizer), limit, tools_allowed, "toolu_",
            hosted=hosted,
        )
        # Anthropic cannot return a half-written tool_use block's input: a cut call is dropped.
        calls = [c for c in ans.calls if not c.partial]
        stop = "max_tokens" if ans.truncated else "tool_use" if calls else "end_turn"
        usage = _anthropic_usage(ans, body)
        content: list[dict[str, Any]] = []
        for use in ans.hosted:
            tool_id = self._new_id("srvtoolu_")
            name = "web_search" if use.tool.startswith("web_search") else "web_fetch"
            content.append({"type": "server_tool_use", "id": tool_id, "name": name, "input": {"query": "q"}})
            content.append({"type": f"{name}_tool_result", "tool_use_id": tool_id, "content": []})
        if ans.text or not calls:
            content.append({"type": "text", "text": ans.text})
        content.extend({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input} for c in calls)
        msg_id = self._new_id("msg_")
        if thread is not None:
            history = [*body["messages"], {"role": "assistant", "content": content}]
            self._threads[msg_id] = _Thread(body.get("system"), body.get("tools"), history)
            if len(self._threads) > _MAX_REMEMBERED_RESPONSES:
                del self._threads[next(iter(self._threads))]  # the oldest
        headers = self._anthropic_headers(step)
        message_obj = {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }
        if step.omit_usage:
            del message_obj["usage"]
        if not rec.stream:
            return self._reply(request, rec, step, orjson.dumps(message_obj), headers)

        start = {**message_obj, "content": [], "stop_reason": None}
        if not step.omit_usage:
            start["usage"] = {**usage, "output_tokens": 1}
            start["usage"].pop("server_tool_use", None)
        events = [_sse_event(b"message_start", {"type": "message_start", "message": start})]
        stall_at = 0
        tool_uses = 0
        for index, block in enumerate(content):
            if block["type"] not in ("text", "tool_use"):  # server tool blocks: whole, no deltas
                events.append(
                    _sse_event(
                        b"content_block_start",
                        {"type": "content_block_start", "index": index, "content_block": block},
                    )
                )
                events.append(
                    _sse_event(b"content_block_stop", {"type": "content_block_stop", "index": index})
                )
                continue
            if block["type"] == "text":
                events.append(
                    _sse_event(
                        b"content_block_start",
                        {
                            "type": "content_block_start",
                            "index": index,
                            "content_block": {"type": "text", "text": ""},
                        },
                    )
                )
                deltas = [{"type": "text_delta", "text": p} for p in _pieces(block["text"], self.chunk_chars)]
            else:
                c = calls[tool_uses]
                tool_uses += 1
                events.append(
                    _sse_event(
                        b"content_block_start",
                        {
                            "type": "content_block_start",
                            "index": index,
                            "content_block": {**block, "input": {}},
                        },
                    )
                )
                deltas = [{"type": "input_json_delta", "partial_json": ""}]
                deltas.extend(
                    {"type": "input_json_delta", "partial_json": p}
                    for p in _pieces(c.arguments, self.chunk_chars)
                )
            if index == 0:
                events.append(_sse_event(b"ping", {"type": "ping"}))
            for i, delta in enumerate(deltas):
                events.append(
                    _sse_event(
                        b"content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
                )
                if index == 0 and i == 0:
                    stall_at = len(events) - 1
            events.append(_sse_event(b"content_block_stop", {"type": "content_block_stop", "index": index}))
        delta_event: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": None},
        }
        if not step.omit_usage:
            delta_event["usage"] = {k: usage[k] for k in _ANTHROPIC_DELTA_USAGE_KEYS if k in usage}
        events.append(_sse_event(b"message_delta", delta_event))
        events.append(_sse_event(b"message_stop", {"type": "message_stop"}))
        error = {
            "type": "error",
            "error": {"type": step.error_type or "overloaded_error", "message": step.error or "Overloaded"},
            "request_id": headers["request-id"],
        }
        return await self._stream(request, rec, step, events, stall_at, headers, _sse_event(b"error", error))

    def _thread_of(
        self, rec: RecordedRequest, thread: Any, body: dict[str, Any]
    ) -> _Thread | web.Response | None:
        """The thread a request continues (None for `create`), or the error response."""
        betas = [b.strip() for b in (rec.header("anthropic-beta") or "").split(",")]
        if MESSAGE_THREADS_BETA not in betas:
            raise _BadRequest("thread: Extra inputs are not permitted")
        kind = thread.get("type") if isinstance(thread, dict) else None
        if kind == "create":
            return None
        if kind != "continue":
            raise _BadRequest("thread.type: Input should be 'create' or 'continue'")
        previous = thread.get("previous_message_id")
        kept = self._threads.get(previous) if isinstance(previous, str) else None
        if kept is None:
            headers = self._anthropic_headers(None)
            err = orjson.loads(
                _anthropic_error_body(
                    404, f"thread: no message {previous!r} to continue", None, headers["request-id"]
                )
            )
            err["error"]["details"] = {"error_code": "thread_not_found"}
            return self._json(rec, 404, orjson.dumps(err), headers)
        repeated = [name for name in ("system", "tools") if name in body]
        if repeated:
            raise _BadRequest(
                f"{' and '.join(repeated)}: cannot be sent with thread.type 'continue': the thread keeps "
                "the ones it was created with"
            )
        return kept

    # ================================================================== fallbacks

    async def handle_not_found(self, request: web.Request) -> web.StreamResponse:
        if self.record:
            with contextlib.suppress(Exception):
                await self._begin(request)
            if self.requests:
                self.requests[-1].status = 404
                self.requests[-1].completed = True
        if request.path.startswith("/v1/messages"):
            return self._anthropic_fail(None, f"Not found: {request.method} {request.path}", 404)
        body = _openai_error_body(404, f"Invalid URL ({request.method} {request.path})", None)
        return web.Response(status=404, body=body, content_type=_JSON)


# Cumulative usage in Anthropic's message_delta (the current API repeats the input counts there).
_ANTHROPIC_DELTA_USAGE_KEYS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
    "server_tool_use",  # the final counts of the server tools' uses
)


def _served_tier(step: Step, body: dict[str, Any]) -> str:
    """The OpenAI service tier an answer reports: the step's, else the one requested (`auto` and
    none: "default")."""
    if step.service_tier is not None:
        return step.service_tier
    tier = body.get("service_tier")
    return tier if tier in ("default", "flex", "priority", "scale") else "default"


def _openai_usage(ans: _Answer) -> dict[str, Any]:
    prompt_details: dict[str, int] = {
        "cached_tokens": ans.cache_read_tokens,
        "audio_tokens": ans.input_audio_tokens,
    }
    if ans.cache_write_tokens:
        prompt_details["cache_write_tokens"] = ans.cache_write_tokens
    return {
        "prompt_tokens": ans.input_tokens,
        "completion_tokens": ans.output_tokens,
        "total_tokens": ans.input_tokens + ans.output_tokens,
        "prompt_tokens_details": prompt_details,
        "completion_tokens_details": {
            "reasoning_tokens": ans.reasoning_tokens,
            "audio_tokens": ans.audio_tokens,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _responses_usage(ans: _Answer) -> dict[str, Any]:
    return {
        "input_tokens": ans.input_tokens,
        "input_tokens_details": {
            "cached_tokens": ans.cache_read_tokens,
            "cache_write_tokens": ans.cache_write_tokens,
        },
        "output_tokens": ans.output_tokens,
        "output_tokens_details": {"reasoning_tokens": ans.reasoning_tokens},
        "total_tokens": ans.input_tokens + ans.output_tokens,
    }


def _anthropic_usage(ans: _Answer, body: dict[str, Any]) -> dict[str, Any]:
    # Anthropic's input_tokens excludes the tokens read from and written to the cache.
    usage: dict[str, Any] = {
        "input_tokens": ans.input_tokens - ans.cache_read_tokens - ans.cache_write_tokens,
        "cache_creation_input_tokens": ans.cache_write_tokens,
        "cache_read_input_tokens": ans.cache_read_tokens,
        "output_tokens": ans.output_tokens,
        "service_tier": "standard",
    }
    if ans.hosted:
        usage["server_tool_use"] = {
            "web_search_requests": sum(1 for h in ans.hosted if h.tool.startswith("web_search")),
            "web_fetch_requests": sum(1 for h in ans.hosted if h.tool.startswith("web_fetch")),
        }
    if body.get("speed") in ("fast", "standard"):
        usage["speed"] = body["speed"]
    return usage


def make_app(upstream: ScriptedUpstream) -> web.Application:
    """The aiohttp application serving `upstream` (routes only; no middleware on the hot path)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", upstream.handle_chat)
    app.router.add_post("/openai/deployments/{deployment}/chat/completions", upstream.handle_chat)
    app.router.add_post("/v1/responses", upstream.handle_responses)
    app.router.add_post("/v1/completions", upstream.handle_completions)
    app.router.add_post("/v1/embeddings", upstream.handle_embeddings)
    app.router.add_post("/v1/messages", upstream.handle_messages)
    app.router.add_post("/v1/messages/count_tokens", upstream.handle_count_tokens)
    app.router.add_get("/v1/models", upstream.handle_models)
    app.router.add_get("/v1/models/{model}", upstream.handle_models)
    app.router.add_route("*", "/{tail:.*}", upstream.handle_not_found)
    return app


def run(host: str = "127.0.0.1", port: int = 8000, script_path: str | None = None) -> None:
    """Serve until interrupted (`runcap mock-upstream --listen H:P --script FILE`).

    Requests are not recorded here: nothing in-process reads them, and a long benchmark would
    otherwise grow memory without bound.
    """
    scripts = load_scripts(script_path) if script_path else None
    upstream = ScriptedUpstream(scripts, record=False)

    async def serve() -> None:
        url = await upstream.start(host, port)
        print(f"scripted upstream listening on {url} (scripts: {', '.join(sorted(upstream.scripts))})")
        try:
            await asyncio.Event().wait()
        finally:
            await upstream.stop()

    try:
        import uvloop  # type: ignore[import-not-found]

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve())
