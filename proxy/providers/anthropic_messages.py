"""Anthropic Messages (`POST /v1/messages`) as a data mapper.

Tool calls are `tool_use` content blocks (their `input` is an object; `ToolCall.arguments` is its
compact JSON); results come back as `tool_result` blocks in user messages. Anthropic reports
`input_tokens` WITHOUT the cached parts, so the normalised input is
`input_tokens + cache_read_input_tokens + cache_creation_input_tokens`. In a stream,
`message_start` carries the input and cache counts and `message_delta` the cumulative output
(and, on newer API versions, updated cumulative input counts); only `message_stop` says they are
final.

Message threads (beta `message-threads-2026-08-12`, used by the SDK's tool runner): a request
with `thread: {"type": "continue", "previous_message_id": ...}` sends only the new messages; the
provider holds — and bills — the thread's system prompt, tools and history, and the thread's
tools stay live although the request has none.
"""

from __future__ import annotations

from typing import Any

import orjson

from .base import (
    BodyError,
    HostedTool,
    RequestInfo,
    ResponseInfo,
    ToolCall,
    ToolResult,
    Usage,
    context_digest,
    turn_key,
)
from .billable import (
    anthropic_hosted_tools,
    anthropic_provider_calls,
    anthropic_speed,
    count_references,
    set_anthropic_max_uses,
)
from .body import (
    BASE_OVERHEAD,
    BUILTIN_TOOL_BOUND,
    MEDIA_TOKEN_BOUND,
    MESSAGE_OVERHEAD,
    TOOL_PROMPT_BOUND,
    ContentBound,
    bool_field,
    compact_json,
    content_bound,
    count,
    inline_media_bound,
    json_bytes,
    limit_field,
    list_field,
    model_field,
    object_item,
    request_object,
    text_bytes,
    text_of,
)
from .sse import SSEEvent, SSEStreamReader, error_text

_TOOL_BLOCKS = frozenset(("tool_use", "tool_result"))
# The response asks the agent to act (run tools, or resend to continue a paused server tool).
_NOT_FINAL = frozenset(("tool_use", "pause_turn"))
# Extended thinking needs budget_tokens >= 1024 and < max_tokens.
_MIN_THINKING_BUDGET = 1024


def _usage(input_tokens: int, output_tokens: int, cache_read: int, cache_write: int) -> Usage:
    return Usage(
        input_tokens=input_tokens + cache_read + cache_write,
        output_tokens=output_tokens,
        cache_read_tokens=cache_read,
        cache_write_tokens=cache_write,
    )


def anthropic_usage(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    out = _usage(
        count(usage, "input_tokens"),
        count(usage, "output_tokens"),
        count(usage, "cache_read_input_tokens"),
        count(usage, "cache_creation_input_tokens"),
    )
    searches = count(usage.get("server_tool_use"), "web_search_requests")
    if searches:
        out.tool_uses = {"web_search": searches}
    return out


def _served_speed(usage: Any) -> tuple[tuple[str, str], ...] | None:
    """The speed an answer says it was served at (`usage.speed`), None when it did not say."""
    speed = usage.get("speed") if isinstance(usage, dict) else None
    if speed == "fast":
        return (("speed", "fast"),)
    return () if speed == "standard" else None


def _is_reference(block: dict[str, Any]) -> bool:
    """An image or document given by URL or file id: rendered at the provider, not in the body."""
    source = block.get("source") if block.get("type") in ("image", "document") else None
    return isinstance(source, dict) and source.get("type") in ("url", "file")


def _media_block(block: dict[str, Any]) -> int:
    extra = content_bound(block.get("title"), _PARTS) + content_bound(block.get("context"), _PARTS)
    source = block.get("source")
    if not isinstance(source, dict):
        return MEDIA_TOKEN_BOUND + extra
    kind = source.get("type")
    if kind == "base64":
        return inline_media_bound(source.get("data")) + extra
    if kind == "text":
        return content_bound(source.get("data"), _PARTS) + extra
    if kind == "content":
        return content_bound(source.get("content"), _PARTS) + extra
    return MEDIA_TOKEN_BOUND + extra  # url / file


def _input_block(block: dict[str, Any]) -> int:
    """tool_use and its server-side kin: the model reads `input` as JSON."""
    return (
        text_bytes(text_of(block, "id")) + text_bytes(text_of(block, "name")) + json_bytes(block.get("input"))
    )


_PARTS = {
    "image": _media_block,
    "document": _media_block,
    "tool_use": _input_block,
    "server_tool_use": _input_block,
    "mcp_tool_use": _input_block,
}
# On the JSON fast path tool inputs are already counted as JSON: only media need the walk.
_CONTENT = ContentBound(_PARTS, media=("image", "document"))


def _has_tool_blocks(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") in _TOOL_BLOCKS:
                    return True
    return False


def _blocks_turn(content: Any) -> bytes | None:
    """`turn_key` of assistant content (a response's, or one sent back as history): text blocks
    and tool_use blocks; None for anything else (thinking, server tools...)."""
    if isinstance(content, str):
        return turn_key(content, ())
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    calls: list[tuple[str, str]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append((text_of(block, "name"), compact_json(block.get("input", {}))))
        else:
            return None
    return turn_key("".join(texts), calls)


class MessagesStreamReader(SSEStreamReader):
    """Reads Messages API stream events.

    Mid-stream `info`: model, id, input tokens and cache read/write counts as soon as
    `message_start` arrived (output tokens then hold the start value, usually 1); output tokens
    (cumulative) at each `message_delta`; tool calls from `content_block_start` with the
    `input_json_delta` fragments so far (arguments become compact JSON at `content_block_stop`);
    `finished` once `message_delta` gave a stop reason other than tool_use / pause_turn;
    `complete` once `message_stop` arrived (an `error` event ends a stream without it).
    """

    def __init__(self) -> None:
        super().__init__(may_drop=False)
        self._model = ""
        self._id = ""
        self._counts: dict[str, int] | None = None  # input, output, cache_read, cache_write
        self._stop = ""
        # content block index -> [id, name, input fragments]
        self._calls: dict[int, list[Any]] = {}
        self._text: list[str] = []
        self._other_blocks = False  # thinking, server tools...: no turn key
        self._searches = 0  # usage.server_tool_use.web_search_requests (cumulative)
        self._speed: tuple[tuple[str, str], ...] | None = None
        self._provider_calls: dict[int, ToolCall] = {}  # server_tool_use blocks by index

    def on_event(self, event: SSEEvent) -> bool:
        data = event.json()
        if not isinstance(data, dict):
            return True
        kind = data.get("type") or event.event
        if kind == "content_block_delta":
            delta = data.get("delta")
            if (
                isinstance(delta, dict)
                and delta.get("type") == "text_delta"
                and isinstance(delta.get("text"), str)
            ):
                self._text.append(delta["text"])
            elif isinstance(delta, dict) and delta.get("type") == "input_json_delta":
                slot = self._calls.get(data.get("index"))  # type: ignore[arg-type]
                if slot is not None and isinstance(delta.get("partial_json"), str):
                    slot[2].append(delta["partial_json"])
        elif kind == "content_block_start":
            block = data.get("content_block")
            if isinstance(block, dict) and block.get("type") not in ("text", "tool_use"):
                self._other_blocks = True
            if isinstance(block, dict) and block.get("type") == "text" and block.get("text"):
                self._text.append(block["text"])
            if isinstance(block, dict):
                for call in anthropic_provider_calls([block]):
                    self._provider_calls[data.get("index", len(self._provider_calls))] = call
            if isinstance(block, dict) and block.get("type") == "tool_use":
                start = block.get("input")
                fragments = [compact_json(start)] if start else []
                self._calls[data.get("index", len(self._calls))] = [
                    text_of(block, "id"),
                    text_of(block, "name"),
                    fragments,
                ]
        elif kind == "content_block_stop":
            slot = self._calls.get(data.get("index"))  # type: ignore[arg-type]
            if slot is not None:
                slot[2] = [_compact(slot[2])]
        elif kind == "message_start":
            message = data.get("message")
            if isinstance(message, dict):
                self._model = text_of(message, "model")
                self._id = text_of(message, "id")
                self._read_usage(message.get("usage"))
        elif kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self._stop = delta["stop_reason"]
            self._read_usage(data.get("usage"))
        elif kind == "message_stop":
            self._closed = True
        elif kind == "error":  # the provider failed mid-stream (overloaded...): no message_stop follows
            self._error = error_text(data.get("error"))
        return True

    def _read_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        if isinstance(usage.get("server_tool_use"), dict):
            self._searches = count(usage["server_tool_use"], "web_search_requests")
        self._speed = _served_speed(usage) if "speed" in usage else self._speed
        counts = self._counts or {"input": 0, "output": 0, "cache_read": 0, "cache_write": 0}
        # Later counts are cumulative: each field present replaces the earlier value.
        for field, key in (
            ("input_tokens", "input"),
            ("output_tokens", "output"),
            ("cache_read_input_tokens", "cache_read"),
            ("cache_creation_input_tokens", "cache_write"),
        ):
            if usage.get(field) is not None:
                counts[key] = count(usage, field)
        self._counts = counts

    @property
    def info(self) -> ResponseInfo:
        calls = [ToolCall(slot[0], slot[1], "".join(slot[2]) or "{}") for slot in self._calls.values()]
        counts = self._counts
        usage = None
        if counts is not None:
            usage = _usage(counts["input"], counts["output"], counts["cache_read"], counts["cache_write"])
            if self._searches:
                usage.tool_uses = {"web_search": self._searches}
        return ResponseInfo(
            model=self._model,
            usage=usage,
            tool_calls=calls,
            finished=bool(self._stop) and self._stop not in _NOT_FINAL and not calls,
            response_id=self._id,
            turn=None
            if self._other_blocks
            else turn_key("".join(self._text), [(c.name, c.arguments) for c in calls]),
            complete=self.complete,
            error=self.error,
            price_options=self._speed,
            provider_tool_calls=list(self._provider_calls.values()),
        )


def _thread_context(thread: Any) -> str:
    """`RequestInfo.stored_context` of a request's `thread` field."""
    if thread is None:
        return ""
    if isinstance(thread, dict):
        if thread.get("type") == "create":
            return ""
        previous = thread.get("previous_message_id")
        if isinstance(previous, str) and previous:
            return f"message:{previous}"
    return "server-side"  # a thread of a kind runcap does not know: assume it holds context


def _compact(fragments: list[str]) -> str:
    """The streamed input JSON, re-serialised compactly like a non-streamed `tool_use.input`."""
    text = "".join(fragments)
    if not text:
        return "{}"
    try:
        return compact_json(orjson.loads(text)) or text
    except orjson.JSONDecodeError:
        return text


class MessagesAdapter:
    name = "messages"
    min_output_limit = 1

    def parse_request(self, body: dict[str, Any]) -> RequestInfo:
        body = request_object(body)
        model = model_field(body)
        limit = limit_field(body, "max_tokens", required=True)
        stream = bool_field(body, "stream")
        messages = list_field(body, "messages", required=True)
        tools = list_field(body, "tools")

        bound = BASE_OVERHEAD + _CONTENT(body.get("system"))
        content_bound_, blob = _CONTENT.with_json(messages)
        bound += MESSAGE_OVERHEAD * len(messages) + content_bound_
        results: list[ToolResult] = []
        last_assistant = -1
        for i, message in enumerate(messages):
            message = object_item(message, f"messages[{i}]")
            if message.get("role") == "assistant":
                last_assistant = i
            content = message.get("content")
            if not isinstance(content, list) or message.get("role") != "user":
                continue
            for j, block in enumerate(content):
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    call_id = block.get("tool_use_id")
                    if not isinstance(call_id, str):
                        raise BodyError(f"messages[{i}].content[{j}].tool_use_id must be a string")
                    results.append(
                        ToolResult(
                            call_id, block.get("content"), block.get("is_error") is True, i > last_assistant
                        )
                    )
        if tools:
            bound += TOOL_PROMPT_BOUND + json_bytes(tools)
            for tool in tools:
                # Anthropic-defined tools (bash, computer, web search...) carry no input_schema:
                # their definitions are added by the provider.
                if isinstance(tool, dict) and "input_schema" not in tool:
                    bound += BUILTIN_TOOL_BOUND
        servers = list_field(body, "mcp_servers")
        for server in servers:
            bound += BUILTIN_TOOL_BOUND + _CONTENT(server)
        hosted = anthropic_hosted_tools(tools)
        if servers:  # the MCP connector: remote tools the provider calls, with no use limit
            hosted.append(HostedTool("mcp_servers", None, None, priced=False))
        media = b'"type":"url"' in blob or b'"type":"file"' in blob
        # Structured outputs: the JSON schema the answer must follow (old and new field).
        config = body.get("output_config")
        for schema in (body.get("output_format"), config.get("format") if isinstance(config, dict) else None):
            if isinstance(schema, dict):
                bound += json_bytes(schema)
        thread = body.get("thread")

        return RequestInfo(
            model=model,
            stream=stream,
            max_output_tokens=limit,
            has_tools=bool(tools),
            tool_results=results,
            input_token_bound=bound,
            history=messages,
            # A thread's messages are not resent history: never matched as a prefix of another's.
            context=context_digest(
                model,
                body.get("system"),
                tools,
                body.get("tool_choice"),
                body.get("mcp_servers"),
                body.get("output_format"),
                config,
                thread,
            ),
            stored_context=_thread_context(thread),
            price_option=anthropic_speed(body),
            hosted_tools=hosted,
            by_reference=count_references(messages, _is_reference) if media else 0,
        )

    def history_item(self, item: Any) -> tuple[int, bytes | None]:
        bound = MESSAGE_OVERHEAD + _CONTENT(item)
        if not isinstance(item, dict) or item.get("role") != "assistant":
            return bound, None
        return bound, _blocks_turn(item.get("content"))

    def set_output_limit(self, body: dict[str, Any], limit: int, *, legacy_field: bool = False) -> None:
        body["max_tokens"] = limit
        # Extended thinking must keep 1024 <= budget_tokens < max_tokens, or the call is a 400.
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            budget = thinking.get("budget_tokens")
            if isinstance(budget, int) and budget >= limit:
                if limit > _MIN_THINKING_BUDGET:
                    thinking["budget_tokens"] = max(_MIN_THINKING_BUDGET, limit // 2)
                else:
                    body["thinking"] = {"type": "disabled"}

    def strip_tools(self, body: dict[str, Any]) -> None:
        # Anthropic rejects tool_use / tool_result blocks in the history when `tools` is absent,
        # so such a request keeps its tools and forbids their use instead. So does a thread: the
        # tools it holds stay live without the request's, and a `create` keeps its tools for the
        # thread's later turns (a `continue` may not send any).
        if body.get("thread") is not None or (body.get("tools") and _has_tool_blocks(body.get("messages"))):
            body["tool_choice"] = {"type": "none"}
        else:
            body.pop("tools", None)
            body.pop("tool_choice", None)

    def request_stream_usage(self, body: dict[str, Any]) -> bool:
        return False  # message_start / message_delta always carry usage

    def parse_response(self, body: dict[str, Any]) -> ResponseInfo:
        calls: list[ToolCall] = []
        content = body.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    calls.append(
                        ToolCall(
                            text_of(block, "id"), text_of(block, "name"), compact_json(block.get("input", {}))
                        )
                    )
        stop = body.get("stop_reason")
        return ResponseInfo(
            model=text_of(body, "model"),
            usage=anthropic_usage(body.get("usage")),
            tool_calls=calls,
            finished=isinstance(stop, str) and stop not in _NOT_FINAL and not calls,
            response_id=text_of(body, "id"),
            turn=_blocks_turn(content),
            price_options=_served_speed(body.get("usage")),
            provider_tool_calls=anthropic_provider_calls(content),
        )

    def set_hosted_limit(self, body: dict[str, Any], info: RequestInfo, uses: int) -> None:
        set_anthropic_max_uses(body, info.hosted_tools, uses)

    def stream_reader(self, strip_injected_usage: bool) -> MessagesStreamReader:
        return MessagesStreamReader()
