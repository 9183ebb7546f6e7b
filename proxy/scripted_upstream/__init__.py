"""A scripted, offline stand-in for the model providers runcap sits in front of.

`ScriptedUpstream` is a small aiohttp server that speaks the real wire formats of OpenAI chat
completions, the OpenAI Responses API, legacy completions, embeddings and Anthropic messages —
streaming and not — exactly as the official `openai` and `anthropic` clients expect them. What the
"model" answers comes from a script: a named list of steps, chosen per request by the
`X-Mock-Script` header. runcap's tests, its demo and its throughput benchmarks run against it, and
agent authors can use it (`runcap mock-upstream`) to test agents without a provider.

Step selection is stateless so that concurrent conversations never interfere: the step played is
the number of assistant turns already present in the request's history (chat / Anthropic:
assistant messages; Responses: runs of consecutive `function_call` / assistant `message` /
`reasoning` items of the whole conversation, stored items included). Past the end of a script, its
last step repeats. Legacy completions and embeddings have no history: they always
play the script's first step.

Like the real chat API, chat requests with `tools: []`, or with `tool_choice` /
`parallel_tool_calls` but no tools, get a 400: a proxy that strips tools must strip those too.

Token accounting is deterministic so that tests can assert exact usage (see `count_tokens`):

* input  = 3 + Σ over messages (4 + count_tokens(the message's text)) + count_tokens(tools JSON),
  where a message's text is all its text content, tool-call names and arguments and tool results
  concatenated (an image adds 85); `system` (Anthropic) and `instructions` (Responses) count as one
  message each; legacy completions count only the prompt; embeddings count each input.
  A step's `input_tokens` replaces this; a step's cache tokens raise it when they exceed it.
* output = reasoning tokens + count_tokens(text) + Σ count_tokens(tool-call arguments JSON), at
  least 1. The output-token limit of the request is honoured by truncating the answer.
* `tokenizer=InputTokenizer(...)` counts input otherwise: ceil(bytes / 4) is runcap's own
  estimate, so a test whose oracle must not be the code under test counts each word on its own,
  denser or sparser than that (`InputTokenizer.per_word`).

Steps (dicts in scripts, validated into `Step`):

    text: str                 answer text
    text_tokens: int          answer of exactly N output tokens of filler text
    tool_calls: [{name, arguments: dict | str}]   several = parallel calls; answered with text
                              instead when the request has no tools or tool choice "none"
    status: int, error: str, error_type: str, error_code: str   an error response
    headers: {name: value}    extra response headers (e.g. retry-after)
    delay_s: float            wait before answering (before the response headers)
    stall_s: float            streams: stall after the first content event (non-stream: adds to delay)
    chunk_delay_s: float      streams: pause between events
    drop_after_events: int    streams: close the connection abruptly after N events (a provider
                              failure mid-stream); 0 drops it before any response
    end_after_events: int     streams: end the response cleanly after N events, without the rest
                              (no closing event); negative: all but the last -N events
    end_mid_event: bool       with end_after_events: also send the first half of the next event
    error_after_events: int   streams: after N events send the format's mid-stream error event
                              (`error_type`, default overloaded_error / server_error; `error`
                              message) and end the response cleanly
    oversized_event_bytes: int   streams: after the first event, an SSE comment event of N bytes
                              (clients ignore it), before the rest of the stream
    omit_usage: bool          the answer reports no usage (a server that does not): no `usage` in
                              Anthropic answers and stream events, no usage in chat/completions
                              answers nor a usage chunk in their streams, `usage: null` in Responses
    input_tokens: int         report this many input tokens instead of the computed count
    fetch: {handle, offset, length} or a list of them   call runcap's `runcap_fetch` tool (before
                              any `tool_calls`): `handle` is an index into the distinct
                              `runcap:sha256/<hex>` handles the request's text shows, in order of
                              appearance (past the end: a handle that matches nothing), or a
                              literal handle string; `offset` and `length` are passed as given
    cache_read_tokens, cache_write_tokens, reasoning_tokens: int

Billing beyond text tokens, as the providers document it (the worst case where a step says so):

    service_tier: str         the tier an OpenAI answer reports it was served at (default: the
                              request's, `auto` and none served at "default")
    audio_tokens: int         output audio tokens, when the request asks for audio (chat
                              `modalities: ["audio"]`); part of the output, within its limit
    hosted_uses: int          uses of the request's hosted tools the "model" makes (Responses
                              web_search / file_search / code_interpreter / mcp items; Anthropic
                              web_search / web_fetch `server_tool_use` blocks), never more than the
                              request allows (`max_tool_calls`; each tool's `max_uses`); each is an
                              internal call adding `use_input_tokens` (default 1000) input tokens;
                              web searches are reported (Anthropic `usage.server_tool_use`)
    reference_tokens: int     input tokens each input by reference costs (a file by id, a
                              document or image by URL), rendered at the provider
Input audio parts (chat `input_audio`) count one audio input token per 3 bytes of their data,
reported in `prompt_tokens_details.audio_tokens`. Anthropic `speed` is echoed in `usage.speed`.

Stored Responses, as the provider keeps them: a response not created with `store: false` keeps
its conversation (what it continued, its input, its output) under its id and each output item
under the item's id. `previous_response_id` continues that conversation and an `item_reference`
input item stands for the stored item; either is answered — and billed — as if the stored items
had been sent (instructions and tools are the request's own, as on the real API). Refused like the
real API (400): an unknown response or item, a `function_call_output` without its
`function_call`, a `function_call` without its output.

Anthropic message threads (beta `message-threads-2026-08-12`, the `anthropic` SDK's tool runner):
a request with `thread: {"type": "create"}` has its conversation (system, tools, messages and the
answer) kept under the answer's id; `thread: {"type": "continue", "previous_message_id": id}`
sends only the new messages, and is answered — and billed — as if it had sent the kept system,
tools and history (the kept tools stay live); it may not repeat `system` or `tools`. An ended stream
still keeps the whole answer, as the provider holds it. Without the beta header `thread` is a 400.

For tests, the server records every request (`requests`, `last`, `hits()`: method, path, lower-cased
headers, parsed body, step played, usage answered, and whether a stream completed, was left by the
client, dropped or ended early by the server) and counts requests in flight (`in_flight`, `max_in_flight`).

The package: `core.py` (`ScriptedUpstream`: lifecycle, recording, step picking, routing), one file
per wire format — `openai_chat.py`, `openai_responses.py`, `openai_basic.py` (completions,
embeddings, models), `anthropic_messages.py`, each a `WireFormat` (`wire_format.py`) — and what
they share: the script model (`script.py`), token counting (`tokens.py`), the answer before any
format (`answer.py`), the recorded requests (`recording.py`), SSE and replies (`wire.py`),
OpenAI's errors and usage (`openai_common.py`).
"""

from proxy.scripted_upstream.anthropic_messages import MESSAGE_THREADS_BETA
from proxy.scripted_upstream.core import ScriptedUpstream, make_app, run
from proxy.scripted_upstream.script import (
    DEFAULT_TEXT,
    FALLBACK_TEXT,
    Step,
    handles_in,
    load_scripts,
)
from proxy.scripted_upstream.tokens import (
    InputTokenizer,
    anthropic_input_tokens,
    chat_input_tokens,
    count_tokens,
    filler_text,
    responses_input_tokens,
)

__all__ = [
    "DEFAULT_TEXT",
    "FALLBACK_TEXT",
    "MESSAGE_THREADS_BETA",
    "InputTokenizer",
    "ScriptedUpstream",
    "Step",
    "anthropic_input_tokens",
    "chat_input_tokens",
    "count_tokens",
    "filler_text",
    "handles_in",
    "load_scripts",
    "make_app",
    "responses_input_tokens",
    "run",
]
