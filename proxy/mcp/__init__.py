"""MCP servers through runcap (`/mcp/{name}`, DESIGN.md "MCP servers").

* `wire.py`     the wire format: JSON-RPC messages, SSE events, runcap's refusals as JSON-RPC errors;
* `catalog.py`  what runcap knows about a server's tools: annotations learnt from `tools/list`,
                the operator's overrides, `deny`;
* `reply.py`    the agent's side of an answer: streamed as it comes, or collected for a batch;
* `gateway.py`  the route: Streamable HTTP relayed both ways, every `tools/call` a tool call of
                the run (counted, deadline- and cancel-bound, at-most-once when side-effecting,
                traced), through the same ledger machinery as `/tools` (server/toolcalls.py).
"""
