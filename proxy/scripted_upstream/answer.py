"""The scripted answer to one request, before any wire format: what a step says, within the
request's output-token limit, and its usage (recorded on the request as runcap's `Usage`).

Each wire format renders the `Answer` in its own shapes (messages, items, blocks, usage objects).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.providers.base import Usage
from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.script import DEFAULT_TEXT, FALLBACK_TEXT, Step
from proxy.scripted_upstream.tokens import count_tokens, filler_text, references, truncate_to_tokens


@dataclass(slots=True)
class Call:
    """A tool call of the answer, named by the server."""

    id: str
    name: str
    arguments: str
    input: dict[str, Any]
    partial: bool  # cut by the output-token limit


@dataclass(slots=True)
class Answer:
    """What the "model" says for one request, after applying the output-token limit."""

    text: str
    calls: list[Call]
    reasoning_tokens: int
    output_tokens: int
    truncated: bool
    input_tokens: int  # all input tokens, cache reads and writes included
    cache_read_tokens: int
    cache_write_tokens: int
    audio_tokens: int = 0  # output audio tokens (part of output_tokens)
    input_audio_tokens: int = 0  # part of input_tokens
    hosted: tuple[HostedUse, ...] = ()  # hosted-tool uses made, in order

    def usage(self) -> Usage:
        """The answer's usage as runcap normalises it."""
        # What the uses bill per use: searches, and code interpreter container sessions (all of a
        # response's calls share one container: one session).
        billed = {
            "web_search": sum(1 for h in self.hosted if h.tool.startswith("web_search")),
            "file_search": sum(1 for h in self.hosted if h.tool == "file_search"),
            "code_execution": 1 if any(h.tool == "code_interpreter" for h in self.hosted) else 0,
        }
        return Usage(
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            cache_read_tokens=self.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens,
            reasoning_tokens=self.reasoning_tokens,
            input_audio_tokens=self.input_audio_tokens,
            output_audio_tokens=self.audio_tokens,
            tool_uses={kind: n for kind, n in billed.items() if n},
        )


@dataclass(frozen=True, slots=True)
class HostedUse:
    tool: str  # the request's tool type ("web_search", "web_search_20250305", "mcp"...)
    label: str  # an MCP tool's server label ("" otherwise)


# Hosted tool types the "model" uses (Responses; Anthropic server tools by type prefix).
RESPONSES_HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter", "mcp")
ANTHROPIC_HOSTED = ("web_search_", "web_fetch_")


def hosted_uses(step: Step, body: dict[str, Any], anthropic: bool) -> tuple[HostedUse, ...]:
    """The hosted-tool uses a step makes: `step.hosted_uses`, shared round-robin among the
    request's hosted tools, never past what the request allows (Responses `max_tool_calls` for
    all of them; an Anthropic tool's `max_uses` for it)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        tools = []
    slots: list[list[Any]] = []  # [tool type, server label, uses left]
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            continue
        if anthropic and kind.startswith(ANTHROPIC_HOSTED):
            left = tool.get("max_uses")
            slots.append([kind, "", left if isinstance(left, int) else 1 << 30])
        elif not anthropic and kind in RESPONSES_HOSTED:
            slots.append([kind, str(tool.get("server_label") or ""), 1 << 30])
    total = step.hosted_uses
    if not anthropic and isinstance(body.get("max_tool_calls"), int):
        total = min(total, body["max_tool_calls"])
    uses: list[HostedUse] = []
    while len(uses) < total and any(slot[2] > 0 for slot in slots):
        for slot in slots:
            if len(uses) < total and slot[2] > 0:
                slot[2] -= 1
                uses.append(HostedUse(slot[0], slot[1]))
    return tuple(uses)


def compose_answer(
    rec: RecordedRequest,
    step: Step,
    input_tokens: int,
    limit: int | None,
    tools_allowed: bool,
    new_call_id: Callable[[], str],
    *,
    hosted: tuple[HostedUse, ...] = (),
    audio: bool = False,
    input_audio: int = 0,
) -> Answer:
    """What `step` answers to `rec` (`input_tokens` as the format counts them, `limit` its output
    limit); sets `rec.usage`. `new_call_id` names each tool call, in order."""
    if step.input_tokens is not None:
        input_tokens = step.input_tokens
    # Billed beyond the body's text: each hosted-tool use is an internal call reading more
    # input, each input by reference its rendering, input audio its audio tokens.
    input_tokens += len(hosted) * step.use_input_tokens + input_audio
    input_tokens += references(rec.body) * step.reference_tokens
    # Scripted cache numbers are honoured as given: they raise the input when larger than it.
    input_tokens = max(input_tokens, step.cache_read_tokens + step.cache_write_tokens)
    budget = limit if limit is not None else 1 << 62
    reasoning = min(step.reasoning_tokens, budget)
    truncated = reasoning < step.reasoning_tokens
    budget -= reasoning
    if step.text_tokens is not None:
        text = filler_text(min(step.text_tokens, budget))
        truncated = truncated or step.text_tokens > budget
    else:
        if step.text is not None:
            text = step.text
        elif step.tool_calls:
            text = "" if tools_allowed else FALLBACK_TEXT
        else:
            text = DEFAULT_TEXT
        if count_tokens(text) > budget:
            text = truncate_to_tokens(text, budget)
            truncated = True
    used = count_tokens(text)
    budget -= used
    audio_out = min(step.audio_tokens, budget) if audio else 0
    budget -= audio_out
    output = reasoning + used + audio_out
    calls: list[Call] = []
    if tools_allowed and not truncated:
        for spec in step.tool_calls:
            need = count_tokens(spec.arguments)
            if need > budget:
                truncated = True
                if budget > 0:
                    args = truncate_to_tokens(spec.arguments, budget)
                    calls.append(Call(new_call_id(), spec.name, args, spec.input, True))
                    output += count_tokens(args)
                break
            calls.append(Call(new_call_id(), spec.name, spec.arguments, spec.input, False))
            budget -= need
            output += need
    if output == 0:
        output = 1  # a turn always emits at least one (end-of-turn) token
    ans = Answer(
        text=text,
        calls=calls,
        reasoning_tokens=reasoning,
        output_tokens=output,
        truncated=truncated,
        input_tokens=input_tokens,
        cache_read_tokens=step.cache_read_tokens,
        cache_write_tokens=step.cache_write_tokens,
        audio_tokens=audio_out,
        input_audio_tokens=input_audio,
        hosted=hosted,
    )
    rec.usage = ans.usage()
    return ans
