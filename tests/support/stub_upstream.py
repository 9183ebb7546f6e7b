"""The recording stub every upstream and tool of the trust-boundary tests points at
(tests/support/tool_service.py), the configuration that points them there, and a request sent
exactly as given."""

from __future__ import annotations

from typing import Any

from yarl import URL

from tests.support.raw_http import json_bytes, json_or, request
from tests.support.tool_service import ToolService

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


OPERATOR_KEY = "sk-operator-secret"


def stub_config(svc: ToolService, **extra: Any) -> dict[str, Any]:
    """Every upstream and tool points at the recording stub, each under a base path of its own."""
    return {
        "upstreams": {
            "openai": {"url": f"{svc.url}/oa"},
            "anthropic": {"url": f"{svc.url}/an"},
            "local": {"url": f"{svc.url}/loc", "api_key_env": "LOCAL_KEY"},
        },
        "tools": {
            "refund": {
                "url": f"{svc.url}/refund",
                "side_effects": True,
                "headers": {"Authorization": "Bearer tool-own-credential"},
            },
            "lookup": {"url": f"{svc.url}/lookup", "forward_headers": ["Authorization"]},
        },
        **extra,
    }


async def send(
    url: str, method: str = "POST", *, headers: dict[str, str] | None = None, body: Any = CHAT
) -> tuple[int, dict[str, str], Any]:
    """Send exactly `url` (already encoded: the client must not normalise it)."""
    h = {"Content-Type": "application/json", **(headers or {})}
    status, answer_headers, raw = await request(method, URL(url, encoded=True), json_bytes(body), h)
    return status, answer_headers, json_or(raw, raw)
