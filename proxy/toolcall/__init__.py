"""A tool call through runcap, whatever the wire it came on — what both tool gateways share:
`/tools/{name}` (plain HTTP, proxy/tools/gateway.py) and MCP `tools/call` (`/mcp/{name}`, proxy/mcp/).
The gateways differ only in how they forward the call and shape the answer; neither imports the
other, both import this.

* `call.py`     the call's record (`ToolCall`): what its span and a cancel need;
* `ledger.py`   the ledger as a tool call uses it (`ToolCallLedger`): ask, wait out a duplicate in
                flight, record the outcome, `unknown`, release;
* `outcome.py`  the outcome rule (recorded answer, `unknown`, or released) and bounded reads;
* `keys.py`     the arguments an idempotency key is derived from (`key_fields`);
* `clock.py`    a call's timeout and deadline headers, from the run's deadline;
* `span.py`     the call's `tool` span, metrics and access-log line;
* `policy.py`   the tools' rules (`PolicyCheck.admit`: allow, deny, approve, cap), checked
                before the ledger's begin;
* `approval.py` where a call that needs a person waits (`ApprovalGate`);
* `route.py`    what a tool gateway is built on (`ToolRoute`) and the tool-side pool (`ToolClient`).
"""
