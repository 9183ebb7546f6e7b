"""The operator's side of approvals (DESIGN.md "Tool policies and approvals"):

  GET  /approvals[?run=ID][&state=pending|approved|denied|expired|all][&limit=N]
       → {"approvals": [{"id", "run_id", "tool", "args_hash", "args", "state", "requested_at",
          "decided_at", "expires_at", "by", "reason", "rule", "rule_reason", "tenant", "step"}]}
       (default: pending; `args` read from the payload store when the call's body was kept, else null)
  POST /approvals/{approval_id}  {"decision": "approve"|"deny", "by": "...", "reason": "..."}
       → the record; 409 `approval_not_pending` once decided or expired; a denial needs a reason
       (the agent is told it)

Who: the admin token sees and decides every approval. With `[auth] client_tokens`, a tenant's
approver token (`client_tokens.TENANT.approver_token`, sent as `Authorization: Bearer`) sees and
decides its own tenant's approvals, and a client token (`X-Run-Client-Token`) only *sees* them: the
agent holds its client token, so a decision made with it would be the agent approving its own
call — 403 `approval_needs_a_person`. Run ids as the tenant knows them (without the `{tenant}:`
namespace); another tenant's approval is a 404, as if it did not exist. `runcap approvals /
approve / deny` (proxy/approval_cli.py) call these routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from proxy.bounds import ASCII_INT
from proxy.caps import LEDGER_RUN_ID_RE
from proxy.errors import InvalidRequest, NotFound, Rejection, Unauthorized
from proxy.ledger.base import APPROVAL_STATES, PENDING, Approval, ApprovalNotPending
from proxy.server.auth import CLIENT_TOKEN_HEADER, AdminGuard, ClientAuth
from proxy.server.ops import iso
from proxy.spans.payloads import open_payload_store
from proxy.toolcall.approvals import ApprovalDesk

log = logging.getLogger("runcap.approvals")

_MAX_LIST = 10_000
_MAX_TEXT = 2000  # characters of `by` / `reason`
_ARGS_TIMEOUT_S = 2.0  # reading one body from the payload store for a listing


class ApprovalNotPendingRejection(Rejection):
    status = 409
    type = "invalid_request"
    code = "approval_not_pending"


class ApprovalNeedsAPerson(Rejection):
    status = 403
    type = "forbidden"
    code = "approval_needs_a_person"


class ApprovalRoutes:
    def __init__(
        self,
        desk: ApprovalDesk,
        guard: AdminGuard,
        clients: ClientAuth,
        *,
        data_dir: Path,
        s3_url: str | None = None,
    ) -> None:
        self.desk = desk
        self.guard = guard
        self.clients = clients
        self.data_dir = data_dir
        self.s3_url = s3_url

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/approvals", self.listing)
        app.router.add_post("/approvals/{approval_id}", self.decide)

        async def close(app: web.Application) -> None:
            await self.desk.close()

        app.on_cleanup.append(close)

    def _who(self, request: web.Request) -> tuple[str | None, bool]:
        """(None: the admin, else the tenant; whether it may decide): the admin token, a tenant's
        approver token, or — listing only — its client token. Raises `Unauthorized`."""
        try:
            self.guard.check(request)
            return None, True
        except Unauthorized:
            approver = self.clients.approver(request)
            if approver is not None:
                return approver, True
            if not self.clients.enabled or CLIENT_TOKEN_HEADER not in request.headers:
                raise
        tenant = self.clients.tenant(request)
        assert tenant is not None
        return tenant, False

    async def listing(self, request: web.Request) -> web.Response:
        try:
            tenant, _ = self._who(request)
            state = request.query.get("state") or PENDING
            if state not in ("all", *APPROVAL_STATES):
                raise InvalidRequest(f"state: one of all, {', '.join(APPROVAL_STATES)}", param="state")
            limit = request.query.get("limit", "1000")
            if not ASCII_INT.fullmatch(limit) or len(limit) > 6 or int(limit) > _MAX_LIST:
                raise InvalidRequest(f"limit: a whole number from 0 to {_MAX_LIST}", param="limit")
            run_id = request.query.get("run") or None
            if run_id is not None:
                if tenant is not None:
                    run_id = f"{tenant}:{run_id}"
                if not LEDGER_RUN_ID_RE.match(run_id):
                    raise InvalidRequest(f"run: {run_id[:140]!r} is not a run id", param="run")
            found = await self.desk.ledger.list_approvals(
                time.time(), state=None if state == "all" else state, run_id=run_id,
                limit=_MAX_LIST if tenant is not None else int(limit),
            )  # fmt: skip
            if tenant is not None:
                found = [a for a in found if a.tenant == tenant][: int(limit)]
        except Rejection as rej:
            return rej.response("openai")
        args = await self._args([a.request_hash for a in found])
        rows = [approval_json(a, tenant, call_arguments(a, args.get(a.request_hash))) for a in found]
        return _json({"approvals": rows})

    async def decide(self, request: web.Request) -> web.Response:
        try:
            tenant, may_decide = self._who(request)
            if not may_decide:
                raise ApprovalNeedsAPerson(
                    f"{CLIENT_TOKEN_HEADER}: a client token lists its tenant's approvals but cannot "
                    "decide them (the agent holds it: it would approve its own call); decide with "
                    "the tenant's approver token ([auth] client_tokens.TENANT.approver_token, as "
                    "Authorization: Bearer) or the admin token"
                )
            approval_id = request.match_info["approval_id"]
            try:
                body = orjson.loads(await request.read() or b"{}")
            except orjson.JSONDecodeError:
                raise InvalidRequest("body: expected a JSON object", param="body") from None
            if not isinstance(body, dict):
                raise InvalidRequest("body: expected a JSON object", param="body")
            decision = body.get("decision")
            if decision not in ("approve", "deny"):
                raise InvalidRequest('decision: "approve" or "deny"', param="decision")
            by, reason = body.get("by") or "", body.get("reason") or ""
            for name, value in (("by", by), ("reason", reason)):
                if not isinstance(value, str) or len(value) > _MAX_TEXT:
                    raise InvalidRequest(f"{name}: a string of at most {_MAX_TEXT} characters", param=name)
            if decision == "deny" and not reason.strip():
                raise InvalidRequest(
                    "reason: a denial needs one (the agent is told why its call was refused)", param="reason"
                )
            if tenant is not None:
                seen = await self.desk.ledger.get_approval(approval_id, time.time())
                if seen is None or seen.tenant != tenant:
                    raise _not_found(approval_id)
                by = f"{tenant}: {by or 'approver token'}"
            try:
                approval = await self.desk.decide(approval_id, decision == "approve", by or "admin", reason)
            except ApprovalNotPending as e:
                a = e.approval
                raise ApprovalNotPendingRejection(
                    f"approval {approval_id} is {a.state}"
                    + (f" (by {a.by}: {a.reason})" if a.by else "")
                    + "; a decision is final — the same call asked again after an expiry is a new approval"
                ) from None
            if approval is None:
                raise _not_found(approval_id)
        except Rejection as rej:
            return rej.response("openai")
        return _json(approval_json(approval, tenant, None))

    async def _args(self, hashes: list[str]) -> dict[str, Any]:
        """The calls' arguments from the payload store, where their bodies were kept (and shipped)."""
        wanted = sorted({h for h in hashes if h})
        if not wanted:
            return {}

        def read() -> dict[str, Any]:
            store = open_payload_store(self.s3_url, self.data_dir)
            out: dict[str, Any] = {}
            try:
                for h in wanted:
                    try:
                        out[h] = orjson.loads(store.get(h))
                    except KeyError:
                        continue  # not shipped yet, or not kept
                    except orjson.JSONDecodeError:
                        continue
            finally:
                store.close()
            return out

        try:
            async with asyncio.timeout(_ARGS_TIMEOUT_S):
                return await asyncio.to_thread(read)
        except Exception as e:  # the listing answers without them
            log.warning("approvals: could not read arguments from the payload store: %s", e)
            return {}


def _not_found(approval_id: str) -> NotFound:
    return NotFound(
        f"no approval {approval_id[:64]!r} (see `runcap approvals --all`)", param="approval_id"
    )


def call_arguments(approval: Approval, body: Any) -> Any:
    """The arguments a person approves, from the call's kept body (as sent to the tool): a `/tools`
    call's body is its arguments; an MCP call's is its `tools/call` request, whose
    `params.arguments` they are."""
    if approval.tool.startswith("mcp:") and isinstance(body, dict):
        params = body.get("params")
        return params.get("arguments") if isinstance(params, dict) else None
    return body


def approval_json(a: Approval, tenant: str | None, args: Any) -> dict[str, Any]:
    run_id = a.run_id
    if tenant is not None and run_id.startswith(f"{tenant}:"):
        run_id = run_id[len(tenant) + 1 :]
    return {
        "id": a.id,
        "run_id": run_id,
        "tool": a.tool,
        "args_hash": a.args_hash,
        "args": args,
        "state": a.state,
        "requested_at": iso(a.requested_at),
        "decided_at": iso(a.decided_at),
        "expires_at": iso(a.expires_at),
        "by": a.by,
        "reason": a.reason,
        "rule": a.rule,
        "rule_reason": a.rule_reason,
        "tenant": a.tenant,
        "step": a.step,
        "request_hash": a.request_hash,
    }


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")
