"""`/tools/{name}`: the tool gateway — an agent's HTTP tool calls through runcap, at most once.

`gateway.py` is the route; what it shares with the MCP gateway (the idempotency record, the
outcome rule, the span of a call, the call's clock) is `proxy/toolcall/`, and neither gateway
imports the other (the import contract in pyproject.toml says so).
"""
