"""Agent loops for the context-policy tests: one tool, large results, driven with the official
`openai` (chat completions, Responses) and `anthropic` clients — streamed or not — through
runcap. Each loop keeps the conversation the way its SDK's users do (the model's turn sent back
as the client returned it, then the tool results) and records every tool call it was shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai

FORMATS = ("chat", "responses", "messages")
TOOL = "read"
_PARAMS = {"type": "object", "properties": {"i": {"type": "integer"}}}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": TOOL, "description": "read a page", "parameters": _PARAMS}}
]
RESPONSES_TOOLS = [{"type": "function", "name": TOOL, "description": "read a page", "parameters": _PARAMS}]
ANTHROPIC_TOOLS = [{"name": TOOL, "description": "read a page", "input_schema": _PARAMS}]


def tool_result(i: int, size: int = 20_480) -> str:
    """The text tool `read` returns for page `i`: `size` bytes of numbered lines."""
    lines = []
    total = 0
    n = 0
    while total < size:
        line = f"page {i} line {n:05d}: the quick brown fox jumps over the lazy dog {n * 7919 % 10007}\n"
        lines.append(line)
        total += len(line)
        n += 1
    return "".join(lines)[:size]


@dataclass
class AgentRun:
    tool_names: list[str] = field(default_factory=list)  # every tool call the agent was shown
    calls: int = 0  # model calls the agent made
    final_text: str = ""
    headers: list[dict[str, str]] = field(default_factory=list)


def _page(arguments: Any) -> int:
    import json

    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return int((args or {}).get("i", 0))


async def run_agent(
    fmt: str,
    base: str,
    headers: dict[str, str],
    *,
    stream: bool = False,
    max_calls: int = 40,
    result_size: int = 20_480,
    model: str | None = None,
    max_tokens: int = 1024,
) -> AgentRun:
    """Drive one run until the model answers without a tool call (or `max_calls`)."""
    run = AgentRun()
    if fmt == "chat":
        await _chat(base, headers, stream, max_calls, result_size, run, model or "gpt-4o-mini", max_tokens)
    elif fmt == "responses":
        await _responses(
            base, headers, stream, max_calls, result_size, run, model or "gpt-4o-mini", max_tokens
        )
    else:
        await _messages(
            base, headers, stream, max_calls, result_size, run, model or "claude-sonnet-4-5", max_tokens
        )
    return run


async def _chat(
    base: str, h: dict[str, str], stream: bool, max_calls: int, size: int, run: AgentRun, model: str, mt: int
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "read the pages"}]
    for _ in range(max_calls):
        run.calls += 1
        # The history in `extra_body`: the SDK walks typed `messages` one by one (slow for 30 steps of
        # 20 KB results) and sends the same JSON.
        kwargs: dict[str, Any] = {"model": model, "messages": [], "tools": CHAT_TOOLS, "max_tokens": mt}
        kwargs["extra_body"] = {"messages": msgs}
        if stream:
            async with client.chat.completions.stream(**kwargs, extra_headers=h) as s:
                completion = await s.get_final_completion()
        else:
            raw = await client.chat.completions.with_raw_response.create(**kwargs, extra_headers=h)
            run.headers.append(dict(raw.headers))
            completion = raw.parse()
        msg = completion.choices[0].message
        calls = msg.tool_calls or []
        run.tool_names.extend(c.function.name for c in calls)
        turn: dict[str, Any] = {"role": "assistant", "content": msg.content}
        if calls:
            turn["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ]
        msgs.append(turn)
        if not calls:
            run.final_text = msg.content or ""
            return
        for c in calls:
            msgs.append(
                {
                    "role": "tool",
                    "tool_call_id": c.id,
                    "content": tool_result(_page(c.function.arguments), size),
                }
            )


async def _responses(
    base: str, h: dict[str, str], stream: bool, max_calls: int, size: int, run: AgentRun, model: str, mt: int
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    items: list[Any] = [{"role": "user", "content": "read the pages"}]
    for _ in range(max_calls):
        run.calls += 1
        # The history goes in `extra_body`: the SDK walks typed `input` item by item (seconds for
        # 30 steps of 20 KB results) and sends the same JSON either way.
        kwargs: dict[str, Any] = {
            "model": model,
            "tools": RESPONSES_TOOLS,
            "max_output_tokens": mt,
            "extra_body": {"input": items},
        }
        if stream:
            async with client.responses.stream(**kwargs, extra_headers=h) as s:
                response = await s.get_final_response()
        else:
            raw = await client.responses.with_raw_response.create(**kwargs, extra_headers=h)
            run.headers.append(dict(raw.headers))
            response = raw.parse()
        calls = [item for item in response.output if item.type == "function_call"]
        run.tool_names.extend(c.name for c in calls)
        items.extend(item.model_dump(exclude_none=True) for item in response.output)
        if not calls:
            run.final_text = response.output_text
            return
        for c in calls:
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": c.call_id,
                    "output": tool_result(_page(c.arguments), size),
                }
            )


async def _messages(
    base: str, h: dict[str, str], stream: bool, max_calls: int, size: int, run: AgentRun, model: str, mt: int
) -> None:
    client = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "read the pages"}]
    for _ in range(max_calls):
        run.calls += 1
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": msgs,
            "tools": ANTHROPIC_TOOLS,
            "max_tokens": mt,
        }
        if stream:
            async with client.messages.stream(**kwargs, extra_headers=h) as s:
                message = await s.get_final_message()
        else:
            raw = await client.messages.with_raw_response.create(**kwargs, extra_headers=h)
            run.headers.append(dict(raw.headers))
            message = await raw.parse()
        calls = [b for b in message.content if b.type == "tool_use"]
        run.tool_names.extend(c.name for c in calls)
        msgs.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        )
        if not calls:
            run.final_text = "".join(b.text for b in message.content if b.type == "text")
            return
        msgs.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": c.id, "content": tool_result(_page(c.input), size)}
                    for c in calls
                ],
            }
        )


def tool_result_texts(fmt: str, body: dict[str, Any]) -> list[str]:
    """The tool-result texts of a request body as the upstream received it."""
    out: list[str] = []
    if fmt == "chat":
        out.extend(m["content"] for m in body.get("messages", []) if m.get("role") == "tool")
    elif fmt == "responses":
        out.extend(i["output"] for i in body.get("input", []) if i.get("type") == "function_call_output")
    else:
        for m in body.get("messages", []):
            if m.get("role") == "user" and isinstance(m.get("content"), list):
                out.extend(b["content"] for b in m["content"] if b.get("type") == "tool_result")
    return [t for t in out if isinstance(t, str)]


def answered_history(fmt: str, pages: int, size: int) -> dict[str, Any]:
    """A request body whose history holds `pages` answered calls of `read` with `size`-byte results."""
    if fmt == "chat":
        msgs: list[Any] = [{"role": "user", "content": "go"}]
        for i in range(pages):
            call = {"id": f"c{i}", "type": "function", "function": {"name": TOOL, "arguments": "{}"}}
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": tool_result(i, size)})
        return {
            "model": "gpt-4o-mini",
            "messages": msgs,
            "tools": [{"type": "function", "function": {"name": TOOL}}],
        }
    if fmt == "responses":
        items: list[Any] = [{"role": "user", "content": "go"}]
        for i in range(pages):
            items.append({"type": "function_call", "call_id": f"c{i}", "name": TOOL, "arguments": "{}"})
            items.append({"type": "function_call_output", "call_id": f"c{i}", "output": tool_result(i, size)})
        return {"model": "gpt-4o-mini", "input": items, "tools": [{"type": "function", "name": TOOL}]}
    msgs = [{"role": "user", "content": "go"}]
    for i in range(pages):
        msgs.append(
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": TOOL, "input": {}}]}
        )
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": tool_result(i, size)}
        msgs.append({"role": "user", "content": [result]})
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 512,
        "messages": msgs,
        "tools": [{"name": TOOL, "input_schema": {"type": "object"}}],
    }
