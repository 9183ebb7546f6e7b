"""Model calls runcap makes itself, on the agent's behalf, within the agent's run.

A `runcap_fetch` continuation (proxy/context/fetch.py) and a summary of the middle of a
conversation (proxy/context/summarize.py) are model calls the agent never sees, but they are
steps of its run like any other: each is a new `Flow` (`inner=True`, the parent's run, upstream
and endpoint) that goes through the parent's `Pipeline` — the budget step reserves, clamps and
settles it against the run's caps, the context step measures and caps its context, the trace step
records its span — and is sent unstreamed to the same upstream with the agent's own headers
(credentials by the one rule of server/outbound.py).

A step that refuses the call (a cap, a cancelled run) raises its `Rejection` to the caller, which
answers the agent's request with it; the deadline bounds the call and is a `DeadlineExceeded`;
an operator's cancel of the run interrupts it like the agent's own call.

The policies in proxy/context/ see these calls only as a `ModelCaller` (`InnerCalls.caller`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from proxy.context import ModelAnswer, ModelCaller
from proxy.errors import DeadlineExceeded, InvalidRequest, Rejection, UpstreamAnswerTooLarge
from proxy.providers.base import BodyError
from proxy.server.flow import Flow
from proxy.server.outbound import OutboundClient, ResponseTooLarge, model_headers, read_bounded, run_deadline


class InnerCalls:
    """runcap's own model calls, through `client`; each goes through its parent flow's pipeline."""

    def __init__(self, client: OutboundClient, max_answer_bytes: int = 128 * 1024 * 1024) -> None:
        self.client = client
        self.max_answer_bytes = max_answer_bytes  # the agent's calls' bound (config `max_answer_bytes`)

    def caller(self, parent: Flow) -> ModelCaller:
        """`parent`'s calls as the policies see them: body in, `ModelAnswer` out."""

        async def call(body: dict[str, Any]) -> ModelAnswer:
            child, parsed = await self.call(parent, body)
            return ModelAnswer(
                status=child.status,
                upstream_status=child.upstream_status,
                body=child.response_body or b"",
                parsed=parsed,
                error=child.error,
                reply_headers=dict(child.reply_headers),
            )

        return call

    async def call(self, parent: Flow, body: dict[str, Any]) -> tuple[Flow, dict[str, Any] | None]:
        """One unstreamed call of `body` to `parent`'s upstream and endpoint, as a step of its run.
        Returns the child flow and the parsed answer (None when the upstream failed: the child's
        status, outcome, error and `response_body` say how)."""
        pipeline = parent.pipeline
        assert parent.adapter is not None and pipeline is not None, "an inner call outside a pipeline"
        child = Flow(parent.request, parent.upstream, parent.target, parent.adapter, inner=True)
        child.pipeline = pipeline
        child.run = parent.run
        child.tenant, child.api_key = parent.tenant, parent.api_key
        child.body = orjson.dumps(body)
        child.body_json = body
        try:
            try:
                try:
                    child.info = parent.adapter.parse_request(body)
                except BodyError as e:
                    raise InvalidRequest(f"runcap's own call is malformed: {e}", param="body") from None
                await pipeline.request(child)
            except Rejection as rej:
                child.status, child.outcome, child.error = rej.status, rej.outcome, rej.message
                raise
            return child, await self._exchange(parent, child)
        finally:
            await pipeline.done(child)

    async def _exchange(self, parent: Flow, child: Flow) -> dict[str, Any] | None:
        assert child.run is not None and child.pipeline is not None
        deadline = run_deadline(child.run, child.state, parent.started_wall)
        sent = orjson.dumps(child.body_json) if child.body_changed else child.body
        child.sent_body = sent
        headers = model_headers(child.request.headers, child.flavor, child.api_key)
        try:
            async with self.client.call(
                "POST", child.target.url, deadline=deadline, headers=headers, data=sent
            ) as upstream:
                child.upstream_status = child.status = upstream.status
                raw = await read_bounded(upstream, self.max_answer_bytes)
        except ResponseTooLarge as e:
            # Answered, and billed: charged at its reservation (no usage read), as forward.py does.
            child.response_bytes = e.size or self.max_answer_bytes + 1
            child.outcome, child.status = "error", UpstreamAnswerTooLarge.status
            child.error = (
                f"upstream '{child.upstream.name}' answered runcap's own call with more than "
                f"max_answer_bytes = {self.max_answer_bytes} bytes"
            )
            raise UpstreamAnswerTooLarge(
                f"{child.error} (step {child.step}); the answer was cut and the call is charged at "
                "its reservation"
            ) from None
        except TimeoutError:
            child.cut_reason = child.cut_reason or "deadline"
            child.outcome, child.status = DeadlineExceeded.outcome, DeadlineExceeded.status
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
        await child.pipeline.response(child)
        return parsed
