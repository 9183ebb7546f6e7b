"""Context management: what runcap may do to a conversation that outgrew itself.

Without `X-Run-Context-Policy` (or a task's `context_policy`) runcap never changes a message;
it only measures the context (`X-Run-Context-Tokens`, `X-Run-Context-Growth`, the share of the
input that is tool output) and enforces `X-Run-Max-Context-Tokens`. With a policy:

* `offload` (`offload.py`): tool results older than the last `keep_last_steps` steps and larger
  than `offload_min_bytes` are replaced by their head and tail plus a handle
  (`runcap:sha256/<hash>`); runcap adds a `runcap_fetch` tool the model can call to read more,
  executes it itself and continues the conversation with the upstream (`fetch.py`).
* `summarize` (`summarize.py`): past `summarize_above_tokens`, the turns between the first
  `summary_keep_first` and the last `summary_keep_last` are replaced by a summary made by
  `summary_model`, cached per run by the hash of what it replaces. Tool-call / tool-result pairs
  are never split.

Every rewrite is a `Rewrite` on the flow: the span records the original and forwarded bodies'
hashes, what was removed and the policy.

The policies make model calls of their own (a summary, a `runcap_fetch` continuation): they
get a `ModelCaller` and know nothing of the server that makes the call — the context step
(proxy/server/steps/context.py) hands them runcap's inner calls (proxy/server/inner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

POLICIES = ("offload", "summarize")
FETCH_TOOL = "runcap_fetch"
HANDLE_PREFIX = "runcap:sha256/"


@dataclass(frozen=True, slots=True)
class ContextSettings:
    """`[context]` in runcap.toml: the thresholds the policies use."""

    keep_last_steps: int = 2  # offload: results of the last N steps stay whole
    offload_min_bytes: int = 2048  # offload: smaller results stay whole
    head_bytes: int = 512  # offload: what stays of a result, at its start
    tail_bytes: int = 256  # ... and at its end
    max_fetch_calls: int = 8  # runcap_fetch rounds within one agent request
    summarize_above_tokens: int = 32_000  # summarize: input bound that triggers a summary
    summary_keep_first: int = 2  # summarize: turns kept at the start
    summary_keep_last: int = 6  # summarize: turns kept at the end
    summary_model: str = ""  # summarize: the model that writes the summary (required for it)
    summary_max_tokens: int = 1024
    growth_alert: float = 4.0  # /metrics and the Runs dashboard flag runs grown past this


@dataclass(slots=True)
class Rewrite:
    """What a policy did to one request before it was forwarded."""

    policy: str  # the policies that changed something, comma-separated ("offload", "summarize")
    original_body: bytes  # the request body as the agent sent it (stored as a payload)
    removed_bytes: int = 0
    removed_tokens: int = 0  # input-token bound of the original minus that of the forwarded body
    # Full tool results taken out of band, by sha256 hex: what `runcap_fetch` reads (and what the
    # payload store keeps under the same hash).
    handles: dict[str, bytes] = field(default_factory=dict)
    fetch_tool: bool = False  # `runcap_fetch` was added to the request's tools
    # With the fetch tool added, the request goes upstream unstreamed (runcap must see the whole
    # answer before the agent gets any of it) and the final answer is re-encoded as the stream the
    # agent asked for: `agent_stream`, and `agent_stream_usage` for OpenAI chat's usage chunk.
    agent_stream: bool = False
    agent_stream_usage: bool = False
    max_fetch_calls: int = 0  # `runcap_fetch` rounds this request may take (ContextSettings)
    summarized_items: int = 0  # summarize: conversation items replaced by a summary


@dataclass(slots=True)
class ContextReading:
    """What runcap measured of one step's context (proxy/server/steps/context.py), for the response
    headers, the cap, the span and /metrics. Token counts are of the request as forwarded."""

    # A lower bound of the input tokens (refuse only above it: never a step that fits) and an
    # upper bound (the budget's tokenizer-free bound, tightened by the run's own usage).
    lower: int
    upper: int
    # What `X-Run-Context-Tokens` says before the provider's usage is known (streams): the exact
    # count of the history the previous step sent, plus the new part at ~4 bytes a token.
    estimate: int
    # Bytes of tool results / bytes of messages (JSON as sent), 0..1.
    tool_output_share: float
    # The provider-reported input tokens of this step, once known (0: not known).
    tokens: int = 0
    # This step's tokens over the run's first step's (1.0 for the first step).
    growth: float = 1.0
    cap: int | None = None  # X-Run-Max-Context-Tokens that applied, if any
    policies: tuple[str, ...] = ()  # the policies the request asked for (header or task)


@dataclass(slots=True)
class ModelAnswer:
    """What one of runcap's own model calls returned."""

    status: int  # the status of the call as recorded (the upstream's, or runcap's for a failure)
    upstream_status: int  # 0: the upstream never answered (unreachable, reset)
    body: bytes  # the upstream's answer as read (b"": none)
    parsed: dict[str, Any] | None  # the answer as a JSON object; None: an error or no JSON object
    error: str = ""  # why, when the call failed
    reply_headers: dict[str, str] = field(default_factory=dict)  # the run headers after the call


class ModelCaller(Protocol):
    """Make one unstreamed model call of `body` as a step of the current request's run, on its
    upstream and endpoint: reserved, capped, settled and traced like the agent's own calls. A
    refusal (a cap, the deadline, a cancel) raises its `Rejection`."""

    async def __call__(self, body: dict[str, Any]) -> ModelAnswer: ...
