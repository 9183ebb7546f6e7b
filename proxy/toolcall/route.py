"""What a tool gateway — `/tools/{name}` (proxy/tools/gateway.py) or `/mcp/{name}` (proxy/mcp/) — is
built on (`ToolRoute`: the ledger's side of a call, its policy check and approval gate), and the
connection pool to tool services and MCP servers they share (`ToolClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from proxy.config import Config
from proxy.errors import RunCancelled
from proxy.ledger.base import Ledger
from proxy.server.auth import ClientAuth
from proxy.server.flow import Cuttable, Flights
from proxy.server.metrics import Metrics
from proxy.server.outbound import OutboundClient
from proxy.spans.recorder import NullRecorder, SpanRecorder
from proxy.toolcall.approval import ApprovalGate, RefusingGate
from proxy.toolcall.ledger import ToolCallLedger
from proxy.toolcall.policy import PolicyCheck


class ToolClient(OutboundClient):
    """The connection pool to tool services and MCP servers, shared by `/tools` and `/mcp`: those
    are other hosts than the model providers, so a pool of their own (sending as every outbound
    call does: server/outbound.py). Closed at clean-up after the gateways' own (an MCP gateway
    still sends `notifications/cancelled` through it), so `add_to` comes after theirs."""

    def __init__(self) -> None:
        super().__init__(keepalive_timeout_s=30, connect_timeout_s=10)


@dataclass(eq=False)
class ToolRoute:
    """What `/tools/{name}` (proxy/tools/gateway.py) and `/mcp/{name}` (proxy/mcp/) are built on: the
    ledger's side of a tool call, the shared tool-side pool, the span recorder, the client
    tokens, and the in-flight calls a cancel can cut. A gateway that builds more parts does it
    in `__post_init__` (after this one's)."""

    config: Config
    ledger: Ledger
    flights: Flights
    metrics: Metrics
    client: ToolClient
    recorder: SpanRecorder = field(default_factory=NullRecorder)
    clients: ClientAuth = field(default_factory=lambda: ClientAuth({}))
    # Where a call a rule sends to a person waits (toolcall/approval.py); without an approval
    # store, such a call is refused (403 approval_unavailable).
    gate: ApprovalGate = field(default_factory=RefusingGate)
    calls: ToolCallLedger = field(init=False)
    policy: PolicyCheck = field(init=False)  # the tools' rules, checked before the ledger's begin

    def __post_init__(self) -> None:
        self.calls = ToolCallLedger(self.ledger, self.metrics)
        self.policy = PolicyCheck(self.config, self.ledger, self.metrics, self.gate, self.clients.enabled)

    @contextlib.asynccontextmanager
    async def in_flight(self, run_id: str, call: Cuttable, what: str) -> AsyncIterator[None]:
        """`call` as one of the run's in-flight calls: a cancel of the run cuts it, also while it
        waits for a duplicate in flight — then `RunCancelled` naming `what` (the tool)."""
        task = asyncio.current_task()
        assert task is not None
        self.flights.add(run_id, task, call)  # a cancel also ends a wait for a duplicate
        try:
            yield
        except asyncio.CancelledError:
            if call.cut_reason != "cancel":
                raise  # shutting down
            task.uncancel()
            raise RunCancelled(
                f"run {run_id} was cancelled while its call to {what} waited for a duplicate in flight; "
                "start a new run to continue"
            ) from None
        finally:
            self.flights.remove(run_id, task)
