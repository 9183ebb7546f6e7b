"""Tool calls held for a person (DESIGN.md "Tool policies and approvals"): the real `ApprovalGate`
both tool gateways call when a rule's effect is `approve` (`ApprovalDesk.hold`), and the operator's
side of it (`ApprovalDesk.decide`, for `POST /approvals/{id}`: toolcall/approval_routes.py).

An approval is bound to the exact call: its key is the call's idempotency key (run, tool,
canonical arguments, operation id), so approving it releases that call and no other. The ledger
keeps it (both backends; it survives restarts and is shared by replicas), and the call, once
approved, goes through the idempotency record as every call does: sent again, it executes once.

* `wait`: the request is held until the approval is decided — woken at once by a decision made in
  this process, within `POLL_S` by one made on another replica (a read of one ledger key per held
  call) — or until it expires (`approval_ttl_s`, or the run's deadline: 504), or the run is
  cancelled (410; a cancel also denies the run's pending approvals in the ledger, which is how a
  cancel on another replica reaches a held call). `keepalive`, when the gateway can send one
  (MCP to an agent that takes SSE: the answer becomes an event stream at once, then a comment —
  and `notifications/progress` when asked for — on it), is called when the wait begins and every
  `approval_keepalive_s` while it lasts. `/tools` sends nothing while it waits: its answer is one
  HTTP response whose status is the decision's, so no byte can go first.
* `defer`: 428 `approval_required` at once, with `error.approval_id` and `Retry-After`
  (`approval_retry_after_s`); the same call sent again after approval executes (once), after a
  denial gets 403 `tool_call_denied`.

428 Precondition Required: the request is well-formed and would be executed, but a condition
outside it (a person's yes) must hold first — retrying the same request later is the client's
way forward, which a 403 would deny and a 202 would falsely say had been accepted for execution.

Every request, decision, who and why is an `approval` span (`approval.*` attributes), and the
call's own `tool` span carries `approval.id` / `approval.state`. A new pending approval is
announced to `approval_webhook_url` in the background (webhook.py's rules: bounded, retried,
never on the request path).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import orjson

from proxy.config import ApprovalSettings
from proxy.errors import DeadlineExceeded, Rejection, RunCancelled
from proxy.hashing import canonical_json
from proxy.ledger.base import (
    APPROVED,
    CANCELLED_BY,
    DENIED,
    PENDING,
    Approval,
    ApprovalRequest,
    Ledger,
    ToolCallRequest,
)
from proxy.server.metrics import Metrics
from proxy.server.outbound import run_deadline
from proxy.spans.model import Payload, Span
from proxy.spans.recorder import SpanRecorder
from proxy.toolcall.call import ToolCall
from proxy.toolcall.policy import PolicyDecision, ToolCallDenied
from proxy.toolcall.webhook import ApprovalWebhook

log = logging.getLogger("runcap.approvals")

POLL_S = 0.25  # how soon a decision made on another replica reaches a held call
# (span event, state) → the `runcap_approvals_total` event it counts as (each approval once per outcome)
_COUNTED = {
    ("requested", PENDING): "requested",
    ("decided", APPROVED): "approved",
    ("decided", DENIED): "denied",
    ("refused", "expired"): "expired",
    ("decided", "cancelled"): "cancelled",  # the cancel's denial, once, held or deferred
}


class ApprovalRequired(Rejection):
    """`defer`: the call waits for a person; send it again after `Retry-After`."""

    status = 428
    type = "approval_required"
    code = "approval_required"

    def __init__(self, approval_id: str, retry_after_s: int, message: str) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.approval_id = approval_id

    def body(self, flavor: str) -> bytes:
        body = orjson.loads(super().body(flavor))
        body["error"]["approval_id"] = self.approval_id
        return orjson.dumps(body)


class ApprovalDenied(ToolCallDenied):
    """A person said no (code `approval_denied`), or nobody said anything in time
    (`approval_expired`): the call never reaches the tool. A `ToolCallDenied`, so MCP answers it
    as the rule's denials are: a `tools/call` result with `isError: true` the model reads."""

    code = "approval_denied"


def approval_key(req: ToolCallRequest) -> str:
    """The call's identity: its idempotency key; a call without one (no side effects) by the same
    parts the derived key is made of (tool, method, path, arguments)."""
    if req.key is not None:
        return req.key
    parts = [req.tool, req.method, req.path, req.op_hash or req.args_hash]
    return "nokey:" + hashlib.sha256(canonical_json(parts)).hexdigest()[:32]


class ApprovalDesk:
    """Where tool calls wait for a person: `hold` (the gate) and `decide` (the operator)."""

    def __init__(
        self,
        ledger: Ledger,
        settings: ApprovalSettings,
        recorder: SpanRecorder,
        *,
        tenants: bool = False,
        metrics: Metrics | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.ledger = ledger
        self.settings = settings
        self.recorder = recorder
        self.tenants = tenants
        self.poll_s = poll_s
        self.keepalive_s = settings.approval_keepalive_s
        self.metrics = metrics
        failed = metrics.approval_webhook_failures.inc if metrics is not None else None
        self.webhook = ApprovalWebhook(
            settings.approval_webhook_url,
            settings.approval_webhook_timeout_s,
            on_failure=failed,
            secret=settings.approval_webhook_secret,
        )
        self._decided: dict[str, asyncio.Event] = {}  # approval id → set by a decision made here

    def tenant_of(self, run_id: str) -> str:
        """With client tokens, run ids are `{tenant}:{run id}` (proxy/caps.py); else ''."""
        return run_id.split(":", 1)[0] if self.tenants and ":" in run_id else ""

    # -- the gate ---------------------------------------------------------------------------------

    async def hold(
        self,
        call: ToolCall,
        req: ToolCallRequest,
        decision: PolicyDecision,
        keepalive: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Return once this exact call (req.run_id, its key) is approved; raise a `Rejection` when
        it is denied, expired, the run is cancelled or past its deadline, or (mode `defer`)
        `ApprovalRequired` with the approval id and Retry-After."""
        now = time.time()
        state = call.state
        if state is None and call.run is not None:
            # The run as the ledger has it — opened now if this is its first call, so its deadline
            # is fixed from here (not from each resend of a deferred call) — and refused at once
            # when it is cancelled or past its deadline.
            run = call.run
            state = await self.ledger.touch(run, now)
        deadline = run_deadline(call.run, state, now) if call.run is not None else req.caps.deadline
        ttl_end = now + self.settings.approval_ttl_s
        expires_at = ttl_end if deadline is None else min(deadline, ttl_end)
        approval, new = await self.ledger.open_approval(
            ApprovalRequest(
                req.run_id, approval_key(req), req.tool, call.args_hash or req.args_hash,
                self.tenant_of(req.run_id), now, expires_at, rule=decision.rule,
                rule_reason=decision.reason, request_hash=call.request_hash,
                step=state.steps if state is not None else 0,
            )
        )  # fmt: skip
        call.attributes["approval.id"] = approval.id
        if new:
            # The call's body goes with the request's span (shipped now, not when the call ends):
            # `runcap approvals` reads the arguments from the payload store.
            bodies, call.bodies = call.bodies, []
            self._record(approval, call, "requested", decision.mode, bodies=bodies)
            self.webhook.announce(approval)
        started = time.perf_counter()
        if approval.state == PENDING and decision.mode == "defer":
            call.attributes["approval.state"] = PENDING
            raise ApprovalRequired(
                approval.id, self.settings.approval_retry_after_s,
                f"tool {req.tool!r}: this call needs a person's approval "
                f"({decision.reason or decision.rule}); "
                f"approval {approval.id} is pending — send the same call again after it is approved "
                f"(`runcap approve {approval.id}`); it then executes once",
            )  # fmt: skip
        try:
            approval = await self._wait(approval, call, deadline, keepalive)
        except asyncio.CancelledError:
            if call.cut_reason != "cancel":
                raise  # shutting down
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            approval.state, approval.by = DENIED, CANCELLED_BY
        waited_ms = (time.perf_counter() - started) * 1000.0
        call.attributes["approval.state"] = approval.state
        if approval.state == APPROVED:
            if waited_ms > 1.0:
                self._record(approval, call, "released", decision.mode, waited_ms)
            return
        self._record(approval, call, "refused", decision.mode, waited_ms)
        raise self._refusal(approval, req, deadline)

    async def _wait(
        self,
        approval: Approval,
        call: ToolCall,
        deadline: float | None,
        keepalive: Callable[[], Awaitable[None]] | None,
    ) -> Approval:
        """Until `approval` is no longer pending: woken by a decision here, polled for one made
        elsewhere, bounded by its expiry (which is at the latest the run's deadline)."""
        event = self._decided.setdefault(approval.id, asyncio.Event())
        next_beat = time.monotonic() + self.keepalive_s
        try:
            if keepalive is not None and approval.state == PENDING:
                await keepalive()  # the wait begins: the agent hears of it now, not a beat later
                next_beat = time.monotonic() + self.keepalive_s
            while approval.state == PENDING:
                now = time.time()
                if deadline is not None and now >= deadline:
                    break  # the run's deadline ends the wait whatever the approval's expiry says
                pause = self.poll_s
                for end in (approval.expires_at, deadline):
                    if end is not None:
                        pause = min(pause, max(0.0, end - now) + 0.001)
                if keepalive is not None:
                    pause = min(pause, max(0.0, next_beat - time.monotonic()))
                try:
                    await asyncio.wait_for(event.wait(), timeout=pause)
                except TimeoutError:
                    pass
                if keepalive is not None and time.monotonic() >= next_beat:
                    await keepalive()
                    next_beat = time.monotonic() + self.keepalive_s
                seen = await self.ledger.get_approval(approval.id, time.time())
                if seen is None:  # purged with the retention: nobody decided
                    approval.state = "expired"
                    break
                approval = seen
        finally:
            if self._decided.get(approval.id) is event and not event.is_set():
                del self._decided[approval.id]
        return approval

    def _refusal(self, approval: Approval, req: ToolCallRequest, deadline: float | None) -> Rejection:
        if approval.state == DENIED and approval.by == CANCELLED_BY:
            return RunCancelled(
                f"run {req.run_id} was cancelled while its call to tool {req.tool!r} waited for a person's "
                f"approval ({approval.id}); the call was not executed. Start a new run to continue"
            )
        if approval.state == DENIED:
            by = f" by {approval.by}" if approval.by else ""
            why = approval.reason or "no reason given"
            rule = f" (rule {approval.rule!r}: {approval.rule_reason})" if approval.rule_reason else ""
            return ApprovalDenied(
                f"tool {req.tool!r}: this call needed a person's approval{rule}; approval {approval.id} "
                f"was denied{by}: {why}; "
                "the call was not executed and will not be — do something else",
                param=approval.rule or None,
            )
        if deadline is not None and time.time() >= deadline - 0.001:
            return DeadlineExceeded(
                f"run {req.run_id} reached its deadline while its call to tool {req.tool!r} waited for a "
                f"person's approval ({approval.id}); the call was not executed. End the run."
            )
        return ApprovalDenied(
            f"tool {req.tool!r}: approval {approval.id} expired (approvals.approval_ttl_s = "
            f"{self.settings.approval_ttl_s:g} s) before anyone decided; the call was not executed. "
            "Send it again to ask again",
            code="approval_expired",
            param="approval_ttl_s",
        )

    # -- the operator ------------------------------------------------------------------------------

    async def decide(self, approval_id: str, approve: bool, by: str, reason: str) -> Approval | None:
        """Record a person's decision (`ApprovalNotPending` when it was decided or expired), wake
        the call held here, and put it on the record."""
        approval = await self.ledger.decide_approval(approval_id, approve, by, reason, time.time())
        if approval is None:
            return None
        self._wake(approval_id)
        self._record(approval, None, "decided", "")
        return approval

    async def run_cancelled(self, run_id: str) -> None:
        """The run was cancelled (`POST /runs/{id}/cancel`), and its subtree with it: the pending
        approvals of the run and of every descendant are denied (by `runcap: run cancelled`), each
        denial an `approval` span — a deferred one as much as one a call waits on — and a call
        held here woken. The descendants are found from the pending approvals (people-scale, and
        read only on a cancel), each one's run read for its ancestors: a tree's child index is
        not needed, nor bounded by how many children `get_run` lists."""
        now = time.time()
        runs = [run_id]
        checked: set[str] = {run_id}
        for pending in await self.ledger.list_approvals(now, state=PENDING, limit=100_000):
            if pending.run_id in checked:
                continue
            checked.add(pending.run_id)
            state = await self.ledger.get_run(pending.run_id)
            if state is not None and run_id in state.ancestors:
                runs.append(pending.run_id)
        for run in runs:
            for approval in await self.ledger.deny_pending_approvals(run, now):
                self._wake(approval.id)
                self._record(approval, None, "decided", "")

    def _wake(self, approval_id: str) -> None:
        event = self._decided.pop(approval_id, None)
        if event is not None:
            event.set()

    # -- the record --------------------------------------------------------------------------------

    def _record(
        self, approval: Approval, call: ToolCall | None, event: str, mode: str,
        waited_ms: float | None = None, bodies: list[Payload] | None = None,
    ) -> None:  # fmt: skip
        """An `approval` span: the request (`requested`), a person's decision (`decided`, its
        duration the time from request to decision), the end of a held call's wait (`released` /
        `refused`, its duration the wait)."""
        if waited_ms is None:
            decided = approval.decided_at if event == "decided" and approval.decided_at is not None else None
            waited_ms = 0.0 if decided is None else max(0.0, decided - approval.requested_at) * 1000.0
        attributes = {
            "approval.id": approval.id,
            "approval.state": approval.state,
            "approval.event": event,
            "approval.by": approval.by,
            "approval.reason": approval.reason,
            "approval.rule": approval.rule,
        }
        if mode:
            attributes["approval.mode"] = mode
        if self.metrics is not None:
            counted = _COUNTED.get((event, "cancelled" if approval.by == CANCELLED_BY else approval.state))
            if counted is not None:
                self.metrics.approvals.labels(counted).inc()
        if approval.tenant:
            attributes["approval.tenant"] = approval.tenant
        try:
            self.recorder.step(
                [
                    Span(
                        run_id=approval.run_id,
                        kind="approval",
                        step=approval.step,
                        started_at=datetime.fromtimestamp(approval.requested_at, UTC),
                        duration_ms=waited_ms,
                        task=call.run.task if call is not None and call.run is not None else "",
                        endpoint="approval",
                        outcome="ok" if approval.state in (APPROVED, PENDING) else "error",
                        error="" if approval.state in (APPROVED, PENDING) else approval.reason,
                        tool_name=approval.tool,
                        args_hash=approval.args_hash,
                        idempotency_key=approval.key,
                        request_hash=approval.request_hash,
                        attributes=attributes,
                    )
                ],
                None,
                bodies or (),
            )
        except Exception:
            log.exception("could not record the approval span of %s", approval.id)

    async def close(self) -> None:
        await self.webhook.close()
