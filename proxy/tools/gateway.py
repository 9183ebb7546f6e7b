"""`/tools/{name}[/...]`: tool calls through runcap — counted, deadline- and cancel-bound, and
at-most-once when they have side effects (DESIGN.md "Idempotent tool calls").

One call:
  0. the tool's rules (`[[tools.NAME.rules]]`, toolcall/policy.py): a denied call is a 403
     `tool_call_denied` naming the rule and its reason, one that needs approval waits at the
     approval gate — both before the ledger, so nothing of a denied call is recorded;
  1. the ledger, atomically: run live? tool-call cap? the call's idempotency record — replay a
     completed one, wait for one in flight, refuse (409) an unknown one, or record the intent
     (`in_flight`) and count the call;
  2. forward method, sub-path, query and body to the tool, with the run's remaining time as the
     timeout (min the tool's `timeout_s`) and `X-Run-Id`, `Idempotency-Key`, `X-Run-Deadline`,
     `X-Run-Remaining-Ms`; registered in `Flights` so a cancel closes the connection;
  3. record the outcome by the rule MCP `tools/call` follows too (toolcall/outcome.py): the
     tool's HTTP answer, whatever its status (a 3xx, a proxy's 502 or 504 included) — or
     `unknown` when the call was cut after it may have reached the tool (cancel, timeout, reset);
     released only when it never left (no connection) — and answer; one `tool` span.

Idempotency key: the caller's `Idempotency-Key` (namespaced by run in the ledger), else
sha256(canonical_json({"run", "tool", "args", "op"}))[:32] with `args` the JSON body (restricted
to the tool's `key_fields`) and `op` the `X-Run-Operation-Id`. For any call other than a POST to
the tool's root without a query, the "tool" field is "METHOD name/sub-path?query", so
`DELETE /tools/crm/orders/1` and `.../orders/2` are different operations.

The call's record, its side of the ledger (waiting out a duplicate, `unknown`), the outcome
rule, its timeout and its span are shared with MCP `tools/call` (proxy/toolcall/); this module
does not import proxy/mcp/, nor it this one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.caps import RunRequest, claimed_run_id, parse_run_headers
from proxy.config import ToolConfig
from proxy.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Rejection,
    RunCancelled,
    ToolTimeout,
    UpstreamUnavailable,
)
from proxy.hashing import args_hash, idempotency_key, parse_json, result_hash
from proxy.ledger.base import IdempotencyRecord, RunState, ToolCallRequest
from proxy.server.headers import AGENT_CREDENTIALS, request_headers, response_headers
from proxy.server.outbound import ResponseTooLarge, read_bounded, release_or_drop
from proxy.server.request_body import read_body
from proxy.toolcall.call import ToolCall
from proxy.toolcall.clock import tool_clock
from proxy.toolcall.keys import key_args
from proxy.toolcall.outcome import never_left
from proxy.toolcall.policy import ADMITTED
from proxy.toolcall.route import ToolRoute
from proxy.toolcall.span import record_tool_call
from proxy.upstream_url import UpstreamTarget, remaining_segments

log = logging.getLogger("runcap.tools")

SIDE_EFFECT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Response headers worth replaying with a recorded outcome (a 3xx is replayed with its Location).
RECORDED_HEADERS = ("content-type", "location")


def has_side_effects(tool: ToolConfig, method: str) -> bool:
    return tool.side_effects if tool.side_effects is not None else method.upper() in SIDE_EFFECT_METHODS


def canonical_query(query: str) -> str:
    """The query as an operation's identity: pairs decoded and sorted (`?b=2&a=1` is `?a=1&b=2`)."""
    return urlencode(sorted(parse_qsl(query, keep_blank_values=True)))


def derive_key(
    run_id: str, tool: ToolConfig, method: str, tail: str, query: str, body: bytes, operation_id: str | None
) -> str:
    """`tail` is the decoded sub-path, `query` the canonical query (`canonical_query`): two
    spellings of one operation (`%41` for `A`, reordered parameters) get one key."""
    ok, parsed = parse_json(body) if body else (True, None)
    args: Any = key_args(parsed, tool.key_fields) if ok else {"raw_sha256": hashlib.sha256(body).hexdigest()}
    name = tool.name
    if method.upper() != "POST" or tail or query:
        name = f"{method.upper()} {tool.name}/{tail}" + (f"?{query}" if query else "")
    return idempotency_key(run_id, name, args, operation_id)


class ToolGateway(ToolRoute):
    def add_to(self, app: web.Application) -> None:
        app.router.add_route("*", "/tools/{name}", self.handle)
        app.router.add_route("*", "/tools/{name}/{tail:.*}", self.handle)

    # -- the call -------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        # Metric labels stay bounded: a name that is not configured counts as "unknown".
        call = ToolCall(name, known=name in self.config.tools)
        try:
            return await self._handle(request, call)
        except Rejection as rej:
            return self._reject(call, rej)
        finally:
            self._record(request, call)

    async def _handle(self, request: web.Request, call: ToolCall) -> web.StreamResponse:
        tool = self.config.tools.get(call.tool)
        if tool is None:
            known = ", ".join(sorted(self.config.tools)) or "none"
            raise NotFound(
                f"no tool named {call.tool!r}; configured tools: {known} "
                f"(add [tools.{call.tool}] to runcap.toml)",
                param="tool",
            )
        run = call.run = parse_run_headers(
            request.headers,
            self.config.caps,
            require_run_id=self.config.require_run_id,
            tenant=self.clients.tenant(request),
        )
        # Everything that can fail before the tool is reached fails here, before the ledger
        # records an intent: a call refused now can never be left `unknown`.
        segments, query = remaining_segments(request.raw_path, 2)
        target = tool.base.target(segments, query)
        body = await read_body(request, self.config.max_body_bytes)
        tail = "/".join(unquote(seg) for seg in segments)
        headers = self._tool_headers(request, tool, run)
        call.args_hash = args_hash(body)
        query = canonical_query(query)
        call.path = tail + (f"?{query}" if query else "")
        op_hash = ""
        if has_side_effects(tool, request.method):
            if run.generated:
                # A generated run id is new every time: no repeat could ever be recognised.
                raise InvalidRequest(
                    f"X-Run-Id: required on calls to side-effecting tool {tool.name!r} — the "
                    "idempotency key is namespaced by the run, so without one a retry would execute again",
                    param="X-Run-Id",
                )
            # The operation's identity (what the derived key hashes), also under a caller's own
            # key: the ledger refuses a key reused for another operation (422), never replays it.
            op_hash = derive_key(run.run_id, tool, request.method, tail, query, body, run.operation_id)
            call.key = run.idempotency_key or op_hash
        req = ToolCallRequest(
            run.run_id, run.task, run.caps, time.time(), tool.name, call.key, call.args_hash,
            method=request.method.upper(), path=call.path, op_hash=op_hash, parent_run_id=run.parent,
        )  # fmt: skip

        async with self.in_flight(run.run_id, call, f"tool {tool.name!r}"):
            # The tool's rules (toolcall/policy.py) decide before the ledger records anything: a
            # denied call, or one that waits for a person, has no idempotency record.
            admission = ADMITTED
            if self.policy.has_rules(tool.name):
                if body:  # kept before a rule may hold the call: `runcap approvals` shows its arguments
                    call.keep_body(self.recorder, body, response=False)
                ok, parsed = parse_json(body) if body else (True, {})
                admission = await self.policy.admit(
                    call, req, run, args=parsed if ok else {}, method=req.method, path=call.path
                )
                req = replace(req, now=time.time())  # an approval may have been waited for
            try:
                start = await self.calls.begin(req)
            except Rejection:
                await admission.release()  # refused by the ledger: not one of a cap rule's calls
                raise
            call.state = start.state
            if start.action == "replay":
                assert start.record is not None
                return self._replay(call, start.record)
            try:
                return await self._execute(request, call, tool, target, headers, body, start.state)
            except (Rejection, asyncio.CancelledError):
                raise
            except Exception:
                # Anything unforeseen after the intent was recorded: the outcome is unknown, and
                # saying so (409 until reconciled) beats a record left in flight for ever.
                await self._unknown(call, "runcap failed during the call")
                raise

    def _replay(self, call: ToolCall, record: IdempotencyRecord) -> web.Response:
        call.status = record.status or 200
        call.outcome = "replayed"
        call.result_hash = result_hash(record.body)
        self.metrics.tool_replays.labels(call.tool).inc()
        headers = {**record.headers, **call.answer_headers(), "X-Idempotent-Replay": "true"}
        return web.Response(status=call.status, body=record.body, headers=headers)

    def _tool_headers(self, request: web.Request, tool: ToolConfig, run: RunRequest) -> CIMultiDict[str]:
        """The agent's headers minus its credentials (unless the tool allow-lists one), plus the
        tool's configured headers and the run's id."""
        drop = (*(h for h in AGENT_CREDENTIALS if h not in tool.forward_headers), "idempotency-key")
        headers = request_headers(request.headers, drop)
        for name, value in tool.headers.items():
            headers[name] = value
        headers["X-Run-Id"] = run.run_id
        return headers

    async def _execute(
        self,
        request: web.Request,
        call: ToolCall,
        tool: ToolConfig,
        target: UpstreamTarget,
        headers: CIMultiDict[str],
        body: bytes,
        state: RunState,
    ) -> web.StreamResponse:
        run = call.run
        assert run is not None
        clock = tool_clock(run, state, tool.timeout_s)
        timeout, by_deadline = clock.seconds, clock.by_deadline

        if call.key is not None:
            headers["Idempotency-Key"] = call.key
        headers.update(clock.headers())

        recorder = self.recorder
        if body and not call.request_hash:
            call.keep_body(recorder, body, response=False)
        event = self.calls.executing(run.run_id, call.key)
        upstream: aiohttp.ClientResponse | None = None
        answer_headers: Mapping[str, str]  # the tool's, or those of runcap's own 502
        try:
            try:
                async with asyncio.timeout(timeout):
                    upstream = await self.client.request(
                        request.method, target.url, headers=headers, data=body
                    )
                    data = await read_bounded(upstream, self.config.tool_max_response_bytes)
                    status, answer_headers = upstream.status, upstream.headers
            except ResponseTooLarge as e:
                # The tool ran and answered, but its answer is too large to hold: that is the
                # outcome (a repeat replays this 502, never a second execution).
                limit = self.config.tool_max_response_bytes
                status, answer_headers = 502, CIMultiDict({"Content-Type": "application/json"})
                data = UpstreamUnavailable(
                    f"tool {tool.name!r} answered with {e.size or 'more than'} bytes, over "
                    f"tool_max_response_bytes = {limit}; the answer was cut off (the call did take "
                    "place: it is recorded and will not be executed again)",
                    code="tool_response_too_large",
                    param="tool_max_response_bytes",
                ).body("openai")
            except TimeoutError:
                await self._unknown(call, "deadline" if by_deadline else "tool timeout")
                if by_deadline:
                    call.cut_reason = "deadline"
                    await self.ledger.set_status(run.run_id, state.deadline_status, time.time())
                    raise DeadlineExceeded(
                        f"run {run.run_id} reached its deadline during the call to tool {tool.name!r}; "
                        "the call was aborted (it may or may not have taken effect). End the run."
                    ) from None
                raise ToolTimeout(
                    f"tool {tool.name!r} did not answer within its timeout_s = {tool.timeout_s:g} s; "
                    "the call was aborted and may or may not have taken effect"
                    + (" — a repeat gets 409 until it is reconciled" if call.key else "")
                ) from None
            except asyncio.CancelledError:
                if call.cut_reason != "cancel":
                    await self._unknown(call, "runcap shut down during the call")
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                await self._unknown(call, "run cancelled during the call")
                raise RunCancelled(
                    f"run {run.run_id} was cancelled during the call to tool {tool.name!r}; the call was "
                    "aborted (it may or may not have taken effect)"
                ) from None
            except (aiohttp.ClientError, OSError) as e:
                # Released only when it provably never left; else unknown (toolcall/outcome.py).
                await self.calls.failed(call, e, call.tool)
                if never_left(e):
                    raise UpstreamUnavailable(
                        f"tool {tool.name!r} ({tool.display_url}) is unreachable: {e}"
                    ) from None
                raise UpstreamUnavailable(
                    f"tool {tool.name!r} ({tool.display_url}) failed during the call: "
                    f"{type(e).__name__}: {e}; it may or may not have taken effect"
                ) from None
        finally:
            if upstream is not None:
                release_or_drop(upstream)
            self.calls.finished(run.run_id, call.key, event)

        # The tool has answered: from here on the call is not cut any more (a cancel now would
        # only lose the outcome), and recording the outcome must not be interrupted.
        task = asyncio.current_task()
        if task is not None:
            self.flights.remove(run.run_id, task)
        call.status = status
        call.reached = "true"
        call.result_hash = result_hash(data)
        if status >= 400:
            call.outcome = "error"
            call.error = data[:500].decode("utf-8", "replace")
        call.keep_body(
            recorder, data, response=True, is_error=status >= 400,
            content_type=answer_headers.get("content-type", ""),
        )  # fmt: skip
        if call.key is not None:
            recorded = {h: answer_headers[h] for h in RECORDED_HEADERS if h in answer_headers}
            # The answer is the outcome, whatever its status: a repeat replays it.
            await self.calls.complete(run.run_id, call.key, status, recorded, data)
            event.set()
        out = response_headers(answer_headers)
        out.update(call.answer_headers())
        return web.Response(status=status, body=data, headers=out)

    async def _unknown(self, call: ToolCall, reason: str) -> None:
        await self.calls.unknown(call, reason, call.tool)

    def _reject(self, call: ToolCall, rej: Rejection) -> web.Response:
        call.refused(rej)
        self.metrics.rejections.labels(rej.code or rej.type).inc()
        headers = {"X-Run-Id": call.run.run_id} if call.run else {}
        if call.key:
            headers["Idempotency-Key"] = call.key
        return rej.response("openai", headers)

    # -- span and metrics -----------------------------------------------------------------------

    def _record(self, request: web.Request, call: ToolCall) -> None:
        call.attributes["tool.path"] = call.path
        access = None
        if self.config.log_requests:
            access = (request.method, request.path, claimed_run_id(request.headers))
        record_tool_call(
            self.recorder, self.metrics, call, endpoint=request.method,
            metric_label=call.tool if call.known else "unknown", access=access,
        )  # fmt: skip
