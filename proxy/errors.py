"""Rejections: typed exceptions inside, the provider's error shape outside.

Every rejection of a run (budget, deadline, cancel, unknown side-effect outcome, bad input)
is a `Rejection` carrying status, error type, code, message and the parameter at fault. The server
renders it in the shape of the wire format the agent speaks (OpenAI or Anthropic) and always adds
`x-should-retry: false`: the official SDKs retry 408/409/429/5xx unless told not to, and a budget
stop retried is money spent twice. The exceptions are the failures of what runcap depends on —
an unreachable upstream (`UpstreamUnavailable`) and an unavailable run ledger
(`LedgerUnavailable`, with `x-should-retry: true` and `retry-after`) — where a retry may succeed.
"""

from __future__ import annotations

import orjson
from aiohttp import web


class Rejection(Exception):
    status = 400
    type = "invalid_request"
    # The run status a rejection of this kind puts the run in (None: leaves it as it is).
    run_status: str | None = None
    # What the refused or cut call is on record as (its span's and access log's outcome).
    outcome = "error"
    # The code and parameter a rejection of this kind carries unless the raiser names others.
    code: str | None = None
    param: str | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        run: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        # The run whose cap binds, when it is not the caller's own (a run tree's ancestor):
        # `error.run` in the OpenAI shape (DESIGN.md "Rejections").
        self.run = run
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self, flavor: str) -> bytes:
        if flavor == "anthropic":
            return orjson.dumps({"type": "error", "error": {"type": self.type, "message": self.message}})
        error = {"type": self.type, "code": self.code, "message": self.message, "param": self.param}
        if self.run is not None:
            error["run"] = self.run
        return orjson.dumps({"error": error})

    def response(self, flavor: str, extra_headers: dict[str, str] | None = None) -> web.Response:
        headers = {"x-should-retry": "false", **self.headers, **(extra_headers or {})}
        return web.Response(
            status=self.status, body=self.body(flavor), content_type="application/json", headers=headers
        )


class InvalidRequest(Rejection):
    status = 400
    type = "invalid_request"


class BudgetExceeded(Rejection):
    """A cap would be or is exceeded; code is max_usd / max_tokens / max_steps / max_tool_calls, or
    unmetered_endpoint (a POST runcap cannot meter, refused under a dollar/token cap)."""

    status = 402
    type = "run_budget_exceeded"
    outcome = "budget_exceeded"

    _RUN_STATUS = {
        "max_usd": "budget_exceeded",
        "max_tokens": "budget_exceeded",
        "max_steps": "steps_exceeded",
        "max_tool_calls": "tool_calls_exceeded",
        "max_upstream_failures": "budget_exceeded",
        "max_tree_steps": "steps_exceeded",
        "max_tree_tool_calls": "tool_calls_exceeded",
    }

    def __init__(self, code: str, message: str, *, run: str | None = None) -> None:
        super().__init__(message, code=code, param=code, run=run)
        self.run_status = self._RUN_STATUS.get(code)


class DeadlineExceeded(Rejection):
    status = 504
    type = "run_deadline_exceeded"
    run_status = "deadline_exceeded"
    outcome = "deadline_exceeded"
    code = "deadline"


class RunCancelled(Rejection):
    status = 410
    type = "run_cancelled"
    run_status = "cancelled"
    outcome = "cancelled"
    code = "cancelled"


class ToolTimeout(Rejection):
    """A `/tools` call hit the tool's own `timeout_s` (not the run's deadline): the run goes on."""

    status = 504
    type = "tool_timeout"
    outcome = "timeout"
    code = "tool_timeout"


class OutcomeUnknown(Rejection):
    status = 409
    type = "idempotency_outcome_unknown"
    outcome = "unknown"
    code = "outcome_unknown"


class IdempotencyKeyReused(Rejection):
    """An idempotency key sent again for another operation (tool, method, path or arguments):
    refused, never replayed — replaying would tell the caller an operation ran that never did."""

    status = 422
    type = "idempotency_key_reused"
    code = "idempotency_key_reused"
    param = "Idempotency-Key"


class InternalError(Rejection):
    """A bug in runcap (an exception it did not expect): answered in the agent's error shape, so
    the client reads a message and the access log and span record the 500 the agent got."""

    status = 500
    type = "internal_error"
    code = "internal_error"


class NotFound(Rejection):
    status = 404
    type = "not_found"


class PayloadTooLarge(Rejection):
    status = 413
    type = "request_too_large"


class Unauthorized(Rejection):
    status = 401
    type = "unauthorized"


class UpstreamUnavailable(Rejection):
    """The upstream could not be reached or reset the connection. Retrying may help, so unlike
    the run rejections this one lets the SDK retry (no `x-should-retry: false`)."""

    status = 502
    type = "upstream_unavailable"

    def response(self, flavor: str, extra_headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(
            status=self.status,
            body=self.body(flavor),
            content_type="application/json",
            headers=extra_headers or {},
        )


class UpstreamAnswerTooLarge(Rejection):
    """A buffered answer of the upstream passed `max_answer_bytes` while runcap read it: cut, and
    settled at its reservation (the provider did the work and bills it). Not retried: the same
    request would bring the same answer, and its cost, again."""

    status = 502
    type = "upstream_error"
    code = "answer_too_large"
    param = "max_answer_bytes"


class LedgerUnavailable(Rejection):
    """The run ledger could not be asked in time: unreachable, timed out, or its disk full. The
    call was not forwarded (a call is never forwarded unmetered), so retrying later is safe and
    may succeed: the one rejection that tells the SDKs to retry (`x-should-retry: true` and
    `retry-after`). `code` says why: ledger_timeout, ledger_unreachable, ledger_disk_full,
    ledger_replicas_behind (fewer Redis replicas than `redis_wait_replicas` acknowledged) or
    ledger_error; `backend` names the ledger (`sqlite` / `redis`)."""

    status = 503
    type = "ledger_unavailable"

    def __init__(
        self, message: str, *, backend: str, code: str = "ledger_error", retry_after_s: int = 1
    ) -> None:
        super().__init__(
            message,
            code=code,
            headers={"x-should-retry": "true", "retry-after": str(retry_after_s)},
        )
        self.backend = backend

    def response(self, flavor: str, extra_headers: dict[str, str] | None = None) -> web.Response:
        # Not the base class's `x-should-retry: false`: retrying is what the agent should do.
        return web.Response(
            status=self.status,
            body=self.body(flavor),
            content_type="application/json",
            headers={**self.headers, **(extra_headers or {})},
        )
