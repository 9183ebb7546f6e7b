"""What the OpenAI wire formats (chat, Responses, completions, embeddings, models) share: the
error shapes and types, the response headers, the output-token limit, the service tier answered,
and the chat/completions usage object.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.scripted_upstream.answer import Answer
from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.script import Step
from proxy.scripted_upstream.wire import JSON, BadRequest, json_reply, sse_data
from proxy.scripted_upstream.wire_format import WireFormat

OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
}


def openai_stream_error(step: Step) -> bytes:
    """The error chunk OpenAI sends when a chat/completions stream fails midway."""
    error = {
        "message": step.error or "The server had an error while processing your request.",
        "type": step.error_type or "server_error",
        "param": None,
        "code": step.error_code,
    }
    return sse_data({"error": error})


def openai_error_body(
    status: int, message: str, etype: str | None, param: Any = None, code: Any = None
) -> bytes:
    etype = etype or OPENAI_ERROR_TYPES.get(status, "server_error")
    return orjson.dumps({"error": {"message": message, "type": etype, "param": param, "code": code}})


def output_limit(body: dict[str, Any], *names: str, default: int | None = None) -> int | None:
    """The output-token limit: the first of `names` present in the body."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(
                f"Invalid '{name}': expected an integer >= 1, got {value!r}.", name, "invalid_value"
            )
        return value
    return default


def served_tier(step: Step, body: dict[str, Any]) -> str:
    """The OpenAI service tier an answer reports: the step's, else the one requested (`auto` and
    none: "default")."""
    if step.service_tier is not None:
        return step.service_tier
    tier = body.get("service_tier")
    return tier if tier in ("default", "flex", "priority", "scale") else "default"


def openai_usage(ans: Answer) -> dict[str, Any]:
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


class OpenAIFormat(WireFormat):
    """An OpenAI wire format: its errors, as the `openai` client reads them, and its headers."""

    def headers(self, step: Step | None) -> dict[str, str]:
        headers = {"x-request-id": self.upstream.new_id("req_"), "openai-processing-ms": "1"}
        if step is not None and step.headers:
            headers.update(step.headers)
        return headers

    def fail(self, rec: RecordedRequest | None, e: BadRequest) -> web.Response:
        body = openai_error_body(400, e.message, None, e.param, e.code)
        if rec is None:
            return web.Response(status=400, body=body, content_type=JSON)
        return json_reply(rec, 400, body, self.headers(None))

    def step_error(self, rec: RecordedRequest, step: Step) -> web.Response:
        """The error response a step with a `status` scripts."""
        assert step.status is not None
        body = openai_error_body(
            step.status,
            step.error or "The server had an error while processing your request.",
            step.error_type,
            None,
            step.error_code,
        )
        return json_reply(rec, step.status, body, self.headers(step))
