"""Which adapter understands an upstream endpoint.

Endpoints are matched by their last path segments, so the same adapter serves `/v1/chat/completions`,
an OpenAI-compatible server mounted elsewhere (`/api/v1/chat/completions`) and Azure's
`/openai/deployments/{name}/chat/completions`. Sub-resources (`/v1/responses/{id}`,
`/v1/messages/count_tokens`, `/v1/messages/batches`) are not matched: they pass through — and,
while a run has a dollar or token cap, a POST to one is refused unless it is known to cost
nothing (`free_endpoint`) or the operator allow-lists it (DESIGN.md "Metered endpoints").
"""

from __future__ import annotations

import re

from .anthropic_messages import MessagesAdapter
from .base import Adapter
from .openai_basic import CompletionsAdapter, EmbeddingsAdapter
from .openai_chat import ChatCompletionsAdapter
from .openai_responses import ResponsesAdapter

# flavor -> ordered (path suffix, adapter); the first match wins ("/chat/completions" before
# "/completions").
_ADAPTERS: dict[str, tuple[tuple[str, Adapter], ...]] = {
    "openai": (
        ("/chat/completions", ChatCompletionsAdapter()),
        ("/responses", ResponsesAdapter()),
        ("/completions", CompletionsAdapter()),
        ("/embeddings", EmbeddingsAdapter()),
    ),
    # Anthropic also serves OpenAI's chat format (its OpenAI SDK compatibility endpoint).
    "anthropic": (("/messages", MessagesAdapter()), ("/chat/completions", ChatCompletionsAdapter())),
}


def adapter_for(flavor: str, path: str) -> Adapter | None:
    """The adapter for `path` (the upstream path after runcap's prefix) of an upstream of
    `flavor` ("openai" or "anthropic"); None: unknown endpoint, pass it through byte-for-byte."""
    path = path.partition("?")[0].rstrip("/")
    for suffix, adapter in _ADAPTERS.get(flavor, ()):
        if path.endswith(suffix):
            return adapter
    return None


# POSTs that bill nothing: token counting and cancelling work already paid for.
_FREE = re.compile(
    r"/(?:messages/count_tokens|responses/input_tokens|responses/[^/]+/cancel"
    r"|messages/batches/[^/]+/cancel|batches/[^/]+/cancel)$"
)


def free_endpoint(path: str) -> bool:
    """A POST to `path` (decoded, without the query) costs nothing."""
    return _FREE.search(path.rstrip("/")) is not None
