"""A CRM as an MCP server: the official SDK's `MCPServer` over Streamable HTTP, with one tool that
moves money (`refund`, no annotations: side-effecting by the spec's defaults) and one that only
reads (`order_status`, `readOnlyHint: true`).

    .venv/bin/python -m examples.mcp.server --port 9100
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

crm = MCPServer("example-crm", instructions="Orders and refunds.", log_level="WARNING")
refunds: list[dict[str, object]] = []


@crm.tool()
def refund(order_id: str, amount: float, reason: str = "") -> dict[str, object]:
    """Refund `amount` on an order. Money moves: call it once per refund."""
    refunds.append({"order_id": order_id, "amount": amount})
    print(f"refund #{len(refunds)}: {amount} on {order_id} ({reason})", flush=True)
    return {"refund_id": f"rf-{len(refunds)}", "order_id": order_id, "amount": amount}


@crm.tool(annotations=ToolAnnotations(read_only_hint=True))
def order_status(order_id: str) -> dict[str, str]:
    """Where an order is."""
    return {"order_id": order_id, "status": "delivered, damaged"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=9100)
    args = ap.parse_args()
    import uvicorn

    uvicorn.run(crm.streamable_http_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
