"""Anthropic messages as the scripted upstream speaks them (`/v1/messages`, and
`/v1/messages/count_tokens`): answers and streams of typed events, server tools' blocks, and
message threads.

Anthropic message threads (beta `message-threads-2026-08-12`, the `anthropic` SDK's tool runner):
a request with `thread: {"type": "create"}` has its conversation (system, tools, messages and the
answer) kept under the answer's id; `thread: {"type": "continue", "previous_message_id": id}`
sends only the new messages, and is answered — and billed — as if it had sent the kept system,
tools and history. Without the beta header `thread` is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from proxy.scripted_upstream import wire
from proxy.scripted_upstream.answer import Answer, Call, hosted_uses
from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.script import Step
from proxy.scripted_upstream.tokens import anthropic_input_tokens
from proxy.scripted_upstream.wire_format import MAX_REMEMBERED_RESPONSES, WireFormat

if TYPE_CHECKING:
    from proxy.scripted_upstream.core import ScriptedUpstream

# The Anthropic beta that lets a request carry `thread` (server-held conversation state).
MESSAGE_THREADS_BETA = "message-threads-2026-08-12"

ANTHROPIC_ERROR_TYPES = {
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


def anthropic_error_body(status: int, message: str, etype: str | None, request_id: str) -> bytes:
    etype = etype or ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return orjson.dumps(
        {"type": "error", "error": {"type": etype, "message": message}, "request_id": request_id}
    )


@dataclass(frozen=True, slots=True)
class Thread:
    """What an Anthropic thread holds after one answer: the fields a `continue` takes from it."""

    system: Any
    tools: Any
    messages: list[Any]  # the whole history, the answer included


class AnthropicMessages(WireFormat):
    """`/v1/messages` and `/v1/messages/count_tokens`, with the threads the server holds."""

    call_prefix = "toolu_"

    def __init__(self, upstream: ScriptedUpstream) -> None:
        super().__init__(upstream)
        # Anthropic threads by the id of their latest answer, for `thread: continue`.
        self._threads: dict[str, Thread] = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/messages", self.handle),
            web.post("/v1/messages/count_tokens", self.handle_count_tokens),
        ]

    def not_found(self, request: web.Request) -> web.Response | None:
        if not request.path.startswith("/v1/messages"):
            return None
        return self.error(None, f"Not found: {request.method} {request.path}", 404)

    def headers(self, step: Step | None) -> dict[str, str]:
        headers = {"request-id": self.upstream.new_id("req_")}
        if step is not None and step.headers:
            headers.update(step.headers)
        return headers

    def error(
        self, rec: RecordedRequest | None, message: str, status: int = 400, etype: str | None = None
    ) -> web.Response:
        headers = self.headers(None)
        body = anthropic_error_body(status, message, etype, headers["request-id"])
        if rec is None:
            return web.Response(status=status, body=body, content_type=wire.JSON, headers=headers)
        return wire.json_reply(rec, status, body, headers)

    def fail(self, rec: RecordedRequest | None, e: wire.BadRequest) -> web.Response:
        return self.error(rec, e.message)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, self._play)

    async def handle_count_tokens(self, request: web.Request) -> web.StreamResponse:
        rec: RecordedRequest | None = None
        try:
            rec, body = await self.upstream.begin(request)
        except wire.BadRequest as e:
            return self.fail(rec, e)
        tokens = anthropic_input_tokens(body, self.upstream.tokenizer)
        return wire.json_reply(rec, 200, orjson.dumps({"input_tokens": tokens}), self.headers(None))

    async def _play(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        for name in ("model", "messages", "max_tokens"):
            if name not in body:
                raise wire.BadRequest(f"{name}: Field required")
        if not isinstance(body["messages"], list):
            raise wire.BadRequest("messages: Input should be a valid list")
        limit = body["max_tokens"]
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise wire.BadRequest("max_tokens: Input should be greater than or equal to 1")
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
        step = self.upstream.pick_step(rec, _anthropic_turns(body))
        rec.stream = bool(body.get("stream"))
        await wire.pause(step, rec.stream)
        if step.status:
            headers = self.headers(step)
            message = step.error or "Internal server error"
            err = anthropic_error_body(step.status, message, step.error_type, headers["request-id"])
            return wire.json_reply(rec, step.status, err, headers)
        tool_choice = body.get("tool_choice") or {}
        tools_allowed = bool(body.get("tools")) and tool_choice.get("type") != "none"
        hosted = hosted_uses(step, body, anthropic=True) if tools_allowed else ()
        input_tokens = anthropic_input_tokens(body, self.upstream.tokenizer)
        ans = self.answer(rec, step, input_tokens, limit, tools_allowed, hosted=hosted)
        # Anthropic cannot return a half-written tool_use block's input: a cut call is dropped.
        calls = [c for c in ans.calls if not c.partial]
        stop = "max_tokens" if ans.truncated else "tool_use" if calls else "end_turn"
        usage = _anthropic_usage(ans, body)
        content: list[dict[str, Any]] = []
        for use in ans.hosted:
            tool_id = self.upstream.new_id("srvtoolu_")
            name = "web_search" if use.tool.startswith("web_search") else "web_fetch"
            content.append({"type": "server_tool_use", "id": tool_id, "name": name, "input": {"query": "q"}})
            content.append({"type": f"{name}_tool_result", "tool_use_id": tool_id, "content": []})
        if ans.text or not calls:
            content.append({"type": "text", "text": ans.text})
        content.extend({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input} for c in calls)
        msg_id = self.upstream.new_id("msg_")
        if thread is not None:
            history = [*body["messages"], {"role": "assistant", "content": content}]
            self._threads[msg_id] = Thread(body.get("system"), body.get("tools"), history)
            if len(self._threads) > MAX_REMEMBERED_RESPONSES:
                del self._threads[next(iter(self._threads))]  # the oldest
        headers = self.headers(step)
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
            return wire.reply(request, rec, step, orjson.dumps(message_obj), headers)

        events, stall_at = _stream_events(
            message_obj, content, calls, usage, step.omit_usage, self.upstream.chunk_chars
        )
        error = {
            "type": "error",
            "error": {"type": step.error_type or "overloaded_error", "message": step.error or "Overloaded"},
            "request_id": headers["request-id"],
        }
        return await wire.play_stream(
            request, rec, step, events, stall_at, headers, wire.sse_event(b"error", error)
        )

    def _thread_of(
        self, rec: RecordedRequest, thread: Any, body: dict[str, Any]
    ) -> Thread | web.Response | None:
        """The thread a request continues (None for `create`), or the error response."""
        betas = [b.strip() for b in (rec.header("anthropic-beta") or "").split(",")]
        if MESSAGE_THREADS_BETA not in betas:
            raise wire.BadRequest("thread: Extra inputs are not permitted")
        kind = thread.get("type") if isinstance(thread, dict) else None
        if kind == "create":
            return None
        if kind != "continue":
            raise wire.BadRequest("thread.type: Input should be 'create' or 'continue'")
        previous = thread.get("previous_message_id")
        kept = self._threads.get(previous) if isinstance(previous, str) else None
        if kept is None:
            headers = self.headers(None)
            err = orjson.loads(
                anthropic_error_body(
                    404, f"thread: no message {previous!r} to continue", None, headers["request-id"]
                )
            )
            err["error"]["details"] = {"error_code": "thread_not_found"}
            return wire.json_reply(rec, 404, orjson.dumps(err), headers)
        repeated = [name for name in ("system", "tools") if name in body]
        if repeated:
            raise wire.BadRequest(
                f"{' and '.join(repeated)}: cannot be sent with thread.type 'continue': the thread keeps "
                "the ones it was created with"
            )
        return kept


# Cumulative usage in Anthropic's message_delta (the current API repeats the input counts there).
_ANTHROPIC_DELTA_USAGE_KEYS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
    "server_tool_use",  # the final counts of the server tools' uses
)


def _stream_events(
    message_obj: dict[str, Any],
    content: list[dict[str, Any]],
    calls: list[Call],
    usage: dict[str, Any],
    omit_usage: bool,
    chunk_chars: int,
) -> tuple[list[bytes], int]:
    """The events of a streamed message whose whole is `message_obj`, and the index to stall
    after (the first delta of the first block)."""
    stop = message_obj["stop_reason"]
    start = {**message_obj, "content": [], "stop_reason": None}
    if not omit_usage:
        start["usage"] = {**usage, "output_tokens": 1}
        start["usage"].pop("server_tool_use", None)
    events = [wire.sse_event(b"message_start", {"type": "message_start", "message": start})]
    stall_at = 0
    tool_uses = 0
    for index, block in enumerate(content):
        if block["type"] not in ("text", "tool_use"):  # server tool blocks: whole, no deltas
            events.append(
                wire.sse_event(
                    b"content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": block},
                )
            )
            events.append(
                wire.sse_event(b"content_block_stop", {"type": "content_block_stop", "index": index})
            )
            continue
        if block["type"] == "text":
            events.append(
                wire.sse_event(
                    b"content_block_start",
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            )
            deltas = [{"type": "text_delta", "text": p} for p in wire.text_pieces(block["text"], chunk_chars)]
        else:
            c = calls[tool_uses]
            tool_uses += 1
            events.append(
                wire.sse_event(
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
                for p in wire.text_pieces(c.arguments, chunk_chars)
            )
        if index == 0:
            events.append(wire.sse_event(b"ping", {"type": "ping"}))
        for i, delta in enumerate(deltas):
            events.append(
                wire.sse_event(
                    b"content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            )
            if index == 0 and i == 0:
                stall_at = len(events) - 1
        events.append(wire.sse_event(b"content_block_stop", {"type": "content_block_stop", "index": index}))
    delta_event: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": stop, "stop_sequence": None},
    }
    if not omit_usage:
        delta_event["usage"] = {k: usage[k] for k in _ANTHROPIC_DELTA_USAGE_KEYS if k in usage}
    events.append(wire.sse_event(b"message_delta", delta_event))
    events.append(wire.sse_event(b"message_stop", {"type": "message_stop"}))
    return events, stall_at


def _anthropic_usage(ans: Answer, body: dict[str, Any]) -> dict[str, Any]:
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


def _anthropic_turns(body: dict[str, Any]) -> int:
    msgs = [m for m in body.get("messages") or () if isinstance(m, dict)]
    turns = sum(1 for m in msgs if m.get("role") == "assistant")
    if msgs and msgs[-1].get("role") == "assistant":
        turns -= 1  # a trailing assistant message is a prefill, not a finished turn
    return turns
