"""`POST /runs/{id}/caps`: an operator raises (or lowers) a run's caps — "pause, approve, continue"
instead of kill-only. Agents can only lower their caps (headers); raising is the operator's, with
the admin token, and every change is a span of the run (who, when, old and new caps).

Body (every field optional; absent = unchanged, null = remove that cap):
    {"max_usd": "2.00", "max_tokens": 200000, "max_steps": 30, "max_tool_calls": 10,
     "max_tree_steps": 200, "max_tree_tool_calls": 50, "max_children": 20, "max_depth": 4,
     "deadline": "2026-12-01T18:00:00Z" | 1764612000, "extend_s": 600,
     "by": "alice", "reason": "approved the long refund"}
`extend_s` moves the deadline that many seconds past the later of now and the current deadline.
"""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson
from aiohttp import web

from proxy.bounds import MAX_CAP, MAX_USD, PLAIN_DECIMAL, OutOfBounds, whole_number
from proxy.caps import LEDGER_RUN_ID_RE, OPERATOR_WHOLE_CAPS, RunCaps
from proxy.config import CapsConfig
from proxy.errors import InvalidRequest, NotFound, Rejection
from proxy.ledger.base import CapsChange, Ledger
from proxy.money import format_usd, usd_to_nanos
from proxy.server.auth import AdminGuard
from proxy.server.ops import iso, run_json
from proxy.server.steps.trace import run_snapshot, run_tree
from proxy.spans.model import Span
from proxy.spans.recorder import SpanRecorder

_FIELDS = {"max_usd", *OPERATOR_WHOLE_CAPS, "deadline", "extend_s", "by", "reason"}


def caps_json(caps: RunCaps) -> dict[str, Any]:
    return {
        "max_usd": None if caps.max_usd_nanos is None else format_usd(caps.max_usd_nanos),
        "max_tokens": caps.max_tokens,
        "max_steps": caps.max_steps,
        "max_tool_calls": caps.max_tool_calls,
        "deadline": iso(caps.deadline),
        "max_depth": caps.max_depth,
        "max_children": caps.max_children,
        "max_tree_steps": caps.max_tree_steps,
        "max_tree_tool_calls": caps.max_tree_tool_calls,
    }


def parse_change(body: Any, current: RunCaps | None, caps: CapsConfig, now: float) -> CapsChange:
    """The body's caps as ledger fields; a bad value is a 400 naming the field."""
    if not isinstance(body, dict) or not body:
        raise InvalidRequest('body: a JSON object of caps, e.g. {"max_usd": "2.00", "max_steps": 30}')
    extra = set(body) - _FIELDS
    if extra:
        raise InvalidRequest(f"{sorted(extra)[0]}: unknown field (known: {', '.join(sorted(_FIELDS))})")
    change: CapsChange = {}
    if "max_usd" in body:
        change["max_usd_nanos"] = None if body["max_usd"] is None else usd_to_nanos(_usd(body["max_usd"]))
    for field in OPERATOR_WHOLE_CAPS:
        if field in body:
            value = body[field]
            if value is not None:
                try:
                    whole_number(value, field, maximum=MAX_CAP)
                except OutOfBounds as e:
                    raise InvalidRequest(f"{e}, or null for no cap", param=field) from None
            change[field] = value
    if "deadline" in body and "extend_s" in body:
        raise InvalidRequest("deadline, extend_s: send one of them", param="deadline")
    if "deadline" in body:
        change["deadline"] = None if body["deadline"] is None else _deadline(body["deadline"])
    if "extend_s" in body:
        extend = body["extend_s"]
        if isinstance(extend, bool) or not isinstance(extend, (int, float)) or not extend > 0:
            raise InvalidRequest("extend_s: a number of seconds > 0", param="extend_s")
        if extend > caps.max_run_seconds:
            raise InvalidRequest(
                f"extend_s: {extend:g} s is beyond caps.max_run_seconds = {caps.max_run_seconds:g} s",
                param="extend_s",
            )
        base = max(now, current.deadline) if current is not None and current.deadline is not None else now
        change["deadline"] = base + float(extend)
    deadline = change.get("deadline")
    if deadline is not None and deadline <= now:
        raise InvalidRequest(
            f"deadline: {datetime.fromtimestamp(deadline, UTC).isoformat(timespec='seconds')} is in the "
            "past, so the run would stop at once; give a future time, --extend SECONDS, or "
            "cancel the run (runcap cancel RUN_ID)",
            param="deadline",
        )
    if deadline is not None and deadline - now > caps.max_run_seconds:
        raise InvalidRequest(
            f"deadline: more than caps.max_run_seconds = {caps.max_run_seconds:g} s away", param="deadline"
        )
    for field in ("by", "reason"):
        if field in body and not (isinstance(body[field], str) and len(body[field]) <= 256):
            raise InvalidRequest(f"{field}: a string of at most 256 characters", param=field)
    if not change:
        raise InvalidRequest("body: names no cap to change", param="body")
    return change


def _usd(raw: Any) -> Decimal:
    """A dollar amount: a plain decimal string ("2.50", ASCII, as in X-Run-Max-Usd) or a JSON number."""
    d: Decimal | None = None
    if isinstance(raw, str):
        d = Decimal(raw) if PLAIN_DECIMAL.fullmatch(raw) else None
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
        with contextlib.suppress(InvalidOperation):
            d = Decimal(str(raw))
    if d is None or not d.is_finite() or d < 0:
        raise InvalidRequest(
            f'max_usd: {str(raw)[:40]!r} is not a dollar amount (like "2.50")', param="max_usd"
        )
    if d > MAX_USD:
        raise InvalidRequest(
            f"max_usd: {str(raw)[:40]!r} is above the largest dollar cap runcap accepts ({MAX_USD})",
            param="max_usd",
        )
    return d


_LAST_UNIX_SECOND = 253_402_300_799  # 9999-12-31T23:59:59Z


def _deadline(raw: Any) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        # Unix seconds between 1970 and the year 9999: anything else is no deadline at all (and
        # would not even format as a date)
        if not 0 <= raw <= _LAST_UNIX_SECOND:
            raise InvalidRequest(
                f"deadline: {raw!r} Unix seconds is outside 0..{_LAST_UNIX_SECOND} (1970 to the year 9999)",
                param="deadline",
            )
        return float(raw)
    if isinstance(raw, str):
        try:
            dt = datetime.fromisoformat(raw.replace("Z", "+00:00"))
            if dt.tzinfo is not None:
                return dt.astimezone(UTC).timestamp()
        except ValueError:
            pass
    raise InvalidRequest(
        "deadline: RFC 3339 with a zone (2026-01-02T15:04:05Z) or Unix seconds", param="deadline"
    )


class RunCapsAdmin:
    def __init__(self, ledger: Ledger, guard: AdminGuard, caps: CapsConfig, recorder: SpanRecorder) -> None:
        self.ledger = ledger
        self.guard = guard
        self.caps = caps
        self.recorder = recorder

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/runs/{run_id}/caps", self.set_caps)

    async def set_caps(self, request: web.Request) -> web.Response:
        started = time.time()
        try:
            self.guard.check(request)
            run_id = request.match_info["run_id"]
            if not LEDGER_RUN_ID_RE.match(run_id):
                raise InvalidRequest(f"run id {run_id[:140]!r} is not valid", param="run_id")
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:
                raise InvalidRequest('body: JSON, e.g. {"max_usd": "2.00"}', param="body") from None
            state = await self.ledger.get_run(run_id)
            if state is None:
                raise NotFound(f"no run {run_id!r} in the ledger", param="run_id")
            change = parse_change(body, state.caps, self.caps, started)
            done = await self.ledger.set_caps(run_id, change, time.time())
            if done is None:
                raise NotFound(f"no run {run_id!r} in the ledger", param="run_id")
        except Rejection as rej:
            return rej.response("openai")
        before, state = done
        old, new = caps_json(before), caps_json(state.caps)
        by = body.get("by") or "operator"
        self.recorder.span(
            Span(
                run_id=run_id,
                kind="caps_change",
                step=state.steps,
                started_at=datetime.fromtimestamp(started, UTC),
                duration_ms=(time.time() - started) * 1000.0,
                task=state.task,
                endpoint="POST /runs/{id}/caps",
                status_code=200,
                outcome="ok",
                attributes={
                    "caps.by": by,
                    "caps.reason": body.get("reason") or "",
                    "caps.old": orjson.dumps(old).decode(),
                    "caps.new": orjson.dumps(new).decode(),
                    "client.address": request.remote or "",
                },
                **run_tree(state),
            )
        )
        self.recorder.run(run_snapshot(state))
        return web.Response(
            body=orjson.dumps({**run_json(state, time.time()), "previous_caps": old, "changed_by": by}),
            content_type="application/json",
        )
