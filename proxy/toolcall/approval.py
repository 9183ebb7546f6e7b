"""Where a tool call that a rule sends to a person waits (`effect = "approve"`): the `ApprovalGate`
both tool gateways hold such a call at (through policy.py's `PolicyCheck`), before the ledger's
begin — so nothing of a call that is never approved reaches the tool or the idempotency records.

This module is the protocol only. The gate runcap is wired with when no approval store is
configured is `RefusingGate`: every call that needs approval is refused with a named 403
`approval_unavailable`, never let through.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from proxy.errors import Rejection
from proxy.ledger.base import ToolCallRequest
from proxy.toolcall.call import ToolCall
from proxy.toolcall.policy import PolicyDecision


class ApprovalGate(Protocol):
    async def hold(self, call: ToolCall, req: ToolCallRequest, decision: PolicyDecision,
                   keepalive: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        """Return once this exact call (req.run_id, req.key) is approved; raise a Rejection when
        it is denied, expired, the run is cancelled or past its deadline, or (mode defer)
        `approval_required` with the approval id and Retry-After."""


class ApprovalUnavailable(Rejection):
    """A rule asks for a person's approval and this runcap has no approval store to ask in."""

    status = 403
    type = "approval_unavailable"
    code = "approval_unavailable"


class RefusingGate:
    """No approval store configured: a call that needs approval is refused, never executed."""

    async def hold(self, call: ToolCall, req: ToolCallRequest, decision: PolicyDecision,
                   keepalive: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        why = f": {decision.reason}" if decision.reason else ""
        raise ApprovalUnavailable(
            f"tool {call.tool!r}: rule {decision.rule!r} needs a person's approval{why} — and no approval "
            "store is configured on this runcap, so the call was refused and not executed"
        )
