"""The OpenAI Responses API as the scripted upstream speaks it (`/v1/responses`): answers and
streams of typed events, hosted-tool items, and stored responses.

Stored Responses, as the provider keeps them: a response not created with `store: false` keeps
its conversation (what it continued, its input, its output) under its id and each output item
under the item's id. `previous_response_id` continues that conversation and an `item_reference`
input item stands for the stored item; either is answered — and billed — as if the stored items
had been sent. Refused like the real API (400): an unknown response or item, a
`function_call_output` without its `function_call`, a `function_call` without its output.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from proxy.scripted_upstream.answer import Answer, HostedUse, hosted_uses
from proxy.scripted_upstream.openai_common import OpenAIFormat, output_limit, served_tier
from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.tokens import responses_input_tokens
from proxy.scripted_upstream.wire import BadRequest, pause, play_stream, reply, sse_event, text_pieces
from proxy.scripted_upstream.wire_format import MAX_REMEMBERED_RESPONSES

if TYPE_CHECKING:
    from proxy.scripted_upstream.core import ScriptedUpstream


class OpenAIResponses(OpenAIFormat):
    """`/v1/responses`, with the responses and items the server stores."""

    def __init__(self, upstream: ScriptedUpstream) -> None:
        super().__init__(upstream)
        # Stored Responses (`store` not false): the conversation behind each response id — its
        # input with what it continued, then its output — for `previous_response_id`; and each
        # stored output item by id, for `item_reference` input items.
        self._stored_responses: dict[str, list[Any]] = {}
        self._stored_items: dict[str, dict[str, Any]] = {}

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.handle)]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, self._play)

    async def _play(
        self, request: web.Request, rec: RecordedRequest, body: dict[str, Any]
    ) -> web.StreamResponse:
        items = body.get("input")
        if not isinstance(items, (str, list)):
            raise BadRequest("Missing required parameter: 'input'.", "input", "missing_required_parameter")
        if not isinstance(body.get("model"), str):
            raise BadRequest("Missing required parameter: 'model'.", "model", "missing_required_parameter")
        limit = output_limit(body, "max_output_tokens")
        # Answered — and billed — as if the stored conversation and the referenced items had been
        # sent: the input the model reads is the whole conversation.
        conversation = self._responses_conversation(body)
        body = {**body, "input": conversation}
        turns = _responses_turns(conversation)
        step = self.upstream.pick_step(rec, turns)
        rec.stream = bool(body.get("stream"))
        await pause(step, rec.stream)
        if step.status:
            return self.step_error(rec, step)
        tools = body.get("tools") or []
        tools_allowed = bool(tools) and body.get("tool_choice") != "none"
        hosted = hosted_uses(step, body, anthropic=False) if tools_allowed else ()
        input_tokens = responses_input_tokens(body, self.upstream.tokenizer)
        ans = self.answer(rec, step, input_tokens, limit, tools_allowed, hosted=hosted)
        rid = self.upstream.new_id("resp_")
        headers = self.headers(step)

        output: list[dict[str, Any]] = []
        container = self.upstream.new_id("cntr_")
        for use in ans.hosted:
            output.append(self._hosted_item(use, container))
        if ans.reasoning_tokens:
            output.append({"id": self.upstream.new_id("rs_"), "type": "reasoning", "summary": []})
        if ans.text or not ans.calls:
            status = "incomplete" if ans.truncated and not ans.calls else "completed"
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ans.text}
            output.append(
                {
                    "id": self.upstream.new_id("msg_"),
                    "type": "message",
                    "status": status,
                    "content": [part],
                    "role": "assistant",
                }
            )
        for c in ans.calls:
            output.append(
                {
                    "id": self.upstream.new_id("fc_"),
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
            "service_tier": served_tier(step, body),
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
            return reply(request, rec, step, orjson.dumps(final), headers)

        events, stall_at = _stream_events(final, output, ans.truncated, self.upstream.chunk_chars)
        error = {
            "type": "error",
            "sequence_number": len(events),
            "code": step.error_code or step.error_type or "server_error",
            "message": step.error or "The server had an error while processing your request.",
            "param": None,
        }
        return await play_stream(request, rec, step, events, stall_at, headers, sse_event(b"error", error))

    def _hosted_item(self, use: HostedUse, container: str) -> dict[str, Any]:
        """The output item of one hosted-tool use the provider executed (Responses)."""
        kind = use.tool
        if kind.startswith("web_search"):
            action = {"type": "search", "query": "runcap mock search"}
            item_id = self.upstream.new_id("ws_")
            return {"id": item_id, "type": "web_search_call", "status": "completed", "action": action}
        if kind == "file_search":
            return {
                "id": self.upstream.new_id("fs_"),
                "type": "file_search_call",
                "status": "completed",
                "queries": ["runcap mock query"],
                "results": None,
            }
        if kind == "code_interpreter":
            return {
                "id": self.upstream.new_id("ci_"),
                "type": "code_interpreter_call",
                "status": "completed",
                "code": "print(1)",
                "container_id": container,
                "outputs": None,
            }
        return {
            "id": self.upstream.new_id("mcp_"),
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
                raise BadRequest(
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
                    raise BadRequest(f"Item with id '{ref}' not found.", "input", "item_not_found")
                item = stored_item
            conversation.append(item)
        kinds = [(i.get("type"), i.get("call_id")) for i in conversation if isinstance(i, dict)]
        calls = [call_id for kind, call_id in kinds if kind == "function_call"]
        outputs = [call_id for kind, call_id in kinds if kind == "function_call_output"]
        orphans = [call_id for call_id in outputs if call_id not in calls]
        if orphans:
            raise BadRequest(
                f"No tool call found for function call output with call_id {orphans[0]}.", "input"
            )
        unanswered = [call_id for call_id in calls if call_id not in outputs]
        if unanswered:
            raise BadRequest(f"No tool output found for function call {unanswered[0]}.", "input")
        return conversation

    def _store_response(self, rid: str, conversation: list[Any], output: list[dict[str, Any]]) -> None:
        """Keep a stored response's conversation and output items (bounded: the oldest go)."""
        self._stored_responses[rid] = [*conversation, *output]
        for item in output:
            self._stored_items[item["id"]] = item
        while len(self._stored_responses) > MAX_REMEMBERED_RESPONSES:
            del self._stored_responses[next(iter(self._stored_responses))]
        while len(self._stored_items) > 4 * MAX_REMEMBERED_RESPONSES:
            del self._stored_items[next(iter(self._stored_items))]


def _stream_events(
    final: dict[str, Any], output: list[dict[str, Any]], truncated: bool, chunk_chars: int
) -> tuple[list[bytes], int]:
    """The events of a streamed response whose end is `final`, and the index to stall after
    (the first delta of the first item)."""
    seq = itertools.count()
    events: list[bytes] = []

    def emit(name: str, payload: dict[str, Any]) -> None:
        payload = {"type": name, "sequence_number": next(seq), **payload}
        events.append(sse_event(name.encode(), payload))

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
            for p in text_pieces(text, chunk_chars):
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
            for p in text_pieces(item["arguments"], chunk_chars):
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
    emit("response.incomplete" if truncated else "response.completed", {"response": final})
    return events, 2 if stall_at is None else stall_at


def _responses_usage(ans: Answer) -> dict[str, Any]:
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
