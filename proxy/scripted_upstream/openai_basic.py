"""The basic OpenAI endpoints as the scripted upstream speaks them: legacy completions
(`/v1/completions`, streamed or not), embeddings (`/v1/embeddings`: deterministic unit vectors of
the input's text) and the model list (`/v1/models`). Completions and embeddings have no history:
they always play the script's first step.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
from typing import Any

import orjson
from aiohttp import web

from proxy.providers.base import Usage
from proxy.scripted_upstream import wire
from proxy.scripted_upstream.openai_common import (
    OpenAIFormat,
    openai_stream_error,
    openai_usage,
    output_limit,
)
from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.tokens import prompt_tokens

EMBEDDING_DIMENSIONS = 8
# Legacy completions default `max_tokens` to 16, as the real API does.
LEGACY_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MODELS = ("gpt-4o-mini", "gpt-4.1", "o4-mini", "text-embedding-3-small", "claude-sonnet-4-5")


class OpenAIBasic(OpenAIFormat):
    """Legacy completions, embeddings and the model list."""

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.handle_completions),
            web.post("/v1/embeddings", self.handle_embeddings),
            web.get("/v1/models", self.handle_models),
            web.get("/v1/models/{model}", self.handle_models),
        ]

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, self._completions)

    async def handle_embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, self._embeddings)

    async def _completions(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        if "prompt" not in body:
            raise wire.BadRequest(
                "Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter"
            )
        limit = output_limit(body, "max_tokens", default=LEGACY_COMPLETIONS_DEFAULT_MAX_TOKENS)
        step = self.upstream.pick_step(rec, 0)
        rec.stream = bool(body.get("stream"))
        await wire.pause(step, rec.stream)
        if step.status:
            return self.step_error(rec, step)
        ans = self.answer(rec, step, prompt_tokens(body.get("prompt")), limit, False)
        finish = "length" if ans.truncated else "stop"
        usage = openai_usage(ans)
        base: dict[str, Any] = {
            "id": self.upstream.new_id("cmpl-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "system_fingerprint": "fp_runcapmock",
        }
        headers = self.headers(step)
        if not rec.stream:
            choice = {"text": ans.text, "index": 0, "logprobs": None, "finish_reason": finish}
            out = {**base, "choices": [choice], "usage": usage}
            if step.omit_usage:
                del out["usage"]
            return wire.reply(request, rec, step, orjson.dumps(out), headers)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if include_usage:
            base["usage"] = None
        events = [
            wire.sse_data(
                {**base, "choices": [{"text": p, "index": 0, "logprobs": None, "finish_reason": None}]}
            )
            for p in wire.text_pieces(ans.text, self.upstream.chunk_chars)
        ]
        events.append(
            wire.sse_data(
                {**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": finish}]}
            )
        )
        if include_usage and not step.omit_usage:
            events.append(wire.sse_data({**base, "choices": [], "usage": usage}))
        events.append(wire.SSE_DONE)
        return await wire.play_stream(request, rec, step, events, 0, headers, openai_stream_error(step))

    async def _embeddings(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        value = body.get("input")
        if value is None:
            raise wire.BadRequest(
                "Missing required parameter: 'input'.", "input", "missing_required_parameter"
            )
        step = self.upstream.pick_step(rec, 0)
        await wire.pause(step, False)
        if step.status:
            return self.step_error(rec, step)
        if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
            inputs: list[Any] = [value]
        else:
            inputs = list(value)
        dims = body.get("dimensions") or EMBEDDING_DIMENSIONS
        if not isinstance(dims, int) or not 1 <= dims <= 4096:
            raise wire.BadRequest(f"Invalid 'dimensions': {dims!r}.", "dimensions", "invalid_value")
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        for i, item in enumerate(inputs):
            vec = _embedding(item if isinstance(item, str) else orjson.dumps(item).decode(), dims)
            embedding: Any = base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode() if as_base64 else vec
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = step.input_tokens if step.input_tokens is not None else prompt_tokens(inputs)
        rec.usage = Usage(input_tokens=tokens)
        out = {
            "object": "list",
            "data": data,
            "model": body.get("model"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return wire.reply(request, rec, step, orjson.dumps(out), self.headers(step))

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
        if self.upstream.record:
            self.upstream.requests.append(
                RecordedRequest(
                    request.method,
                    request.path,
                    request.query_string,
                    {k.lower(): v for k, v in request.headers.items()},
                    None,
                    completed=True,
                )
            )
        return web.Response(body=orjson.dumps(body), content_type=wire.JSON)


def _embedding(text: str, dims: int) -> list[float]:
    raw = hashlib.shake_128(text.encode()).digest(2 * dims)
    vec = [v / 32767.5 - 1.0 for v in struct.unpack(f"<{dims}H", raw)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [round(v / norm, 6) for v in vec]
