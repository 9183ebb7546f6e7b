"""A complete answer re-encoded as the SSE stream the agent asked for.

With `runcap_fetch` in a request, runcap must read the model's whole answer before deciding
whether the agent gets it (it may be a fetch runcap answers itself), so the upstream is called
unstreamed and the final answer is sent to a streaming agent as one burst of the format's events:
the same events, in the same order, the provider would send (chat chunks with the usage chunk
when the agent asked for it; Responses semantic events; Anthropic message events). The
trade-off: such a step's time to first token is its whole latency.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson


def _data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _event(name: str, obj: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def sse_answer(endpoint: str, response: dict[str, Any], *, include_usage: bool) -> bytes:
    if endpoint == "chat.completions":
        return _chat(response, include_usage)
    if endpoint == "responses":
        return _responses(response)
    return _messages(response)


def _chat(response: dict[str, Any], include_usage: bool) -> bytes:
    base = {
        "id": response.get("id", ""),
        "object": "chat.completion.chunk",
        "created": response.get("created", 0),
        "model": response.get("model", ""),
    }
    if response.get("system_fingerprint") is not None:
        base["system_fingerprint"] = response["system_fingerprint"]
    out: list[bytes] = []

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> None:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        out.append(_data({**base, "choices": [choice]}))

    for position, choice in enumerate(response.get("choices") or ()):
        index = choice.get("index", position)
        message = choice.get("message") or {}
        first: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("refusal") is not None:
            first["refusal"] = message["refusal"]
        chunk(index, first)
        for i, call in enumerate(message.get("tool_calls") or ()):
            fn = call.get("function") or {}
            chunk(
                index,
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call.get("id"),
                            "type": call.get("type", "function"),
                            "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments", "")},
                        }
                    ]
                },
            )
        chunk(index, {}, choice.get("finish_reason") or "stop")
    if include_usage and response.get("usage") is not None:
        out.append(_data({**base, "choices": [], "usage": response["usage"]}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def _responses(response: dict[str, Any]) -> bytes:
    seq = itertools.count()
    out: list[bytes] = []

    def emit(name: str, payload: dict[str, Any]) -> None:
        out.append(_event(name, {"type": name, "sequence_number": next(seq), **payload}))

    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    emit("response.created", {"response": pending})
    emit("response.in_progress", {"response": pending})
    for index, item in enumerate(response.get("output") or ()):
        kind = item.get("type")
        item_id = item.get("id", "")
        if kind == "message":
            emit(
                "response.output_item.added",
                {"output_index": index, "item": {**item, "status": "in_progress", "content": []}},
            )
            for c, part in enumerate(item.get("content") or ()):
                empty = {**part, "text": ""} if part.get("type") == "output_text" else part
                emit(
                    "response.content_part.added",
                    {"item_id": item_id, "output_index": index, "content_index": c, "part": empty},
                )
                if part.get("type") == "output_text":
                    text = part.get("text", "")
                    base = {"item_id": item_id, "output_index": index, "content_index": c, "logprobs": []}
                    emit("response.output_text.delta", {**base, "delta": text})
                    emit("response.output_text.done", {**base, "text": text})
                emit(
                    "response.content_part.done",
                    {"item_id": item_id, "output_index": index, "content_index": c, "part": part},
                )
        elif kind == "function_call":
            arguments = item.get("arguments", "")
            emit(
                "response.output_item.added",
                {"output_index": index, "item": {**item, "status": "in_progress", "arguments": ""}},
            )
            emit(
                "response.function_call_arguments.delta",
                {"item_id": item_id, "output_index": index, "delta": arguments},
            )
            emit(
                "response.function_call_arguments.done",
                {"item_id": item_id, "output_index": index, "arguments": arguments},
            )
        else:
            emit("response.output_item.added", {"output_index": index, "item": item})
        emit("response.output_item.done", {"output_index": index, "item": item})
    status = response.get("status")
    emit("response.incomplete" if status == "incomplete" else "response.completed", {"response": response})
    return b"".join(out)


def _messages(response: dict[str, Any]) -> bytes:
    usage = response.get("usage") or {}
    start = {**response, "content": [], "stop_reason": None, "stop_sequence": None}
    if usage:
        start["usage"] = {**usage, "output_tokens": 1}
    out = [_event("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(response.get("content") or ()):
        kind = block.get("type")
        if kind == "text":
            opened: dict[str, Any] = {**block, "text": ""}
            deltas = [{"type": "text_delta", "text": block.get("text", "")}]
        elif kind == "tool_use":
            opened = {**block, "input": {}}
            deltas = [
                {"type": "input_json_delta", "partial_json": orjson.dumps(block.get("input", {})).decode()}
            ]
        elif kind == "thinking":
            opened = {**block, "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block.get("thinking", "")}]
            if block.get("signature"):
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
        else:
            opened, deltas = block, []
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": opened},
            )
        )
        for delta in deltas:
            out.append(
                _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            )
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta_event: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": response.get("stop_reason"), "stop_sequence": response.get("stop_sequence")},
    }
    if usage:
        delta_event["usage"] = usage
    out.append(_event("message_delta", delta_event))
    out.append(_event("message_stop", {"type": "message_stop"}))
    return b"".join(out)
