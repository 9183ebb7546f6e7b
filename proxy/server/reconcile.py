"""Admin routes behind `runcap reconcile`: list idempotency records (the `unknown` ones above all)
and resolve an unknown one — `done` (with the outcome to replay) or `not_done` (deleted, so the
next attempt executes).

  GET  /admin/idempotency?state=unknown[&run_id=R][&limit=N]   → JSON array of records
  POST /admin/idempotency/{key}/resolve  {"run_id"?, "outcome": "done"|"not_done",
                                          "status"?: 200, "body"?: str, "content_type"?: str}
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from proxy.bounds import ASCII_INT
from proxy.caps import LEDGER_RUN_ID_RE
from proxy.errors import InvalidRequest, NotFound, Rejection
from proxy.ledger.base import TOOL_CALL_STATES, UNKNOWN, IdempotencyRecord, Ledger, RecordNotUnknown
from proxy.server.auth import AdminGuard
from proxy.server.ops import iso

_MAX_LIST = 100_000  # records one GET /admin/tool-calls answers with


def record_json(r: IdempotencyRecord) -> dict[str, Any]:
    return {
        "run_id": r.run_id,
        "key": r.key,
        "tool": r.tool,
        "method": r.method or None,  # None: a record from before records stored their operation
        "path": r.path,
        "args_hash": r.args_hash,
        "state": r.state,
        "step": r.step,
        "created_at": iso(r.created_at),
        "updated_at": iso(r.updated_at),
        "status": r.status,
        "error": r.error,
    }


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


class IdempotencyAdmin:
    def __init__(self, ledger: Ledger, guard: AdminGuard) -> None:
        self.ledger = ledger
        self.guard = guard

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/admin/idempotency", self.list)
        app.router.add_post("/admin/idempotency/{key}/resolve", self.resolve)

    async def list(self, request: web.Request) -> web.Response:
        try:
            self.guard.check(request)
            state = request.query.get("state") or None
            if state not in (None, "all", *TOOL_CALL_STATES):
                raise InvalidRequest(f"state: one of all, {', '.join(TOOL_CALL_STATES)}", param="state")
            limit = request.query.get("limit", "1000")
            if not ASCII_INT.fullmatch(limit) or len(limit) > 7 or int(limit) > _MAX_LIST:
                raise InvalidRequest(f"limit: a whole number from 0 to {_MAX_LIST}", param="limit")
            run_id = request.query.get("run_id") or None
            if run_id is not None and not LEDGER_RUN_ID_RE.match(run_id):
                raise InvalidRequest(f"run_id: {run_id[:140]!r} is not a run id", param="run_id")
            records = await self.ledger.list_tool_calls(None if state == "all" else state, run_id, int(limit))
        except Rejection as rej:  # also LedgerUnavailable: a 503 the CLI can retry
            return rej.response("openai")
        return _json([record_json(r) for r in records])

    async def resolve(self, request: web.Request) -> web.Response:
        try:
            self.guard.check(request)
            key = request.match_info["key"]
            try:
                body = orjson.loads(await request.read() or b"{}")
            except orjson.JSONDecodeError as e:
                raise InvalidRequest(f"body is not JSON: {e}", param="body") from None
            if not isinstance(body, dict) or body.get("outcome") not in ("done", "not_done"):
                raise InvalidRequest('outcome: "done" or "not_done"', param="outcome")
            done = body["outcome"] == "done"
            status = body.get("status", 200)
            if not isinstance(status, int) or not 100 <= status <= 599:
                raise InvalidRequest("status: an HTTP status (100-599)", param="status")
            result = body.get("body", "")
            if not isinstance(result, str):
                result = orjson.dumps(result).decode()
            content_type = body.get("content_type") or (
                "application/json" if result[:1] in ("{", "[") else "text/plain; charset=utf-8"
            )
            if not isinstance(content_type, str) or len(content_type) > 256 or not content_type.isprintable():
                raise InvalidRequest(
                    "content_type: a media type of at most 256 characters", param="content_type"
                )
            run_id = body.get("run_id")
            if run_id is not None and not (isinstance(run_id, str) and LEDGER_RUN_ID_RE.match(run_id)):
                raise InvalidRequest(f"run_id: {str(run_id)[:140]!r} is not a run id", param="run_id")
            if run_id is None:
                matches = [r for r in await self.ledger.list_tool_calls(UNKNOWN) if r.key == key]
                if not matches:  # not unknown: say what it is
                    matches = [r for r in await self.ledger.list_tool_calls() if r.key == key]
                if not matches:
                    raise NotFound(f"no idempotency record with key {key!r}", param="key")
                if len({r.run_id for r in matches}) > 1:
                    runs = ", ".join(sorted({r.run_id for r in matches}))
                    raise InvalidRequest(
                        f"key {key!r} exists in several runs ({runs}): pass run_id", param="run_id"
                    )
                run_id = matches[0].run_id
            try:
                before = await self.ledger.resolve_tool_call(
                    run_id, key, done=done, now=time.time(), status=status,
                    headers={"content-type": content_type} if done else None, body=result.encode(),
                )  # fmt: skip
            except RecordNotUnknown as e:
                raise InvalidRequest(
                    f"tool call {key} of run {run_id} is {e.record.state}, not unknown: only an unknown "
                    "outcome can be resolved",
                    param="key",
                    status=409,
                ) from None
            if before is None:
                raise NotFound(f"no idempotency record {key!r} in run {run_id!r}", param="key")
        except Rejection as rej:
            return rej.response("openai")
        return _json({**record_json(before), "resolved": body["outcome"], "previous_state": before.state})
