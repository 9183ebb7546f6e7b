"""The ledger as the server uses it: every operation bounded, every backend failure one rejection.

`GuardedLedger` wraps a backend (SQLite, Redis) and keeps its interface:

* every operation has a timeout (`ledger_timeout_s`, default 2 s; readiness a shorter one), so a
  frozen Redis or a locked file costs a call that long at most, never the socket's own timeouts
  (SQLite bounds its own waits with its busy timeout, set to the same: `bounds_its_own_wait`);
* a failure that means the backend is unavailable — connection refused or lost, a timeout, a full
  disk, an I/O error, Redis refusing writes (the backend's `failure_code` says which) — becomes
  one `LedgerUnavailable` (503, `ledger_unavailable`, naming the backend, with a retry hint); any
  other error (a bug) passes through unchanged. The agent never gets a bare 500 for an outage,
  and a call the ledger could not meter is never forwarded;
* a request waits for an unavailable ledger once: after a failure, the same task's next
  operations within the timeout fail at once (e.g. the run's state fetched for the refused call's
  span), so an answer comes within one timeout;
* writes that record what already happened are never dropped (`pending.py`): a tool call's outcome
  the backend could not take is kept and retried in the background (the tool ran: the caller gets
  its answer), as are the releases of writes left in doubt; settlements are handed over by the
  budget step (`settle_later`) after settling the current call first.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from proxy.caps import RunCaps
from proxy.errors import LedgerUnavailable, Rejection
from proxy.ledger.base import (
    Approval,
    ApprovalRequest,
    CapsChange,
    IdempotencyRecord,
    Ledger,
    RecoveredReservation,
    Reservation,
    RunState,
    Settlement,
    StepRequest,
    ToolCallRequest,
    ToolCallStart,
    Verdict,
)
from proxy.ledger.pending import (
    PendingRelease,
    PendingSettlement,
    PendingToolForget,
    PendingToolOutcome,
    PendingToolRelease,
    PendingToolUnknown,
    PendingWrites,
)

log = logging.getLogger("runcap.ledger")

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 2.0
RETRY_AFTER_S = 1
# Readiness answers fast: a probe that waits as long as a request would is no probe.
READY_TIMEOUT_S = 1.0

_WHY = {
    "ledger_timeout": "did not answer within {timeout:g} s",
    "ledger_unreachable": "is unreachable",
    "ledger_disk_full": "cannot write: its disk is full",
    "ledger_replicas_behind": "did not replicate the write to `redis_wait_replicas` replicas in time",
    "ledger_error": "failed",
}


class GuardedLedger(Ledger):
    def __init__(self, backend: Ledger, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.backend = backend
        self.name = backend.name
        self.timeout_s = timeout_s
        self.ready_timeout_s = min(READY_TIMEOUT_S, timeout_s)
        # Operations that read or sweep a whole store (recovery, listings) get more time.
        self.slow_timeout_s = max(30.0, 10 * timeout_s)
        self.pending = PendingWrites(backend, timeout_s, self._failure_code)
        self.unavailable: Counter[tuple[str, str]] = Counter()  # (operation, code) → failures
        self.settle_failures = 0  # settlements the ledger did not take (first tries and retries)
        # Per request task: when its last operation failed, and how (see the module docstring).
        self._failed_in: weakref.WeakKeyDictionary[asyncio.Task[object], tuple[float, LedgerUnavailable]]
        self._failed_in = weakref.WeakKeyDictionary()
        self._last_failure = -float("inf")  # monotonic time of the newest entry in _failed_in

    @property
    def location(self) -> str:
        return self.backend.location

    # -- the guard ------------------------------------------------------------------------------

    def _failure_code(self, exc: BaseException) -> str | None:
        if isinstance(exc, TimeoutError):  # ours (asyncio.timeout) or a socket's
            return "ledger_timeout"
        return self.backend.failure_code(exc)

    def rejection(self, code: str, exc: BaseException | None, timeout_s: float) -> LedgerUnavailable:
        where = f"{self.name} at {self.location}" if self.location else self.name
        why = _WHY.get(code, _WHY["ledger_error"]).format(timeout=timeout_s)
        detail = ""
        if exc is not None and str(exc) and code != "ledger_timeout":
            detail = f" ({type(exc).__name__}: {exc})"
        return LedgerUnavailable(
            f"the run ledger ({where}) {why}{detail}. runcap cannot check or record budgets without "
            f"it, so nothing was forwarded; retry in {RETRY_AFTER_S} s",
            backend=self.name,
            code=code,
            retry_after_s=RETRY_AFTER_S,
        )

    async def _guard(
        self,
        op: str,
        call: Callable[[], Awaitable[T]],
        *,
        timeout_s: float | None = None,
        remember: bool = True,
    ) -> T:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        # (no lookup unless the ledger failed within the timeout: the common case costs a clock read)
        if remember and time.monotonic() - self._last_failure < self.timeout_s:
            seen = self._failed_in.get(asyncio.current_task())  # type: ignore[arg-type]
            if seen is not None and time.monotonic() - seen[0] < self.timeout_s:
                failed = seen[1]
                raise LedgerUnavailable(
                    failed.message,
                    backend=failed.backend,
                    code=failed.code or "ledger_error",
                    retry_after_s=RETRY_AFTER_S,
                )
        try:
            if self.backend.bounds_its_own_wait:
                return await call()
            async with asyncio.timeout(timeout):
                return await call()
        except Rejection:
            raise
        except Exception as e:
            self._take_in_doubt()
            code = self._failure_code(e)
            if code is None:
                raise
            rej = self.rejection(code, e, timeout)
            self.unavailable[(op, code)] += 1
            if op == "settle":
                self.settle_failures += 1
            task = asyncio.current_task() if remember else None
            if task is not None:
                self._last_failure = time.monotonic()
                self._failed_in[task] = (self._last_failure, rej)
            raise rej from e
        except BaseException:
            self._take_in_doubt()
            raise

    def _take_in_doubt(self) -> None:
        """Writes the backend sent without learning their outcome, for calls now refused: each
        released in the background once the backend answers again."""
        for item in self.backend.drain_in_doubt():
            if isinstance(item, Reservation):
                self.pending.add(PendingRelease(item))
            else:
                self.pending.add(PendingToolRelease(item))

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start retrying pending writes in the background (on the server's event loop)."""
        self.pending.start()

    async def close(self) -> None:
        await self.pending.aclose()
        try:
            async with asyncio.timeout(self.slow_timeout_s):
                await self.backend.close()
        except Exception as e:
            log.warning("closing the %s ledger: %s: %s", self.name, type(e).__name__, e)

    async def ping(self) -> None:
        await self._guard("ping", self.backend.ping, timeout_s=self.ready_timeout_s, remember=False)

    async def recover(self) -> list[RecoveredReservation]:
        return await self._guard(
            "recover", self.backend.recover, timeout_s=self.slow_timeout_s, remember=False
        )

    def cancel_events(self) -> AsyncIterator[str] | None:
        return self.backend.cancel_events()

    # -- settlements ----------------------------------------------------------------------------

    def settle_later(self, reservation: Reservation, settlement: Settlement, now: float) -> None:
        """Hand over a settlement the ledger did not take: retried in the background."""
        self.pending.add(PendingSettlement(reservation, settlement, now))

    # -- the operations -------------------------------------------------------------------------

    async def begin_step(self, req: StepRequest) -> Reservation:
        return await self._guard("begin_step", lambda: self.backend.begin_step(req))

    async def settle(self, reservation: Reservation, settlement: Settlement, now: float) -> RunState:
        return await self._guard("settle", lambda: self.backend.settle(reservation, settlement, now))

    async def touch_run(
        self, run_id: str, task: str, caps: RunCaps, now: float, parent: str = ""
    ) -> RunState:
        return await self._guard("touch_run", lambda: self.backend.touch_run(run_id, task, caps, now, parent))

    async def get_run(self, run_id: str) -> RunState | None:
        return await self._guard("get_run", lambda: self.backend.get_run(run_id))

    async def cancel(self, run_id: str, now: float) -> RunState | None:
        return await self._guard("cancel", lambda: self.backend.cancel(run_id, now))

    async def set_caps(self, run_id: str, change: CapsChange, now: float) -> tuple[RunCaps, RunState] | None:
        return await self._guard("set_caps", lambda: self.backend.set_caps(run_id, change, now))

    async def set_status(self, run_id: str, status: str, now: float) -> None:
        await self._guard("set_status", lambda: self.backend.set_status(run_id, status, now))

    async def begin_tool_call(self, req: ToolCallRequest) -> ToolCallStart:
        return await self._guard("begin_tool_call", lambda: self.backend.begin_tool_call(req))

    async def complete_tool_call(
        self, run_id: str, key: str, status: int, headers: dict[str, str], body: bytes, now: float
    ) -> None:
        # The tool ran: its outcome is kept until the ledger takes it, and the caller gets its
        # answer (a repeat meanwhile waits for the record, which is in flight in a live process).
        try:
            await self._guard(
                "complete_tool_call",
                lambda: self.backend.complete_tool_call(run_id, key, status, headers, body, now),
                remember=False,
            )
        except LedgerUnavailable as e:
            log.warning("run %s: outcome of tool call %s kept for a later write: %s", run_id, key, e.message)
            self.pending.add(PendingToolOutcome(run_id, key, status, headers, body, now))

    async def mark_unknown(self, run_id: str, key: str, now: float, reason: str = "") -> None:
        try:
            await self._guard(
                "mark_unknown", lambda: self.backend.mark_unknown(run_id, key, now, reason), remember=False
            )
        except LedgerUnavailable as e:
            log.warning(
                "run %s: unknown outcome of tool call %s kept for a later write: %s", run_id, key, e.message
            )
            self.pending.add(PendingToolUnknown(run_id, key, now, reason))

    async def get_tool_call(self, run_id: str, key: str) -> IdempotencyRecord | None:
        return await self._guard("get_tool_call", lambda: self.backend.get_tool_call(run_id, key))

    async def list_tool_calls(
        self, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[IdempotencyRecord]:
        return await self._guard(
            "list_tool_calls",
            lambda: self.backend.list_tool_calls(state, run_id, limit),
            timeout_s=self.slow_timeout_s,
        )

    async def apply_verdict(self, run_id: str, key: str, verdict: Verdict) -> IdempotencyRecord | None:
        try:
            return await self._guard(
                "resolve_tool_call",
                lambda: self.backend.apply_verdict(run_id, key, verdict),
                remember=not verdict.force,
            )
        except LedgerUnavailable as e:
            if not (verdict.force and not verdict.done):
                raise  # an operator's verdict: they retry it
            # The tool path releasing its own intent (the tool was never reached): kept for a
            # later write like an outcome, so the caller gets its 502 rather than a 503.
            log.warning("run %s: release of tool call %s kept for a later write: %s", run_id, key, e.message)
            self.pending.add(PendingToolForget(run_id, key, verdict.now))
            return None

    async def release_reservation(self, reservation: Reservation) -> None:
        await self._guard("release", lambda: self.backend.release_reservation(reservation), remember=False)

    async def release_tool_call(self, record: IdempotencyRecord) -> None:
        await self._guard("release", lambda: self.backend.release_tool_call(record), remember=False)

    async def claim_objects(self, account: str, object_ids: Sequence[str], tenant: str, now: float) -> None:
        await self._guard(
            "claim_objects", lambda: self.backend.claim_objects(account, object_ids, tenant, now)
        )

    async def object_owners(self, account: str, object_ids: Sequence[str]) -> dict[str, str]:
        return await self._guard("object_owners", lambda: self.backend.object_owners(account, object_ids))

    async def open_approval(self, req: ApprovalRequest) -> tuple[Approval, bool]:
        return await self._guard("open_approval", lambda: self.backend.open_approval(req))

    async def get_approval(self, approval_id: str, now: float) -> Approval | None:
        return await self._guard("get_approval", lambda: self.backend.get_approval(approval_id, now))

    async def list_approvals(
        self, now: float, *, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[Approval]:
        return await self._guard(
            "list_approvals",
            lambda: self.backend.list_approvals(now, state=state, run_id=run_id, limit=limit),
            timeout_s=self.slow_timeout_s,
        )

    async def decide_approval(
        self, approval_id: str, approve: bool, by: str, reason: str, now: float
    ) -> Approval | None:
        return await self._guard(
            "decide_approval", lambda: self.backend.decide_approval(approval_id, approve, by, reason, now)
        )

    async def deny_pending_approvals(self, run_id: str, now: float) -> list[Approval]:
        return await self._guard(
            "deny_pending_approvals", lambda: self.backend.deny_pending_approvals(run_id, now)
        )


def guarded(ledger: Ledger, timeout_s: float = DEFAULT_TIMEOUT_S) -> GuardedLedger:
    """`ledger` guarded (itself when it already is)."""
    return ledger if isinstance(ledger, GuardedLedger) else GuardedLedger(ledger, timeout_s=timeout_s)
