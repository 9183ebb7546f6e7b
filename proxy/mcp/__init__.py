"""MCP servers through runcap (`/mcp/{name}`, DESIGN.md "MCP servers").

* `gateway.py`     the route: which server and run, which headers go on, where each message goes;
* `relay.py`       the transport: Streamable HTTP relayed both ways (POST answers as JSON or SSE,
                   resumed streams, GET streams, DELETE), bound to the run's deadline and cancel;
* `tools_call.py`  every `tools/call` a tool call of the run (counted, deadline- and cancel-bound,
                   at-most-once when side-effecting, traced), through the machinery `/tools`
                   uses too (proxy/toolcall/);
* `outcome.py`     a `tools/call` outcome as recorded and replayed;
* `listing.py`     runcap's own `tools/list`, for a call to a tool not seen listed yet;
* `catalog.py`     what runcap knows about a server's tools: annotations learnt from `tools/list`,
                   the operator's overrides, `deny`;
* `reply.py`       the agent's side of an answer: streamed as it comes, or collected for a batch;
* `wire.py`        the wire format: JSON-RPC messages, SSE events, runcap's refusals as JSON-RPC errors.
"""
