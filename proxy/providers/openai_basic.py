"""OpenAI legacy text completions (`/v1/completions`) and embeddings (`/v1/embeddings`).

Usage-only mappers: neither has tools. Completions stream like chat (same chunk stream, same
`stream_options.include_usage` usage chunk), so they reuse the chat stream reader and usage
reader. Embeddings have no output limit and never stream; an embeddings call is never the
run's final answer (`finished` stays False).
"""

from __future__ import annotations

from typing import Any

from .base import BodyError, NoHistory, RequestInfo, ResponseInfo
from .body import (
    BASE_OVERHEAD,
    MESSAGE_OVERHEAD,
    bool_field,
    limit_field,
    model_field,
    request_object,
    text_bytes,
    text_of,
)
from .openai_chat import (
    ChatStreamReader,
    choices_count,
    openai_usage,
    request_stream_usage,
    wants_stream_usage,
)


def _prompts(body: dict[str, Any], name: str) -> tuple[int, int]:
    """(input-token bound, number of prompts) of a `prompt` / `input` field.

    It is a string, an array of strings, an array of token ids or an array of token-id arrays;
    token ids are counted exactly (one id is one token).
    """
    value = body.get(name)
    if isinstance(value, str):
        return text_bytes(value) + MESSAGE_OVERHEAD, 1
    if not isinstance(value, list):
        if value is None:
            raise BodyError(f"{name} is required")
        raise BodyError(f"{name} must be a string or an array")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return len(value) + MESSAGE_OVERHEAD, 1
    bound = 0
    for i, item in enumerate(value):
        if isinstance(item, str):
            bound += text_bytes(item) + MESSAGE_OVERHEAD
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            bound += len(item) + MESSAGE_OVERHEAD
        else:
            raise BodyError(f"{name}[{i}] must be a string or an array of token ids")
    return bound, len(value)


def _generations(body: dict[str, Any], prompts: int) -> int:
    return prompts * max(choices_count(body, "n"), choices_count(body, "best_of"))


class CompletionsAdapter(NoHistory):
    name = "completions"
    min_output_limit = 1

    def parse_request(self, body: dict[str, Any]) -> RequestInfo:
        body = request_object(body)
        model = model_field(body)
        stream = bool_field(body, "stream")
        bound, prompts = _prompts(body, "prompt")
        suffix = body.get("suffix")
        if isinstance(suffix, str):
            bound += text_bytes(suffix)
        limit = limit_field(body, "max_tokens")
        generations = _generations(body, prompts)  # read (and bounded) with or without a limit
        if limit is not None:
            limit *= generations
        return RequestInfo(
            model=model,
            stream=stream,
            max_output_tokens=limit,
            input_token_bound=BASE_OVERHEAD + bound,  # billed once however many generations
            client_wants_stream_usage=stream and wants_stream_usage(body),
        )

    def set_output_limit(self, body: dict[str, Any], limit: int, *, legacy_field: bool = False) -> None:
        # `limit` bounds the whole call: every prompt times n (or best_of) generations share it.
        _, prompts = _prompts(body, "prompt")
        body["max_tokens"] = max(1, limit // _generations(body, prompts))

    def set_hosted_limit(self, body: dict[str, Any], info: RequestInfo, uses: int) -> None:
        pass  # this format has no hosted (provider-executed) tools: nothing to bound

    def strip_tools(self, body: dict[str, Any]) -> None:
        """Completions have no tools."""

    def request_stream_usage(self, body: dict[str, Any]) -> bool:
        return request_stream_usage(body)

    def parse_response(self, body: dict[str, Any]) -> ResponseInfo:
        return ResponseInfo(
            model=text_of(body, "model"),
            usage=openai_usage(body.get("usage")),
            finished=bool(body.get("choices")),
            response_id=text_of(body, "id"),
        )

    def stream_reader(self, strip_injected_usage: bool) -> ChatStreamReader:
        return ChatStreamReader(strip_injected_usage)


class EmbeddingsAdapter(NoHistory):
    name = "embeddings"
    min_output_limit = 1

    def parse_request(self, body: dict[str, Any]) -> RequestInfo:
        body = request_object(body)
        bound, _ = _prompts(body, "input")
        return RequestInfo(model=model_field(body), input_token_bound=BASE_OVERHEAD + bound)

    def set_output_limit(self, body: dict[str, Any], limit: int, *, legacy_field: bool = False) -> None:
        """Embeddings produce no output tokens."""

    def set_hosted_limit(self, body: dict[str, Any], info: RequestInfo, uses: int) -> None:
        pass  # this format has no hosted (provider-executed) tools: nothing to bound

    def strip_tools(self, body: dict[str, Any]) -> None:
        """Embeddings have no tools."""

    def request_stream_usage(self, body: dict[str, Any]) -> bool:
        return False

    def parse_response(self, body: dict[str, Any]) -> ResponseInfo:
        return ResponseInfo(model=text_of(body, "model"), usage=openai_usage(body.get("usage")))

    def stream_reader(self, strip_injected_usage: bool) -> ChatStreamReader:
        return ChatStreamReader(strip_injected_usage)  # embeddings do not stream; relays as-is
