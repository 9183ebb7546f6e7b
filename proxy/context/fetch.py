"""`runcap_fetch`: runcap answers the model's reads of offloaded results itself.

When a policy added the fetch tool to a request (`Rewrite.fetch_tool`), the context step
(proxy/server/steps/context.py, its `answer` hook) hands the upstream's answer to `answer_fetches`
before the agent sees anything:

* only `runcap_fetch` calls: runcap reads each handle from the results this request had taken
  out of band (`Rewrite.handles`) — never from the payload store: a handle is a capability of the
  request that offloaded it, not a content address any prompt could name (the store holds every
  run's and tenant's bodies; a handle seen in a span, or injected by a tool's output, must not
  open them). The agent resends its history, so every handle its model was shown is offloaded
  again, and readable, in each later request. Then runcap appends the model's turn and the
  results to the request in its wire format and calls the upstream again — an inner call, a step
  of the run like any other (reserved, capped, settled, traced) — at most `max_fetch_calls`
  rounds; the agent gets the final answer only.
* `runcap_fetch` mixed with the agent's own tool calls: the fetch calls are dropped from the
  answer and the agent gets its own calls. Answering the fetches first would make the model
  answer again and possibly change (or repeat) the calls it already chose; the handle stays in
  the context, so the model can ask again at its next step.
* rounds used up: the fetch calls are dropped from the last answer likewise.

The agent never sees a `runcap_fetch` call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.context import FETCH_TOOL, HANDLE_PREFIX, ModelCaller, Rewrite
from proxy.context.conversation import items_key
from proxy.context.offload import FETCH_DEFAULT_LENGTH, FETCH_MAX_LENGTH
from proxy.errors import UpstreamUnavailable
from proxy.providers.base import Adapter, ToolCall

log = logging.getLogger("runcap.context")


def read_handle(arguments: str, handles: dict[str, bytes]) -> str:
    """The text `runcap_fetch(handle, offset, length)` returns to the model (errors included:
    the model reads them and can correct its call)."""
    try:
        args = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return f"{FETCH_TOOL} error: arguments are not valid JSON: {arguments[:200]!r}"
    if not isinstance(args, dict) or not isinstance(args.get("handle"), str):
        return f'{FETCH_TOOL} error: give the handle as a string, e.g. {{"handle": "{HANDLE_PREFIX}<hex>"}}'
    handle = args["handle"].strip()
    offset, length = args.get("offset", 0), args.get("length", FETCH_DEFAULT_LENGTH)
    if offset is None:
        offset = 0
    if length is None:
        length = FETCH_DEFAULT_LENGTH
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        return f"{FETCH_TOOL} error: offset must be a non-negative integer, got {offset!r}"
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        return f"{FETCH_TOOL} error: length must be a positive integer, got {length!r}"
    length = min(length, FETCH_MAX_LENGTH)
    digest = handle.removeprefix(HANDLE_PREFIX).lower()
    data = handles.get(digest)
    if data is None:
        return (
            f"{FETCH_TOOL} error: unknown handle {handle!r}. Use a handle exactly as printed in a "
            f"shortened tool result of this conversation ({HANDLE_PREFIX}<64 hex digits>)."
        )
    size = len(data)
    if offset >= size:
        return f"[{FETCH_TOOL} {handle}: offset {offset} is at or past the end; the result has {size} bytes]"
    start, end = offset, min(size, offset + length)
    # Whole characters only: start after, and end before, a UTF-8 continuation byte.
    while start < end and data[start] & 0xC0 == 0x80:
        start += 1
    while start < end < size and data[end] & 0xC0 == 0x80:
        end -= 1
    try:
        text = data[start:end].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        text = data[start:end].decode("utf-8", "replace")
    return f"[{FETCH_TOOL} {handle} bytes {start}-{end} of {size}]\n{text}"


# -- the wire formats ------------------------------------------------------------------------


def continuation(
    endpoint: str, body: dict[str, Any], response: dict[str, Any], results: list[tuple[str, str]]
) -> dict[str, Any]:
    """`body` continued by the model's answer `response` and the results of its calls (a new
    dict: `body` is not changed)."""
    out = dict(body)
    key = items_key(endpoint)
    items = body.get(key)
    if endpoint == "responses":
        history = [{"role": "user", "content": items}] if isinstance(items, str) else list(items or ())
        history.extend(response.get("output") or ())
        history.extend(
            {"type": "function_call_output", "call_id": cid, "output": text} for cid, text in results
        )
    elif endpoint == "chat.completions":
        message = response["choices"][0]["message"]
        turn: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            turn["tool_calls"] = message["tool_calls"]
        history = [*(items or ()), turn]
        history.extend({"role": "tool", "tool_call_id": cid, "content": text} for cid, text in results)
    else:
        history = [*(items or ()), {"role": "assistant", "content": response.get("content") or []}]
        history.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": cid, "content": text} for cid, text in results
                ],
            }
        )
    out[key] = history
    return out


def strip_fetch_calls(endpoint: str, response: dict[str, Any]) -> dict[str, Any]:
    """`response` without its `runcap_fetch` calls (a copy), its stop reason adjusted when no
    tool call is left."""
    out = dict(response)
    if endpoint == "chat.completions":
        choices = []
        for choice in response.get("choices") or ():
            message = choice.get("message") if isinstance(choice, dict) else None
            if not isinstance(message, dict) or not message.get("tool_calls"):
                choices.append(choice)
                continue
            calls = [c for c in message["tool_calls"] if _chat_call_name(c) != FETCH_TOOL]
            message = dict(message)
            choice = dict(choice)
            if calls:
                message["tool_calls"] = calls
            else:
                message.pop("tool_calls", None)
                if choice.get("finish_reason") == "tool_calls":
                    choice["finish_reason"] = "stop"
                if message.get("content") is None:
                    message["content"] = ""
            choice["message"] = message
            choices.append(choice)
        out["choices"] = choices
    elif endpoint == "responses":
        out["output"] = _without_fetch(response.get("output"), "function_call")
    else:
        content = _without_fetch(response.get("content"), "tool_use")
        out["content"] = content
        if out.get("stop_reason") == "tool_use" and not any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in content
        ):
            out["stop_reason"] = "end_turn"
    return out


def _chat_call_name(call: Any) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    return fn.get("name", "") if isinstance(fn, dict) else ""


def _single_answer(endpoint: str, response: dict[str, Any]) -> bool:
    """A continuation is built from one answer (chat: one choice)."""
    if endpoint != "chat.completions":
        return True
    choices = response.get("choices")
    return isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)


# -- the loop --------------------------------------------------------------------------------


@dataclass(slots=True)
class FetchAnswer:
    """What the agent gets: `body` (None: the upstream's first answer, unchanged) with `status`,
    and the run headers of the last inner call (its step, what is left of the caps)."""

    status: int
    body: bytes | None
    response: dict[str, Any] | None
    reply_headers: dict[str, str] = field(default_factory=dict)
    rounds: int = 0


async def answer_fetches(
    adapter: Adapter,
    rewrite: Rewrite,
    body: dict[str, Any],
    first: dict[str, Any],
    call: ModelCaller,
    upstream: str,
) -> FetchAnswer:
    """Run the fetch loop for the upstream's answer `first` to the request `body` (as forwarded,
    to `adapter`'s endpoint of the upstream named `upstream`). Raises a `Rejection` when an inner
    call is refused (a cap, the deadline) or the upstream cannot be reached."""
    endpoint = adapter.name
    response = first
    changed = False
    rounds = 0
    reply_headers: dict[str, str] = {}
    while True:
        calls: list[ToolCall] = adapter.parse_response(response).tool_calls
        fetches = [c for c in calls if c.name == FETCH_TOOL]
        if not fetches:
            break
        if (
            len(fetches) < len(calls)
            or rounds >= rewrite.max_fetch_calls
            or not _single_answer(endpoint, response)
        ):
            response = strip_fetch_calls(endpoint, response)
            changed = True
            break
        results = [(c.id, read_handle(c.arguments, rewrite.handles)) for c in fetches]
        body = continuation(endpoint, body, response, results)
        answer = await call(body)
        rounds += 1
        reply_headers = dict(answer.reply_headers)
        if answer.parsed is None:
            if answer.upstream_status == 0:
                raise UpstreamUnavailable(answer.error or f"upstream '{upstream}' failed")
            # The upstream's own error, passed through as for any call.
            return FetchAnswer(answer.status, answer.body, None, reply_headers, rounds)
        response = answer.parsed
        changed = True
    return FetchAnswer(200, orjson.dumps(response) if changed else None, response, reply_headers, rounds)


def _without_fetch(items: Any, call_type: str) -> list[Any]:
    """`items` (a response's output items or content blocks) but the `runcap_fetch` calls, of
    type `call_type`."""
    return [
        item
        for item in items or ()
        if not (isinstance(item, dict) and item.get("type") == call_type and item.get("name") == FETCH_TOOL)
    ]
