"""The trace step: one span per step event, handed to the recorder after the exchange is over.

For a model call: a `model` span (usage, cost, latency, TTFT, outcome), one `tool_call` span per
tool call the model requested (with `args_hash`), one `tool_result` span per tool result the
agent sent back for the first time (with `result_hash`), the run's latest state, and the request
and response bodies for the payload store — all of it one `recorder.step(...)`, one WAL record.
It runs once the upstream exchange is over and before the agent has the end of the response (a
buffered body is sent after the steps, a stream's end-of-body too: forward.py), so a response the
agent received whole is on record even if runcap is killed right after.

The steps that end in one turn of the event loop are recorded together, at the end of that turn:
each `done` waits for its record to be written, and one flush builds and encodes them all in a
row and writes them with one system call (`SpanRecorder.group`). Under load that is several steps
per turn (about 11 at 64 concurrent requests here), and a step costs half the CPU it costs alone
(bench/README.md); an idle server pays one more loop turn per step.

A step is answered only once its record is in the WAL. While the WAL has no room (a full disk,
`wal_max_bytes` reached) its record is held in memory and `done` waits with it, the held records
tried again every `_RETRY_S` (and before any newer one); a record the hold cannot keep (past
`wal_hold_bytes` / `wal_hold_ms`) is dropped — counted per step and logged with its run by the
WAL — and the call is refused instead of answered (`flow.unrecorded`: 503 `ledger_unavailable`,
code `ledger_disk_full`), so every answered call has its span, and every call without one was
told so. (A call runcap refused itself without forwarding it keeps that refusal, and does not
wait while its record is held.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypedDict

from proxy.caps import RunRequest
from proxy.errors import LedgerUnavailable
from proxy.hashing import args_hash, canonical_json, result_hash
from proxy.ledger.base import RunState
from proxy.ledger.repeats import call_fingerprint
from proxy.money import NANOS_PER_USD
from proxy.providers.base import ToolCall
from proxy.server.flow import Flow, FlowStep
from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.recorder import SpanRecorder, sha256_hex

log = logging.getLogger("runcap.trace")

# Per (run, tool call id), this process remembers the tool calls it saw requested (their step and
# tool name, for the result's span) and the results it recorded (an agent that retries a request
# resends them): bounded, least recently used first out.
_MEMORY = 100_000
# While records are held for want of room in the WAL, how often they are tried again.
_RETRY_S = 0.05


class _Memory(OrderedDict[tuple[str, str], tuple[int, str]]):
    def remember(self, key: tuple[str, str], value: tuple[int, str]) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > _MEMORY:
            self.popitem(last=False)


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


@functools.lru_cache(maxsize=4096)
def usd(nanos: int) -> Decimal:
    """Dollars of `nanos`, exact (a Decimal is immutable: one object per amount is shared). Cached:
    caps, and the costs of calls alike, repeat from step to step and run to run."""
    return Decimal(nanos) / NANOS_PER_USD


class RunTree(TypedDict, total=False):
    parent_run_id: str
    root_run_id: str


def run_tree(state: RunState | None) -> RunTree:
    """A span's run-tree fields (`Span(..., **run_tree(state))`) from its run's state (a root:
    '' and its own id; no state, a call refused before the ledger saw it: the span's run is
    taken as its own root)."""
    if state is None:
        return {}
    return {"parent_run_id": state.parent_run_id, "root_run_id": state.root}


def run_snapshot(state: RunState) -> RunSnapshot:
    caps = state.caps
    return RunSnapshot(
        run_id=state.run_id,
        task=state.task,
        started_at=utc(state.started_at),
        updated_at=utc(state.updated_at),
        status=state.status,
        steps=state.steps,
        tool_calls=state.tool_calls,
        input_tokens=state.input_tokens,
        output_tokens=state.output_tokens,
        cost_usd=usd(state.spent_usd_nanos),
        max_usd=None if caps.max_usd_nanos is None else usd(caps.max_usd_nanos),
        max_tokens=caps.max_tokens,
        max_steps=caps.max_steps,
        max_tool_calls=caps.max_tool_calls,
        deadline=None if (deadline := state.deadline) is None else utc(deadline),  # or an ancestor's
        parent_run_id=state.parent_run_id,
        root_run_id=state.root,
    )


def tool_result_hash(content: Any) -> str:
    """A result as the agent sent it back: text is hashed like a tool's response body (parsed as
    JSON when it is JSON), so it matches the `result_hash` of the same result seen on `/tools`."""
    if isinstance(content, str):
        return result_hash(content.encode("utf-8", "surrogatepass"))
    return sha256_hex(canonical_json(content))


def context_record(
    flow: Flow, rec: SpanRecorder, attributes: dict[str, str], is_error: bool
) -> list[Payload]:
    """The context reading and any rewrite of a model call, as span attributes (`context.*`),
    and the bodies the payload store keeps for a rewrite: the request as the agent sent it (its
    hash in `context.original_request_hash`; `request_hash` is the one forwarded) and each tool
    result taken out of band (under the hash its handle names)."""
    reading, rewrite = flow.context, flow.rewrite
    if reading is not None:
        if reading.tokens:
            attributes["context.tokens"] = str(reading.tokens)
            attributes["context.growth"] = f"{reading.growth:.3f}"
        attributes["context.tokens_lower"] = str(reading.lower)
        attributes["context.tool_output_share"] = f"{reading.tool_output_share:.4f}"
        if reading.cap is not None:
            attributes["context.max_tokens"] = str(reading.cap)
    if rewrite is None:
        return []
    bodies = []
    original = rec.body(rewrite.original_body, is_error=is_error)
    attributes["context.policy"] = rewrite.policy
    attributes["context.original_request_hash"] = original.sha256 if original is not None else ""
    attributes["context.removed_bytes"] = str(rewrite.removed_bytes)
    attributes["context.removed_tokens"] = str(rewrite.removed_tokens)
    if original is not None:
        bodies.append(original)
    if rewrite.handles:
        attributes["context.handles"] = ",".join(sorted(rewrite.handles))
    for data in rewrite.handles.values():
        body = rec.body(data, is_error=is_error)
        if body is not None:
            bodies.append(body)
    return bodies


# What a tool's rules would decide on a call the model requested (seen in its answer, executed by
# the agent or the provider, not through runcap): (name, arguments, provider-executed, run, state)
# → attributes for its `tool_call` span (toolcall/policy.py `PolicyCheck.judge_requested`).
RequestedCallJudge = Callable[[str, str, bool, RunRequest, RunState | None], dict[str, str]]


class TraceStep(FlowStep):
    def __init__(self, recorder: SpanRecorder, judge: RequestedCallJudge | None = None) -> None:
        self.recorder = recorder
        self.judge = judge
        self._calls = _Memory()  # (run, call id) → (step that requested it, tool name)
        self._results = _Memory()  # (run, call id) of results already recorded
        self._waiting: list[tuple[Flow, asyncio.Future[str]]] = []  # until this loop turn ends
        self._retry: asyncio.TimerHandle | None = None  # while the WAL holds records

    async def done(self, flow: Flow) -> None:
        if flow.run is None:
            return
        loop = asyncio.get_running_loop()
        recorded: asyncio.Future[str] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._flush)
        self._waiting.append((flow, recorded))
        # Cancelled while waiting (shutting down): the record is written (or held) all the same.
        why = await recorded
        # Only a call that was made is withheld: runcap's own refusal of a call it did not forward
        # (a cap, the ledger) stands as it is — its dropped record is counted and logged all the same.
        if why and flow.upstream_status:
            flow.unrecorded = LedgerUnavailable(
                f"runcap could not put this call of run {flow.run.run_id} on record: {why} (its span "
                "log, data_dir/wal, has no room: the disk is full or wal_max_bytes is reached). The "
                "call was made and is charged to the run; its answer was withheld. Retry once the "
                "disk has room",
                backend="wal",
                code="ledger_disk_full",
            )

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        try:
            with self.recorder.group():
                for flow, recorded in waiting:
                    try:
                        self._record(flow, functools.partial(_tell, recorded))
                    except Exception:
                        # A bug building this record, not a full disk: answered as before (and
                        # logged), rather than refusing calls for a fault of runcap's tracing.
                        log.exception("recording the step of run %s failed", flow.run and flow.run.run_id)
                        _tell(recorded, "")
        except Exception:
            log.exception("writing %d step records failed", len(waiting))
            for _, recorded in waiting:
                _tell(recorded, "the WAL writer failed")
        for flow, recorded in waiting:
            if not flow.upstream_status:
                # Not forwarded (runcap refused it: a cap, the ledger): its refusal stands whatever
                # becomes of the record, so it does not wait while the record is held.
                _tell(recorded, "")
        self._schedule_retry()

    def _schedule_retry(self) -> None:
        if self._retry is None and self.recorder.held():
            self._retry = asyncio.get_running_loop().call_later(_RETRY_S, self._retry_held)

    def _retry_held(self) -> None:
        self._retry = None
        if self._waiting:
            return  # this turn's flush appends the held records first anyway
        try:
            self.recorder.flush_held()
        except Exception:
            log.exception("appending the held step records failed")
        self._schedule_retry()

    def _record(self, flow: Flow, on_done: Callable[[str], None]) -> None:
        assert flow.run is not None
        if flow.adapter is None:
            self._passthrough(flow, on_done)
            return
        rec = self.recorder
        is_error = flow.outcome != "ok"
        request_body = rec.body(flow.sent_body, is_error=is_error) if flow.sent_body else None
        response_bytes = flow.response_body if flow.response_body is not None else flow.captured
        response_body = rec.body(bytes(response_bytes), is_error=is_error) if response_bytes else None
        bodies = [b for b in (request_body, response_body) if b is not None]

        state = flow.state
        step = flow.step or (state.steps + 1 if state is not None else 0)
        info, resp = flow.info, flow.response_info
        usage = flow.usage
        started = utc(flow.started_wall)
        attributes = {"upstream": flow.upstream.name}
        if flow.clamped_to is not None:
            attributes["clamped_to"] = str(flow.clamped_to)
        if flow.final_step:
            attributes["final_step"] = "true"
            if state is not None and state.final_reason:
                attributes["final_step.reason"] = state.final_reason
                if state.final_reason == "max_repeats":
                    attributes["repeats.reason"] = state.repeats.stopped
        if state is not None and state.repeats.stopped and state.repeats.stopped_step == step:
            # this step's answer showed the loop: the run's next step is answer-only
            attributes["repeats.stopped"] = state.repeats.stopped
        if flow.run.generated:
            attributes["generated_run_id"] = "true"
        if flow.no_answer:
            # No model output: the step was given back (the next call has the same step number).
            attributes["step.counted"] = "false"
        if any(flow.usage_reserved):
            # Cut short: the settled figures are partly the reservation, not reported usage.
            seen = flow.usage_seen
            for name, reserved, seen_tokens in (
                ("input", flow.usage_reserved[0], seen.input_tokens if seen else 0),
                ("output", flow.usage_reserved[1], seen.output_tokens if seen else 0),
            ):
                attributes[f"usage.{name}"] = "reserved" if reserved else "reported"
                attributes[f"usage.seen_{name}_tokens"] = str(seen_tokens)
        if state is not None and state.upstream_failures:
            attributes["upstream.failures"] = str(state.upstream_failures)
        if flow.billing:
            attributes.update(flow.billing)  # runcap's bounds on what the call may be billed
        if flow.cost is not None:
            for kind, part in flow.cost.parts:  # what made up the cost
                attributes[f"cost.{kind}"] = f"{part.normalize():f}"
        if usage is not None:
            if usage.input_audio_tokens:
                attributes["billed.input_audio_tokens"] = str(usage.input_audio_tokens)
            if usage.output_audio_tokens:
                attributes["billed.output_audio_tokens"] = str(usage.output_audio_tokens)
            for kind, uses in usage.tool_uses.items():
                attributes[f"billed.{kind}"] = str(uses)
        if info is not None and flow.priced_model and flow.priced_model != info.model:
            attributes["pricing.model"] = flow.priced_model
        served = resp.price_options if resp is not None else None
        if served:
            attributes["pricing.variant"] = ",".join(f"{k}={v}" for k, v in served)
        bodies.extend(context_record(flow, rec, attributes, is_error))
        model_span = Span(
            run_id=flow.run.run_id,
            kind="model",
            step=step,
            started_at=started,
            duration_ms=flow.duration_ms,
            ttft_ms=flow.ttft_ms,
            task=flow.run.task or (state.task if state else ""),
            provider=flow.upstream.name,
            model=(resp.model if resp and resp.model else "") or (info.model if info else ""),
            endpoint=flow.endpoint,
            status_code=flow.status,
            outcome=flow.outcome,
            error=flow.error[:2000],
            input_tokens=usage.input_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            cache_read_tokens=usage.cache_read_tokens if usage else 0,
            cache_write_tokens=usage.cache_write_tokens if usage else 0,
            reasoning_tokens=usage.reasoning_tokens if usage else 0,
            cost_usd=usd(flow.cost_nanos),
            price_known=flow.price_known,
            request_hash=request_body.sha256 if request_body is not None else "",
            response_hash=response_body.sha256 if response_body is not None else "",
            attributes=attributes,
            **run_tree(state),
        )
        spans = [model_span]

        def child(kind: str, at_step: int, at: datetime, tool: str, call_id: str, **fields: Any) -> Span:
            """A span of this call's tool traffic: same run, trace and labels, under the call, with
            this call's status (a tool_result span: the status of the call whose request carried
            the result, as tool_call spans carry the status of the response they were seen in)."""
            return Span(
                run_id=model_span.run_id,
                trace_id=model_span.trace_id,
                parent_span_id=model_span.span_id,
                task=model_span.task,
                provider=model_span.provider,
                model=model_span.model,
                endpoint=model_span.endpoint,
                kind=kind,
                step=at_step,
                started_at=at,
                status_code=flow.status,
                tool_name=tool,
                tool_call_id=call_id,
                parent_run_id=model_span.parent_run_id,
                root_run_id=model_span.root_run_id,
                **fields,
            )

        if info is not None:
            # Results the agent sent back are facts even when this call was then refused.
            for result in info.tool_results:
                key = (flow.run.run_id, result.tool_call_id)
                if not result.fresh or key in self._results:
                    continue
                self._results.remember(key, (step, ""))
                # The step that requested the call, when this process saw it requested.
                call_step, tool_name = self._calls.get(key, (step, ""))
                outcome = "error" if result.is_error else "ok"
                result_digest = tool_result_hash(result.content)
                spans.append(
                    child(
                        "tool_result",
                        call_step,
                        started,
                        tool_name,
                        result.tool_call_id,
                        outcome=outcome,
                        result_hash=result_digest,
                    )
                )
        if resp is not None:
            ended = started + timedelta(milliseconds=flow.duration_ms)
            for call in resp.tool_calls:
                self._calls.remember((flow.run.run_id, call.id), (step, call.name))
            # Provider-executed calls (a remote MCP server, web search...) are counted against
            # X-Run-Max-Tool-Calls; the agent sends no result for them.
            calls: list[tuple[ToolCall, dict[str, str]]] = [(call, {}) for call in resp.tool_calls]
            calls += [(call, {"tool.executed_by": "provider"}) for call in resp.provider_tool_calls]
            counted = state is not None and state.caps.max_repeats is not None and not flow.no_answer
            for call, extra in calls:
                digest = args_hash(call.arguments)
                if counted and "tool.executed_by" not in extra:
                    # X-Run-Max-Repeats: times the run's model asked for this call (the window's count)
                    assert state is not None
                    times = state.repeats.calls.get(call_fingerprint(call.name, digest))
                    if times is not None:
                        extra = {"repeats.count": str(times)}
                if self.judge is not None:
                    provider = "tool.executed_by" in extra
                    extra = {**extra, **self.judge(call.name, call.arguments, provider, flow.run, state)}
                spans.append(
                    child(
                        "tool_call",
                        step,
                        ended,
                        call.name,
                        call.id,
                        outcome=flow.outcome,
                        args_hash=digest,
                        attributes=extra,
                    )
                )
        rec.step(spans, run_snapshot(state) if state is not None else None, bodies, on_done=on_done)

    def _passthrough(self, flow: Flow, on_done: Callable[[str], None]) -> None:
        """An endpoint runcap does not meter is still a step event: a `model` span naming the
        method and endpoint, with status, latency and outcome (no usage, no cost)."""
        assert flow.run is not None
        state = flow.state
        attributes = {
            "upstream": flow.upstream.name,
            "passthrough": "true",
            "http.method": flow.request.method,
            "request.bytes": str(len(flow.body)),
            "response.bytes": str(flow.response_bytes),
        }
        if flow.run.generated:
            attributes["generated_run_id"] = "true"
        span = Span(
            run_id=flow.run.run_id,
            kind="model",
            step=state.steps if state is not None else 0,
            started_at=utc(flow.started_wall),
            duration_ms=flow.duration_ms,
            ttft_ms=flow.ttft_ms,
            task=flow.run.task or (state.task if state else ""),
            provider=flow.upstream.name,
            endpoint=flow.target.path[:256],
            status_code=flow.status,
            outcome=flow.outcome,
            error=flow.error[:2000],
            price_known=False,
            attributes=attributes,
            **run_tree(state),
        )
        self.recorder.step([span], on_done=on_done)


def _tell(recorded: asyncio.Future[str], why: str) -> None:
    """A record's fate, to the `done` that waits for it (if it still does)."""
    if not recorded.done():
        recorded.set_result(why)
