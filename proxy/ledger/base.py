"""The run ledger: budgets, reservations and cancel flags — the control the hot path waits on.

Every backend (SQLite embedded, Redis shared) stores the same `RunState` and runs the same
decision functions below inside one atomic transaction: a backend only has to load a run, apply
`decide_step` / `apply_settlement` and write the result back atomically. That keeps the rules in
one place and makes the backends interchangeable (they pass one contract test suite).

Rules (DESIGN.md "Enforcement rules"):
* caps are fixed when a run is first seen; later requests may lower them, never raise them;
* a model call reserves its worst case (input bound + output limit) before it is forwarded, and is
  refused only when even the input plus a useful output cannot fit; otherwise its output limit is
  clamped to what fits, so concurrent calls cannot jointly overshoot;
* the next-to-last allowed call is answer-only (tools stripped); a call past it is refused;
* a model call that got no answer (connect error, 408/409/429/5xx, cut before any output:
  `Settlement.no_answer`) gives its step back — it is not a step, and never the answer-only final
  step; a run's consecutive upstream failures (`Settlement.upstream_failed`) are counted, and its
  next call is refused once they reach `StepRequest.max_upstream_failures` (402
  `max_upstream_failures`); an answered call sets the count back to 0;
* settlement replaces the reservation by the actual usage — also a reservation a sweep already
  charged at its reserved amount because its owner looked dead (`apply_unrecovery`): a settlement
  always wins over a sweep's estimate, and nothing is ever charged twice;
* a `/tools` call is counted (and refused past the tool-call cap) atomically with its idempotency
  record: a new side-effecting call is recorded `in_flight` before it is forwarded; a completed one
  is replayed; one in flight is waited for while its owner lives and is `unknown` (409 until
  reconciled) once it is dead or the call was cut (`decide_tool_call`);
* an idempotency record is bound to its operation: a key reused for another operation is refused
  (422), whatever the record's state (`same_operation`);
* under `X-Run-Max-Repeats`, settlement counts the tool calls the answer requested and the request
  body it answered (`RunState.repeats`, proxy/ledger/repeats.py): a run whose model repeats a call
  or cycles gets an answer-only next step (`final_reason = "max_repeats"`), and a request body
  answered that many times already is refused (402 `max_repeats`).
"""

from __future__ import annotations

import abc
import errno
import itertools
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from decimal import Decimal
from typing import Any

from proxy.caps import OPERATOR_WHOLE_CAPS, RunCaps, RunRequest, stored_caps
from proxy.errors import (
    BudgetExceeded,
    DeadlineExceeded,
    IdempotencyKeyReused,
    InvalidRequest,
    OutcomeUnknown,
    Rejection,
    RunCancelled,
)
from proxy.ledger.repeats import Repeats, note_calls, note_request, request_copies
from proxy.money import format_usd, tokens_affordable, tokens_cost_nanos

# Reservation ids: unique across processes sharing a ledger, without a syscall per call.
_RESERVATION_PREFIX = secrets.token_hex(6)
_RESERVATION_SEQ = itertools.count(1)


def _new_prefix_after_fork() -> None:
    global _RESERVATION_PREFIX
    _RESERVATION_PREFIX = secrets.token_hex(6)


os.register_at_fork(after_in_child=_new_prefix_after_fork)

TERMINAL_STATUSES = frozenset(
    {"budget_exceeded", "deadline_exceeded", "steps_exceeded", "tool_calls_exceeded", "cancelled",
     "repeats_exceeded"}
)  # fmt: skip


@dataclass(slots=True)
class RunState:
    run_id: str
    task: str = ""
    status: str = "active"
    started_at: float = 0.0
    updated_at: float = 0.0
    caps: RunCaps = field(default_factory=RunCaps)
    spent_usd_nanos: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    tool_calls_requested: int = 0
    tool_calls_executed: int = 0
    reserved_usd_nanos: int = 0
    reserved_tokens: int = 0
    # The cap that forced an answer-only step; the run's next model call is refused with it.
    final_reason: str | None = None
    cancelled: bool = False
    # Caps an operator set (`POST /runs/{id}/caps`), comma-separated RunCaps fields: headers no
    # longer change them — an agent resending its original headers must not undo a top-up.
    operator_caps: str = ""
    # Input tokens of the run's first answered model step: the baseline of X-Run-Context-Growth
    # (proxy/server/steps/context.py), kept here so it survives restarts and is shared by replicas.
    context_baseline: int = 0
    # Model calls in a row that failed upstream (no answer); 0 after an answered call.
    upstream_failures: int = 0
    # Run trees (issue 22): the run that spawned this one ("" for a root) and the tree's root
    # ("" for a root: the run is its own root; see `root`).
    parent_run_id: str = ""
    root_run_id: str = ""
    # What the run repeated, under `X-Run-Max-Repeats` (empty without the cap): bounded windows.
    repeats: Repeats = field(default_factory=Repeats)
    # The run's ancestors, parent first and root last (() for a root): fixed when the run is
    # created, so one read finds every state a call of this run checks and updates.
    ancestors: tuple[str, ...] = ()
    children: int = 0  # direct children started
    # Their ids, the first CHILD_IDS_KEPT of them, as `get_run` reads them (GET /runs); () elsewhere.
    child_ids: tuple[str, ...] = ()
    # What the run's descendants spent, hold reserved and counted — kept by every call of a
    # descendant, atomically with it (`propagate`): a run's dollar and token caps, and its
    # `max_tree_steps` / `max_tree_tool_calls`, bound its own use plus these.
    sub_spent_usd_nanos: int = 0
    sub_reserved_usd_nanos: int = 0
    sub_tokens: int = 0
    sub_reserved_tokens: int = 0
    sub_steps: int = 0
    sub_tool_calls: int = 0
    # The earliest deadline of the run's ancestors, as the call that loaded them saw it (None: none,
    # or not loaded) — never stored: a child stores only its own deadline, so an operator's
    # extension of an ancestor reaches its descendants at their next call (`check_tree_live`).
    tree_deadline: float | None = None

    @property
    def root(self) -> str:
        return self.root_run_id or self.run_id

    @property
    def deadline(self) -> float | None:
        """When the run's calls are cut: the earlier of its own deadline and its ancestors'."""
        own, tree = self.caps.deadline, self.tree_deadline
        return tree if own is None else own if tree is None else min(own, tree)

    @property
    def deadline_status(self) -> str:
        """The status a call cut by `deadline` leaves the run in: an ancestor's deadline (earlier
        than its own) leaves it `ancestor_deadline_exceeded`, which an extension of that ancestor
        undoes; its own, `deadline_exceeded`."""
        own, tree = self.caps.deadline, self.tree_deadline
        return ANCESTOR_DEADLINE if tree is not None and (own is None or tree < own) else "deadline_exceeded"

    @property
    def tree_usd_nanos(self) -> int:
        """Spent and reserved by the run and its descendants."""
        own = self.spent_usd_nanos + self.reserved_usd_nanos
        return own + self.sub_spent_usd_nanos + self.sub_reserved_usd_nanos

    @property
    def tree_tokens(self) -> int:
        return self.tokens_used + self.reserved_tokens + self.sub_tokens + self.sub_reserved_tokens

    @property
    def tool_calls(self) -> int:
        # An agent that both lets the model request a call and executes it through /tools
        # must not be counted twice.
        return max(self.tool_calls_requested, self.tool_calls_executed)

    @property
    def tokens_used(self) -> int:
        return self.input_tokens + self.output_tokens

    def remaining(self, now: float) -> dict[str, int | float | None]:
        """What is left of each cap, counting reservations as spent (None: no cap)."""
        c = self.caps
        return {
            "usd_nanos": None
            if c.max_usd_nanos is None
            else max(0, c.max_usd_nanos - self.tree_usd_nanos),
            "tokens": None
            if c.max_tokens is None
            else max(0, c.max_tokens - self.tree_tokens),
            "steps": None if c.max_steps is None else max(0, c.max_steps - self.steps),
            "tool_calls": None if c.max_tool_calls is None else max(0, c.max_tool_calls - self.tool_calls),
            "ms": None if (deadline := self.deadline) is None else max(0.0, (deadline - now) * 1000.0),
        }


def _positional(name: str, params: str, args: Callable[[str], str]) -> Callable[..., RunState]:
    """A function `name(params)` returning `RunState(...)` with each field passed positionally as
    `args(field)`, built once from the dataclass's fields: states are copied and built on every
    call, and `dataclasses.replace` or keywords cost several times more for a class this wide."""
    passed = ", ".join(args(f.name) for f in fields(RunState))
    source = f"def {name}({params}):\n    return RunState({passed})\n"
    namespace: dict[str, Any] = {"RunState": RunState, "RunCaps": RunCaps, "Repeats": Repeats}
    exec(source, namespace)  # the text is made of the dataclass's own field names
    built: Callable[..., RunState] = namespace[name]
    return built


# A shallow copy of a state (a reservation's snapshot, a tool call's answer).
copy_state: Callable[[RunState], RunState] = _positional("copy_state", "s", lambda n: f"s.{n}")


@dataclass(frozen=True, slots=True)
class StepRequest:
    """What a model call needs from the ledger before it may be forwarded."""

    run_id: str
    task: str
    caps: RunCaps
    now: float
    model: str
    input_tokens_bound: int
    client_output_limit: int | None
    model_output_bound: int  # the model's maximum output tokens (or the configured default)
    min_output_tokens: int
    # Worst-case USD per million tokens; None when the model has no known price.
    input_usd_per_mtok: Decimal | None
    output_usd_per_mtok: Decimal | None
    allow_unpriced: bool = False
    counts_as_step: bool = True  # embeddings spend tokens and dollars but are not agent steps
    # Consecutive upstream failures after which the run's calls are refused (`[caps]`); None: no limit.
    max_upstream_failures: int | None = None
    # Priced or refused (DESIGN.md "Enforcement rules"): what the call may be billed beyond its
    # input and output tokens. `fixed_usd_nanos`: fees it pays whatever it answers (a search
    # model's search). Uses of hosted tools (the provider's web search, file search, code
    # execution, MCP calls): each is an internal model call that may add up to `use_tokens` input
    # tokens (the model's context window) and cost up to `use_usd_nanos` (those tokens at the
    # worst input rate plus the tool's per-use fee); `uses_wanted` is the request's own limit on
    # them (None: unbounded, so runcap sets one: `Reservation.hosted_uses`).
    fixed_usd_nanos: int = 0
    hosted_tools: bool = False
    use_tokens: int = 0
    use_usd_nanos: int = 0
    uses_wanted: int | None = None
    # `repeats.request_fingerprint` of the body the agent sent, when the request carries
    # `X-Run-Max-Repeats` ('' otherwise: nothing to compare).
    request_fingerprint: str = ""
    # `X-Run-Parent` (the ledger's run id): the run that started this one; "" for none.
    parent_run_id: str = ""


@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    run_id: str
    step: int
    usd_nanos: int
    input_tokens: int
    output_tokens: int
    # The output limit to write into the request, or None to leave the request as it is.
    output_limit: int | None
    # The budget lowered the output limit below what the client asked for (or the model's max).
    clamped: bool
    final_step: bool
    state: RunState  # the run right after this reservation
    # False: a call with nothing to enforce, decided without the ledger (`begin_unledgered_step`)
    # and settled the same way — there is no row to settle.
    ledgered: bool = True
    counts_as_step: bool = True  # the call took a step (given back when it gets no answer)
    # The limit on hosted-tool uses to write into the request (below its own, or where it set
    # none), or None to leave the request as it is; `uses` is what the reservation covers.
    hosted_uses: int | None = None
    uses: int = 0
    request_fingerprint: str = ""  # the StepRequest's: counted when the call is answered
    # A run in a tree: (dollars in nano-dollars, tokens) left of the tightest cap of the run and
    # its ancestors after this reservation (None: no such cap) — what `X-Run-Remaining-*` shows
    # when an ancestor's cap is tighter than the run's own. None for a run outside a tree.
    tree_left: tuple[int | None, int | None] | None = None

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Settlement:
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd_nanos: int = 0
    tool_calls_requested: int = 0
    finished: bool = False  # the response ended without requesting tools
    run_status: str | None = None  # e.g. deadline_exceeded / cancelled when the call was cut
    # The provider-reported input tokens of a model step's context (0: not a context reading).
    context_tokens: int = 0
    # The call produced no model output (connect error, 408/409/429/5xx, cut before any output):
    # not a step, and not the answer-only final step.
    no_answer: bool = False
    # ... because the upstream failed (not because the agent, a cancel or the deadline cut it):
    # counts towards the run's consecutive upstream failures.
    upstream_failed: bool = False
    # The tool calls the answer requested, in order (`repeats.call_fingerprint`), when the run has
    # `X-Run-Max-Repeats` (empty otherwise).
    tool_call_fingerprints: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Verdict:
    """An operator's (or the tool path's) verdict on a tool call (`Ledger.resolve_tool_call`):
    `done` with the outcome to replay, or not done (the record goes, the call is uncounted)."""

    done: bool
    now: float
    status: int = 200
    headers: dict[str, str] | None = None
    body: bytes = b""
    force: bool = False


@dataclass(frozen=True, slots=True)
class RecoveredReservation:
    run_id: str
    reservation_id: str
    usd_nanos: int
    tokens: int


class Ledger(abc.ABC):
    """One backend of the run ledger. Every call is awaited on the request path, so each must be
    fast (sub-millisecond on loopback Redis or a local SQLite file)."""

    name: str
    # True: every operation ends within the backend's own timeout, so the guarded ledger adds
    # none of its own (an asyncio timeout costs a timer per operation).
    bounds_its_own_wait: bool = False

    @abc.abstractmethod
    async def begin_step(self, req: StepRequest) -> Reservation:
        """Open or update the run, check every cap and reserve the call's worst case, atomically.
        Raises a `Rejection` (the run's status updated accordingly) when the call may not go."""

    @abc.abstractmethod
    async def settle(self, reservation: Reservation, settlement: Settlement, now: float) -> RunState:
        """Replace the reservation by what the call actually used (see the module's rules). A
        settlement of a reservation already settled does nothing, so a retried one is safe."""

    @abc.abstractmethod
    async def touch_run(
        self, run_id: str, task: str, caps: RunCaps, now: float, parent: str = ""
    ) -> RunState:
        """Open or update the run for a call that reserves nothing (pass-through, tools) and
        check its deadline and cancel flag, and its ancestors' (`parent`: X-Run-Parent, for a
        run this call may create). Raises a `Rejection`."""

    async def touch(self, run: RunRequest, now: float) -> RunState:
        """`touch_run` for a request's run, as the request named it — its parent included: the
        one way the request path opens a run without a reservation, so no call site can open a
        child as a root (a held approval's first call did)."""
        return await self.touch_run(run.run_id, run.task, run.caps, now, run.parent)

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> RunState | None: ...

    @abc.abstractmethod
    async def cancel(self, run_id: str, now: float) -> RunState | None:
        """Mark the run cancelled (creating it if unknown, so a cancel that races the first
        request still wins). Returns the state. Its descendants are cancelled with it: each of
        their calls checks its ancestors (`check_tree_live`), and the cancel event names this
        run, whose subtree `Flights.cancel_run` cuts."""

    @abc.abstractmethod
    async def set_status(self, run_id: str, status: str, now: float) -> None:
        """Record a terminal status seen outside a step (e.g. a deadline hit mid-call)."""

    @abc.abstractmethod
    async def set_caps(self, run_id: str, change: CapsChange, now: float) -> tuple[RunCaps, RunState] | None:
        """An operator's top-up (`POST /runs/{id}/caps`): set the named caps, raising or
        lowering them (`apply_caps_change`). Returns (the caps before, the run after); None when
        the run is unknown."""

    @abc.abstractmethod
    async def recover(self) -> list[RecoveredReservation]:
        """Settle, at their reserved amount, the reservations of processes that died."""

    async def ping(self) -> None:  # noqa: B027 - optional for backends that cannot fail
        """Raise unless the backend accepts a write now (readiness)."""

    # -- faults (proxy/ledger/guarded.py turns them into `LedgerUnavailable`) ----------------

    @property
    def location(self) -> str:
        """Where the backend keeps its data, for messages: a file, a URL without its password."""
        return ""

    def failure_code(self, exc: BaseException) -> str | None:
        """Whether `exc`, raised by an operation, means the backend is unavailable (not a bug):
        `ledger_unreachable`, `ledger_timeout`, `ledger_disk_full` or `ledger_error`; None otherwise."""
        if isinstance(exc, ConnectionError):
            return "ledger_unreachable"
        if isinstance(exc, OSError):
            return "ledger_disk_full" if exc.errno == errno.ENOSPC else "ledger_error"
        return None

    def drain_in_doubt(self) -> list[Reservation | IdempotencyRecord]:
        """Writes this instance sent whose outcome it never learnt (the connection failed after
        sending), for calls that were then refused: reservations of calls never forwarded, and
        `in_flight` records of tool calls never executed. Taken by the caller, which releases
        each (`release_reservation`, `release_tool_call`) once the backend answers again."""
        return []

    async def release_reservation(self, reservation: Reservation) -> None:
        """Drop the reservation of a call that was never forwarded (nothing was spent); nothing
        happens when it was never written."""
        await self.settle(reservation, Settlement(no_answer=True), time.time())

    async def release_tool_call(self, record: IdempotencyRecord) -> None:  # noqa: B027
        """Delete `record` — this instance's `in_flight` record of a call it never executed — if
        it is still that record (same owner and creation time), and uncount the call."""

    def cancel_events(self) -> AsyncIterator[str] | None:
        """Run ids cancelled through other instances of this ledger, pushed as they happen
        (Redis pub/sub). None: the backend cannot push; the caller polls `get_run` instead."""
        return None

    @abc.abstractmethod
    async def close(self) -> None: ...

    # -- tool calls and their idempotency records (DESIGN.md "Idempotent tool calls") ----------

    @abc.abstractmethod
    async def begin_tool_call(self, req: ToolCallRequest) -> ToolCallStart:
        """Open or update the run, check it is live, and — atomically with counting the call —
        look up the call's idempotency record: replay a completed one, wait for one in flight,
        refuse an unknown one (`OutcomeUnknown`), or record the new call's intent (`in_flight`,
        owned by this process) and count it against the tool-call cap (`BudgetExceeded`)."""

    @abc.abstractmethod
    async def complete_tool_call(
        self, run_id: str, key: str, status: int, headers: dict[str, str], body: bytes, now: float
    ) -> None:
        """Record the outcome of an executed call (also over an `unknown` left by a cut that
        raced the answer: the answer is the truth)."""

    @abc.abstractmethod
    async def mark_unknown(self, run_id: str, key: str, now: float, reason: str = "") -> None:
        """The call was cut after it may have reached the tool (cancel, timeout, reset)."""

    @abc.abstractmethod
    async def get_tool_call(self, run_id: str, key: str) -> IdempotencyRecord | None: ...

    @abc.abstractmethod
    async def list_tool_calls(
        self, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[IdempotencyRecord]:
        """Idempotency records, oldest first (for `runcap reconcile`)."""

    async def resolve_tool_call(
        self,
        run_id: str,
        key: str,
        *,
        done: bool,
        now: float,
        status: int = 200,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        force: bool = False,
    ) -> IdempotencyRecord | None:
        """An operator's (or the tool path's) verdict on a call: `done` records the outcome to
        replay; not done deletes the record so the next attempt executes. Only an `unknown`
        record may be resolved unless `force` (the tool path releasing its own `in_flight` record
        when the tool was never reached). Returns the record as it was; None when there is none.
        Raises `RecordNotUnknown` when the record is not `unknown`."""
        return await self.apply_verdict(run_id, key, Verdict(done, now, status, headers, body, force))

    @abc.abstractmethod
    async def apply_verdict(self, run_id: str, key: str, verdict: Verdict) -> IdempotencyRecord | None:
        """`resolve_tool_call` with its verdict as one value: what each backend implements."""

    # -- provider objects and the tenant that created each (server/steps/tenant_objects.py) ----------

    @abc.abstractmethod
    async def claim_objects(self, account: str, object_ids: Sequence[str], tenant: str, now: float) -> None:
        """Record `tenant` as the creator of each of `object_ids` — objects a provider holds for
        the key `account` names (files, stored responses, batches...). The first claim wins: an
        id already recorded keeps its tenant. Not purged with the runs: the objects outlive them."""

    @abc.abstractmethod
    async def object_owners(self, account: str, object_ids: Sequence[str]) -> dict[str, str]:
        """The recorded tenant of each of `object_ids` that has one."""

    # -- approvals (DESIGN.md "Tool policies and approvals"; the rules: `open_approval` below) ----

    @abc.abstractmethod
    async def open_approval(self, req: ApprovalRequest) -> tuple[Approval, bool]:
        """The approval of the call (run, key), atomically: the existing one, or a new pending one
        (`open_approval`'s rule). True when it is new."""

    @abc.abstractmethod
    async def get_approval(self, approval_id: str, now: float) -> Approval | None:
        """The approval by its id, its expiry applied (`expire_if_due`)."""

    @abc.abstractmethod
    async def list_approvals(
        self, now: float, *, state: str | None = None, run_id: str | None = None, limit: int = 1000
    ) -> list[Approval]:
        """Approvals, oldest first, their expiry applied; `state` pending reads the pending index."""

    @abc.abstractmethod
    async def decide_approval(
        self, approval_id: str, approve: bool, by: str, reason: str, now: float
    ) -> Approval | None:
        """A person's decision (`decide_approval`'s rule), atomically. None: no such approval.
        Raises `ApprovalNotPending`."""

    @abc.abstractmethod
    async def deny_pending_approvals(self, run_id: str, now: float) -> list[Approval]:
        """The run was cancelled: deny its pending approvals (`deny_for_cancel`). The denied ones —
        each exactly once, however many cancels race (the caller records each denial: a span)."""


# A cap an operator may set: RunCaps field → the value (None: remove the cap).
CapsChange = dict[str, "int | float | None"]
OPERATOR_CAPS = ("max_usd_nanos", *OPERATOR_WHOLE_CAPS, "deadline")
# Statuses a cap put the run in: a top-up that makes room lets the run continue.
_CAP_STATUSES = {
    "budget_exceeded": ("max_usd_nanos", "max_tokens"),
    "steps_exceeded": ("max_steps", "max_tree_steps"),
    "tool_calls_exceeded": ("max_tool_calls", "max_tree_tool_calls"),
    "deadline_exceeded": ("deadline",),
}
_FINAL_REASON_CAP = {
    "max_steps": "max_steps", "max_tool_calls": "max_tool_calls", "max_repeats": "max_repeats"
}  # fmt: skip
# The run's status once the answer-only step forced by a cap was answered.
_FINAL_STATUS = {"max_steps": "steps_exceeded", "max_tool_calls": "tool_calls_exceeded",
                 "max_repeats": "repeats_exceeded"}  # fmt: skip


def apply_caps_change(state: RunState, change: CapsChange, now: float) -> None:
    """Set the operator's caps on the run (only the caps named). A run stopped by a cap the
    change raises is active again, and an answer-only final step forced by a raised cap no
    longer ends it; a cancelled run stays cancelled."""
    unknown = set(change) - set(OPERATOR_CAPS)
    if unknown:
        raise ValueError(f"not an operator cap: {sorted(unknown)}")
    state.caps = replace(state.caps, **change, timeout_s=None)  # type: ignore[arg-type]
    state.operator_caps = ",".join(sorted({*filter(None, state.operator_caps.split(",")), *change}))
    if state.final_reason is not None and _FINAL_REASON_CAP[state.final_reason] in change:
        state.final_reason = None
    # An operator acting on the run has seen its upstream failures: it may try again (a run that
    # is out of dollars or tokens too is stopped again by its next call).
    if state.upstream_failures:
        state.upstream_failures = 0
        if state.status == "budget_exceeded" and not state.cancelled:
            state.status = "active"
    if not state.cancelled and any(cap in change for cap in _CAP_STATUSES.get(state.status, ())):
        state.status = "active"
    state.updated_at = max(state.updated_at, now)


def new_run(run_id: str, task: str, caps: RunCaps, now: float) -> RunState:
    return RunState(run_id=run_id, task=task, started_at=now, updated_at=now, caps=caps.resolve_deadline(now))


def merge_caps(state: RunState, task: str, caps: RunCaps, now: float) -> None:
    """Later requests may lower a cap, never raise it (nor change one an operator set); a task
    label sticks once set."""
    lowered = state.caps.lowered_by(caps.resolve_deadline(state.started_at))
    if state.operator_caps:
        kept = {name: getattr(state.caps, name) for name in state.operator_caps.split(",")}
        lowered = replace(lowered, **kept)
    state.caps = lowered
    if task and not state.task:
        state.task = task
    state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest


def apply_status(state: RunState, now: float, *, cancel: bool = False, status: str | None = None) -> None:
    """A cancel (`Ledger.cancel`) or a terminal status seen outside a step (`Ledger.set_status`);
    a cancelled run stays cancelled."""
    if cancel:
        state.cancelled = True
        state.status = "cancelled"
    elif status and state.status != "cancelled":
        state.status = status
    state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest


def touched_run(state: RunState | None, run_id: str, task: str, caps: RunCaps, now: float) -> RunState:
    """The run a call that reserves nothing opens or updates (`Ledger.touch_run`), before
    `check_live`: new, or its caps merged."""
    if state is None:
        return new_run(run_id, task, caps, now)
    merge_caps(state, task, caps, now)
    return state


def check_touched(state: RunState, chain: Sequence[RunState | None], now: float) -> None:
    """`touch_run`'s check: the run and its ancestors live."""
    check_live(state, now)
    if chain:
        check_tree_live(state, chain, now)


def check_live(state: RunState, now: float) -> None:
    """Refuse any call of a cancelled run or one past its deadline."""
    if state.cancelled:
        state.status = "cancelled"
        raise RunCancelled(f"run {state.run_id} was cancelled; start a new run (new X-Run-Id) to continue")
    deadline = state.caps.deadline
    if deadline is not None and now >= deadline:
        _set_status(state, "deadline_exceeded")
        raise DeadlineExceeded(
            f"run {state.run_id} passed its deadline (X-Run-Deadline / X-Run-Timeout) "
            f"{now - deadline:.3f}s ago; end the run"
        )


def _set_status(state: RunState, status: str) -> None:
    # A terminal status sticks (a cancelled run stays cancelled); "cancelled" wins over the rest.
    if state.status not in TERMINAL_STATUSES or status == "cancelled":
        state.status = status


def decide_step(state: RunState, req: StepRequest, chain: Sequence[RunState | None] = ()) -> Reservation:
    """Check every cap and compute the reservation. Mutates `state` (also when it raises: the
    rejection's run status is recorded) — the caller persists `state` in both cases. `chain`:
    the run's ancestors (`RunState.ancestors`, None for one that expired), mutated and persisted
    with it in the same way."""
    merge_caps(state, req.task, req.caps, req.now)
    check_live(state, req.now)
    if in_tree(state, chain):
        return _decide_tree_step(state, req, chain)
    try:
        reservation = _reserve(state, req)
    except Rejection as rej:
        if rej.run_status:
            _set_status(state, rej.run_status)
        raise
    return reservation


def _reserve(state: RunState, req: StepRequest, *, tree: bool = False) -> Reservation:
    """The reservation of a call of `state` under `state.caps` (for a run in a `tree`, the tree's
    view of them: `_tree_view`), or the rejection of the cap it passes."""
    caps = state.caps
    final_reason: str | None = None
    limit_failures = req.max_upstream_failures
    if limit_failures is not None and state.upstream_failures >= limit_failures:
        raise BudgetExceeded(
            "max_upstream_failures",
            f"caps.max_upstream_failures: the last {state.upstream_failures} model calls of run "
            f"{state.run_id} got no answer from the upstream (connection error, 408/409/429/5xx or "
            f"cut before any output; the limit is {limit_failures} in a row), so runcap stopped the "
            "run. Check the provider, then start a new run, or have an operator let this one go on "
            "(runcap caps RUN_ID ...).",
        )
    if req.counts_as_step:
        if state.final_reason is not None:
            cap = state.final_reason
            raise BudgetExceeded(
                cap,
                f"{_HEADER[cap]}: run {state.run_id} already had its answer-only final step; "
                "the run is over — start a new run to continue",
            )
        fingerprint = req.request_fingerprint
        if caps.max_repeats is not None and fingerprint:
            copies = request_copies(state.repeats, fingerprint)
            if copies >= caps.max_repeats:
                raise BudgetExceeded(
                    "max_repeats",
                    f"X-Run-Max-Repeats: run {state.run_id} sent this same model request (byte for "
                    f"byte) {copies} times already and got an answer each time (the cap is "
                    f"{caps.max_repeats}); it would get the same answer again. Change the request "
                    "(add the tool results, a new instruction), or end the run.",
                )
        if caps.max_steps is not None:
            if state.steps + 1 > caps.max_steps:
                raise BudgetExceeded(
                    "max_steps",
                    f"X-Run-Max-Steps: run {state.run_id} has used all {caps.max_steps} steps; "
                    "the run is over — start a new run to continue",
                )
            if state.steps + 1 == caps.max_steps:
                final_reason = "max_steps"
        if (
            final_reason is None
            and caps.max_tool_calls is not None
            and state.tool_calls >= caps.max_tool_calls
        ):
            final_reason = "max_tool_calls"
        if final_reason is None and caps.max_repeats is not None and state.repeats.stopped:
            final_reason = "max_repeats"  # the model repeated itself: it answers now

    priced = req.input_usd_per_mtok is not None and req.output_usd_per_mtok is not None
    if caps.max_usd_nanos is not None and not priced and not req.allow_unpriced:
        raise InvalidRequest(
            f"model {req.model!r} has no known price, so X-Run-Max-Usd cannot be enforced for it; "
            f'configure [prices."{req.model}"] or set caps.allow_unpriced = true',
            code="unpriced_model",
            param="model",
        )
    in_rate = req.input_usd_per_mtok or Decimal(0)
    out_rate = req.output_usd_per_mtok or Decimal(0)

    wanted = req.client_output_limit if req.client_output_limit is not None else req.model_output_bound
    limit = wanted
    useful = min(req.min_output_tokens, wanted)
    capped = False
    uses, hosted_uses = _hosted_uses(state, req, final_reason is not None, in_rate, out_rate, useful)
    input_tokens = req.input_tokens_bound + uses * req.use_tokens
    input_cost = tokens_cost_nanos(req.input_tokens_bound, in_rate) + req.fixed_usd_nanos
    input_cost += uses * req.use_usd_nanos

    if caps.max_usd_nanos is not None and priced:
        capped = True
        left = caps.max_usd_nanos - state.spent_usd_nanos - state.reserved_usd_nanos
        affordable = tokens_affordable(left - input_cost, out_rate) if left >= input_cost else -1
        if affordable < useful:
            need = input_cost + tokens_cost_nanos(useful, out_rate)
            raise BudgetExceeded(
                "max_usd",
                f"X-Run-Max-Usd: run {state.run_id} has ${format_usd(max(left, 0))} left of its "
                f"${format_usd(caps.max_usd_nanos)} cap (spent ${format_usd(state.spent_usd_nanos)}, "
                f"${format_usd(state.reserved_usd_nanos)} reserved by calls in flight); this call needs "
                f"at least ${format_usd(need)} ({input_tokens} input tokens at most + {useful} "
                f"output tokens of {req.model}{_fees_text(req, uses)}). The run is out of budget: end it "
                "or start a new run.",
            )
        limit = min(limit, affordable)
    if caps.max_tokens is not None:
        capped = True
        left_tokens = caps.max_tokens - state.tokens_used - state.reserved_tokens
        affordable_tokens = left_tokens - input_tokens
        if affordable_tokens < useful:
            raise BudgetExceeded(
                "max_tokens",
                f"X-Run-Max-Tokens: run {state.run_id} has {max(left_tokens, 0)} of its {caps.max_tokens} "
                f"tokens left ({state.reserved_tokens} reserved by calls in flight); this call needs at "
                f"least {input_tokens + useful} ({input_tokens} input at most + "
                f"{useful} output). The run is out of tokens: end it or start a new run.",
            )
        limit = min(limit, affordable_tokens)

    # Write a limit into the request when it is lower than what the client asked for, or when the
    # client asked for none and a cap applies (an unlimited output is an unbounded cost).
    output_limit = limit if (limit < wanted or (capped and req.client_output_limit is None)) else None
    usd = input_cost + tokens_cost_nanos(limit, out_rate)

    if req.counts_as_step:
        state.steps += 1
        if final_reason is not None:
            state.final_reason = final_reason
    state.reserved_usd_nanos += usd
    state.reserved_tokens += input_tokens + limit
    if state.status not in TERMINAL_STATUSES:
        state.status = "active"
    tree_left = None
    if tree:  # what the view's caps leave now: the tightest of the run's and its ancestors'
        held_usd = state.spent_usd_nanos + state.reserved_usd_nanos
        held_tokens = state.tokens_used + state.reserved_tokens
        tree_left = (
            None if caps.max_usd_nanos is None else caps.max_usd_nanos - held_usd,
            None if caps.max_tokens is None else caps.max_tokens - held_tokens,
        )
    return Reservation(
        id=f"{_RESERVATION_PREFIX}-{next(_RESERVATION_SEQ)}",
        run_id=state.run_id,
        step=state.steps,
        usd_nanos=usd,
        input_tokens=input_tokens,
        output_tokens=limit,
        output_limit=output_limit,
        clamped=limit < wanted,
        final_step=final_reason is not None,
        state=copy_state(state),
        counts_as_step=req.counts_as_step,
        hosted_uses=hosted_uses,
        uses=uses,
        request_fingerprint=req.request_fingerprint,
        tree_left=tree_left,
    )


# -- run trees (issue 22) ------------------------------------------------------------------------
#
# A run names its parent when it is created (`open_run`); its `ancestors` are fixed then. Every
# call of a run with ancestors loads their states with its own and decides and writes them in one
# atomic operation: the call is checked against its own caps and every ancestor's remaining
# dollars, tokens and tree totals (`_tree_view`), and what it changes in its own totals is added
# to each ancestor's `sub_*` (`propagate`), so an ancestor's cap bounds its whole subtree.
# A run refused because an ancestor's cap binds is `ancestor_budget_exceeded`: not terminal, so a
# top-up of that ancestor (which is `budget_exceeded`) lets it continue.

ANCESTOR_STOPPED = "ancestor_budget_exceeded"
# A run refused because an ancestor passed its deadline: not terminal either (an operator may
# extend the ancestor's deadline).
ANCESTOR_DEADLINE = "ancestor_deadline_exceeded"


# Where a run's subtree totals (`sub_*`, in `Totals`' order) and its tree caps are in
# `tree_values`' list: a backend may store or read them apart (the SQLite ledger keeps the totals
# in columns of their own, and reads an ancestor's tree caps out of the rest).
SUB_TOTALS = slice(4, 10)
TREE_CAPS_AT = {"max_depth": 10, "max_children": 11, "max_tree_steps": 12, "max_tree_tool_calls": 13}


def tree_values(s: RunState) -> list[object]:
    """A run's tree fields (issue 22) as the list both backends store (Redis appended to a run's
    JSON, SQLite in its `tree` column); [] for a run in no tree and without tree caps, which is
    then stored as before run trees."""
    c = s.caps
    values = [
        s.parent_run_id, s.root_run_id, list(s.ancestors), s.children,
        s.sub_spent_usd_nanos, s.sub_reserved_usd_nanos, s.sub_tokens, s.sub_reserved_tokens,
        s.sub_steps, s.sub_tool_calls, c.max_depth, c.max_children, c.max_tree_steps, c.max_tree_tool_calls,
    ]  # fmt: skip
    # A cap of 0 is a cap ("no sub-runs"), not its absence: kept even when it is all there is.
    return values if any(values[:10]) or any(v is not None for v in values[10:]) else []


def load_tree_values(state: RunState, t: Sequence[Any]) -> None:
    """`tree_values`' list back into `state`."""
    state.parent_run_id, state.root_run_id, state.ancestors, state.children = t[0], t[1], tuple(t[2]), t[3]
    (
        state.sub_spent_usd_nanos, state.sub_reserved_usd_nanos, state.sub_tokens,
        state.sub_reserved_tokens, state.sub_steps, state.sub_tool_calls,
    ) = t[SUB_TOTALS]  # fmt: skip
    c = state.caps
    state.caps = stored_caps(
        c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls, c.deadline, c.timeout_s,
        c.max_context_tokens, c.max_repeats, t[10], t[11], t[12], t[13],
    )  # fmt: skip

# A run's state read by `get_run` lists at most this many of its children's ids; `children`
# counts them all. The ids are not part of the state every call of the subtree reads and writes
# (`tree_values`): each backend indexes a child under its parent once, when it is created.
CHILD_IDS_KEPT = 256
_TREE_HEADER = {
    "max_usd": "X-Run-Max-Usd",
    "max_tokens": "X-Run-Max-Tokens",
    "max_tree_steps": "X-Run-Max-Tree-Steps",
    "max_tree_tool_calls": "X-Run-Max-Tree-Tool-Calls",
}


def _parent_error(code: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"X-Run-Parent: {message}", code=code, param="X-Run-Parent")


def _ended(state: RunState, now: float) -> str | None:
    """Why `state` may not start a child (None: it may). Cancelled and past its deadline are
    for good; a run stopped by a cap is not (a top-up lets it go on), so it may start a child —
    whose calls its cap then refuses by name while it has nothing left."""
    if state.cancelled or state.status == "cancelled":
        return "was cancelled"
    deadline = state.caps.deadline
    if state.status == "deadline_exceeded" or (deadline is not None and now >= deadline):
        return "passed its deadline"
    return None


def open_run(
    state: RunState | None,
    chain: Sequence[RunState | None],
    run_id: str,
    task: str,
    caps: RunCaps,
    parent: str,
    now: float,
) -> RunState:
    """The run a call opens, placed in its tree. `state`: the run as stored (None: new); `parent`:
    the request's X-Run-Parent ("" for none); `chain`: when the run is new or names a parent
    other than its own, the named parent's state followed by its ancestors', else the run's own
    ancestors. A new child gets its parent's tree (and its deadline when earlier than its own) and
    counts as one of its children — `chain[0]` is mutated, persist it. Raises `InvalidRequest`
    (code `parent_*`, param X-Run-Parent) or `BudgetExceeded` (`max_depth`, `max_children`)."""
    if not parent or (state is not None and state.parent_run_id == parent):
        return state if state is not None else new_run(run_id, task, caps, now)
    named = chain[0] if chain else None
    if parent == run_id or (named is not None and run_id in named.ancestors):
        raise _parent_error(
            "parent_cycle",
            f"run {parent!r} is run {run_id!r} itself or one of its descendants: a run tree has no "
            "cycles; name the run that started this one",
        )
    if state is not None:
        was = f"run {state.parent_run_id!r}" if state.parent_run_id else "none (it is a root)"
        raise _parent_error(
            "parent_changed",
            f"run {run_id!r} already exists with parent {was}; a run's parent is fixed when the run "
            f"is created, so it cannot become a child of {parent!r}. Send its original X-Run-Parent "
            "(or none), or start a new run",
        )
    if named is None:
        raise _parent_error(
            "parent_unknown",
            f"no run {parent!r} (of this client's tenant) is known to this runcap; a parent must "
            "have made a call first — send the child's calls after the parent's first request",
        )
    for node in (named, *chain[1:]):
        why = None if node is None else _ended(node, now)
        if node is not None and why is not None:
            whose = "" if node is named else f" (its ancestor {node.run_id!r})"
            raise _parent_error(
                "parent_ended",
                f"parent run {parent!r}{whose} {why}; a sub-run may only be started under a live run",
            )
    for distance, node in enumerate((named, *chain[1:]), start=1):
        if node is not None and node.caps.max_depth is not None and distance > node.caps.max_depth:
            raise BudgetExceeded(
                "max_depth",
                f"X-Run-Max-Depth: run {node.run_id} allows {node.caps.max_depth} levels of sub-runs "
                f"below it; run {run_id} would be {distance} levels below it. Do the work in an "
                "existing run instead of starting a deeper one",
                run=node.run_id,
            )
    limit = named.caps.max_children
    if limit is not None and named.children + 1 > limit:
        raise BudgetExceeded(
            "max_children",
            f"X-Run-Max-Children: run {named.run_id} may start {limit} sub-runs and has started "
            f"{named.children}; run {run_id} was not started. Reuse one of them, or end the run",
            run=named.run_id,
        )
    child = new_run(run_id, task, caps, now)
    child.parent_run_id = named.run_id
    child.root_run_id = named.root
    child.ancestors = (named.run_id, *named.ancestors)
    # Its own deadline only: its ancestors' bind it at each call (`check_tree_live`), as they
    # stand then — an operator's extension of an ancestor reaches it.
    named.children += 1
    named.updated_at = max(named.updated_at, now)
    return child


def in_tree(state: RunState, chain: Sequence[RunState | None]) -> bool:
    """Whether a call of `state` is decided under its tree's rules: it has ancestors or children,
    or caps its own subtree — which counts the run itself from its first call, children or not."""
    c = state.caps
    own_tree_caps = c.max_tree_steps is not None or c.max_tree_tool_calls is not None
    return bool(chain) or state.children > 0 or own_tree_caps


def check_tree_live(state: RunState, chain: Sequence[RunState | None], now: float) -> None:
    """Refuse a call of a run whose ancestor was cancelled or passed its deadline: a cancel cuts
    the whole subtree, and a child's deadline is the earliest of its chain's (`state.tree_deadline`
    is set to its ancestors' earliest, for the call's timeouts and X-Run-Remaining-Ms). A run cut
    by an ancestor's deadline is `ancestor_deadline_exceeded`, not terminal: an operator's
    extension of that ancestor lets it continue."""
    earliest = None
    for node in chain:
        if node is None:
            continue
        if node.cancelled:
            _set_status(state, "cancelled")
            raise RunCancelled(
                f"run {state.run_id} was cancelled with its ancestor {node.run_id} (a cancel stops "
                "the run's whole subtree); start a new run to continue"
            )
        deadline = node.caps.deadline
        if deadline is None:
            continue
        if now >= deadline:
            _set_status(state, ANCESTOR_DEADLINE)
            raise DeadlineExceeded(
                f"run {state.run_id}: its ancestor {node.run_id} passed its deadline "
                f"{now - deadline:.3f}s ago, and a sub-run ends with it; end the run, or have an "
                f"operator extend run {node.run_id}'s deadline (runcap caps {node.run_id} --deadline ...)"
            )
        if earliest is None or deadline < earliest:
            earliest = deadline
    state.tree_deadline = earliest


Totals = tuple[int, int, int, int, int, int]


def totals(state: RunState) -> Totals:
    """What a run's ancestors add up in their `sub_*` fields."""
    return (
        state.spent_usd_nanos, state.reserved_usd_nanos, state.tokens_used, state.reserved_tokens,
        state.steps, state.tool_calls,
    )  # fmt: skip


def change(before: Totals, state: RunState) -> Totals | None:
    """What changed in `state`'s totals since `before` — what each of its ancestors adds to its
    subtree totals; None when nothing did."""
    after = totals(state)
    if after == before:
        return None
    usd, res_usd, tokens, res_tokens, steps, tool_calls = (a - b for a, b in zip(after, before, strict=True))
    return usd, res_usd, tokens, res_tokens, steps, tool_calls


def propagate(before: Totals, state: RunState, chain: Sequence[RunState | None], now: float) -> None:
    """Add what changed in `state`'s totals since `before` to every ancestor's subtree totals."""
    delta = change(before, state)
    if delta is not None:
        add_to_subtrees(chain, delta, now)


def add_to_subtrees(nodes: Iterable[RunState | None], delta: Totals, now: float) -> None:
    """`delta` added to each node's subtree totals and its `updated_at` moved to `now` (None: an
    ancestor that expired) — what every ancestor of a run takes of its change."""
    usd, res_usd, tokens, res_tokens, steps, tool_calls = delta
    for node in nodes:
        if node is None:
            continue
        node.sub_spent_usd_nanos += usd
        node.sub_reserved_usd_nanos += res_usd
        node.sub_tokens += tokens
        node.sub_reserved_tokens += res_tokens
        node.sub_steps += steps
        node.sub_tool_calls += tool_calls
        node.updated_at = max(node.updated_at, now)  # argMax(updated_at) picks the newest


def _tree_view(state: RunState, chain: Sequence[RunState | None]) -> tuple[RunCaps, dict[str, RunState]]:
    """The caps a call of `state` is decided under: each of its own lowered to what its subtree
    and every ancestor's leave it; and, for each cap a tree node binds (an ancestor's, or the
    run's own subtree cap), that node — keyed by the code `_reserve` raises. Of nodes that leave
    the same, the nearest binds (the run itself first). One pass over the chain: every call of a
    sub-run makes it."""
    usd = tokens = steps = calls = None  # (what is left, the node it is left of) of each tightest cap
    for node in (state, *chain):
        if node is None:
            continue
        nc = node.caps
        if nc.max_usd_nanos is not None:
            left = nc.max_usd_nanos - node.tree_usd_nanos
            if usd is None or left < usd[0]:
                usd = (left, node)
        if nc.max_tokens is not None:
            left = nc.max_tokens - node.tree_tokens
            if tokens is None or left < tokens[0]:
                tokens = (left, node)
        if nc.max_tree_steps is not None:
            left = nc.max_tree_steps - node.steps - node.sub_steps
            if steps is None or left < steps[0]:
                steps = (left, node)
        if nc.max_tree_tool_calls is not None:
            left = nc.max_tree_tool_calls - node.tool_calls - node.sub_tool_calls
            if calls is None or left < calls[0]:
                calls = (left, node)
    c = state.caps
    binds: dict[str, RunState] = {}
    max_usd, max_tokens, max_steps, max_calls = c.max_usd_nanos, c.max_tokens, c.max_steps, c.max_tool_calls
    if usd is not None:
        max_usd = state.spent_usd_nanos + state.reserved_usd_nanos + usd[0]
        binds["max_usd"] = usd[1]
    if tokens is not None:
        max_tokens = state.tokens_used + state.reserved_tokens + tokens[0]
        binds["max_tokens"] = tokens[1]
    if steps is not None and (max_steps is None or state.steps + steps[0] < max_steps):
        max_steps = state.steps + max(0, steps[0])
        binds["max_steps"] = steps[1]
    if calls is not None and (max_calls is None or state.tool_calls + calls[0] < max_calls):
        max_calls = state.tool_calls + max(0, calls[0])
        binds["max_tool_calls"] = calls[1]
    if not binds:
        return c, binds
    return c.with_budget(max_usd, max_tokens, max_steps, max_calls), binds


def _decide_tree_step(state: RunState, req: StepRequest, chain: Sequence[RunState | None]) -> Reservation:
    check_tree_live(state, chain, req.now)
    before = totals(state)
    own = state.caps
    view, binds = _tree_view(state, chain)
    _resume_if_the_tree_has_room(state, view)
    state.caps = view
    try:
        res = _reserve(state, req, tree=True)
    except Rejection as rej:
        state.caps = own
        node = binds.get(rej.code or "")
        own_cap = node is state and not state.children and rej.code in ("max_usd", "max_tokens")
        if not isinstance(rej, BudgetExceeded) or node is None or own_cap:
            if rej.run_status:
                _set_status(state, rej.run_status)
            raise
        raise _tree_rejection(state, node, rej) from None
    state.caps = own
    res.state.caps = own  # (the snapshot was taken under the view)
    propagate(before, state, chain, req.now)
    return res


def _resume_if_the_tree_has_room(state: RunState, view: RunCaps) -> None:
    """A run whose answer-only final step was its tree's (an ancestor's `max_tree_steps` /
    `max_tree_tool_calls` bound) goes on once the tree has room again — an operator topped the
    ancestor up — as a run whose own raised cap forced that step does (`apply_caps_change`).
    `view` is the tighter of the run's own cap and its tree's, so a step its own cap forced
    never has room here."""
    reason = state.final_reason
    if reason == "max_steps":
        used, cap = state.steps, view.max_steps
    elif reason == "max_tool_calls":
        used, cap = state.tool_calls, view.max_tool_calls
    else:
        return  # no final step, or one of repeats: not a cap a tree lowers
    if cap is None or used < cap:
        state.final_reason = None
        if state.status == _FINAL_STATUS[reason]:  # (a cancelled run was refused before this)
            state.status = "active"


def tree_left_after(res: Reservation, s: Settlement) -> tuple[int | None, int | None] | None:
    """`res.tree_left` once the call is settled as `s`: its reservation replaced by what it used
    (what this call knows; other calls of the tree may have moved it since)."""
    if res.tree_left is None:
        return None
    usd, tokens = res.tree_left
    return (
        None if usd is None else max(0, usd + res.usd_nanos - s.cost_usd_nanos),
        None if tokens is None else max(0, tokens + res.tokens - s.input_tokens - s.output_tokens),
    )


def _tree_rejection(state: RunState, node: RunState, rej: BudgetExceeded) -> BudgetExceeded:
    """A refusal because a tree node's cap binds: the node is `budget_exceeded` (or steps/tool
    calls exceeded), the run `ancestor_budget_exceeded` when the node is an ancestor."""
    tree_code = {"max_steps": "max_tree_steps", "max_tool_calls": "max_tree_tool_calls"}
    code = tree_code.get(rej.code or "", rej.code or "max_usd")
    c = node.caps
    if code == "max_usd":
        assert c.max_usd_nanos is not None
        spent = node.spent_usd_nanos + node.sub_spent_usd_nanos
        reserved = node.reserved_usd_nanos + node.sub_reserved_usd_nanos
        what = (
            f"${format_usd(max(0, c.max_usd_nanos - node.tree_usd_nanos))} left of its "
            f"${format_usd(c.max_usd_nanos)} cap (spent ${format_usd(spent)}, "
            f"${format_usd(reserved)} reserved by calls in flight)"
        )
    elif code == "max_tokens":
        assert c.max_tokens is not None
        what = f"{max(0, c.max_tokens - node.tree_tokens)} of its {c.max_tokens} tokens left"
    elif code == "max_tree_steps":
        what = f"used {node.steps + node.sub_steps} of its {c.max_tree_steps} model calls"
    else:
        what = f"used {node.tool_calls + node.sub_tool_calls} of its {c.max_tree_tool_calls} tool calls"
    whose = "its own" if node is state else f"its ancestor {node.run_id}'s"
    _set_status(node, rej.run_status or "budget_exceeded")
    if node is not state:
        _set_status(state, ANCESTOR_STOPPED)
    return BudgetExceeded(
        code,
        f"{_TREE_HEADER[code]}: run {state.run_id} is bounded by {whose} cap, which covers that run's "
        f"whole subtree: {node.run_id} has {what}, and this call needs more than that. An operator "
        f"can top up run {node.run_id} (runcap caps {node.run_id} ...) to let its sub-runs "
        "continue; otherwise end the run.",
        run=node.run_id,
    )


# Hosted-tool uses runcap allows in one call when the request sets no limit and only the
# tool-call cap (or nothing) bounds them: the uses a dollar or token cap leaves are counted
# individually, so this only caps an enormous budget's count.
MAX_HOSTED_USES = 64


def _hosted_uses(
    state: RunState, req: StepRequest, answer_only: bool, in_rate: Decimal, out_rate: Decimal, useful: int
) -> tuple[int, int | None]:
    """(uses the reservation covers, the limit to write into the request or None).

    Each use of a hosted tool is bounded by what is true — an internal call reads at most the
    model's context window, plus the tool's fee — and their number by the request's own limit,
    lowered to what the run's dollar, token and tool-call caps leave; where the request sets no
    limit runcap sets one. An answer-only step has its tools stripped: no use."""
    if not req.hosted_tools or answer_only:
        return 0, None
    caps = state.caps
    wanted = req.uses_wanted
    bounds: list[int] = [] if wanted is None else [wanted]
    if caps.max_tool_calls is not None:
        bounds.append(max(0, caps.max_tool_calls - state.tool_calls))
    money = caps.max_usd_nanos is not None and req.input_usd_per_mtok is not None
    if money and req.use_usd_nanos > 0:
        assert caps.max_usd_nanos is not None
        left = caps.max_usd_nanos - state.spent_usd_nanos - state.reserved_usd_nanos
        left -= tokens_cost_nanos(req.input_tokens_bound, in_rate) + req.fixed_usd_nanos
        left -= tokens_cost_nanos(useful, out_rate)
        bounds.append(max(0, left // req.use_usd_nanos))
    if caps.max_tokens is not None and req.use_tokens > 0:
        left_tokens = caps.max_tokens - state.tokens_used - state.reserved_tokens
        bounds.append(max(0, (left_tokens - req.input_tokens_bound - useful) // req.use_tokens))
    if not bounds:
        return 0, None  # nothing to enforce: the request goes as it is, its uses unreserved
    if wanted is None:
        bounds.append(MAX_HOSTED_USES)
    uses = min(bounds)
    if (
        uses < 1
        and (money or caps.max_tokens is not None)
        and (caps.max_tool_calls is None or caps.max_tool_calls > state.tool_calls)
    ):
        cap = "X-Run-Max-Usd" if money else "X-Run-Max-Tokens"
        raise BudgetExceeded(
            "max_usd" if money else "max_tokens",
            f"{cap}: run {state.run_id} cannot afford one use of the request's hosted tools (web "
            f"search, file search, code execution, MCP...): each use is an internal call of {req.model} "
            f"that may read up to {req.use_tokens} input tokens (its context window)"
            + (f" and costs up to ${format_usd(req.use_usd_nanos)}" if money else "")
            + ". Remove the hosted tools, or end the run.",
        )
    return uses, (uses if wanted is None or uses < wanted else None)


def _fees_text(req: StepRequest, uses: int) -> str:
    parts = []
    if uses:
        parts.append(f"{uses} hosted-tool uses")
    if req.fixed_usd_nanos:
        parts.append(f"${format_usd(req.fixed_usd_nanos)} of fees")
    return (" + " + " + ".join(parts)) if parts else ""


_HEADER = {"max_steps": "X-Run-Max-Steps", "max_tool_calls": "X-Run-Max-Tool-Calls",
           "max_repeats": "X-Run-Max-Repeats"}  # fmt: skip


# -- calls with nothing to enforce ---------------------------------------------------------------


def nothing_to_enforce(run_id_generated: bool, caps: RunCaps) -> bool:
    """A model call that needs no ledger: its run id is one runcap made up (the request is its own
    one-step run, so no other call shares its budget) and no cap applies to it — none from
    headers, `[caps]` defaults or `[tasks]` (a deadline or timeout is a cap too: it must survive a
    restart; any other `RunCaps` field set counts too, to be safe). Nothing could refuse or clamp
    it, and nothing is left to recover after a crash."""
    return run_id_generated and caps == _NO_CAPS  # every field at its default: no cap of any kind


_NO_CAPS = RunCaps()


def begin_unledgered_step(req: StepRequest) -> Reservation:
    """`begin_step` for a call with nothing to enforce (`nothing_to_enforce`): the same decision on
    a new run, in memory. The run snapshot and span it leads to are those a ledger would give
    (step 1, the same status and counters); no ledger row is written, so no transaction is spent."""
    state = new_run(req.run_id, req.task, req.caps, req.now)
    return replace(decide_step(state, req), ledgered=False)


def settle_unledgered(reservation: Reservation, settlement: Settlement, now: float) -> RunState:
    """`settle` for a reservation of `begin_unledgered_step`: the run after the call, in memory
    (no other call shares the run, so its state at reservation time is the whole story)."""
    state = copy_state(reservation.state)
    apply_settlement(state, reservation, settlement, now)
    return state


def apply_settlement(state: RunState, reservation: Reservation, s: Settlement, now: float) -> None:
    state.tree_deadline = reservation.state.tree_deadline  # as the reservation's call saw them
    state.reserved_usd_nanos = max(0, state.reserved_usd_nanos - reservation.usd_nanos)
    state.reserved_tokens = max(0, state.reserved_tokens - reservation.tokens)
    state.spent_usd_nanos += s.cost_usd_nanos
    state.input_tokens += s.input_tokens
    state.output_tokens += s.output_tokens
    state.tool_calls_requested += s.tool_calls_requested
    if s.context_tokens and not state.context_baseline:
        state.context_baseline = s.context_tokens  # the run's first answered step
    if s.no_answer:
        # Not a step: its slot goes back to the run, and so does an answer-only final step
        # (the next call is the final step again, with its tools stripped).
        if reservation.counts_as_step:
            state.steps = max(0, state.steps - 1)
            if reservation.final_step:
                state.final_reason = None
        if s.upstream_failed:
            state.upstream_failures += 1
    else:
        state.upstream_failures = 0
        limit = state.caps.max_repeats
        if limit is not None:
            note_repeats(state, reservation, s, limit)
    state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest
    if s.run_status:
        _set_status(state, s.run_status)
    elif state.status not in TERMINAL_STATUSES:
        state.status = "completed" if s.finished else "active"
    if state.final_reason is not None and reservation.final_step and not s.no_answer:
        # The answer-only step happened: the run ended on the cap that forced it.
        _set_status(state, _FINAL_STATUS[state.final_reason])


def note_repeats(state: RunState, reservation: Reservation, s: Settlement, limit: int) -> None:
    """An answered call of a run with `X-Run-Max-Repeats`: count its request body and the tool
    calls its answer requested (a run that starts repeating gets its answer-only step next:
    `_reserve`). The window is copied first: the state may be a reservation's snapshot."""
    repeats = state.repeats.copy()
    if reservation.request_fingerprint and reservation.counts_as_step:
        note_request(repeats, reservation.request_fingerprint)
    if s.tool_call_fingerprints:
        note_calls(repeats, s.tool_call_fingerprints, limit, reservation.step)
    state.repeats = repeats


def apply_recovery(
    state: RunState, usd_nanos: int, input_tokens: int, output_tokens: int, now: float
) -> None:
    """A dead process's reservation: charge it in full, as if the call used its worst case."""
    state.reserved_usd_nanos = max(0, state.reserved_usd_nanos - usd_nanos)
    state.reserved_tokens = max(0, state.reserved_tokens - input_tokens - output_tokens)
    state.spent_usd_nanos += usd_nanos
    state.input_tokens += input_tokens
    state.output_tokens += output_tokens
    state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest


def apply_unrecovery(
    state: RunState, usd_nanos: int, input_tokens: int, output_tokens: int, now: float
) -> None:
    """Undo `apply_recovery`: the owner of a reservation charged at its reserved amount turned
    out to be alive (it was swept during an outage), so the reservation is held again."""
    state.spent_usd_nanos = max(0, state.spent_usd_nanos - usd_nanos)
    state.input_tokens = max(0, state.input_tokens - input_tokens)
    state.output_tokens = max(0, state.output_tokens - output_tokens)
    state.reserved_usd_nanos += usd_nanos
    state.reserved_tokens += input_tokens + output_tokens
    state.updated_at = max(state.updated_at, now)  # argMax(updated_at) picks the newest


# -- tool calls --------------------------------------------------------------------------------

IN_FLIGHT = "in_flight"
COMPLETED = "completed"
UNKNOWN = "unknown"
TOOL_CALL_STATES = (IN_FLIGHT, COMPLETED, UNKNOWN)

DEFAULT_RETENTION_S = 7 * 24 * 3600.0


class RecordNotUnknown(Exception):
    """`resolve_tool_call` on a record that is in flight or already completed."""

    def __init__(self, record: IdempotencyRecord) -> None:
        super().__init__(f"idempotency record {record.key} of run {record.run_id} is {record.state}")
        self.record = record


@dataclass(slots=True)
class IdempotencyRecord:
    """One side-effecting tool call, by (run, key): the operation, its intent, then its outcome."""

    run_id: str
    key: str
    tool: str
    args_hash: str  # sha256 of the whole body (canonical JSON), as in the call's span
    state: str  # in_flight / completed / unknown
    owner: str  # the ledger instance (process) executing it
    created_at: float
    updated_at: float
    # The operation (see `same_operation`). method "" marks a record written before records
    # stored their operation (an upgraded ledger): only its tool is known.
    method: str = ""
    path: str = ""  # the sub-path after /tools/{name}, plus "?query"; "" for the tool's root
    op_hash: str = ""  # what identifies the arguments (ToolCallRequest.op_hash); "" = not given
    step: int = 0
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)  # the ones that matter: content-type
    body: bytes = b""
    error: str = ""  # why it became unknown


@dataclass(frozen=True, slots=True)
class ToolCallRequest:
    run_id: str
    task: str
    caps: RunCaps
    now: float
    tool: str
    key: str | None  # None: no side effects, no idempotency record (still counted)
    args_hash: str = ""  # sha256 of the whole body (canonical JSON)
    method: str = "POST"
    path: str = ""  # the sub-path after /tools/{name} (no leading "/"), plus "?query" when there is one
    # The arguments that identify the operation: the key runcap derives for the call (tool,
    # method, path, the body restricted to the tool's `key_fields`, operation id) — passed also
    # when the caller's own Idempotency-Key is used. "" = not given: `args_hash` is compared.
    op_hash: str = ""
    parent_run_id: str = ""  # `X-Run-Parent` (see StepRequest)


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    action: str  # "execute", "replay" (record is completed) or "wait" (in flight elsewhere)
    state: RunState
    record: IdempotencyRecord | None


def _check_tree_tool_call(state: RunState, chain: Sequence[RunState | None]) -> None:
    """One more tool call of `state` must fit every `max_tree_tool_calls` of its chain."""
    for node in (state, *chain):
        limit = None if node is None else node.caps.max_tree_tool_calls
        if node is not None and limit is not None and node.tool_calls + node.sub_tool_calls + 1 > limit:
            _set_status(node, "tool_calls_exceeded")
            if node is not state:
                _set_status(state, ANCESTOR_STOPPED)
            raise BudgetExceeded(
                "max_tree_tool_calls",
                f"X-Run-Max-Tree-Tool-Calls: run {node.run_id} allows {limit} tool calls in its whole "
                f"subtree and they are used; the call of run {state.run_id} was not executed — answer "
                "without it, or have an operator raise the cap",
                run=node.run_id,
            )


def same_operation(record: IdempotencyRecord, req: ToolCallRequest) -> bool:
    """Whether `req` is the operation `record` was made for. The rule:

    * the tool, the method and the path (sub-path and query) are equal, and
    * the arguments are: `op_hash` when both sides carry one — it covers only what the key is
      derived from (the body restricted to the tool's `key_fields`, and the operation id), so a
      retry that rewords a free-text field is still the same operation, with a derived key and
      with the caller's own key alike; else `args_hash`, the whole body (Stripe's rule).

    With a derived key the key already encodes all of this, so a mismatch comes from a caller's
    `Idempotency-Key` reused for another call — but the check does not assume so.
    A record written before records stored their operation (`method == ""`, left by an upgrade
    for at most the ledger's retention) is compared by tool only: that is all it knows.
    """
    if record.tool != req.tool:
        return False
    if not record.method:
        return True
    if (record.method, record.path) != (req.method, req.path):
        return False
    if record.op_hash and req.op_hash:
        return record.op_hash == req.op_hash
    return record.args_hash == req.args_hash


def describe_operation(tool: str, method: str, path: str) -> str:
    """`DELETE /tools/refund/accounts/42?x=1`, as the caller sent it."""
    if not method:
        return f"a call to tool {tool!r}"
    sep = "/" if path and not path.startswith("?") else ""
    return f"{method} /tools/{tool}{sep}{path}"


def _key_reused(record: IdempotencyRecord, req: ToolCallRequest) -> IdempotencyKeyReused:
    first = describe_operation(record.tool, record.method, record.path)
    now = describe_operation(req.tool, req.method, req.path)
    if now == first:
        now += " with other arguments"
    return IdempotencyKeyReused(
        f"Idempotency-Key {record.key!r} of run {record.run_id} belongs to {first} ({record.state}); "
        f"this request is {now}, so it was neither executed nor answered with that call's result. "
        "Send a new operation with a new Idempotency-Key (or none, to let runcap derive one); "
        "repeat the original request unchanged to get its result."
    )


def decide_tool_call(
    state: RunState,
    record: IdempotencyRecord | None,
    req: ToolCallRequest,
    owner: str,
    owner_alive: bool,
    chain: Sequence[RunState | None] = (),
) -> ToolCallStart:
    """The rules of one `/tools` call. Mutates `state` and `record` (also when it raises: a
    rejection's run status, an in-flight record of a dead owner turned `unknown`) — the caller
    persists both in every case. `owner_alive`: whether `record.owner` still runs.

    A record found under the key for another operation (`same_operation`) is refused with
    `IdempotencyKeyReused` whatever its state — completed, in flight or unknown: never replayed,
    waited for or executed, and the record is left as it is."""
    merge_caps(state, req.task, req.caps, req.now)
    check_live(state, req.now)
    if chain:
        check_tree_live(state, chain, req.now)
    if record is not None:
        if not same_operation(record, req):
            raise _key_reused(record, req)
        if record.state == COMPLETED:
            return ToolCallStart("replay", copy_state(state), record)
        if record.state == IN_FLIGHT and owner_alive:
            return ToolCallStart("wait", copy_state(state), record)
        if record.state == IN_FLIGHT:
            record.state = UNKNOWN
            record.updated_at = req.now
            record.error = "the runcap process executing it died"
        raise OutcomeUnknown(
            f"tool call {record.key} ({record.tool}) of run {record.run_id} was interrupted "
            f"({record.error or 'outcome unknown'}) and may or may not have taken effect; it will not be "
            "executed again until an operator resolves it with `runcap reconcile` — check the tool's "
            "side, or continue the run without it"
        )
    caps = state.caps
    # Executing a call the model requested is not a second use of the cap (used = max of the
    # two counts): only executions beyond the cap are refused.
    if caps.max_tool_calls is not None and state.tool_calls_executed + 1 > caps.max_tool_calls:
        _set_status(state, "tool_calls_exceeded")
        raise BudgetExceeded(
            "max_tool_calls",
            f"X-Run-Max-Tool-Calls: run {state.run_id} has used all {caps.max_tool_calls} tool calls; "
            "the call was not executed — answer without it or start a new run",
        )
    if in_tree(state, chain) and state.tool_calls_executed + 1 > state.tool_calls_requested:
        _check_tree_tool_call(state, chain)
    before = totals(state)
    state.tool_calls_executed += 1
    propagate(before, state, chain, req.now)
    if state.status not in TERMINAL_STATUSES:
        state.status = "active"
    new = None
    if req.key is not None:
        new = IdempotencyRecord(
            run_id=req.run_id,
            key=req.key,
            tool=req.tool,
            args_hash=req.args_hash,
            state=IN_FLIGHT,
            owner=owner,
            created_at=req.now,
            updated_at=req.now,
            method=req.method,
            path=req.path,
            op_hash=req.op_hash,
            step=state.steps,
        )
    return ToolCallStart("execute", copy_state(state), new)


# -- approvals: a person's yes or no on one exact tool call (DESIGN.md "Tool policies and approvals")

PENDING = "pending"
APPROVED = "approved"
DENIED = "denied"
EXPIRED = "expired"
APPROVAL_STATES = (PENDING, APPROVED, DENIED, EXPIRED)
# Who denied the pending approvals of a cancelled run (`deny_for_cancel`): the gate tells a
# cancel (410) from a person's denial (403) by it.
CANCELLED_BY = "runcap: run cancelled"


class ApprovalNotPending(Exception):
    """A decision on an approval that is no longer pending (decided, or expired)."""

    def __init__(self, approval: Approval) -> None:
        super().__init__(f"approval {approval.id} of run {approval.run_id} is {approval.state}")
        self.approval = approval


@dataclass(slots=True)
class Approval:
    """A person's decision on one exact tool call, keyed by the call's idempotency key (run, tool,
    canonical arguments, operation id): approving it releases that call, not the tool."""

    id: str  # 32 hex chars, random: unguessable, and says nothing about the run
    run_id: str
    key: str  # the call's idempotency key
    tool: str
    args_hash: str
    tenant: str  # '' without client tokens
    state: str  # pending / approved / denied / expired
    requested_at: float
    expires_at: float | None  # the run's deadline or `approval_ttl_s`, whichever is first
    decided_at: float | None = None
    by: str = ""
    reason: str = ""
    rule: str = ""  # the rule that asked for a person, and its reason
    rule_reason: str = ""
    request_hash: str = ""  # the call's body in the payload store ('' when not kept)
    step: int = 0

    def as_json(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """A call a rule says needs a person (`Ledger.open_approval`)."""

    run_id: str
    key: str
    tool: str
    args_hash: str
    tenant: str
    now: float
    expires_at: float | None
    rule: str = ""
    rule_reason: str = ""
    request_hash: str = ""
    step: int = 0


def new_approval_id() -> str:
    return secrets.token_hex(16)


def expire_if_due(approval: Approval, now: float) -> bool:
    """A pending approval past its expiry is expired (nobody decided in time). True if it changed."""
    if approval.state == PENDING and approval.expires_at is not None and now >= approval.expires_at:
        approval.state = EXPIRED
        approval.decided_at = approval.expires_at
        approval.by = "runcap"
        approval.reason = "expired: nobody decided before the run's deadline or approval_ttl_s"
        return True
    return False


def open_approval(existing: Approval | None, req: ApprovalRequest) -> tuple[Approval, bool]:
    """The approval of the call `req`: the one it has (pending, approved or denied — a decision
    sticks for that exact call), or a new pending one when it has none or its last one expired
    (nobody said no: asking again is asking anew). True when it is new. Mutates `existing`
    (expiry): the caller persists it."""
    if existing is not None:
        expire_if_due(existing, req.now)
        if existing.state != EXPIRED:
            return existing, False
    return Approval(
        id=new_approval_id(), run_id=req.run_id, key=req.key, tool=req.tool, args_hash=req.args_hash,
        tenant=req.tenant, state=PENDING, requested_at=req.now, expires_at=req.expires_at,
        rule=req.rule, rule_reason=req.rule_reason, request_hash=req.request_hash, step=req.step,
    ), True  # fmt: skip


def decide_approval(approval: Approval, approve: bool, by: str, reason: str, now: float) -> None:
    """A person's decision; only a pending approval takes one (`ApprovalNotPending`)."""
    expire_if_due(approval, now)
    if approval.state != PENDING:
        raise ApprovalNotPending(approval)
    approval.state = APPROVED if approve else DENIED
    approval.decided_at = now
    approval.by = by
    approval.reason = reason


def deny_for_cancel(approval: Approval, now: float) -> bool:
    """The run was cancelled: its pending approval is denied (True), a decided one stays."""
    if expire_if_due(approval, now) or approval.state != PENDING:
        return False
    decide_approval(approval, False, CANCELLED_BY, "the run was cancelled", now)
    return True
