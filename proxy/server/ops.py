"""Operational routes: run state, cancel, health, readiness, metrics, and the admin guard."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from proxy.bounds import INT64_MIN, UINT64_MAX
from proxy.caps import LEDGER_RUN_ID_RE
from proxy.errors import InvalidRequest, LedgerUnavailable, NotFound, Unauthorized
from proxy.ledger.base import Ledger, RunState
from proxy.money import format_usd
from proxy.server.auth import AdminGuard
from proxy.server.flow import Flights
from proxy.server.metrics import Metrics
from proxy.server.steps.trace import run_snapshot
from proxy.spans.control import ShipperClient, ShipperQueryError, ShipperStoreError, ShipperUnavailable
from proxy.spans.recorder import NullRecorder, SpanRecorder


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def run_json(state: RunState, now: float) -> dict[str, Any]:
    caps = state.caps
    rem = state.remaining(now)
    return {
        "run_id": state.run_id,
        "status": state.status,
        "task": state.task,
        "started_at": iso(state.started_at),
        "updated_at": iso(state.updated_at),
        "steps": state.steps,
        "tool_calls": state.tool_calls,
        "tool_calls_requested": state.tool_calls_requested,
        "tool_calls_executed": state.tool_calls_executed,
        "input_tokens": state.input_tokens,
        "output_tokens": state.output_tokens,
        "cost_usd": format_usd(state.spent_usd_nanos),
        "reserved_usd": format_usd(state.reserved_usd_nanos),
        "reserved_tokens": state.reserved_tokens,
        "final_step_reason": state.final_reason,
        # Model calls in a row the upstream did not answer (caps.max_upstream_failures stops the run).
        "upstream_failures": state.upstream_failures,
        # Input tokens of the run's first answered step: the baseline of X-Run-Context-Growth.
        "context_baseline_tokens": state.context_baseline,
        # X-Run-Max-Repeats (proxy/ledger/repeats.py): the cap, why runcap stopped the run and at
        # which step, and the calls requested more than once (of the last 64 distinct ones).
        "repeats": {
            "max_repeats": caps.max_repeats,
            "stopped": state.repeats.stopped or None,
            "stopped_step": state.repeats.stopped_step or None,
            "calls": {call: n for call, n in state.repeats.calls.items() if n > 1},
        },
        "caps": {
            "max_usd": None if caps.max_usd_nanos is None else format_usd(caps.max_usd_nanos),
            "max_tokens": caps.max_tokens,
            "max_steps": caps.max_steps,
            "max_tool_calls": caps.max_tool_calls,
            "deadline": iso(caps.deadline),
        },
        # Run trees (issue 22): the run's place in its tree, and its subtree's totals (the run
        # and its descendants) that its dollar/token caps and tree caps bound.
        "parent": state.parent_run_id or None,
        "root": state.root,
        "ancestors": list(state.ancestors),
        "children": list(state.child_ids),  # the first 256; children_count counts them all
        "children_count": state.children,
        "tree_caps": {
            "max_depth": caps.max_depth,
            "max_children": caps.max_children,
            "max_tree_steps": caps.max_tree_steps,
            "max_tree_tool_calls": caps.max_tree_tool_calls,
        },
        "subtree": {
            "cost_usd": format_usd(state.spent_usd_nanos + state.sub_spent_usd_nanos),
            "reserved_usd": format_usd(state.reserved_usd_nanos + state.sub_reserved_usd_nanos),
            "tokens": state.tokens_used + state.sub_tokens,
            "reserved_tokens": state.reserved_tokens + state.sub_reserved_tokens,
            "steps": state.steps + state.sub_steps,
            "tool_calls": state.tool_calls + state.sub_tool_calls,
        },
        # Same keys as caps; the deadline's remainder is in milliseconds.
        "remaining": {
            "max_usd": None if rem["usd_nanos"] is None else format_usd(int(rem["usd_nanos"])),
            "max_tokens": rem["tokens"],
            "max_steps": rem["steps"],
            "max_tool_calls": rem["tool_calls"],
            "deadline": None if rem["ms"] is None else int(rem["ms"]),
        },
    }


MAX_SQL_CHARS = 256 * 1024
MAX_SQL_PARAMS = 64
MAX_SQL_PARAM_CHARS = 64 * 1024
MAX_SQL_PARAM_ITEMS = 10_000
_PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def check_sql_params(params: dict[str, Any]) -> None:
    """`/admin/sql` parameters: what ClickHouse query parameters can hold — names of at most 64
    identifier characters; strings, 64-bit integers, finite numbers, booleans, null, or an array
    of those — each bounded, so a value is a 400 naming it, never a failure deeper down."""
    if len(params) > MAX_SQL_PARAMS:
        raise InvalidRequest(f'"params": {len(params)} parameters, beyond {MAX_SQL_PARAMS}', param="params")
    for name, value in params.items():
        if not _PARAM_NAME.fullmatch(name):
            raise InvalidRequest(
                f"params.{name[:64]!r}: a parameter name is 1-64 characters of A-Z a-z 0-9 _ (not starting "
                "with a digit)",
                param="params",
            )
        items = value if isinstance(value, list) else [value]
        if len(items) > MAX_SQL_PARAM_ITEMS:
            raise InvalidRequest(
                f"params.{name}: more than {MAX_SQL_PARAM_ITEMS} items", param=f"params.{name}"
            )
        for item in items:
            _check_param_value(name, item)


def _check_param_value(name: str, value: Any) -> None:
    where = f"params.{name}"
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= UINT64_MAX:
            raise InvalidRequest(
                f"{where}: beyond what a 64-bit integer holds ({INT64_MIN} to {UINT64_MAX})", param=where
            )
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"{where}: not a finite number", param=where)
        return
    if isinstance(value, str):
        if len(value) > MAX_SQL_PARAM_CHARS:
            raise InvalidRequest(
                f"{where}: {len(value)} characters, beyond {MAX_SQL_PARAM_CHARS}", param=where
            )
        return
    raise InvalidRequest(
        f"{where}: a string, number, boolean, null or an array of those (got {type(value).__name__})",
        param=where,
    )


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(data), content_type="application/json", headers=headers
    )


@dataclass(eq=False)
class OpsRoutes:
    """`metrics_guard`: who may scrape /metrics ([metrics] require_token); None: anyone."""

    ledger: Ledger
    metrics: Metrics
    flights: Flights
    guard: AdminGuard
    span_store: ShipperClient | None = None
    recorder: SpanRecorder = field(default_factory=NullRecorder)
    metrics_guard: AdminGuard | None = None
    # What else a cancel ends, once the run is marked and its calls cut (the approvals desk:
    # the run's pending approvals are denied, each on the record).
    on_cancel: Callable[[str], Awaitable[None]] | None = None

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/runs/{run_id}", self.get_run)
        app.router.add_post("/runs/{run_id}/cancel", self.cancel_run)
        app.router.add_post("/admin/sql", self.admin_sql)

    async def healthz(self, request: web.Request) -> web.Response:
        # Liveness: the process answers. Never the ledger's state — restarting runcap does not
        # bring Redis back or free a disk, and it answers what it can meanwhile.
        return _json({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready when the ledger accepts a write within a short timeout (the guarded ledger's
        `ping`) and, with tracing on, the span shipper answers on its socket (the read commands
        and /admin/sql go through it): otherwise 503, naming what is not ready and why."""
        name = self.ledger.name
        try:
            await self.ledger.ping()
        except LedgerUnavailable as e:
            body = {"status": "unavailable", "ledger": name, "reason": e.code, "error": e.message}
            return _json(body, 503, e.headers)
        except Exception as e:
            body = {"status": "unavailable", "ledger": name, "reason": "ledger_error", "error": str(e)}
            return _json(body, 503)
        if self.span_store is not None:
            try:
                await self.span_store.stats(timeout_s=1.0)
            except ShipperUnavailable as e:
                body = {"status": "unavailable", "ledger": name, "shipper": "unavailable",
                        "reason": "shipper_starting_or_down", "error": str(e)}  # fmt: skip
                return _json(body, 503, {"Retry-After": "1"})
            return _json({"status": "ready", "ledger": name, "shipper": "ready"})
        return _json({"status": "ready", "ledger": name})

    async def metrics_text(self, request: web.Request) -> web.Response:
        if self.metrics_guard is not None:
            try:
                self.metrics_guard.check(request)
            except Unauthorized as rej:
                return rej.response("openai")
        body = await self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    def _run_id(self, request: web.Request) -> str:
        run_id = request.match_info["run_id"]
        if not LEDGER_RUN_ID_RE.match(run_id):
            raise InvalidRequest(
                f"run id {run_id[:140]!r} is not valid (A-Z a-z 0-9 . _ : -; with client tokens "
                "`{tenant}:{run id}`)"
            )
        return run_id

    async def get_run(self, request: web.Request) -> web.StreamResponse:
        # Admin only: a run id is not a secret (it is in logs, URLs, spans); agents read their
        # budget from the X-Run-Remaining-* headers of their own calls.
        try:
            self.guard.check(request)
            run_id = self._run_id(request)
            state = await self.ledger.get_run(run_id)
            if state is None:
                raise NotFound(
                    f"no run {run_id!r} in the ledger (a call without X-Run-Id and without caps is a "
                    "one-step run kept out of the ledger: read it from runcap.runs / runcap.spans)"
                )
        except (InvalidRequest, NotFound, Unauthorized, LedgerUnavailable) as rej:
            return rej.response("openai")
        return _json(run_json(state, time.time()))

    async def cancel_run(self, request: web.Request) -> web.StreamResponse:
        try:
            self.guard.check(request)
            run_id = self._run_id(request)
        except (InvalidRequest, Unauthorized) as rej:
            return rej.response("openai")
        try:
            # A run not seen yet is cancelled all the same (a cancel racing the run's first
            # request must win), and the answer says it was not known (a typo?).
            known = await self.ledger.get_run(run_id) is not None
            state = await self.ledger.cancel(run_id, time.time())
            aborted = self.flights.cancel_run(run_id)
            if self.on_cancel is not None:
                await self.on_cancel(run_id)
        except LedgerUnavailable as rej:
            return rej.response("openai")  # not (all) done: retry (x-should-retry: true)
        assert state is not None
        if known:  # the run's row says cancelled now, not at its next call
            self.recorder.run(run_snapshot(state))
        return _json({**run_json(state, time.time()), "aborted_in_flight": aborted, "known": known})

    async def admin_sql(self, request: web.Request) -> web.StreamResponse:
        """Read-only SQL against the span store, through the shipper's socket: the shipper owns
        the store (embedded chdb lives in its process only) and checks every query with sqlguard."""
        try:
            self.guard.check(request)
            try:
                body = await request.json(loads=orjson.loads)
            except ValueError:
                raise InvalidRequest('body must be JSON: {"sql": "SELECT ...", "params": {...}}') from None
            sql = body.get("sql") if isinstance(body, dict) else None
            params = body.get("params") or {} if isinstance(body, dict) else None
            if not isinstance(sql, str) or not sql.strip():
                raise InvalidRequest('"sql" must be a non-empty string', param="sql")
            if not isinstance(params, dict):
                raise InvalidRequest('"params" must be an object of name → value', param="params")
            if len(sql) > MAX_SQL_CHARS:
                raise InvalidRequest(f'"sql": {len(sql)} characters, beyond {MAX_SQL_CHARS}', param="sql")
            check_sql_params(params)
            if self.span_store is None:
                raise NotFound("no span store: tracing is off in this runcap's configuration")
        except (InvalidRequest, NotFound, Unauthorized) as rej:
            return rej.response("openai")
        try:
            columns, rows = await self.span_store.query(sql, params)
        except ShipperQueryError as e:
            return InvalidRequest(f"query failed: {e}", param="sql").response("openai")
        except (ShipperStoreError, ShipperUnavailable) as e:
            return _json({"error": {"type": "span_store_unavailable", "message": str(e)}}, 503)
        return _json({"columns": columns, "rows": rows})
