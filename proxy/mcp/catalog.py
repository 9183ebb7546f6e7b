"""What runcap knows about each MCP server's tools, and what follows for a call.

Side effects (DESIGN.md "MCP servers"): the operator's `side_effects` for the tool when set;
else the tool's annotations from the server's `tools/list` — side-effecting unless
`readOnlyHint: true`, the spec's default for an absent hint; a tool runcap has not seen listed is
side-effecting too (the gateway first lists the server's tools itself, so another replica's or an
earlier process's listing is not needed).

`deny` hides tools: removed from every `tools/list` answer, refused when called anyway.
Annotations are learnt per configured server (not per session): they describe the server's tools.
"""

from __future__ import annotations

from typing import Any

from proxy.config import MCPServerConfig


class ToolCatalog:
    def __init__(self) -> None:
        # server name → tool name → readOnlyHint is true
        self._read_only: dict[str, dict[str, bool]] = {}

    def learn(self, server: str, result: Any) -> None:
        """Read the annotations of a `tools/list` result (one page of it)."""
        tools = result.get("tools") if isinstance(result, dict) else None
        if not isinstance(tools, list):
            return
        known = self._read_only.setdefault(server, {})
        for tool in tools:
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                continue
            annotations = tool.get("annotations")
            hint = annotations.get("readOnlyHint") if isinstance(annotations, dict) else None
            known[tool["name"]] = hint is True

    def knows(self, server: str, tool: str) -> bool:
        return tool in self._read_only.get(server, {})

    def side_effects(self, server: MCPServerConfig, tool: str) -> bool:
        override = server.tools.get(tool)
        if override is not None and override.side_effects is not None:
            return override.side_effects
        return not self._read_only.get(server.name, {}).get(tool, False)

    def needs_listing(self, server: MCPServerConfig, tool: str) -> bool:
        """Whether the call's side effects depend on a listing runcap has not seen."""
        override = server.tools.get(tool)
        if override is not None and override.side_effects is not None:
            return False
        return not self.knows(server.name, tool)

    @staticmethod
    def without_denied(server: MCPServerConfig, result: Any) -> Any | None:
        """The `tools/list` result minus the denied tools; None when nothing was removed."""
        if not server.deny or not isinstance(result, dict) or not isinstance(result.get("tools"), list):
            return None
        kept = [t for t in result["tools"] if not (isinstance(t, dict) and t.get("name") in server.deny)]
        if len(kept) == len(result["tools"]):
            return None
        return {**result, "tools": kept}
