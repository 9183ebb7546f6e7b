"""MCP `tools/call`: a tool call of the run, at most once when side-effecting (DESIGN.md "MCP
servers"), through the same machinery as `/tools` (proxy/toolcall/):
  1. denied tool → -32044; the tool's rules (`[[mcp.NAME.tools.TOOL.rules]]`, toolcall/policy.py,
     before the ledger): a denial is a `tools/call` result with `isError: true` and the rule's
     reason as its text (the model reads it; `_meta["runcap/refusal"]` has the type, code and
     rule), an approval waits at the gate — for an agent that takes SSE, on a stream runcap
     opens at once and keeps alive (`_keepalive`; the decision's answer then comes on it);
     side effects from the operator's override or the annotations (a tool not seen listed yet:
     runcap lists the server's tools first, in the agent's session: listing.py);
  2. the ledger, atomically: run live? `X-Run-Max-Tool-Calls`? For a side-effecting call its
     idempotency record — key = sha256({"run", "tool": "mcp:{server}/{tool}", "args":
     params.arguments restricted to `key_fields`, "op": `params._meta["runcap/operation_id"]` or
     `X-Run-Operation-Id`})[:32] — replay a completed one (its `result`, under this request's id,
     `_meta["runcap/replay"] = true`), wait for one in flight, refuse an unknown one (-32043), or
     record the intent; then the tool's `max_calls_per_run`;
  3. forward (relay.py), with the run's remaining time (or the tool's `timeout_s`) as the
     timeout, and `X-Run-Id`, `Idempotency-Key`, `X-Run-Deadline`, `X-Run-Remaining-Ms`; a cancel
     or the deadline cuts it: the server's stream is closed and it gets `notifications/cancelled`
     for the request id; the tool's own timeout is a result with `isError: true` the model can
     read;
  4. the outcome, by the rule `/tools` follows too (toolcall/outcome.py; recorded and replayed
     as outcome.py says): the server's JSON-RPC response (a result or an error, whatever its
     code) is recorded before the agent sees it; a stream that ends without it is resumed
     (`Last-Event-ID`) when the server made it resumable; an HTTP answer without it (a proxy's
     502/504, a redirect), a reset or an unreadable body is `unknown`; only a call that never
     left (no connection) is released;
  5. one `tool` span (tool_name = the MCP tool, `mcp.server`, `mcp.method.name`).

Per-tool `max_calls_per_run` is counted in the ledger as a run of its own
(`{run}/mcp:{server}/{tool}`, with that cap as its tool-call cap): atomic across replicas, and
nothing new in the ledger. A replay does not use it; a side-effecting call refused by it is not
counted against the run either.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
from multidict import CIMultiDict

from proxy.caps import RunCaps, RunRequest
from proxy.config import MCPServerConfig
from proxy.errors import (
    BudgetExceeded,
    DeadlineExceeded,
    InvalidRequest,
    Rejection,
    RunCancelled,
    UpstreamUnavailable,
)
from proxy.hashing import canonical_json, idempotency_key, result_hash
from proxy.ledger.base import IdempotencyRecord, RunState, ToolCallRequest
from proxy.mcp.catalog import ToolCatalog
from proxy.mcp.listing import ToolListing
from proxy.mcp.outcome import outcome_of, replayed
from proxy.mcp.relay import ANSWER_FAILED, Exchange, StreamableHTTPRelay
from proxy.mcp.reply import LiveReply, Reply
from proxy.mcp.wire import (
    JSON,
    ToolDenied,
    denied_result,
    dumps,
    is_response,
    json_object,
    refusal,
    result_message,
)
from proxy.server.outbound import release_or_drop
from proxy.toolcall.call import ToolCall
from proxy.toolcall.clock import tool_clock
from proxy.toolcall.keys import key_args
from proxy.toolcall.outcome import never_left, session_refused
from proxy.toolcall.policy import ADMITTED, ToolCallDenied
from proxy.toolcall.route import ToolRoute
from proxy.toolcall.span import record_tool_call


class MCPToolCalls:
    """Every `tools/call` request of an agent to an MCP server (the gateway routes them here)."""

    def __init__(self, route: ToolRoute, relay: StreamableHTTPRelay, catalog: ToolCatalog) -> None:
        self.route = route
        self.config = route.config
        self.ledger = route.ledger
        self.flights = route.flights
        self.metrics = route.metrics
        self.client = route.client
        self.recorder = route.recorder
        self.calls = route.calls
        self.relay = relay
        self.catalog = catalog
        self.listing = ToolListing(relay, catalog)

    async def call(
        self,
        ex: Exchange,
        message: dict[str, Any],
        body: bytes,
        reply: Reply,
    ) -> None:
        server, run, headers = ex.server, ex.run, ex.headers
        rid = message["id"]
        params = json_object(message.get("params"))
        meta = json_object(params.get("_meta"))
        name = params.get("name")
        call = ToolCall(name if isinstance(name, str) else "", run=run)
        call.attributes.update(
            {"mcp.server": server.name, "mcp.method.name": "tools/call", "jsonrpc.request.id": str(rid)}
        )
        for header, attribute in (
            ("Mcp-Session-Id", "mcp.session.id"),
            ("MCP-Protocol-Version", "mcp.protocol.version"),
        ):
            if headers.get(header):
                call.attributes[attribute] = headers[header]
        # The model's tool call id when the agent passes it on, else the request's own id.
        given = meta.get("runcap/tool_call_id")
        call.tool_call_id = given if isinstance(given, str) else str(rid)
        label = f"mcp:{server.name}"
        try:
            await self._admit(ex, message, params, meta, body, reply, call)
        except Rejection as rej:
            call.refused(rej)
            self.metrics.rejections.labels(rej.code or rej.type).inc()
            # A rule's denial is a result the model reads (the spec's tool execution error); every
            # other refusal is a JSON-RPC error.
            answer = denied_result(rid, rej) if isinstance(rej, ToolCallDenied) else refusal(rid, rej)
            await reply.message(answer, call.answer_headers())
        finally:
            access = ("POST", f"/mcp/{server.name}", run.run_id) if self.config.log_requests else None
            record_tool_call(
                self.recorder, self.metrics, call, endpoint="tools/call", metric_label=label, access=access
            )

    async def _admit(
        self,
        ex: Exchange,
        message: dict[str, Any],
        params: dict[str, Any],
        meta: dict[str, Any],
        body: bytes,
        reply: Reply,
        call: ToolCall,
    ) -> None:
        server, target, run, headers = ex.server, ex.target, ex.run, ex.headers
        name = call.tool
        if not name:
            raise InvalidRequest("tools/call: params.name must be the name of a tool", param="params.name")
        if name in server.deny:
            raise ToolDenied(
                f"tool {name!r} of MCP server {server.name!r} is denied by this runcap's operator "
                f"([mcp.{server.name}] deny); it was not called — answer without it"
            )
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise InvalidRequest("tools/call: params.arguments must be an object", param="params.arguments")
        if self.catalog.needs_listing(server, name):
            now, state = time.time(), None
            if not run.generated:  # the run's own deadline bounds runcap's listing too
                state = await self.calls.touch_run(run, now)
            deadline = tool_clock(run, state, now=now).deadline
            listed = await self.listing.list_tools(server, target, headers, meta, deadline)
            if listed and not self.catalog.knows(server.name, name):
                # The server's whole tools/list does not have it: never forwarded (-32044).
                raise ToolDenied(
                    f"tool {name!r} is not one of MCP server {server.name!r}'s tools (its tools/list "
                    "does not have it); it was not called — call one of the listed tools",
                    code="unknown_tool",
                )
        tool = server.tools.get(name)
        side_effects = self.catalog.side_effects(server, name)
        call.attributes["mcp.side_effects"] = "true" if side_effects else "false"
        try:
            canonical_args = canonical_json(arguments)
        except ValueError as e:
            raise InvalidRequest(f"tools/call: params.arguments: {e}", param="params.arguments") from None
        call.args_hash = hashlib.sha256(canonical_args).hexdigest()
        qualified = f"mcp:{server.name}/{name}"
        if side_effects:
            if run.generated:
                # A generated run id is new every time: no repeat could ever be recognised.
                raise InvalidRequest(
                    f"X-Run-Id: required on calls to side-effecting tool {name!r} of MCP server "
                    f"{server.name!r} — the idempotency key is namespaced by the run, so without one a "
                    "retry would execute again (set it on the client's Streamable HTTP transport)",
                    param="X-Run-Id",
                )
            args = key_args(arguments, tool.key_fields if tool is not None else None)
            operation = meta.get("runcap/operation_id")
            operation_id = operation if isinstance(operation, str) and operation else run.operation_id
            call.key = idempotency_key(run.run_id, qualified, args, operation_id)
        req = ToolCallRequest(
            run.run_id, run.task, run.caps, time.time(), qualified, call.key, call.args_hash,
            method="tools/call", path="", op_hash=call.key or "", parent_run_id=run.parent,
        )  # fmt: skip
        limit = tool.max_calls_per_run if tool is not None else None

        async with self.route.in_flight(run.run_id, call, f"tool {name!r} of MCP server {server.name!r}"):
            # The tool's rules (toolcall/policy.py) decide before the ledger records anything: a
            # denied call, or one that waits for a person, has no idempotency record.
            admission = ADMITTED
            if self.route.policy.has_rules(qualified):
                # Kept before a rule may hold the call: `runcap approvals` shows its arguments.
                call.keep_body(self.recorder, body, response=False)
                keepalive = self._keepalive(reply, call, message["id"], meta, headers)
                admission = await self.route.policy.admit(
                    call, req, run, args=arguments, server=server.name, keepalive=keepalive
                )
                req = replace(req, now=time.time())  # an approval may have been waited for
            try:
                if limit is not None and call.key is None:
                    await self._claim(server, name, limit, run)
                start = await self.calls.begin(req)
            except Rejection:
                await admission.release()  # refused after all: not one of a cap rule's calls
                raise
            call.state = start.state
            if start.action == "replay":
                assert start.record is not None
                await self._replay(call, start.record, message["id"], reply, label=f"mcp:{server.name}")
                return
            if limit is not None and call.key is not None:
                try:
                    await self._claim(server, name, limit, run)
                except Rejection:
                    await self.calls.release(run.run_id, call.key)  # never executed: not counted
                    await admission.release()
                    raise
            try:
                await self._execute(ex, message, body, reply, call, start.state)
            except (Rejection, asyncio.CancelledError):
                raise
            except Exception:
                await self.calls.unknown(call, "runcap failed during the call", f"mcp:{server.name}")
                raise

    def _keepalive(
        self, reply: Reply, call: ToolCall, rid: Any, meta: dict[str, Any], headers: CIMultiDict[str]
    ) -> Callable[[], Awaitable[None]] | None:
        """What a call held for a person sends while it waits (the gate calls it when the wait
        begins and every `approval_keepalive_s`): the first beat makes the answer an SSE stream
        (with the session's id and the run's headers), each beat is a comment on it — bytes that
        reset the agent's read timeout — and, when the request asked for progress
        (`params._meta.progressToken`), a `notifications/progress` whose text says what it waits
        for. None when the answer cannot be a stream: a batch, or an agent that takes only JSON."""
        if not isinstance(reply, LiveReply) or not reply.accepts_events():
            return None
        token = meta.get("progressToken")
        if isinstance(token, bool) or not isinstance(token, (str, int)):
            token = None
        session = headers.get("Mcp-Session-Id")
        beats = 0

        async def beat() -> None:
            nonlocal beats
            beats += 1
            approval = call.attributes.get("approval.id", "")
            waiting = f"waiting for a person's approval ({approval})"
            if not reply.opened:
                opened = {**({"Mcp-Session-Id": session} if session else {}), **call.answer_headers()}
                await reply.open_events(rid, opened)
            await reply.comment(f"runcap: {waiting}")
            if token is not None:
                progress = {"progressToken": token, "progress": beats, "message": f"runcap: {waiting}"}
                note = {"jsonrpc": "2.0", "method": "notifications/progress", "params": progress}
                await reply.message(note, {})

        return beat

    async def _claim(self, server: MCPServerConfig, tool: str, limit: int, run: RunRequest) -> None:
        """One of the tool's `max_calls_per_run`, counted atomically in the ledger as the tool
        calls of a run of its own (a `/` never occurs in a run id, so it meets no real run)."""
        qualified = f"mcp:{server.name}/{tool}"
        quota = ToolCallRequest(
            f"{run.run_id}/{qualified}", "", RunCaps(max_tool_calls=limit), time.time(), qualified, None
        )
        try:
            await self.metrics.timed_ledger_op("tool_quota", self.ledger.begin_tool_call(quota))
        except BudgetExceeded:
            raise BudgetExceeded(
                "max_calls_per_run",
                f"max_calls_per_run: tool {tool!r} of MCP server {server.name!r} may be called {limit} "
                f"time{'s' if limit != 1 else ''} per run ([mcp.{server.name}.tools.{tool}]) and run "
                f"{run.run_id} has used {'them' if limit != 1 else 'it'}; the call was not executed — "
                "answer without it",
            ) from None

    async def _replay(
        self, call: ToolCall, record: IdempotencyRecord, rid: Any, reply: Reply, label: str
    ) -> None:
        call.status = 200
        call.outcome = "replayed"
        call.result_hash = result_hash(record.body)
        self.metrics.tool_replays.labels(label).inc()
        assert call.run is not None
        headers = {**call.answer_headers(), "X-Idempotent-Replay": "true"}
        await reply.message(replayed(record, rid), headers)

    async def _execute(
        self,
        ex: Exchange,
        message: dict[str, Any],
        body: bytes,
        reply: Reply,
        call: ToolCall,
        state: RunState,
    ) -> None:
        server, target, run, headers = ex.server, ex.target, ex.run, ex.headers
        rid, name, label = message["id"], call.tool, f"mcp:{server.name}"
        tool = server.tools.get(name)
        timeout_s = tool.timeout_s if tool is not None and tool.timeout_s is not None else server.timeout_s
        limits = tool_clock(run, state, timeout_s)
        timeout, by_deadline = limits.seconds, limits.by_deadline
        headers = CIMultiDict(headers)
        if call.key is not None:
            headers["Idempotency-Key"] = call.key
        headers.update(limits.headers())
        if not call.request_hash:
            call.request_hash = self.recorder.payload(body)
        task = asyncio.current_task()
        assert task is not None
        executing = self.calls.executing(run.run_id, call.key)
        answered: dict[str, Any] | None = None
        clock: asyncio.Timeout | None = None

        async def watch(m: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal answered
            if answered is None and is_response(m) and m.get("id") == rid:
                answered = m
                # Answered: from here on the call is not cut any more (a cut now would only lose
                # the outcome), and the outcome is recorded before the agent sees it.
                if clock is not None:
                    clock.reschedule(None)
                self.flights.remove(run.run_id, task)
                await self._outcome(call, m)
                self.calls.finished(run.run_id, call.key, executing)
            return None

        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                async with asyncio.timeout(timeout) as clock:
                    upstream = await self.client.request("POST", target.url, data=body, headers=headers)
                    answer_headers = call.answer_headers()
                    end = await self.relay.answer(upstream, reply, answer_headers, watch, rid)
                    upstream, end = await self.relay.resume(target, headers, reply, watch, rid, upstream, end)
            except TimeoutError:
                if answered is not None:
                    return
                why = "the run's deadline" if by_deadline else f"its timeout_s = {timeout_s:g} s"
                self.relay.cut(server, target, headers, rid, "tools/call", upstream, f"runcap: {why} passed")
                await self.calls.unknown(call, "deadline" if by_deadline else "tool timeout", label)
                if by_deadline:
                    call.cut_reason = "deadline"
                    await self.ledger.set_status(run.run_id, state.deadline_status, time.time())
                    raise DeadlineExceeded(
                        f"run {run.run_id} reached its deadline during the call to tool {name!r} of MCP "
                        f"server {server.name!r}; the call was cancelled (it may or may not have taken "
                        "effect). End the run."
                    ) from None
                # The tool's own timeout: a result the model can read, and the run goes on.
                text = (
                    f"runcap: tool {name!r} did not answer within its timeout_s = {timeout_s:g} s; the call "
                    "was cancelled and may or may not have taken effect"
                    + (" — a repeat is refused until an operator reconciles it" if call.key else "")
                )
                call.status, call.error = 504, text
                if call.outcome != "unknown":
                    call.outcome = "timeout"
                result = {"content": [{"type": "text", "text": text}], "isError": True}
                await reply.message(result_message(rid, result), call.answer_headers())
                return
            except asyncio.CancelledError:
                if answered is not None and call.cut_reason == "cancel":
                    # The cancel raced the answer: the call happened, and the agent gets its result.
                    task.uncancel()
                    await reply.message(answered, call.answer_headers())
                    return
                if call.cut_reason != "cancel":
                    if answered is None:
                        await self.calls.unknown(call, "runcap shut down during the call", label)
                    raise
                task.uncancel()
                self.relay.cut(
                    server, target, headers, rid, "tools/call", upstream, "runcap: the run was cancelled"
                )
                await self.calls.unknown(call, "run cancelled during the call", label)
                raise RunCancelled(
                    f"run {run.run_id} was cancelled during the call to tool {name!r} of MCP server "
                    f"{server.name!r}; the call was cancelled (it may or may not have taken effect)"
                ) from None
            except ANSWER_FAILED as e:
                if answered is not None:
                    return
                # Released only when it provably never left; else unknown (toolcall/outcome.py).
                await self.calls.failed(call, e, label)
                if never_left(e):
                    raise UpstreamUnavailable(
                        f"MCP server {server.name!r} ({server.display_url}) is unreachable: {e}"
                    ) from None
                raise self.relay.unavailable(server, f"tools/call {name!r}", e) from None
        finally:
            if upstream is not None:
                release_or_drop(upstream)
            self.calls.finished(run.run_id, call.key, executing)
        if answered is None and upstream is not None and session_refused(upstream.status, headers):
            # The session is gone (toolcall/outcome.py): refused before dispatch. The 404 went to
            # the agent as it was; it starts a new session and sends the call again.
            if call.key is not None:
                await self.calls.release(run.run_id, call.key)
            call.status, call.outcome = upstream.status, "error"
            call.error = f"MCP server {server.name!r} answered HTTP 404: no such session"
            return
        if answered is None and upstream is not None and upstream.status >= 300:
            # An HTTP answer without the JSON-RPC response (a 502/504 of a proxy in front of the
            # server, a redirect, an error page): the bytes reached something that may have passed
            # them on, and nothing says what happened. Relayed to the agent as it was; unknown.
            why = f"the server answered HTTP {upstream.status} without a result"
            await self.calls.unknown(call, why, label)  # (a read-only call has no record to mark)
            call.status, call.outcome = upstream.status, "unknown" if call.key is not None else "error"
            call.error = (
                f"MCP server {server.name!r} answered HTTP {upstream.status} without a JSON-RPC response; "
                "the call may or may not have taken effect"
            )
            return
        if answered is None:
            await self.calls.unknown(call, "the server ended its answer without the result", label)
            raise UpstreamUnavailable(
                f"MCP server {server.name!r} ended its answer to tools/call {name!r} without the result; "
                "the call may or may not have taken effect"
                + (" — a repeat is refused until an operator reconciles it" if call.key else "")
            )

    async def _outcome(self, call: ToolCall, message: dict[str, Any]) -> None:
        """The server's answer is the call's outcome: recorded against the key (a repeat replays
        it), a JSON-RPC error as much as a result (toolcall/outcome.py)."""
        assert call.run is not None
        call.status = 200
        call.reached = "true"
        outcome = outcome_of(message)  # as the server sent it (a replay gives back the same JSON)
        if outcome.error is not None:
            call.outcome, call.error = "error", outcome.error
        call.result_hash = outcome.result_hash
        call.response_hash = self.recorder.payload(
            dumps(message), is_error=call.outcome != "ok", content_type=JSON
        )
        if call.key is None:
            return
        await self.calls.complete(call.run.run_id, call.key, 200, outcome.headers, outcome.body)
