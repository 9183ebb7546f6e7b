"""runcap's own `tools/list`, for a `tools/call` to a tool it has not seen listed (DESIGN.md "MCP
servers": what stays unknown is side-effecting): sent in the agent's session, each page within
LISTING_TIMEOUT_S and the run's deadline; what it learns goes into the `ToolCatalog`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from multidict import CIMultiDict

from proxy.config import MCPServerConfig
from proxy.mcp.catalog import ToolCatalog
from proxy.mcp.relay import ANSWER_FAILED, StreamableHTTPRelay
from proxy.mcp.reply import BatchReply
from proxy.mcp.wire import dumps
from proxy.server.outbound import release_or_drop
from proxy.toolcall.clock import deadline_clock
from proxy.upstream_url import UpstreamTarget

log = logging.getLogger("runcap.mcp")

LISTING_TIMEOUT_S = 5.0
LISTING_PAGES = 10
_ENVELOPE = "io.modelcontextprotocol/"  # 2026-07-28: the per-request `_meta` envelope's keys


class ToolListing:
    def __init__(self, relay: StreamableHTTPRelay, catalog: ToolCatalog) -> None:
        self.relay = relay
        self.catalog = catalog

    async def list_tools(
        self,
        server: MCPServerConfig,
        target: UpstreamTarget,
        headers: CIMultiDict[str],
        meta: dict[str, Any],
        deadline: float | None,
    ) -> bool:
        """Learn the server's tools (best effort); each page within LISTING_TIMEOUT_S and the
        run's `deadline`. True when the whole listing was read (every page)."""
        out = CIMultiDict(headers)
        for h in ("Mcp-Name", "Idempotency-Key", "Last-Event-ID"):
            out.popall(h, None)
        for h in [h for h in out if h.lower().startswith("mcp-param-")]:
            out.popall(h, None)
        if "Mcp-Method" in out:
            out["Mcp-Method"] = "tools/list"
        envelope = {k: v for k, v in meta.items() if k.startswith(_ENVELOPE)}
        cursor = None
        for _ in range(LISTING_PAGES):
            params: dict[str, Any] = {}
            if envelope:
                params["_meta"] = envelope
            if cursor:
                params["cursor"] = cursor
            rid = f"runcap-tools-list-{secrets.token_hex(6)}"
            request = {"jsonrpc": "2.0", "id": rid, "method": "tools/list", "params": params}
            collected = BatchReply()
            try:
                async with asyncio.timeout(deadline_clock(deadline, LISTING_TIMEOUT_S).seconds):
                    upstream = await self.relay.route.client.request(
                        "POST", target.url, data=dumps(request), headers=out
                    )
                    try:
                        await self.relay.answer(upstream, collected, {}, None, rid)
                    finally:
                        release_or_drop(upstream)
            except (TimeoutError, *ANSWER_FAILED) as e:
                log.warning("could not list the tools of MCP server %s: %s", server.name, e)
                return False
            answer = next((m for m in collected.messages if m.get("id") == rid), None)
            result = answer.get("result") if answer is not None else None
            if not isinstance(result, dict):
                return False
            self.catalog.learn(server.name, result)
            cursor = result.get("nextCursor")
            if not cursor:
                return True
        return False
