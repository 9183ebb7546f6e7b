"""OpenAI Responses (`POST /v1/responses`) as a data mapper.

Tool calls the agent must execute are output items of a client-side call type (`function_call`,
`custom_tool_call`, and the client-executed built-ins such as `computer_call` or `shell_call`),
each with a `call_id`; their results come back as `*_output` input items with the same
`call_id`. Hosted tools (web search, file search, code interpreter, MCP) run at OpenAI and are
not tool calls of the agent. Usage arrives only with the terminal event of a stream.
"""

from __future__ import annotations

from typing import Any

from .base import BodyError, NoHistory, RequestInfo, ResponseInfo, ToolCall, ToolResult, Usage
from .billable import (
    count_references,
    openai_service_tier,
    responses_hosted_tools,
    responses_provider_calls,
    served_tier,
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
    inline_media_bound,
    json_bytes,
    limit_field,
    list_field,
    model_field,
    object_item,
    openai_style_usage,
    request_object,
    text_bytes,
    text_of,
    url_media_bound,
)
from .sse import SSEEvent, SSEStreamReader, error_text

# Client-executed call item type -> (tool name, or None to read it from the item; arguments key)
_CALLS: dict[str, tuple[str | None, str]] = {
    "function_call": (None, "arguments"),
    "custom_tool_call": (None, "input"),
    "computer_call": ("computer", "action"),
    "local_shell_call": ("local_shell", "action"),
    "shell_call": ("shell", "action"),
    "apply_patch_call": ("apply_patch", "operation"),
}
_CALL_OUTPUTS = frozenset(kind + "_output" for kind in _CALLS)
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_ENDED = frozenset(("completed", "incomplete"))
_DELTA_EVENTS = frozenset(("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"))
_TERMINAL_EVENTS = frozenset(("response.completed", "response.incomplete", "response.failed"))


def responses_usage(usage: Any, output: Any = None) -> Usage | None:
    """The response's usage, with the per-use fees its provider-executed calls bill (`output`)."""
    return openai_style_usage(usage, "input_tokens", "output_tokens", responses_provider_calls(output)[1])


def _is_reference(part: dict[str, Any]) -> bool:
    """A file or image given by id or URL (rendered at the provider, not in the body)."""
    kind = part.get("type")
    if kind == "input_file":
        return part.get("file_data") is None
    if kind == "input_image":
        url = part.get("image_url")
        return part.get("file_id") is not None and url is None
    return False


def _stored_context(body: dict[str, Any]) -> str:
    """Input the provider keeps on its side and bills with this call (`RequestInfo.stored_context`)."""
    held = _held_context(body)
    parts = [held] if held else []
    items = body.get("input")
    if isinstance(items, list):
        parts.extend(
            f"item:{item['id']}"
            for item in items
            if isinstance(item, dict)
            and item.get("type") == "item_reference"
            and isinstance(item.get("id"), str)
        )
    return " ".join(parts)


def _held_context(body: dict[str, Any]) -> str:
    """The stored context that may hold tools of its own: a previous response, a conversation,
    a stored prompt (a referenced output item holds none)."""
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        return f"response:{previous}"
    prompt = body.get("prompt")
    if body.get("conversation") or (isinstance(prompt, dict) and prompt.get("id")):
        return "server-side"
    return ""


def _item_ids(output: Any) -> list[str]:
    if not isinstance(output, list):
        return []
    return [item["id"] for item in output if isinstance(item, dict) and isinstance(item.get("id"), str)]


def _tool_call(item: dict[str, Any]) -> ToolCall | None:
    kind = _CALLS.get(item.get("type"))  # type: ignore[arg-type]
    if kind is None:
        return None
    name, key = kind
    arguments = item.get(key)
    if key == "action" and arguments is None:
        arguments = item.get("actions")  # batched computer actions
    return ToolCall(
        text_of(item, "call_id"),
        name or text_of(item, "name"),
        arguments if isinstance(arguments, str) else compact_json(arguments),
    )


def _tool_calls(output: Any) -> list[ToolCall]:
    calls = []
    if isinstance(output, list):
        for item in output:
            if isinstance(item, dict) and (call := _tool_call(item)) is not None:
                calls.append(call)
    return calls


def _input_image(part: dict[str, Any]) -> int:
    if part.get("image_url") is not None:
        return url_media_bound(part["image_url"])
    return MEDIA_TOKEN_BOUND  # by file_id


def _input_file(part: dict[str, Any]) -> int:
    name = text_bytes(text_of(part, "filename"))
    if part.get("file_data") is not None:
        return inline_media_bound(part["file_data"]) + name
    return MEDIA_TOKEN_BOUND + name  # by file_id or file_url


_CONTENT = ContentBound(
    {"input_image": _input_image, "input_file": _input_file}, media=("input_image", "input_file")
)


class ResponsesStreamReader(SSEStreamReader):
    """Reads Responses API semantic events.

    Mid-stream `info`: model and id after `response.created`; tool calls from
    `response.output_item.added` plus argument deltas (final at `response.output_item.done`,
    and replaced by the terminal response's output); usage only with the terminal event
    (`response.completed` / `response.incomplete` / `response.failed`), None before.

    Each terminal event closes the stream (`complete`) with the final usage: `incomplete` is an
    answer cut short (by its output limit, a content filter), like a chat `finish_reason:
    length`; `failed` is an error (`error` says which) whose usage was still billed.
    """

    def __init__(self) -> None:
        super().__init__(may_drop=False)
        self._model = ""
        self._id = ""
        self._usage: Usage | None = None
        self._ended = False
        # output_index -> ToolCall being built (arguments accumulate from deltas)
        self._calls: dict[int, ToolCall] = {}
        self._item_ids: dict[int, str] = {}  # output_index -> output item id
        self._tier: tuple[tuple[str, str], ...] | None = None
        self._provider_calls: list[ToolCall] = []

    def on_event(self, event: SSEEvent) -> bool:
        data = event.json()
        if not isinstance(data, dict):
            return True
        kind = data.get("type") or event.event
        if kind in _DELTA_EVENTS:
            call = self._calls.get(data.get("output_index"))  # type: ignore[arg-type]
            if call is not None and isinstance(data.get("delta"), str):
                call.arguments += data["delta"]
        elif kind in ("response.output_item.added", "response.output_item.done"):
            item = data.get("item")
            if isinstance(item, dict) and (call := _tool_call(item)) is not None:
                self._calls[data.get("output_index", len(self._calls))] = call
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                self._item_ids[data.get("output_index", len(self._item_ids))] = item["id"]
        elif kind in ("response.created", "response.in_progress", "response.queued"):
            self._read_response(data.get("response"))
        elif kind in _TERMINAL_EVENTS:
            response = data.get("response")
            self._read_response(response)
            if isinstance(response, dict):
                self._usage = responses_usage(response.get("usage"), response.get("output")) or self._usage
                self._tier = served_tier(response.get("service_tier"))
                self._provider_calls = responses_provider_calls(response.get("output"))[0]
                if isinstance(response.get("output"), list):  # the authoritative final output
                    self._calls = dict(enumerate(_tool_calls(response["output"])))
                    self._item_ids = dict(enumerate(_item_ids(response["output"])))
            self._ended = kind != "response.failed"
            self._closed = True
            if kind == "response.failed":
                self._error = error_text(response.get("error") if isinstance(response, dict) else None)
        elif kind == "error":  # the stream failed before a terminal event
            self._error = error_text(data)
        return True

    def _read_response(self, response: Any) -> None:
        if isinstance(response, dict):
            self._model = text_of(response, "model") or self._model
            self._id = text_of(response, "id") or self._id

    @property
    def info(self) -> ResponseInfo:
        calls = [ToolCall(c.id, c.name, c.arguments) for c in self._calls.values()]
        return ResponseInfo(
            model=self._model,
            usage=self._usage,
            tool_calls=calls,
            finished=self._ended and not calls,
            response_id=self._id,
            output_item_ids=list(self._item_ids.values()),
            complete=self.complete,
            error=self.error,
            price_options=self._tier,
            provider_tool_calls=self._provider_calls,
        )


class ResponsesAdapter(NoHistory):
    name = "responses"
    # OpenAI rejects max_output_tokens below 16: a call that cannot afford 16 must be refused.
    min_output_limit = 16

    def parse_request(self, body: dict[str, Any]) -> RequestInfo:
        body = request_object(body)
        # A stored prompt (`prompt.id`) may carry the model; otherwise it is required.
        model = model_field(body, required="prompt" not in body)
        stream = bool_field(body, "stream")
        limit = limit_field(body, "max_output_tokens")
        tools = list_field(body, "tools")

        bound = BASE_OVERHEAD + _CONTENT(body.get("instructions"))
        results: list[ToolResult] = []
        blob = b""
        items = body.get("input")
        if isinstance(items, str):
            bound += MESSAGE_OVERHEAD + text_bytes(items)
        elif isinstance(items, list):
            content, blob = _CONTENT.with_json(items)
            bound += MESSAGE_OVERHEAD * len(items) + content
            last_assistant = -1
            for i, item in enumerate(items):
                item = object_item(item, f"input[{i}]")
                kind = item.get("type")
                if item.get("role") == "assistant" or kind in _CALLS or kind == "reasoning":
                    last_assistant = i  # a model turn: its message, reasoning or tool calls
                if kind in _CALL_OUTPUTS:
                    call_id = item.get("call_id")
                    if not isinstance(call_id, str):
                        raise BodyError(f"input[{i}].call_id must be a string")
                    results.append(
                        ToolResult(
                            call_id,
                            item.get("output"),
                            is_error=item.get("status") == "failed",
                            fresh=i > last_assistant,
                        )
                    )
        elif items is not None:
            raise BodyError("input must be a string or an array")
        if tools:
            bound += TOOL_PROMPT_BOUND + json_bytes(tools)
            for tool in tools:
                if isinstance(tool, dict) and tool.get("type") not in ("function", "custom"):
                    bound += BUILTIN_TOOL_BOUND
        text = body.get("text")
        if isinstance(text, dict) and isinstance(text.get("format"), dict):
            bound += json_bytes(text["format"])
        prompt = body.get("prompt")
        if isinstance(prompt, dict):
            bound += _CONTENT(prompt.get("variables"))
        hosted = responses_hosted_tools(tools)
        refs = count_references(items, _is_reference) if isinstance(items, list) and b'"file_' in blob else 0

        return RequestInfo(
            model=model,
            stream=stream,
            max_output_tokens=limit,
            has_tools=bool(tools),
            tool_results=results,
            input_token_bound=bound,
            stored_context=_stored_context(body),
            price_option=openai_service_tier(body),
            audio=False,  # the Responses API takes and gives no audio
            hosted_tools=hosted,
            hosted_limit=limit_field(body, "max_tool_calls"),
            by_reference=refs,
        )

    def set_hosted_limit(self, body: dict[str, Any], info: RequestInfo, uses: int) -> None:
        body["max_tool_calls"] = uses

    def set_output_limit(self, body: dict[str, Any], limit: int, *, legacy_field: bool = False) -> None:
        body["max_output_tokens"] = limit

    def strip_tools(self, body: dict[str, Any]) -> None:
        for name in _TOOL_FIELDS:
            body.pop(name, None)
        if _held_context(body):
            # Stored context (a stored prompt's tools, a conversation) may bring tools of its own.
            body["tool_choice"] = "none"

    def request_stream_usage(self, body: dict[str, Any]) -> bool:
        return False  # usage is always in the terminal event

    def parse_response(self, body: dict[str, Any]) -> ResponseInfo:
        calls = _tool_calls(body.get("output"))
        status = body.get("status", "completed")
        return ResponseInfo(
            model=text_of(body, "model"),
            usage=responses_usage(body.get("usage"), body.get("output")),
            tool_calls=calls,
            finished=status in _ENDED and not calls,
            response_id=text_of(body, "id"),
            output_item_ids=_item_ids(body.get("output")),
            price_options=served_tier(body.get("service_tier")),
            provider_tool_calls=responses_provider_calls(body.get("output"))[0],
        )

    def stream_reader(self, strip_injected_usage: bool) -> ResponsesStreamReader:
        return ResponsesStreamReader()
