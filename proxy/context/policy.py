"""The context policies applied to one request: what the context step calls.

`apply_policies` runs before the budget step (so the run is charged for what is forwarded, not
for what the agent sent): `offload` first (deterministic and free), then `summarize` when the
request is still past its threshold. It returns None — the agent's bytes forwarded as they came —
unless a policy changed something; then a `Rewritten`: the new body, its reading and the
`Rewrite` that says what was done (the context step puts them on the flow).

Skipped: requests whose context the provider holds (`previous_response_id`, an Anthropic thread,
a conversation: the old results are not in the body), and — for offload — requests that declare
a `runcap_fetch` tool of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.context import ContextSettings, ModelCaller, Rewrite
from proxy.context.conversation import ENDPOINTS, declares_fetch_tool
from proxy.context.offload import offload
from proxy.context.summarize import SummaryCache, summarize
from proxy.errors import InvalidRequest
from proxy.providers.base import Adapter, RequestInfo

POLICY_HEADER = "X-Run-Context-Policy"


@dataclass(slots=True)
class Rewritten:
    """The request as the policies left it: the body to forward, its reading, what was done."""

    body: dict[str, Any]
    info: RequestInfo
    rewrite: Rewrite


async def apply_policies(
    adapter: Adapter,
    body: dict[str, Any],
    info: RequestInfo,
    sent: bytes,
    policies: tuple[str, ...],
    settings: ContextSettings,
    *,
    run_id: str,
    summaries: SummaryCache,
    call: ModelCaller,
) -> Rewritten | None:
    """The agent's request `body` (read as `info`, sent as the bytes `sent`) of run `run_id`,
    rewritten by `policies`; None when nothing changed."""
    if adapter.name not in ENDPOINTS:
        return None
    if "summarize" in policies and not settings.summary_model:
        raise InvalidRequest(
            f"{POLICY_HEADER}: summarize needs a model to write summaries, and none is configured: "
            "set [context] summary_model in runcap.toml, or drop summarize from the header",
            param=POLICY_HEADER,
        )
    if info.stored_context:
        return None
    applied: list[str] = []
    handles: dict[str, bytes] = {}
    fetch_tool = False
    replaced = 0
    forwarded = info
    if "offload" in policies and not declares_fetch_tool(body):
        done = offload(body, adapter.name, settings)
        if done is not None:
            body, handles, fetch_tool = done.body, done.handles, True
            applied.append("offload")
            if info.stream:
                # runcap must see the whole answer before the agent gets any of it (fetch.py,
                # stream.py): the request goes upstream unstreamed.
                body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            forwarded = adapter.parse_request(body)
    if "summarize" in policies:
        summary = await summarize(
            adapter, run_id, body, forwarded.input_token_bound, settings, summaries, call
        )
        if summary is not None:
            body, replaced = summary.body, summary.replaced
            applied.append("summarize")
            forwarded = adapter.parse_request(body)
    if not applied:
        return None
    agent_stream = info.stream
    rewrite = Rewrite(
        policy=",".join(applied),
        original_body=sent,
        removed_bytes=max(0, len(sent) - len(orjson.dumps(body))),
        removed_tokens=info.input_token_bound - forwarded.input_token_bound,
        handles=handles,
        fetch_tool=fetch_tool,
        agent_stream=fetch_tool and agent_stream,
        agent_stream_usage=fetch_tool and info.client_wants_stream_usage,
        max_fetch_calls=settings.max_fetch_calls,
        summarized_items=replaced,
    )
    return Rewritten(body, forwarded, rewrite)
