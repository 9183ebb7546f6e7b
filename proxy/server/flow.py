"""One request's journey through runcap, and the hooks that act on it.

The forwarding core (`forward.py`) only moves bytes and has the `Pipeline` call the steps' hooks in
order, like mitmproxy's addons: budget enforcement, metrics, logging and tracing are separate
`FlowStep`s, each readable and testable on its own; runcap's own model calls within a run
(`inner.py`) go through the same pipeline.

Hook order for one request:
  request(flow)   before forwarding; may raise a Rejection or rewrite `flow.body_json`
  response(flow)  upstream answered, nothing sent to the agent yet; for a buffered (non-stream)
                  response `flow.response_body` is set; steps may add `flow.reply_headers`
  answer(flow)    the agent's buffered, successful answer: a step may answer in its place (the
                  context step's `runcap_fetch` loop continues the conversation with the upstream)
  done(flow)      the exchange is over (all bytes relayed, or it failed); always called once, and
                  before the agent has the end of the response (a buffered body, a stream's
                  closing event and end-of-body: forward.py), so what a step records precedes a
                  complete answer; a step that could not record it sets `flow.unrecorded`, and
                  the agent gets that refusal instead of the end of the answer
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from proxy.caps import RunRequest
from proxy.config import UpstreamConfig
from proxy.context import ContextReading, Rewrite
from proxy.errors import Rejection
from proxy.ledger.base import Reservation, RunState
from proxy.pricing import Cost
from proxy.providers.base import Adapter, RequestInfo, ResponseInfo, Usage
from proxy.upstream_url import UpstreamTarget

log = logging.getLogger("runcap.forward")


@dataclass(slots=True, eq=False)
class Flow:
    request: web.Request
    upstream: UpstreamConfig
    target: UpstreamTarget  # the URL sent upstream, and the path the upstream reads
    adapter: Adapter | None  # None: an endpoint runcap does not understand (byte pass-through)
    started: float = field(default_factory=time.perf_counter)
    started_wall: float = field(default_factory=time.time)
    body: bytes = b""  # as received from the agent
    body_json: dict[str, Any] | None = None
    body_changed: bool = False  # body_json was rewritten: re-serialise before forwarding
    info: RequestInfo | None = None
    run: RunRequest | None = None
    tenant: str | None = None  # the client token's tenant ([auth] client_tokens); None: no tenants
    # The provider key runcap sends instead of the agent's credentials: the tenant's own for this
    # upstream, else the upstream's `api_key_env`; None: the agent's own credentials go through.
    api_key: str | None = None
    reservation: Reservation | None = None
    step: int = 0
    state: RunState | None = None  # the run after the latest ledger operation
    clamped_to: int | None = None  # the budget lowered the output limit to this
    # A run in a tree: (nano-dollars, tokens) left of the tightest cap of the run and its
    # ancestors, after the reservation and then after the settlement (`Reservation.tree_left`).
    tree_left: tuple[int | None, int | None] | None = None
    final_step: bool = False
    injected_stream_usage: bool = False
    status: int = 0  # as returned to the agent
    upstream_status: int = 0
    # The connection to the upstream was never made: the request cannot have been processed.
    upstream_unreached: bool = False
    reply_headers: dict[str, str] = field(default_factory=dict)  # runcap's own response headers
    response_body: bytes | None = None  # buffered responses only
    reply: web.StreamResponse | None = None  # the relayed stream, once its headers are sent
    sent_body: bytes = b""  # the request body as forwarded upstream (after clamps and strips)
    # Raw upstream bytes of a relayed stream, kept for the payload store while they fit its limit
    # (None: not captured, or over the limit).
    captured: bytearray | None = None
    response_bytes: int = 0  # bytes of a relayed body received from the upstream
    response_info: ResponseInfo | None = None
    streamed: bool = False
    ttft_ms: float | None = None
    # Waiting for the upstream: from sending the request to its last byte (a stream's relay
    # included); None until the call was sent. The rest of duration_ms is runcap's own.
    upstream_started: float | None = None
    upstream_ms: float | None = None
    usage: Usage | None = None  # as settled
    # A call cut short is settled partly at its reservation: which of `usage`'s input and output
    # figures are the reserved worst case (not reported by the provider), and what the provider
    # had reported when it was cut (None: nothing).
    usage_reserved: tuple[bool, bool] = (False, False)
    usage_seen: Usage | None = None
    cost_nanos: int = 0
    price_known: bool = True
    outcome: str = "ok"
    error: str = ""
    # The call produced no model output (budget.answer_missing): it gave its step back.
    no_answer: bool = False
    # Why the call was cut, when it was: "deadline" or "cancel" (set by whoever cut it).
    cut_reason: str | None = None
    # A context policy rewrote the request (proxy/context); None: forwarded as the agent sent it.
    rewrite: Rewrite | None = None
    # The answer is read whole before it is relayed (a step rewrites it: a list filtered per tenant).
    buffer_answer: bool = False
    # The call runcap made itself on the agent's behalf (a `runcap_fetch` continuation, a
    # summary): a step of the run like any other, but its answer goes back to runcap.
    inner: bool = False
    # What runcap measured of the request's context (proxy/server/steps/context.py); None: not measured.
    context: ContextReading | None = None
    # Priced or refused (proxy/server/steps/billing.py): the model the call is priced as (the body's,
    # or the one a deployment serves), the price variants its options may select, and what the
    # budget step decided and settled beyond tokens, for the span (`attributes`).
    priced_model: str = ""
    cost: Cost | None = None  # as settled
    price_options: tuple[tuple[tuple[str, str], ...], ...] = ((),)
    billing: dict[str, str] = field(default_factory=dict)
    # A relayed stream's closing part (its closing event and anything after it), written only
    # after the done steps (forward.py): the agent has a complete answer only once it is on record.
    held_tail: bytes = b""
    # What the agent gets instead of `response_body`, when a step answered in the upstream's place
    # (FlowStep.answer: the final answer of the `runcap_fetch` loop); None: the upstream's answer.
    answer: bytes | None = None
    # The steps this flow goes through; runcap's own calls within it go through the same (inner.py).
    pipeline: Pipeline | None = None
    # Set by a done step that could not put the call on record (the span WAL had no room): the
    # agent gets this refusal instead of the answer, or instead of the stream's closing part.
    unrecorded: Rejection | None = None

    @property
    def shares_key(self) -> bool:
        """A tenant's call sent with the key every tenant shares: what the provider holds for that
        key (files, stored responses...) is every tenant's, unless runcap keeps them apart
        (server/steps/tenant_objects.py)."""
        return self.tenant is not None and self.api_key is not None and self.api_key == self.upstream.api_key

    @property
    def flavor(self) -> str:
        """The wire format the agent speaks on this call (error shapes, credential header): the
        adapter's, else the upstream's (Anthropic also serves OpenAI's chat format)."""
        if self.adapter is None:
            return self.upstream.flavor
        return "anthropic" if self.adapter.name == "messages" else "openai"

    @property
    def endpoint(self) -> str:
        return self.adapter.name if self.adapter else "passthrough"

    @property
    def duration_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0

    def upstream_answered(self) -> None:
        """The upstream's answer is in (or the exchange failed): stop its clock, once."""
        if self.upstream_started is not None and self.upstream_ms is None:
            self.upstream_ms = (time.perf_counter() - self.upstream_started) * 1000.0


class FlowStep:
    """One concern acting on every flow (budget, context, tracing...). Each hook is a no-op here:
    a step overrides the ones it needs, and the `Pipeline` calls only those."""

    async def request(self, flow: Flow) -> None:
        """Before forwarding: may raise a `Rejection` or rewrite `flow.body_json`."""

    async def response(self, flow: Flow) -> None:
        """The upstream answered; nothing has been sent to the agent yet."""

    async def answer(self, flow: Flow) -> None:
        """The agent's own call answered in full and successfully (buffered, status < 400), after
        the response hooks: a step may answer in the upstream's place — `flow.answer` and
        `flow.status` — or raise the `Rejection` the agent gets instead (the `runcap_fetch` loop:
        server/steps/context.py). Not called for runcap's own calls."""

    async def done(self, flow: Flow) -> None:
        """The exchange is over (or failed); called once for every flow."""


_HOOKS = ("request", "response", "answer", "done")


class Pipeline:
    """The steps every model call goes through, in order — the agent's calls (forward.py) and
    runcap's own within a run (inner.py) alike — and the one error policy for their hooks:

    * `request`, `response`, `answer`: a step's exception (a `Rejection`, a cancel) propagates at
      once; the later steps' hooks do not run;
    * `done`: every step's hook runs; an error is logged, and a cancellation is re-raised once
      the rest have run (the call is settled and its span recorded whatever happens).

    Only the hooks a step overrides are called (the lists are computed when a step is added)."""

    def __init__(self, steps: Sequence[object] = ()) -> None:
        self._steps: list[object] = []
        self._hooks: dict[str, list[Callable[[Flow], Awaitable[None]]]] = {name: [] for name in _HOOKS}
        for step in steps:
            self.append(step)

    def append(self, step: object) -> None:
        """Add a step at the end: a `FlowStep`, or any object with some of its hook methods."""
        self._steps.append(step)
        for name in _HOOKS:
            own = getattr(type(step), name, None)
            if own is not None and own is not getattr(FlowStep, name):
                self._hooks[name].append(getattr(step, name))

    def __iter__(self) -> Iterator[object]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def hooks(self, name: str) -> list[Callable[[Flow], Awaitable[None]]]:
        """The bound `name` hooks that are called, in order (for tests and introspection)."""
        return list(self._hooks[name])

    async def _each(self, name: str, flow: Flow) -> None:
        """The `request`/`response`/`answer` policy: in order, and the first exception propagates."""
        for hook in self._hooks[name]:
            await hook(flow)

    async def request(self, flow: Flow) -> None:
        await self._each("request", flow)

    async def response(self, flow: Flow) -> None:
        await self._each("response", flow)

    async def answer(self, flow: Flow) -> None:
        await self._each("answer", flow)

    async def done(self, flow: Flow) -> None:
        cancelled: asyncio.CancelledError | None = None
        for hook in self._hooks["done"]:
            try:
                await hook(flow)
            except asyncio.CancelledError as e:
                cancelled = e  # the other steps still run: the call is settled, its span recorded
            except Exception:
                own = " (runcap's own call)" if flow.inner else ""
                log.exception(
                    "step %s failed after %s %s%s",
                    type(getattr(hook, "__self__", hook)).__name__,
                    flow.request.method,
                    flow.request.path,
                    own,
                )
        if cancelled is not None:
            raise cancelled


class Cuttable(Protocol):
    """A call a cancel can cut: a model `Flow` or a `/tools` call. Its `cut_reason` tells the
    task being cancelled why."""

    cut_reason: str | None


class Flights:
    """In-flight upstream calls (model and tool) by run, so a cancel can abort them (this
    process only; `server/cancel.py` carries cancels made elsewhere to here). A cancel of a run
    cuts its subtree: the calls of every run whose ancestors include it (learnt from the run
    states the calls got from the ledger, or the parent a call names before it has one)."""

    ANCESTORS_KEPT = 10_000  # runs whose ancestors this process remembers

    def __init__(self) -> None:
        self._by_run: dict[str, dict[asyncio.Task[Any], Cuttable]] = {}
        # A run's ancestors are fixed when it is created: once seen, they hold.
        self._ancestors: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    def _chain(self, run_id: str, calls: dict[asyncio.Task[Any], Cuttable]) -> tuple[str, ...]:
        known = self._ancestors.get(run_id)
        if known is not None:
            return known
        parent: tuple[str, ...] = ()
        for call in calls.values():
            state = getattr(call, "state", None)
            if isinstance(state, RunState) and state.run_id == run_id:
                self._ancestors[run_id] = state.ancestors
                if len(self._ancestors) > self.ANCESTORS_KEPT:
                    self._ancestors.popitem(last=False)
                return tuple(state.ancestors)
            run = getattr(call, "run", None)
            if isinstance(run, RunRequest) and run.parent:
                parent = (run.parent,)  # its first call, before the ledger answered
        return parent

    def add(self, run_id: str, task: asyncio.Task[Any], flow: Cuttable) -> None:
        self._by_run.setdefault(run_id, {})[task] = flow

    def remove(self, run_id: str, task: asyncio.Task[Any]) -> None:
        tasks = self._by_run.get(run_id)
        if tasks is not None:
            tasks.pop(task, None)
            if not tasks:
                del self._by_run[run_id]

    def cancel_run(self, run_id: str) -> int:
        """Cut the calls in flight of `run_id` and of its descendants; how many were cut."""
        cut = 0
        for rid, tasks in list(self._by_run.items()):
            if rid != run_id and run_id not in self._chain(rid, tasks):
                continue
            for task, flow in list(tasks.items()):
                if flow.cut_reason == "cancel":
                    continue  # already cut: a second cancel would interrupt its clean-up
                flow.cut_reason = "cancel"
                task.cancel("runcap: run cancelled")
                cut += 1
        return cut

    def run_ids(self) -> list[str]:
        """The runs with calls in flight, and their ancestors (a cancel of one cuts them too)."""
        ids = dict.fromkeys(self._by_run)
        for rid, tasks in list(self._by_run.items()):
            ids.update(dict.fromkeys(self._chain(rid, tasks)))
        return list(ids)
