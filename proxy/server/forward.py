"""The forwarding core: agent request in → upstream → response out, through the steps' pipeline.

It knows HTTP, not budgets: reading the request, the exchange (one `OutboundClient.call`,
bounded by the run's deadline; headers by server/outbound.py's credential rule), streaming relay
chunk by chunk, and turning a cut (deadline, cancel, client gone, upstream reset) into the right
answer for the agent. Everything else is a `FlowStep` the `Pipeline` (server/flow.py) calls —
context policies and the `runcap_fetch` loop included (server/steps/context.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.caps import parse_run_headers
from proxy.config import Config, UpstreamConfig
from proxy.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    Rejection,
    RunCancelled,
    UpstreamAnswerTooLarge,
    UpstreamUnavailable,
)
from proxy.providers.base import BodyError, ResponseInfo
from proxy.providers.registry import adapter_for
from proxy.server.auth import ClientAuth
from proxy.server.flow import Flights, Flow, Pipeline
from proxy.server.headers import response_headers
from proxy.server.metrics import Metrics
from proxy.server.outbound import OutboundClient, ResponseTooLarge, model_headers, read_bounded, run_deadline
from proxy.server.request_body import read_body
from proxy.upstream_url import UpstreamTarget

log = logging.getLogger("runcap.forward")


class Forwarder:
    def __init__(
        self, config: Config, client: OutboundClient, steps: Pipeline, flights: Flights, metrics: Metrics
    ) -> None:
        self.config = config
        self.client = client  # every call to a model upstream leaves through it (server/outbound.py)
        self.steps = steps  # also runcap's own calls within a run go through them (server/inner.py)
        self.flights = flights
        self.metrics = metrics
        # Streams are captured for the payload store only when it keeps bodies at all.
        self.capture_limit = 0 if config.spans.payloads == "off" else config.spans.payload_max_bytes

    async def handle(
        self, request: web.Request, upstream: UpstreamConfig, target: UpstreamTarget, clients: ClientAuth
    ) -> web.StreamResponse:
        # Chosen on the decoded form of exactly the path that is sent (upstream_url.py).
        adapter = adapter_for(upstream.flavor, target.path) if request.method == "POST" else None
        flow = Flow(request, upstream, target, adapter, pipeline=self.steps)
        try:
            reply = await self._answer(flow, clients)
        except ConnectionError:
            # The client went away (while sending its body): nobody to answer; on record as 499.
            flow.status, flow.outcome, flow.error = flow.status or 499, "cancelled", "client disconnected"
            raise
        except web.HTTPException:
            raise  # an answer aiohttp sends itself
        except Exception as e:
            # A bug: the agent gets a 500 in its own error shape, and the done steps (access log,
            # span) record that 500 — not the "0 ok" of a flow nobody finished.
            log.exception("%s %s failed inside runcap", request.method, request.path)
            if flow.reply is not None and flow.reply.prepared:
                reply = flow.reply
                flow.outcome, flow.error = "error", f"{type(e).__name__} inside runcap"
            else:
                reply = self._reject(flow, InternalError(
                    f"runcap failed on this request ({type(e).__name__}); the call may not have been "
                    "sent. This is a bug in runcap: report it with the server log"
                ))  # fmt: skip
        finally:
            await self.steps.done(flow)
        return await self._finish(flow, reply)

    async def _answer(self, flow: Flow, clients: ClientAuth) -> web.StreamResponse:
        """The call, up to the answer: a buffered response not yet sent, or a relayed stream
        without its closing part (`flow.held_tail`) and end-of-body — both follow the done steps."""
        try:
            await self._read(flow, clients)
        except Rejection as rej:
            return self._reject(flow, rej)
        return await self._forward(flow)

    async def _finish(self, flow: Flow, reply: web.StreamResponse) -> web.StreamResponse:
        """After the done steps: the answer, now that it is on record — or, when a step could not
        record it (`flow.unrecorded`), that refusal instead: a buffered answer is replaced by it;
        a stream gets it as an error event in place of its closing part, then its end."""
        refused = flow.unrecorded
        if not reply.prepared:
            if refused is None:
                return reply  # a buffered body is sent after the handler returns
            self.metrics.rejections.labels(refused.code or refused.type).inc()
            return refused.response(flow.flavor, {"X-Run-Id": flow.run.run_id} if flow.run else {})
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            if refused is not None:
                self.metrics.rejections.labels(refused.code or refused.type).inc()
                await reply.write(_error_event(flow.flavor, refused))
            elif flow.held_tail:
                await reply.write(flow.held_tail)
            await reply.write_eof()
        return reply

    async def _forward(self, flow: Flow) -> web.StreamResponse:
        """The steps' request hooks, then the upstream exchange (the run's call is in flight)."""
        task = asyncio.current_task()
        assert task is not None and flow.run is not None
        # In flight from here: an operator's cancel also cuts what the steps do before the
        # call (a context policy's summary call is a model call of its own).
        self.flights.add(flow.run.run_id, task, flow)
        self.metrics.calls_in_flight += 1
        try:
            try:
                await self.steps.request(flow)
            except Rejection as rej:
                return self._reject(flow, rej)
            except asyncio.CancelledError:
                if flow.cut_reason != "cancel":
                    raise  # shutting down
                task.uncancel()
                return self._reject(flow, RunCancelled(
                    f"run {flow.run.run_id} was cancelled while runcap prepared this call; it was "
                    "not sent. Start a new run to continue"
                ))  # fmt: skip
            return await self._exchange(flow)
        finally:
            self.metrics.calls_in_flight -= 1
            self.flights.remove(flow.run.run_id, task)

    async def _read(self, flow: Flow, clients: ClientAuth) -> None:
        """The run's headers and the body, read and checked (the steps' request hooks follow)."""
        request = flow.request
        flow.tenant = clients.tenant(request)
        flow.api_key = clients.upstream_key(flow.tenant, flow.upstream.name) or flow.upstream.api_key
        flow.run = parse_run_headers(
            request.headers,
            self.config.caps,
            require_run_id=self.config.require_run_id,
            tenant=flow.tenant,
        )
        flow.body = await read_body(request, self.config.max_body_bytes)
        if flow.adapter is not None:
            try:
                body = orjson.loads(flow.body)
            except orjson.JSONDecodeError as e:
                raise InvalidRequest(f"request body is not valid JSON: {e}", param="body") from None
            if not isinstance(body, dict):
                raise InvalidRequest("request body must be a JSON object", param="body")
            flow.body_json = body
            try:
                flow.info = flow.adapter.parse_request(body)
            except BodyError as e:
                raise InvalidRequest(str(e), param=e.field) from None
            except RecursionError:
                # orjson takes up to 1024 levels; the readers recurse (a 500 was the answer)
                raise InvalidRequest(
                    "request body: nested deeper than runcap reads (messages and content blocks "
                    "nest a few levels; this body nests hundreds)",
                    param="body",
                ) from None

    def _reject(self, flow: Flow, rej: Rejection) -> web.Response:
        flow.status = rej.status
        flow.outcome = rej.outcome
        flow.error = rej.message
        self.metrics.rejections.labels(rej.code or rej.type).inc()
        headers = {"X-Run-Id": flow.run.run_id} if flow.run else {}
        return rej.response(flow.flavor, headers)

    # -- the upstream exchange --------------------------------------------------------------

    async def _exchange(self, flow: Flow) -> web.StreamResponse:
        assert flow.run is not None
        body = orjson.dumps(flow.body_json) if flow.body_changed else flow.body
        flow.sent_body = body
        reply: web.StreamResponse | None = None
        flow.upstream_started = time.perf_counter()
        try:
            async with self.client.call(
                flow.request.method,
                flow.target.url,
                deadline=run_deadline(flow.run, flow.state, flow.started_wall),
                headers=model_headers(flow.request.headers, flow.flavor, flow.api_key),
                data=body,
            ) as upstream:
                flow.upstream_status = upstream.status
                relay = flow.adapter is None and not flow.buffer_answer
                if relay or upstream.content_type == "text/event-stream":
                    reply = await self._start_stream(flow, upstream)
                    await self._relay(flow, upstream, reply)
                    return reply
                return await self._buffered(flow, upstream)
        except TimeoutError:
            flow.cut_reason = flow.cut_reason or "deadline"
            return await self._cut(flow, reply, DeadlineExceeded(
                f"run {flow.run.run_id if flow.run else ''} reached its deadline during the call to "
                f"upstream '{flow.upstream.name}'; the call was aborted. End the run."
            ))  # fmt: skip
        except asyncio.CancelledError:
            if flow.cut_reason != "cancel":
                raise  # the server is shutting down
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            return await self._cut(flow, reply, RunCancelled(
                f"run {flow.run.run_id if flow.run else ''} was cancelled during the call to upstream "
                f"'{flow.upstream.name}'; the call was aborted"
            ))  # fmt: skip
        except ConnectionResetError:
            # The agent went away mid-stream: stop reading the upstream (closing it stops the
            # generation we would otherwise pay for) and settle what was used.
            flow.outcome = "cancelled"
            flow.error = "client disconnected"
            return reply if reply is not None else web.Response(status=499)
        except (aiohttp.ClientError, OSError) as e:
            flow.upstream_unreached = isinstance(e, aiohttp.ClientConnectorError)
            return await self._cut(flow, reply, UpstreamUnavailable(
                f"upstream '{flow.upstream.name}' ({flow.upstream.display_url}) failed: "
                f"{type(e).__name__}: {e}".rstrip(": ")
            ))  # fmt: skip
        finally:
            flow.upstream_answered()  # cut short: the wait ends here

    async def _buffered(self, flow: Flow, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        limit = self.config.max_answer_bytes
        try:
            body = await read_bounded(upstream, limit)
        except ResponseTooLarge as e:
            # The upstream answered (and bills it): the step counts and is charged at its
            # reservation (budget.settlement: no usage read); the agent gets the refusal.
            flow.upstream_answered()
            flow.response_bytes = e.size or limit + 1
            return await self._cut(flow, None, UpstreamAnswerTooLarge(
                f"upstream '{flow.upstream.name}' answered with more than max_answer_bytes = {limit} "
                f"bytes{f' (Content-Length {e.size})' if e.size else ''}; the answer was cut and the "
                "call is charged at its reservation"
            ))  # fmt: skip
        flow.upstream_answered()
        flow.response_body = body
        flow.status = upstream.status
        if upstream.status >= 400:
            flow.outcome = "error"
            flow.error = body[:500].decode("utf-8", "replace")
        elif flow.adapter is not None:
            try:
                parsed = orjson.loads(body)
                flow.response_info = flow.adapter.parse_response(parsed) if isinstance(parsed, dict) else None
            except (orjson.JSONDecodeError, BodyError) as e:
                log.warning("could not read %s response from %s: %s", flow.endpoint, flow.upstream.name, e)
        await self.steps.response(flow)
        if upstream.status < 400 and not flow.inner:
            try:
                await self.steps.answer(flow)  # a step may answer in the upstream's place
            except Rejection as rej:
                # A step's own call refused (a fetch continuation: a cap, the deadline) or the
                # upstream gone: the agent's request gets runcap's usual answer for it; the calls
                # made so far are settled and traced.
                flow.status = rej.status
                self.metrics.rejections.labels(rej.code or rej.type).inc()
                return rej.response(flow.flavor, {"X-Run-Id": flow.run.run_id} if flow.run else {})
        headers = self._reply_headers(flow, upstream)
        if flow.answer is not None:
            return web.Response(status=flow.status, body=flow.answer, headers=headers)
        if flow.response_body is not body:  # a step rewrote the answer (its length is the new one's)
            body = flow.response_body or b""
            headers.popall("Content-Length", None)
        return web.Response(status=upstream.status, body=body, headers=headers)

    def _reply_headers(self, flow: Flow, upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
        out = response_headers(upstream.headers)
        out.update(flow.reply_headers)
        return out

    async def _start_stream(self, flow: Flow, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        flow.streamed = True
        flow.status = upstream.status
        if upstream.status >= 400:
            flow.outcome = "error"
        await self.steps.response(flow)
        reply = flow.reply = web.StreamResponse(
            status=upstream.status, headers=self._reply_headers(flow, upstream)
        )
        await reply.prepare(flow.request)
        return reply

    async def _relay(self, flow: Flow, upstream: aiohttp.ClientResponse, reply: web.StreamResponse) -> None:
        """Relay bytes as they arrive; the adapter's reader reads usage and tool calls on the way
        (and drops the usage chunk runcap asked for when the agent did not).

        A stream the upstream ended without its closing event (an error event, a close after the
        deltas, an event too long to read) is `incomplete`: its usage is not final, so the budget
        settles it at least at its reservation. One that closed with an error it reported
        (Responses `response.failed`) is an `error`, settled at the usage it reported."""
        reader = None
        if flow.adapter is not None and upstream.status < 400:
            strip = flow.injected_stream_usage and not (flow.info and flow.info.client_wants_stream_usage)
            reader = flow.adapter.stream_reader(strip)
        first = True
        capture_limit = self.capture_limit if reader is not None else 0
        captured = flow.captured = bytearray() if capture_limit else None
        try:
            async for chunk in upstream.content.iter_any():
                if first:
                    flow.ttft_ms = flow.duration_ms
                    first = False
                flow.response_bytes += len(chunk)
                if captured is not None:
                    if len(captured) + len(chunk) <= capture_limit:
                        captured += chunk
                    else:
                        captured = flow.captured = None  # too large to store: hash nothing
                out = reader.feed(chunk) if reader is not None else chunk
                if reader is not None and reader.ended:
                    # The closing event arrived (in this chunk or before): from here on the bytes
                    # wait for the done steps, so the agent has the end only once it is on record.
                    flow.held_tail += out
                elif out:
                    await reply.write(out)
        except BaseException:
            if reader is not None:
                # Cut (cancel, deadline, the agent or the upstream gone): keep the usage the
                # provider reported so far (Anthropic's message_start input, say) — the tokens
                # seen; the budget settles the rest at the reservation. Only the usage: a cut
                # answer's half-streamed tool calls are not the model's requests.
                seen = reader.info
                flow.response_info = ResponseInfo(model=seen.model, usage=seen.usage, complete=False)
            raise
        flow.upstream_answered()
        if reader is not None:
            tail = reader.close()
            if tail:
                if reader.ended:
                    flow.held_tail += tail
                else:
                    await reply.write(tail)
            info = flow.response_info = reader.info
            if flow.outcome == "ok" and not info.complete:
                flow.outcome = "incomplete"
                flow.error = info.error or "the stream ended without its closing event"
            elif flow.outcome == "ok" and info.error:
                flow.outcome = "error"
                flow.error = info.error
        # the closing part and the end of the body are written by _finish(), after the done steps

    async def _cut(self, flow: Flow, reply: web.StreamResponse | None, rej: Rejection) -> web.StreamResponse:
        """The call was cut (deadline, cancel, upstream failure). Before the agent got headers it
        gets the rejection; mid-stream it gets an error event in its format and the end."""
        flow.outcome = rej.outcome
        flow.error = rej.message
        self.metrics.rejections.labels(rej.code or rej.type).inc()
        if reply is None or not reply.prepared:
            flow.status = rej.status
            headers = {"X-Run-Id": flow.run.run_id} if flow.run else {}
            return rej.response(flow.flavor, headers)
        try:
            await reply.write(_error_event(flow.flavor, rej))
        except (ConnectionResetError, RuntimeError):
            pass
        return reply


def _error_event(flavor: str, rej: Rejection) -> bytes:
    """A rejection as an event of a stream already under way, in the stream's format."""
    if flavor == "anthropic":
        return b"event: error\ndata: " + rej.body("anthropic") + b"\n\n"
    return b"data: " + rej.body("openai") + b"\n\n"
