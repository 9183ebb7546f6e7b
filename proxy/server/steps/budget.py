"""The budget step: reserve before forwarding, clamp or strip the request, settle after.

It sees only the provider-neutral `RequestInfo` / `ResponseInfo` (adapters do the wire-format
work) and the ledger (which makes the decision atomically). Settlement happens exactly once per
reservation — when a buffered response is in, or when a stream ends however it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from decimal import Decimal

from proxy.caps import RunCaps
from proxy.config import Config
from proxy.errors import BudgetExceeded, LedgerUnavailable, Rejection
from proxy.hashing import args_hash
from proxy.ledger.base import (
    Reservation,
    RunState,
    Settlement,
    StepRequest,
    begin_unledgered_step,
    nothing_to_enforce,
    settle_unledgered,
    tree_left_after,
)
from proxy.ledger.guarded import GuardedLedger
from proxy.ledger.repeats import call_fingerprint, request_fingerprint
from proxy.money import format_usd, usd_to_nanos
from proxy.pricing import PriceBook, max_output_tokens
from proxy.providers.base import Usage
from proxy.providers.registry import free_endpoint
from proxy.server.flow import Flow, FlowStep
from proxy.server.metrics import Metrics
from proxy.server.steps.billing import quote as billing_quote
from proxy.server.steps.billing import settle_price
from proxy.server.steps.history import ConversationMemory

log = logging.getLogger("runcap.budget")

_WRITE_METHODS = frozenset({"POST", "PUT", "PATCH"})


def passthrough_allowed(patterns: tuple[str, ...], path: str) -> bool:
    """`path` is one of the operator's allow-listed endpoints, or below one; `*` stands for one
    path segment (`/v1/threads/*/runs`)."""
    parts = path.rstrip("/").split("/")
    for pattern in patterns:
        want = pattern.rstrip("/").split("/")
        if len(parts) >= len(want) and all(w in ("*", p) for w, p in zip(want, parts, strict=False)):
            return True
    return False


_MTOK = Decimal(1_000_000)


def pricing_provider(flow: Flow) -> str:
    """genai-prices provider id: the upstream's name for the built-in upstreams; for any other
    upstream (vLLM, a gateway, a second key...) its name, which the price book falls back from
    to matching the model across providers."""
    return flow.upstream.name


class BudgetStep(FlowStep):
    def __init__(self, config: Config, ledger: GuardedLedger, prices: PriceBook, metrics: Metrics) -> None:
        self.config = config
        self.caps = config.caps
        # Guarded: each operation bounded, an unavailable ledger a 503 `ledger_unavailable`, and
        # settlements it could not take retried in the background (`settle_later`).
        self.ledger = ledger
        self.prices = prices
        self.metrics = metrics
        self.history = ConversationMemory()

    # -- request ------------------------------------------------------------------------------

    async def request(self, flow: Flow) -> None:
        run = flow.run
        assert run is not None
        if flow.adapter is None or flow.info is None:
            # A pass-through call reserves nothing, but a cancelled or expired run stays stopped.
            caps = run.caps
            if not run.generated or run.parent:
                flow.state = await self.metrics.timed_ledger_op("touch", self.ledger.touch(run, time.time()))
                caps = flow.state.caps
            self._refuse_unmetered(flow, caps)
            return
        info = flow.info
        provider = pricing_provider(flow)
        bound = (
            info.input_token_bound if run.generated else self.history.bound(run.run_id, flow.adapter, info)
        )
        # Everything the call may be billed for beyond its tokens, bounded or refused (billing.py).
        quote = billing_quote(flow, self.prices, provider, run.caps, bound)
        flow.priced_model = model = quote.model
        flow.price_options = quote.options
        rates = quote.rates
        model_bound = (
            self.config.model_max_output.get(model)
            or max_output_tokens(provider, model)
            or self.caps.default_output_tokens
        )
        bound = quote.input_tokens_bound
        if info.stored_context:
            # Input kept by the provider (previous response, Anthropic thread, conversation,
            # stored prompt): its size if this process saw it answered, else the model's whole
            # context window.
            stored = self.history.stored_tokens(info.stored_context)
            if stored is None:
                stored = quote.window
            bound += stored
        req = StepRequest(
            run_id=run.run_id,
            task=run.task,
            caps=run.caps,
            now=time.time(),
            model=model,
            input_tokens_bound=bound,
            client_output_limit=info.max_output_tokens,
            model_output_bound=model_bound,
            min_output_tokens=max(self.caps.min_output_tokens, flow.adapter.min_output_limit),
            input_usd_per_mtok=rates[0] * _MTOK if rates else None,
            output_usd_per_mtok=rates[1] * _MTOK if rates else None,
            allow_unpriced=self.caps.allow_unpriced,
            counts_as_step=flow.adapter.name != "embeddings",
            max_upstream_failures=self.caps.max_upstream_failures,
            fixed_usd_nanos=quote.fixed_usd_nanos,
            hosted_tools=quote.hosted_tools,
            use_tokens=quote.use_tokens,
            use_usd_nanos=quote.use_usd_nanos,
            uses_wanted=quote.uses_wanted,
            # Only a request that carries the repeat cap is fingerprinted (a hash of its body):
            # a run without it pays nothing.
            request_fingerprint=request_fingerprint(flow.body) if run.caps.max_repeats is not None else "",
            parent_run_id=run.parent,
        )
        if (
            nothing_to_enforce(run.generated, run.caps)
            and not run.parent  # a sub-run spends from its ancestors' budgets
            and flow.rewrite is None
            and not flow.inner
        ):
            # Its own one-step run with no cap: nothing to reserve against, nothing to recover
            # after a crash — decided in memory, no ledger transaction (the same decision and run
            # state as a ledger's: the span and the run row do not change). Not so when a context
            # policy makes calls of its own for it (a summary, `runcap_fetch` continuations): those
            # are steps of the same run, counted together in the ledger.
            res = begin_unledgered_step(req)
            self._apply_reservation(flow, res)
            return
        try:
            res = await self.metrics.timed_ledger_op("reserve", self.ledger.begin_step(req))
        except LedgerUnavailable:
            raise  # no second ledger call for the span: it would only wait to fail again
        except Rejection:
            flow.state = await self.ledger.get_run(run.run_id)  # for the refused call's span
            raise
        self._apply_reservation(flow, res)

    def _apply_reservation(self, flow: Flow, res: Reservation) -> None:
        """The reservation's decision, written into the request: the output limit, the
        answer-only final step, the usage a stream must report."""
        info, adapter = flow.info, flow.adapter
        assert info is not None and adapter is not None
        flow.reservation = res
        flow.state = res.state
        flow.tree_left = res.tree_left
        flow.step = res.step
        body = flow.body_json
        assert body is not None
        if res.output_limit is not None:
            adapter.set_output_limit(body, res.output_limit, legacy_field=flow.upstream.legacy_output_limit)
            flow.body_changed = True
            if res.clamped:
                flow.clamped_to = res.output_limit
        if res.hosted_uses is not None and not res.final_step:
            # The request left its hosted tools' uses unbounded (or above what the caps leave):
            # bounded on the forwarded body, and on the span.
            adapter.set_hosted_limit(body, info, res.hosted_uses)
            flow.body_changed = True
            flow.billing["hosted.max_uses_set"] = str(res.hosted_uses)
        if res.uses:
            flow.billing["hosted.uses_reserved"] = str(res.uses)
        if res.final_step:
            flow.final_step = True
            # Context the provider holds may hold tools too (an Anthropic thread's, a stored
            # prompt's): they stay live although the body has none, so they are forbidden too.
            if info.has_tools or info.stored_context:
                adapter.strip_tools(body)
                flow.body_changed = True
        if info.stream and adapter.request_stream_usage(body):
            flow.injected_stream_usage = True
            flow.body_changed = True

    def _refuse_unmetered(self, flow: Flow, caps: RunCaps) -> None:
        """Metered or refused: under a dollar or token cap, a POST (PUT, PATCH) that no adapter
        understands could spend without limit — refuse it unless it is free or allow-listed."""
        if flow.request.method not in _WRITE_METHODS and not flow.body:
            return  # a read (a GET with a body is not one: some servers act on it)
        if caps.max_usd_nanos is None and caps.max_tokens is None:
            return
        path = flow.target.path
        if free_endpoint(path) or passthrough_allowed(flow.upstream.passthrough_allow, path):
            return
        cap = "X-Run-Max-Usd" if caps.max_usd_nanos is not None else "X-Run-Max-Tokens"
        raise BudgetExceeded(
            "unmetered_endpoint",
            f"{flow.request.method} {path}: runcap cannot meter this endpoint of upstream "
            f"'{flow.upstream.name}', and run {flow.run.run_id if flow.run else ''} has a {cap} cap, "
            "so it is refused. Use a metered endpoint (chat/completions, responses, completions, "
            "embeddings, messages), run without a dollar/token cap, or have the operator allow it "
            f"([upstreams.{flow.upstream.name}] passthrough_allow).",
        )

    # -- response -----------------------------------------------------------------------------

    async def response(self, flow: Flow) -> None:
        if flow.reservation is not None and flow.response_body is not None:
            await self._settle(flow)  # buffered: the exact remaining budget goes in the headers
        if flow.run is not None and flow.state is not None:
            flow.reply_headers.update(run_headers(flow, flow.state, time.time()))

    async def done(self, flow: Flow) -> None:
        if flow.reservation is not None:
            await self._settle(flow)

    async def _settle(self, flow: Flow) -> None:
        res = flow.reservation
        if res is None:
            return
        flow.reservation = None  # exactly once
        settlement = self.settlement(flow, res)
        flow.tree_left = tree_left_after(res, settlement)
        now = time.time()
        self.metrics.settled(flow, settlement)  # what the call spent, whenever the ledger takes it
        if not res.ledgered:
            flow.state = settle_unledgered(res, settlement, now)
            return
        try:
            # This call first, in its own request (earlier failures are retried in the
            # background); shielded: a cancel or deadline arriving now must not lose what it used.
            flow.state = await asyncio.shield(
                self.metrics.timed_ledger_op("settle", self.ledger.settle(res, settlement, now))
            )
        except Exception as e:
            self._retry_unsettled(res, settlement, now, e)
            return
        resp = flow.response_info
        run = flow.run
        if flow.outcome == "ok" and flow.info and resp and resp.usage and run and not run.generated:
            self.history.remember(res.run_id, flow.info, resp.usage, resp)

    def _retry_unsettled(
        self, res: Reservation, settlement: Settlement, now: float, error: Exception
    ) -> None:
        """The ledger did not take a settlement. The agent still gets its (paid-for) answer; the
        ledger keeps the reservation — the worst case, so the cap still holds — until the
        background retry replaces it by what was used (`runcap_unsettled_reservations`), or, should
        this process die first, a sweep settles it at its reserved amount."""
        if isinstance(error, LedgerUnavailable):
            log.warning(
                "run %s step %d: settlement not taken (%s); retrying it in the background",
                res.run_id, res.step, error.message,
            )  # fmt: skip
        else:
            log.error(
                "run %s step %d: settling failed; retrying it in the background",
                res.run_id, res.step, exc_info=error,
            )  # fmt: skip
        self.ledger.settle_later(res, settlement, now)

    def settlement(self, flow: Flow, res: Reservation) -> Settlement:
        info = flow.response_info
        usage = info.usage if info else None
        flow.usage_seen = usage
        if flow.outcome == "incomplete":
            # A stream that ended without its closing event: the provider may have generated (and
            # billed) more than runcap saw, so it is settled at least at its reservation.
            seen = usage or Usage()
            usage = replace(
                seen,
                input_tokens=max(seen.input_tokens, res.input_tokens),
                output_tokens=max(seen.output_tokens, res.output_tokens),
                tool_uses=dict(seen.tool_uses),
            )
        elif usage is None:
            if flow.upstream_status >= 400 or flow.upstream_unreached:
                usage = Usage()  # the provider refused or was never reached: nothing was generated
            else:
                # Cut (the provider may have worked on it, and bills what it did), or an upstream
                # that does not report usage: charge the worst case reserved.
                if flow.outcome == "ok":
                    log.warning(
                        "run %s step %d: %s returned no usage; settled at the reserved worst case",
                        res.run_id, res.step, flow.upstream.name,
                    )  # fmt: skip
                usage = Usage(input_tokens=res.input_tokens, output_tokens=res.output_tokens)
        elif flow.streamed and info is not None and not info.complete:
            # A stream cut before its final usage: what was read so far is a lower bound.
            usage = replace(
                usage,
                input_tokens=usage.input_tokens or res.input_tokens,
                output_tokens=max(usage.output_tokens, res.output_tokens),
                tool_uses=dict(usage.tool_uses),
            )
        if usage is not flow.usage_seen:
            # Settled above what the provider reported (a cut, a missing usage): those figures
            # are the reservation's, and the span says so (trace.py).
            seen = flow.usage_seen or Usage()
            flow.usage_reserved = (
                usage.input_tokens > seen.input_tokens,
                usage.output_tokens > seen.output_tokens,
            )
        # Priced as the model the call reserved for (a gateway or an Azure deployment may answer
        # with a name of its own), at the variant it was served at (billing.py).
        cost = settle_price(flow, self.prices, pricing_provider(flow), usage)
        flow.cost_nanos = usd_to_nanos(cost.usd)
        flow.cost = cost  # what made up the cost: the span's `cost.*` attributes
        if flow.outcome == "incomplete":
            # Cache reads priced below the worst case must not bring it under what was reserved.
            flow.cost_nanos = max(flow.cost_nanos, res.usd_nanos)
        flow.price_known = cost.known
        flow.usage = usage
        status = {"deadline": res.state.deadline_status, "cancel": "cancelled"}.get(flow.cut_reason or "")
        no_answer, upstream_failed = answer_missing(flow)
        flow.no_answer = no_answer
        fingerprints: tuple[str, ...] = ()
        if info is not None and info.tool_calls and res.state.caps.max_repeats is not None:
            fingerprints = tuple(call_fingerprint(c.name, args_hash(c.arguments)) for c in info.tool_calls)
        return Settlement(
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cost_usd_nanos=flow.cost_nanos,
            # Calls the provider executed for the model count like the ones it asks the agent for.
            tool_calls_requested=len(info.tool_calls) + len(info.provider_tool_calls) if info else 0,
            # An answer without tool calls ends the run, also when its stream missed the closing
            # event after the stop reason (the answer reached the agent; only usage is unsure).
            finished=bool(info and info.finished and flow.outcome in ("ok", "incomplete")),
            run_status=status,
            # The provider's count of this step's context (proxy/server/steps/context.py): the run's
            # first one is the baseline of its growth.
            context_tokens=flow.context.tokens if flow.context is not None else 0,
            no_answer=no_answer,
            upstream_failed=upstream_failed,
            tool_call_fingerprints=fingerprints,
        )


# Statuses the official SDKs retry (and providers use for "overloaded", "rate limited", "try
# again"): the call was not answered, so it is not a step of the run.
_RETRIED_STATUSES = frozenset({408, 409, 429})


def answer_missing(flow: Flow) -> tuple[bool, bool]:
    """(no answer, upstream failure) of a settled model call. No answer: the call produced no model
    output — the upstream was not reached, answered 408/409/429/5xx (529 overloaded included), or
    the call was cut before a byte of its response arrived. An upstream failure is the part of
    those the upstream caused (not the agent going away, a cancel or the deadline)."""
    status = flow.upstream_status
    if flow.upstream_unreached or status in _RETRIED_STATUSES or status >= 500:
        return True, True
    if status == 0 or (flow.response_body is None and flow.response_bytes == 0):
        # Cut before the upstream answered anything (no headers, or headers and no body yet).
        return True, flow.cut_reason is None and flow.error != "client disconnected"
    return False, False


def run_headers(flow: Flow, state: RunState, now: float) -> dict[str, str]:
    """X-Run-* response headers: the run, the step, and what is left of each cap."""
    headers = {"X-Run-Id": state.run_id}
    step = flow.step
    if step:
        headers["X-Run-Step"] = str(step)
    remaining = state.remaining(now)
    if flow.tree_left is not None:  # an ancestor's cap may leave less than the run's own
        for name, left in zip(("usd_nanos", "tokens"), flow.tree_left, strict=True):
            own = remaining[name]
            if left is not None:
                remaining[name] = max(0, left) if own is None else min(own, max(0, left))
    if remaining["usd_nanos"] is not None:
        headers["X-Run-Remaining-Usd"] = format_usd(int(remaining["usd_nanos"]))
    if remaining["tokens"] is not None:
        headers["X-Run-Remaining-Tokens"] = str(remaining["tokens"])
    if remaining["steps"] is not None:
        headers["X-Run-Remaining-Steps"] = str(remaining["steps"])
    if remaining["tool_calls"] is not None:
        headers["X-Run-Remaining-Tool-Calls"] = str(remaining["tool_calls"])
    if remaining["ms"] is not None:
        headers["X-Run-Remaining-Ms"] = str(int(remaining["ms"]))
    if flow.final_step:
        headers["X-Run-Final-Step"] = "true"
        if state.final_reason:  # the cap that forced it: max_steps, max_tool_calls, max_repeats
            headers["X-Run-Final-Step-Reason"] = state.final_reason
    if flow.clamped_to is not None:
        # Not in DESIGN's list: tells the agent why an answer may stop short ("length").
        headers["X-Run-Clamped-Output-Tokens"] = str(flow.clamped_to)
    return headers
