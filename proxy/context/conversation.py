"""The conversation a request resends, read the same way for the three wire formats.

What the policies need to know about a body, and nothing else: its list of items (chat and
Anthropic `messages`, Responses `input`), where the model's turns start (a "step" is one
assistant turn: the scripted upstream and the step count agree), which items open tool calls and
which carry their results (so a cut never separates a pair), and the text of a tool result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.context import FETCH_TOOL

ENDPOINTS = ("chat.completions", "responses", "messages")

# Responses items the model produced (a run of them is one turn).
_RESPONSES_MODEL_ITEMS = frozenset(
    {
        "function_call",
        "custom_tool_call",
        "reasoning",
        "computer_call",
        "local_shell_call",
        "shell_call",
        "apply_patch_call",
    }
)
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def items_key(endpoint: str) -> str:
    return "input" if endpoint == "responses" else "messages"


def items_of(body: dict[str, Any], endpoint: str) -> list[Any] | None:
    items = body.get(items_key(endpoint))
    return items if isinstance(items, list) else None


def is_model_item(item: Any, endpoint: str) -> bool:
    if not isinstance(item, dict):
        return False
    if item.get("role") == "assistant":
        return True
    return endpoint == "responses" and item.get("type") in _RESPONSES_MODEL_ITEMS


def turn_starts(items: list[Any], endpoint: str) -> list[int]:
    """Index of the first item of each assistant turn (Responses: a run of model items)."""
    starts: list[int] = []
    previous = False
    for i, item in enumerate(items):
        model = is_model_item(item, endpoint)
        if model and not (previous and endpoint == "responses"):
            starts.append(i)
        previous = model
    return starts


def preamble_length(items: list[Any], endpoint: str) -> int:
    """Leading system / developer messages (chat, Responses): always kept, never counted."""
    n = 0
    for item in items:
        if not isinstance(item, dict) or item.get("role") not in ("system", "developer"):
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class Pairing:
    """Tool calls and results by item: a cut before item `i` is allowed when no call opened
    before `i` has its result at or after `i` (and, Responses, `i - 1` is not a reasoning item,
    which belongs to the call after it)."""

    calls: dict[str, int]  # call id -> item that opened it
    results: dict[str, int]  # call id -> item that carries its result

    def cuttable(self, items: list[Any], endpoint: str) -> list[bool]:
        n = len(items)
        blocked = [0] * (n + 2)
        for call_id, opened in self.calls.items():
            answered = self.results.get(call_id)
            if answered is not None and answered > opened:
                blocked[opened + 1] += 1
                blocked[answered + 1] -= 1
        out = []
        running = 0
        for i in range(n + 1):
            running += blocked[i]
            ok = running == 0
            if ok and endpoint == "responses" and i > 0:
                prev = items[i - 1]
                ok = not (isinstance(prev, dict) and prev.get("type") == "reasoning")
            out.append(ok)
        return out


def pairing(items: list[Any], endpoint: str) -> Pairing:
    calls: dict[str, int] = {}
    results: dict[str, int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        if endpoint == "chat.completions":
            for call in item.get("tool_calls") or ():
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    calls.setdefault(call["id"], i)
            if item.get("role") == "tool" and isinstance(item.get("tool_call_id"), str):
                results.setdefault(item["tool_call_id"], i)
        elif endpoint == "messages":
            content = item.get("content")
            if isinstance(content, list):
                for block in content:
                    if not isinstance(block, dict):
                        continue
                    if block.get("type") in ("tool_use", "server_tool_use") and isinstance(
                        block.get("id"), str
                    ):
                        calls.setdefault(block["id"], i)
                    elif block.get("type") == "tool_result" and isinstance(block.get("tool_use_id"), str):
                        results.setdefault(block["tool_use_id"], i)
        else:
            call_id = item.get("call_id")
            if isinstance(call_id, str):
                kind = item.get("type")
                if isinstance(kind, str) and kind.endswith("_output"):
                    results.setdefault(call_id, i)
                else:
                    calls.setdefault(call_id, i)
    return Pairing(calls, results)


def text_content(content: Any) -> str | None:
    """A tool result's content as one text, when it is text only (a string, or text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "".join(texts)
    return None


def declared_tool_names(body: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for tool in body.get("tools") or ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
        if isinstance(name, str):
            names.add(name)
    for fn in body.get("functions") or ():  # chat's legacy functions
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def declares_fetch_tool(body: dict[str, Any]) -> bool:
    return FETCH_TOOL in declared_tool_names(body)
