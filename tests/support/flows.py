"""`tflow`: a `Flow` for unit-testing one step on its own, without a server (like mitmproxy's
`tflow`). Sensible defaults — a chat-completions call of run `t-run` to the default OpenAI
upstream, its body read by the adapter and its run headers parsed — each one overridable.

    flow = tflow(headers={"X-Run-Max-Context-Tokens": "10"})
    with pytest.raises(BudgetExceeded):
        await step.request(flow)
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp.test_utils import make_mocked_request

from proxy.caps import parse_run_headers
from proxy.config import DEFAULT_UPSTREAMS, CapsConfig
from proxy.providers.registry import adapter_for
from proxy.server.flow import Flow, Pipeline

DEFAULT_BODY: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "say hello to the test"}],
    "max_tokens": 16,
}
# Where each wire format is sent on its default upstream.
PATHS = {"openai": ["v1", "chat", "completions"], "anthropic": ["v1", "messages"]}


def tflow(
    body: dict[str, Any] | None = None,
    *,
    upstream: str = "openai",
    path: list[str] | None = None,
    method: str = "POST",
    run_id: str | None = "t-run",
    headers: dict[str, str] | None = None,
    caps: CapsConfig | None = None,
    pipeline: Pipeline | None = None,
    inner: bool = False,
) -> Flow:
    """A flow as the forwarder has it when the steps' request hooks start: run parsed, body read
    (`body` None: `DEFAULT_BODY`, or an Anthropic equivalent), adapter chosen from the path
    (None for a GET or an endpoint runcap does not understand)."""
    config = DEFAULT_UPSTREAMS[upstream]
    segments = path if path is not None else PATHS[config.flavor]
    target = config.base.target(segments, "")
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if run_id is not None:
        all_headers.setdefault("X-Run-Id", run_id)
    request = make_mocked_request(method, "/" + "/".join(segments), headers=all_headers)
    adapter = adapter_for(config.flavor, target.path) if method == "POST" else None
    if body is None and adapter is not None:
        body = dict(DEFAULT_BODY)
        if config.flavor == "anthropic":
            body["model"] = "claude-sonnet-4-5"
    flow = Flow(request, config, target, adapter, inner=inner, pipeline=pipeline)
    flow.run = parse_run_headers(request.headers, caps or CapsConfig())
    if body is not None:
        flow.body = orjson.dumps(body)
        flow.body_json = body
        if adapter is not None:
            flow.info = adapter.parse_request(body)
    return flow
