"""Model calls runcap makes itself, on the agent's behalf, within the agent's run.

A `runcap_fetch` continuation (proxy/context/fetch.py) and a summary of the middle of a
conversation (proxy/context/summarize.py) are model calls the agent never sees, but they are
steps of its run like any other: each is a new `Flow` (`inner=True`, the parent's run, upstream
and endpoint) that goes through every step's request / response / done hooks — the budget step
reserves, clamps and settles it against the run's caps, the trace step records its span — and is
sent unstreamed to the same upstream with the agent's own headers (credentials, `X-Run-*`).

A step that refuses the call (a cap, a cancelled run) raises its `Rejection` to the caller, which
answers the agent's request with it; the deadline bounds the call and is a `DeadlineExceeded`;
an operator's cancel of the run interrupts it like the agent's own call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from proxy.context.summarize import SummaryCache
from proxy.errors import BudgetExceeded, DeadlineExceeded, InvalidRequest, Rejection, RunCancelled
from proxy.providers.base import BodyError
from proxy.server.flow import Flow
from proxy.server.outbound import call_timeout, run_deadline

if TYPE_CHECKING:
    from proxy.server.forward import Forwarder

log = logging.getLogger("runcap.inner")

_OUTCOMES = {
    BudgetExceeded: "budget_exceeded",
    DeadlineExceeded: "deadline_exceeded",
    RunCancelled: "cancelled",
}


class InnerCalls:
    """Bound to the forwarder once it exists (`bind`): it owns the steps and the upstream session.
    Also holds what such calls produce for later requests of the same runs: the summaries
    (`summaries`)."""

    def __init__(self) -> None:
        self._forwarder: Forwarder | None = None
        self.summaries = SummaryCache()

    def bind(self, forwarder: Forwarder) -> None:
        self._forwarder = forwarder

    async def call(self, parent: Flow, body: dict[str, Any]) -> tuple[Flow, dict[str, Any] | None]:
        """One unstreamed call of `body` to `parent`'s upstream and endpoint, as a step of its run.
        Returns the child flow and the parsed answer (None when the upstream failed: the child's
        status, outcome, error and `response_body` say how)."""
        fw = self._forwarder
        assert fw is not None, "InnerCalls used before bind()"
        assert parent.adapter is not None
        child = Flow(parent.request, parent.upstream, parent.target, parent.adapter, inner=True)
        child.run = parent.run
        child.tenant, child.api_key = parent.tenant, parent.api_key
        child.body = orjson.dumps(body)
        child.body_json = body
        try:
            try:
                child.info = parent.adapter.parse_request(body)
            except BodyError as e:
                raise InvalidRequest(f"runcap's own call is malformed: {e}", param="body") from None
            for step in fw.steps:
                await step.request(child)
        except Rejection as rej:
            child.status = rej.status
            child.outcome = next((o for cls, o in _OUTCOMES.items() if isinstance(rej, cls)), "error")
            child.error = rej.message
            await self._done(child)
            raise
        try:
            return child, await self._exchange(fw, parent, child)
        finally:
            await self._done(child)

    async def _exchange(self, fw: Forwarder, parent: Flow, child: Flow) -> dict[str, Any] | None:
        assert child.run is not None
        deadline = run_deadline(child.run, child.state, parent.started_wall)
        timeout = call_timeout(deadline).seconds
        sent = orjson.dumps(child.body_json) if child.body_changed else child.body
        child.sent_body = sent
        try:
            async with asyncio.timeout(timeout):
                async with fw.client.request(
                    "POST", child.target.url, headers=fw.upstream_headers(child), data=sent
                ) as upstream:
                    child.upstream_status = child.status = upstream.status
                    raw = await upstream.read()
        except TimeoutError:
            child.cut_reason = child.cut_reason or "deadline"
            child.outcome, child.status = "deadline_exceeded", DeadlineExceeded.status
            child.error = (
                f"run {child.run.run_id if child.run else ''} reached its deadline during runcap's own call"
            )
            raise DeadlineExceeded(
                f"{child.error} to upstream '{child.upstream.name}' (step {child.step}); "
                "the call was aborted. End the run."
            ) from None
        except asyncio.CancelledError:
            # An operator's cancel of the run, the agent's request reaching the deadline around
            # this call (forward.py's timeout), or the server stopping: the call was cut.
            expired = deadline is not None and time.time() >= deadline
            child.cut_reason = parent.cut_reason or ("deadline" if expired else None)
            child.outcome = "deadline_exceeded" if child.cut_reason == "deadline" else "cancelled"
            child.error = f"runcap's own call was cut ({child.cut_reason or 'interrupted'})"
            raise
        except (aiohttp.ClientError, OSError) as e:
            child.upstream_unreached = isinstance(e, aiohttp.ClientConnectorError)
            child.outcome, child.status = "error", 502
            where = f"upstream '{child.upstream.name}' ({child.upstream.display_url})"
            child.error = f"{where} failed: {type(e).__name__}: {e}".rstrip(": ")
            return None
        child.response_body = raw
        parsed: Any = None
        if child.status >= 400:
            child.outcome = "error"
            child.error = raw[:500].decode("utf-8", "replace")
        else:
            try:
                parsed = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                try:
                    child.response_info = child.adapter.parse_response(parsed) if child.adapter else None
                except BodyError:
                    child.response_info = None
            else:
                child.outcome = "error"
                child.error = (
                    f"upstream '{child.upstream.name}' answered runcap's own call with no JSON object"
                )
                parsed = None
        for step in fw.steps:
            await step.response(child)
        return parsed

    async def _done(self, child: Flow) -> None:
        fw = self._forwarder
        assert fw is not None
        cancelled: asyncio.CancelledError | None = None
        for step in fw.steps:
            try:
                await step.done(child)
            except asyncio.CancelledError as e:
                cancelled = e  # the other steps still run: the call is settled, its span recorded
            except Exception:
                log.exception("step %s failed after runcap's own call", type(step).__name__)
        if cancelled is not None:
            raise cancelled
