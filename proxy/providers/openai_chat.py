"""OpenAI Chat Completions (`POST /v1/chat/completions`) as a data mapper.

Also the home of what the legacy text completions endpoint shares with it: the usage object
(`prompt_tokens` / `completion_tokens` and their details) and the chunk stream, whose optional
last chunk carries usage with `"choices": []` when `stream_options.include_usage` is set.
"""

from __future__ import annotations

from typing import Any

from proxy.bounds import MAX_CHOICES

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
from .billable import count_references, openai_service_tier, served_tier
from .body import (
    BASE_OVERHEAD,
    MEDIA_TOKEN_BOUND,
    MESSAGE_OVERHEAD,
    TOOL_PROMPT_BOUND,
    ContentBound,
    bool_field,
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

_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")


def openai_usage(usage: Any) -> Usage | None:
    """Usage of chat/completions/embeddings: `prompt_tokens` already includes cached tokens."""
    return openai_style_usage(usage, "prompt_tokens", "completion_tokens")


def _is_reference(part: dict[str, Any]) -> bool:
    """A file given by id (rendered at the provider: its tokens are not in the body)."""
    file = part.get("file") if part.get("type") == "file" else None
    return isinstance(file, dict) and file.get("file_data") is None


def choices_count(body: dict[str, Any], name: str = "n") -> int:
    """`n` (or `best_of`): the output limit applies to each of that many generations."""
    value = limit_field(body, name, maximum=MAX_CHOICES)
    return 1 if value is None else value


def wants_stream_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BodyError("stream_options must be an object")
    return options.get("include_usage") is True


def request_stream_usage(body: dict[str, Any]) -> bool:
    """Set `stream_options.include_usage` on a streaming request; True when the body changed.

    Only for streams: OpenAI rejects `stream_options` on a non-streaming request.
    """
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if isinstance(options, dict):
        if options.get("include_usage") is True:
            return False
        options["include_usage"] = True
    else:
        body["stream_options"] = {"include_usage": True}
    return True


def _image_url(part: dict[str, Any]) -> int:
    image = part.get("image_url")
    return url_media_bound(image.get("url") if isinstance(image, dict) else image)


def _input_audio(part: dict[str, Any]) -> int:
    audio = part.get("input_audio")
    return inline_media_bound(audio.get("data") if isinstance(audio, dict) else None)


def _file(part: dict[str, Any]) -> int:
    file = part.get("file")
    if not isinstance(file, dict):
        return MEDIA_TOKEN_BOUND
    name = text_bytes(text_of(file, "filename"))
    if file.get("file_data") is not None:
        return inline_media_bound(file["file_data"]) + name
    return MEDIA_TOKEN_BOUND + name  # by file_id


_CONTENT = ContentBound(
    {"image_url": _image_url, "input_audio": _input_audio, "file": _file},
    media=("image_url", "input_audio", "file"),
)


def _message_turn(message: dict[str, Any]) -> bytes | None:
    """`turn_key` of an assistant message, as a response or as history (None for content the
    key does not cover: refusals, audio, parts other than text)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in texts) or len(texts) != len(content):
            return None
        content = "".join(texts)  # type: ignore[arg-type]
    elif content is not None and not isinstance(content, str):
        return None
    if message.get("refusal") or message.get("audio"):
        return None
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
            return None
        calls.append((text_of(fn, "name"), fn["arguments"]))
    return turn_key(content or "", calls)


class ChatStreamReader(SSEStreamReader):
    """Reads `chat.completion.chunk` (and `text_completion`) streams.

    Mid-stream `info`: model and id from the first chunk; tool calls with the argument
    fragments received so far; usage only once the final usage chunk arrived (None before);
    `finished` once a choice reported a `finish_reason` without tool calls; `complete` once
    `[DONE]` arrived after the usage chunk (runcap always asks for usage in a stream: a `[DONE]`
    without it leaves the call's usage unknown).
    """

    def __init__(self, strip_injected_usage: bool) -> None:
        super().__init__(may_drop=strip_injected_usage)
        self._model = ""
        self._id = ""
        self._usage: Usage | None = None
        self._ended = False
        # (choice index, tool call index) -> [id, name, argument fragments]
        self._calls: dict[tuple[int, int], list[Any]] = {}
        self._text: list[str] = []  # choice 0's content, for the answer's turn key
        self._choices: set[int] = set()
        self._tier: tuple[tuple[str, str], ...] | None = None

    def on_event(self, event: SSEEvent) -> bool:
        if event.data == b"[DONE]":
            self._ended = True
            self._closed = self._usage is not None
            return True
        chunk = event.json()
        if not isinstance(chunk, dict):
            return True
        if isinstance(chunk.get("error"), dict):  # the error chunk of a stream that failed midway
            self._error = error_text(chunk["error"])
            return True
        if not self._model:
            self._model = text_of(chunk, "model")
            self._id = text_of(chunk, "id")
        if "service_tier" in chunk:
            self._tier = served_tier(chunk["service_tier"])
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = openai_usage(usage)
        choices = chunk.get("choices")
        if not choices:
            # The usage-only chunk: dropped when runcap asked for it and the client did not.
            return not isinstance(usage, dict)
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._read_delta(choice.get("index", 0), delta)
            if choice.get("finish_reason"):
                self._ended = True
        return True

    def _read_delta(self, choice: int, delta: dict[str, Any]) -> None:
        self._choices.add(choice)
        content = delta.get("content")
        if isinstance(content, str) and choice == 0:
            self._text.append(content)
        tool_calls = delta.get("tool_calls")
        if isinstance(tool_calls, list):
            for position, call in enumerate(tool_calls):
                if not isinstance(call, dict):
                    continue
                index = call.get("index")
                if not isinstance(index, int):
                    index = position
                slot = self._calls.setdefault((choice, index), ["", "", []])
                if call.get("id") and not slot[0]:
                    slot[0] = call["id"]
                body = call.get("function") or call.get("custom")
                if isinstance(body, dict):
                    if body.get("name") and not slot[1]:
                        slot[1] = body["name"]
                    fragment = body.get("arguments", body.get("input"))
                    if isinstance(fragment, str):
                        slot[2].append(fragment)
        legacy = delta.get("function_call")
        if isinstance(legacy, dict):
            slot = self._calls.setdefault((choice, -1), ["", "", []])
            if legacy.get("name") and not slot[1]:
                slot[1] = legacy["name"]
            if isinstance(legacy.get("arguments"), str):
                slot[2].append(legacy["arguments"])

    @property
    def info(self) -> ResponseInfo:
        calls = [ToolCall(str(slot[0]), str(slot[1]), "".join(slot[2])) for slot in self._calls.values()]
        single = self._choices <= {0} and all(key[1] >= 0 for key in self._calls)
        return ResponseInfo(
            model=self._model,
            usage=self._usage,
            tool_calls=calls,
            finished=self._ended and not calls,
            response_id=self._id,
            turn=turn_key("".join(self._text), [(c.name, c.arguments) for c in calls]) if single else None,
            complete=self.complete,
            error=self.error,
            price_options=self._tier,
        )


class ChatCompletionsAdapter:
    name = "chat.completions"
    min_output_limit = 1  # the smallest output limit the format accepts

    def parse_request(self, body: dict[str, Any]) -> RequestInfo:
        body = request_object(body)
        model = model_field(body)
        stream = bool_field(body, "stream")
        limit = limit_field(body, "max_completion_tokens")
        if limit is None:
            limit = limit_field(body, "max_tokens")
        choices = choices_count(body)  # read (and bounded) with or without a limit
        if limit is not None:
            limit *= choices
        messages = list_field(body, "messages", required=True)
        tools = list_field(body, "tools")
        functions = list_field(body, "functions")

        content, blob = _CONTENT.with_json(messages)
        bound = BASE_OVERHEAD + MESSAGE_OVERHEAD * len(messages) + content
        results: list[ToolResult] = []
        last_assistant = -1
        for i, message in enumerate(messages):
            message = object_item(message, f"messages[{i}]")
            if message.get("role") == "assistant":
                last_assistant = i
            if isinstance(message.get("audio"), dict):  # an earlier audio answer, by id
                bound += MEDIA_TOKEN_BOUND
            if message.get("role") == "tool":
                call_id = message.get("tool_call_id")
                if not isinstance(call_id, str):
                    raise BodyError(f"messages[{i}].tool_call_id must be a string")
                results.append(ToolResult(call_id, message.get("content"), fresh=i > last_assistant))
        if tools or functions:
            bound += TOOL_PROMPT_BOUND + json_bytes(tools) + json_bytes(functions)
        response_format = body.get("response_format")
        if isinstance(response_format, dict) and "json_schema" in response_format:
            bound += json_bytes(response_format)
        modalities = body.get("modalities")
        audio = (isinstance(modalities, list) and "audio" in modalities) or b'"input_audio"' in blob
        searched = body.get("web_search_options") is not None
        # A search model searches once on every call (one web search fee), whatever it answers.
        hosted = [HostedTool("web_search_options", "web_search", 1, always=True)] if searched else []

        return RequestInfo(
            model=model,
            stream=stream,
            max_output_tokens=limit,
            has_tools=bool(tools or functions),
            tool_results=results,
            input_token_bound=bound,
            client_wants_stream_usage=stream and wants_stream_usage(body),
            price_option=openai_service_tier(body),
            audio=audio,
            hosted_tools=hosted,
            by_reference=count_references(messages, _is_reference) if b'"file_id"' in blob else 0,
            history=messages,
            context=context_digest(
                model,
                tools,
                functions,
                response_format,
                body.get("tool_choice"),
                body.get("parallel_tool_calls"),
            ),
        )

    def history_item(self, item: Any) -> tuple[int, bytes | None]:
        if not isinstance(item, dict):
            return MESSAGE_OVERHEAD + _CONTENT(item), None
        bound = MESSAGE_OVERHEAD + _CONTENT(item)
        if isinstance(item.get("audio"), dict):
            bound += MEDIA_TOKEN_BOUND
        if item.get("role") != "assistant":
            return bound, None
        return bound, _message_turn(item)

    def set_output_limit(self, body: dict[str, Any], limit: int, *, legacy_field: bool = False) -> None:
        # `limit` bounds the whole call; with n > 1 each choice gets its share.
        per_choice = max(1, limit // choices_count(body))
        client_legacy = body.get("max_tokens") is not None and body.get("max_completion_tokens") is None
        if client_legacy or (legacy_field and body.get("max_completion_tokens") is None):
            # The client's (legacy) field, or the one an OpenAI-compatible server knows.
            body["max_tokens"] = per_choice
        else:
            body["max_completion_tokens"] = per_choice
            if body.get("max_tokens") is not None:
                body["max_tokens"] = per_choice

    def set_hosted_limit(self, body: dict[str, Any], info: RequestInfo, uses: int) -> None:
        pass  # this format has no hosted (provider-executed) tools: nothing to bound

    def strip_tools(self, body: dict[str, Any]) -> None:
        for name in _TOOL_FIELDS:
            body.pop(name, None)

    def request_stream_usage(self, body: dict[str, Any]) -> bool:
        return request_stream_usage(body)

    def parse_response(self, body: dict[str, Any]) -> ResponseInfo:
        calls: list[ToolCall] = []
        choices = body.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                message = choice.get("message") if isinstance(choice, dict) else None
                if not isinstance(message, dict):
                    continue
                for call in message.get("tool_calls") or ():
                    if not isinstance(call, dict):
                        continue
                    fn = call.get("function") or call.get("custom") or {}
                    arguments = fn.get("arguments", fn.get("input"))
                    calls.append(
                        ToolCall(
                            text_of(call, "id"),
                            text_of(fn, "name"),
                            arguments if isinstance(arguments, str) else "",
                        )
                    )
                legacy = message.get("function_call")
                if isinstance(legacy, dict):
                    calls.append(ToolCall("", text_of(legacy, "name"), text_of(legacy, "arguments")))
        turn = None
        if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
            message = choices[0].get("message")
            if isinstance(message, dict):
                turn = _message_turn(message)
        return ResponseInfo(
            model=text_of(body, "model"),
            usage=openai_usage(body.get("usage")),
            tool_calls=calls,
            finished=bool(choices) and not calls,
            response_id=text_of(body, "id"),
            turn=turn,
            price_options=served_tier(body.get("service_tier")),
        )

    def stream_reader(self, strip_injected_usage: bool) -> ChatStreamReader:
        return ChatStreamReader(strip_injected_usage)
