"""Provider-neutral view of model traffic.

Each wire format (OpenAI chat, OpenAI responses, OpenAI completions/embeddings, Anthropic
messages) has one adapter module that maps its requests, responses and SSE streams onto these
types, and knows how to clamp the output-token limit and strip tools. Budgets, the ledger and the
span pipeline only ever see `Usage`, `ToolCall`, `ToolResult`, `RequestInfo` and `ResponseInfo`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class _NoUses(Mapping[str, int]):
    """The `Usage.tool_uses` of a call that used no tool billed per use: one shared empty
    mapping that cannot change (a dict per `Usage` was a third of its cost)."""

    def __getitem__(self, key: str) -> int:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __hash__(self) -> int:
        return 0


NO_USES: Mapping[str, int] = _NoUses()


class BodyError(ValueError):
    """A body runcap must understand is malformed; the message says which field (`field`, when
    known, is what the 400's `param` names)."""

    def __init__(self, message: str, *, field: str = "body") -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class Usage:
    """Token usage of one model call, normalised across providers.

    `input_tokens` is ALL input tokens, cached or not (OpenAI's `prompt_tokens`; Anthropic's
    `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`), so that the token cap
    and the spans count every token the provider processed. `cache_read_tokens` and
    `cache_write_tokens` are the parts of it read from / written to the prompt cache.
    `output_tokens` includes `reasoning_tokens` and `output_audio_tokens`; `input_tokens` includes
    `input_audio_tokens`. `tool_uses` counts the uses of tools the provider ran for the model that
    are billed per use (`proxy.pricing.FEE_KINDS`: web searches, file searches, code execution).
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    input_audio_tokens: int = 0
    output_audio_tokens: int = 0
    tool_uses: Mapping[str, int] = NO_USES  # replaced, never changed in place

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(slots=True)
class ToolCall:
    """A tool call the model requested in a response."""

    id: str
    name: str
    arguments: str  # raw JSON text as the model produced it (may not parse)


@dataclass(slots=True)
class HostedTool:
    """A tool in the request that the provider runs for the model (web search, file search, code
    execution, a remote MCP server, web fetch): each use is an internal model call whose results
    join the input, and some are billed per use (`fee`: a `proxy.pricing.FEE_KINDS` kind)."""

    type: str  # as the request names it: "web_search_20250305", "mcp", "file_search"...
    fee: str | None  # the per-use fee kind, None when its uses cost tokens only
    limit: int | None  # the request's own limit on its uses (Anthropic `max_uses`), None: none
    index: int = -1  # its position in the request's `tools`
    priced: bool = True  # False: a hosted tool whose billing runcap does not model
    # Used on every call, up to `limit` (a chat search model's one search): settled at that.
    always: bool = False


@dataclass(slots=True)
class ToolResult:
    """A tool result the agent sent back in a request."""

    tool_call_id: str
    content: Any  # str, or the structured content blocks as sent
    is_error: bool = False
    # Sent after the request's last assistant turn: new in this request, not history that every
    # later request of the conversation resends.
    fresh: bool = True


@dataclass(slots=True)
class RequestInfo:
    model: str = ""
    stream: bool = False
    # The output-token limit the client asked for, or None when it set none.
    max_output_tokens: int | None = None
    has_tools: bool = False
    tool_results: list[ToolResult] = field(default_factory=list)
    # An upper bound on the input tokens of this request, computed without a tokenizer
    # (every token of a byte-level BPE covers at least one UTF-8 byte, plus per-message overhead).
    input_token_bound: int = 0
    # The client asked for usage in the stream itself (OpenAI `stream_options.include_usage`).
    client_wants_stream_usage: bool = False
    # The conversation the request carries (messages), for formats that resend it every call,
    # and a digest of everything else the model reads (model, system prompt, tools...): two
    # requests with the same context whose histories share a prefix read that prefix alike.
    history: list[Any] = field(default_factory=list)
    context: bytes = b""
    # The request extends input the provider stores: "response:{id}" for a previous response
    # (OpenAI responses `previous_response_id`), "message:{id}" for a previous message (an
    # Anthropic message thread continued), "server-side" for a conversation or stored prompt;
    # "" for none; plus "item:{id}" for each stored output item the input references (OpenAI
    # responses `item_reference`, what the Vercel AI SDK sends back for an earlier answer's text),
    # space-separated. Its tokens are not in the body, so `input_token_bound` does not cover them,
    # and tools it holds stay live even when the body has none.
    stored_context: str = ""
    # Priced or refused (DESIGN.md "Enforcement rules"). The request option that selects a price
    # variant, as a genai-prices price-context pair (`("service_tier", "priority")`,
    # `("speed", "fast")`; `("service_tier", "auto")`: the provider picks); None: not set.
    price_option: tuple[str, str] | None = None
    # The call may read or write audio (audio input parts, an audio output modality).
    audio: bool = False
    # Tools the provider runs for the model, and the request's limit on their uses taken
    # together (OpenAI Responses `max_tool_calls`; None: none).
    hosted_tools: list[HostedTool] = field(default_factory=list)
    hosted_limit: int | None = None
    # Inputs the body does not carry (a document or file by URL or id): each is rendered at the
    # provider, up to the model's context window.
    by_reference: int = 0


@dataclass(slots=True)
class ResponseInfo:
    model: str = ""
    usage: Usage | None = None  # None when the response carried no usage
    tool_calls: list[ToolCall] = field(default_factory=list)
    # The response ended without requesting tools (a final answer).
    finished: bool = False
    response_id: str = ""
    # Ids of the answer's output items (OpenAI responses), which a later request may reference
    # (`item_reference`) instead of sending them again.
    output_item_ids: list[str] = field(default_factory=list)
    # `turn_key` of the answer (its text and tool calls), to recognise it when the agent sends it
    # back in the next request's history; None when it cannot be told (several choices...).
    turn: bytes | None = None
    # A stream is complete only once its closing event arrived (Anthropic `message_stop`;
    # chat/completions `[DONE]` after the usage chunk; a Responses terminal event) and every
    # event before it was read: only then is its usage final. Buffered responses are complete.
    complete: bool = True
    # An error the upstream reported inside the stream (Anthropic `error` event, an OpenAI error
    # chunk or event, Responses `response.failed`), or why the stream could not be read; "" if none.
    error: str = ""
    # The price variant the provider says it served the call at (OpenAI `service_tier`,
    # Anthropic `usage.speed`), as genai-prices price context; None when it did not say.
    price_options: tuple[tuple[str, str], ...] | None = None
    # Tool calls the provider executed for the model (Responses `mcp_call`, `web_search_call`,
    # `file_search_call`, `code_interpreter_call`; Anthropic `server_tool_use`): they count
    # against X-Run-Max-Tool-Calls and are `tool_call` spans, but the agent executes none of them.
    provider_tool_calls: list[ToolCall] = field(default_factory=list)


class StreamReader(Protocol):
    """Incremental reader of one SSE response stream."""

    def feed(self, chunk: bytes) -> bytes:
        """Take bytes as they arrive from upstream; return the bytes to relay to the client now."""

    def close(self) -> bytes:
        """End of stream: return any bytes still held back."""

    @property
    def info(self) -> ResponseInfo:
        """What the stream said so far (usage may be partial or None if it was cut; `complete`
        once its closing event arrived)."""

    @property
    def ended(self) -> bool:
        """The format's closing event arrived (complete or not: a chat `[DONE]` without usage)."""


class Adapter(Protocol):
    """One wire format. Stateless; the same instance serves every request."""

    name: str  # endpoint label, e.g. "chat.completions", "responses", "messages"
    # The smallest output limit the provider accepts (OpenAI responses: 16); a call that cannot
    # afford it is refused rather than sent with an invalid limit.
    min_output_limit: int

    def parse_request(self, body: dict[str, Any]) -> RequestInfo: ...

    def set_hosted_limit(self, body: dict[str, Any], info: RequestInfo, uses: int) -> None:
        """Bound the uses of the request's hosted tools the request leaves unbounded to `uses`
        (Responses `max_tool_calls` for all of them; Anthropic `max_uses` per tool)."""

    def set_output_limit(self, body: dict[str, Any], limit: int, *, legacy_field: bool = False) -> None:
        """Set the output-token limit in the request body (the field this format uses).
        `legacy_field`: when the client set none, write the older field (OpenAI chat's
        `max_tokens`), the one OpenAI-compatible servers know."""

    def strip_tools(self, body: dict[str, Any]) -> None:
        """Make the request answer-only: the model cannot request a tool — neither one of the
        body's nor one held by context the provider stores (`RequestInfo.stored_context`)."""

    def request_stream_usage(self, body: dict[str, Any]) -> bool:
        """Ask the upstream for usage in the stream; return True if the body was changed."""

    def parse_response(self, body: dict[str, Any]) -> ResponseInfo: ...

    def history_item(self, item: Any) -> tuple[int, bytes | None]:
        """For one item of `RequestInfo.history`: its input-token bound (as `parse_request`
        counts it) and, for an assistant turn, its `turn_key` (else None)."""

    def stream_reader(self, strip_injected_usage: bool) -> StreamReader: ...


class NoHistory:
    """The `history_item` of an adapter whose requests carry no resent history (its
    `RequestInfo.history` stays empty)."""

    def history_item(self, item: Any) -> tuple[int, bytes | None]:
        raise NotImplementedError("this format's requests carry no resent history")


def turn_key(text: str, calls: Iterable[tuple[str, str]]) -> bytes:
    """Identity of one assistant turn: all its text, then each tool call's name and arguments
    as JSON text. The same answer read from a response and from the next request's history
    gets the same key."""
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16)
    for name, arguments in calls:
        h.update(
            b"\x00"
            + name.encode("utf-8", "surrogatepass")
            + b"\x00"
            + arguments.encode("utf-8", "surrogatepass")
        )
    return h.digest()


def context_digest(*parts: Any) -> bytes:
    import orjson

    try:
        return hashlib.blake2b(orjson.dumps(parts), digest_size=16).digest()
    except TypeError:
        return b""
