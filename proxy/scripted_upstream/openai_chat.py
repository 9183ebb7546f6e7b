"""OpenAI chat completions as the scripted upstream speaks them (`/v1/chat/completions`, and
Azure-style deployments): answers and streams of chunks, as the `openai` client reads them.

Like the real chat API, a request with `tools: []`, or with `tool_choice` / `parallel_tool_calls`
but no tools, gets a 400: a proxy that strips tools must strip those too.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from proxy.scripted_upstream import wire
from proxy.scripted_upstream.openai_common import (
    OpenAIFormat,
    openai_stream_error,
    openai_usage,
    output_limit,
    served_tier,
)
from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.tokens import chat_input_tokens, input_audio_tokens


class OpenAIChat(OpenAIFormat):
    """Chat completions, at OpenAI's path and at Azure-style deployments."""

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.handle),
            web.post("/openai/deployments/{deployment}/chat/completions", self.handle),
        ]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, self._play)

    async def _play(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        if not isinstance(body.get("messages"), list):
            raise wire.BadRequest(
                "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
            )
        if not isinstance(body.get("model"), str):
            raise wire.BadRequest(
                "Missing required parameter: 'model'.", "model", "missing_required_parameter"
            )
        _check_chat_tools(body)
        limit = output_limit(body, "max_completion_tokens", "max_tokens")
        step = self.upstream.pick_step(rec, _chat_turns(body))
        rec.stream = bool(body.get("stream"))
        await wire.pause(step, rec.stream)
        if step.status:
            return self.step_error(rec, step)
        tools_allowed = bool(body.get("tools") or body.get("functions")) and body.get("tool_choice") != "none"
        modalities = body.get("modalities")
        input_tokens = chat_input_tokens(body, self.upstream.tokenizer)
        audio = isinstance(modalities, list) and "audio" in modalities
        input_audio = input_audio_tokens(body.get("messages"))
        ans = self.answer(rec, step, input_tokens, limit, tools_allowed, audio=audio, input_audio=input_audio)
        if body.get("web_search_options") is not None and rec.usage is not None:
            rec.usage.tool_uses = {"web_search": 1}  # a search model searches on every call
        finish = "length" if ans.truncated else "tool_calls" if ans.calls else "stop"
        usage = openai_usage(ans)
        tier = served_tier(step, body)
        model = self.upstream.deployments.get(request.match_info.get("deployment", ""), body["model"])
        rid = self.upstream.new_id("chatcmpl-")
        created = int(time.time())
        headers = self.headers(step)
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
            return wire.reply(request, rec, step, orjson.dumps(out), headers)

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
            return wire.sse_data({**base, "choices": [choice]})

        events: list[bytes] = []
        pieces = wire.text_pieces(ans.text, self.upstream.chunk_chars)
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
                for p in wire.text_pieces(c.arguments, self.upstream.chunk_chars)
            )
        events.append(chunk({}, finish))
        if include_usage and not step.omit_usage:
            events.append(wire.sse_data({**base, "choices": [], "usage": usage}))
        events.append(wire.SSE_DONE)
        return await wire.play_stream(
            request, rec, step, events, min(1, len(events) - 1), headers, openai_stream_error(step)
        )


def _chat_turns(body: dict[str, Any]) -> int:
    return sum(1 for m in body.get("messages") or () if isinstance(m, dict) and m.get("role") == "assistant")


def _check_chat_tools(body: dict[str, Any]) -> None:
    """Reject what the real chat API rejects, so a proxy that strips tools carelessly is caught."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and tools):
        raise wire.BadRequest(
            "Invalid 'tools': empty array. Expected an array with minimum length 1, but got an empty array "
            "instead.",
            "tools",
            "empty_array",
        )
    if not tools:
        for name in ("tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise wire.BadRequest(
                    f"Invalid value for '{name}': '{name}' is only allowed when 'tools' are specified.",
                    name,
                )
