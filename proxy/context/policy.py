"""The context policies applied to one request: what the context step calls.

`apply_policies` runs before the budget step (so the run is charged for what is forwarded, not
for what the agent sent): `offload` first (deterministic and free), then `summarize` when the
request is still past its threshold. It leaves the flow untouched — the agent's bytes forwarded
as they came — unless a policy changed something; then `flow.body_json` is the new body,
`flow.info` its reading and `flow.rewrite` says what was done.

Skipped: requests whose context the provider holds (`previous_response_id`, an Anthropic thread,
a conversation: the old results are not in the body), and — for offload — requests that declare
a `runcap_fetch` tool of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from proxy.context import ContextSettings, Rewrite
from proxy.context.conversation import ENDPOINTS, declares_fetch_tool
from proxy.context.offload import offload
from proxy.context.summarize import summarize
from proxy.errors import InvalidRequest

if TYPE_CHECKING:
    from proxy.server.flow import Flow
    from proxy.server.inner import InnerCalls

POLICY_HEADER = "X-Run-Context-Policy"


async def apply_policies(
    flow: Flow, policies: tuple[str, ...], settings: ContextSettings, inner: InnerCalls
) -> None:
    adapter, body, info = flow.adapter, flow.body_json, flow.info
    if adapter is None or body is None or info is None or adapter.name not in ENDPOINTS or flow.inner:
        return
    if "summarize" in policies and not settings.summary_model:
        raise InvalidRequest(
            f"{POLICY_HEADER}: summarize needs a model to write summaries, and none is configured: "
            "set [context] summary_model in runcap.toml, or drop summarize from the header",
            param=POLICY_HEADER,
        )
    if info.stored_context:
        return
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
        summary = await summarize(flow, body, forwarded.input_token_bound, settings, inner)
        if summary is not None:
            body, replaced = summary.body, summary.replaced
            applied.append("summarize")
            forwarded = adapter.parse_request(body)
    if not applied:
        return
    agent_stream = info.stream
    flow.body_json = body
    flow.body_changed = True
    flow.info = forwarded
    flow.rewrite = Rewrite(
        policy=",".join(applied),
        original_body=flow.body,
        removed_bytes=max(0, len(flow.body) - len(orjson.dumps(body))),
        removed_tokens=info.input_token_bound - forwarded.input_token_bound,
        handles=handles,
        fetch_tool=fetch_tool,
        agent_stream=fetch_tool and agent_stream,
        agent_stream_usage=fetch_tool and info.client_wants_stream_usage,
        max_fetch_calls=settings.max_fetch_calls,
        summarized_items=replaced,
    )
