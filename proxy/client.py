"""For agent hosts: the run headers runcap reads, and runcap's rejections as typed exceptions.

An agent host (a Temporal/Restate/DBOS/Inngest worker, a job runner, a plain loop) sends the same
run headers on every model and tool call of a run, and must tell runcap's refusals — which no
retry can fix — from the upstream's transient errors:

    headers = RunHeaders("ticket-4711", task="refunds", max_usd="0.50", max_steps=20, timeout_s=300)
    client = openai.OpenAI(base_url="http://127.0.0.1:8787/v1", default_headers=headers.as_dict())
    try:
        client.chat.completions.create(...)
    except openai.APIStatusError as e:
        rejection = rejection_from_error(e)   # BudgetExceeded, DeadlineExceeded, RunCancelled, ...
        if rejection is not None:
            raise rejection from e             # a durable engine: fail the step, do not retry
        raise                                  # anything else: the engine's retry policy applies

The same works for `anthropic.APIStatusError`, for an `httpx.HTTPStatusError`, and for the status
and body of a `/tools/...` answer (`rejection_from_response`). Only the standard library is
imported here: the `openai` / `anthropic` errors are read by their attributes, not their classes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from proxy.context import POLICIES as CONTEXT_POLICIES

__all__ = [
    "NON_RETRYABLE_ERROR_TYPES",
    "BudgetExceeded",
    "DeadlineExceeded",
    "IdempotencyKeyReused",
    "InvalidRunRequest",
    "OutcomeUnknown",
    "RunCancelled",
    "RunHeaders",
    "RuncapRejection",
    "ToolTimeout",
    "raise_for_rejection",
    "rejection_from_error",
    "rejection_from_response",
]

# The X-Run-Id contract (DESIGN.md "Run headers"); the server checks it with the same pattern.
_RUN_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True)
class RunHeaders:
    """The `X-Run-*` headers of one run. `as_dict()` fits `default_headers` / `extra_headers` of
    the official clients and the headers of an httpx/aiohttp tool call.

    Send the same caps on every call: runcap fixes them when it first sees the run, and later
    calls may lower them, never raise them — so a restarted worker cannot reset a budget.
    `operation_id` / `idempotency_key` are per tool call (`for_call`)."""

    run_id: str
    task: str | None = None
    max_usd: str | None = None  # a decimal string; floats, ints and Decimals are converted
    max_tokens: int | None = None
    max_steps: int | None = None
    max_tool_calls: int | None = None
    deadline: str | None = None  # RFC 3339 or Unix seconds; datetimes and numbers are converted
    timeout_s: float | None = None  # relative to the run's first request
    max_context_tokens: int | None = None  # one step's input tokens
    context_policy: str | None = None  # "offload", "summarize" or "offload,summarize"
    operation_id: str | None = None
    idempotency_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id):
            raise ValueError(f"run_id {self.run_id!r}: 1-128 characters of A-Z a-z 0-9 . _ : -")
        if self.max_usd is not None:
            object.__setattr__(self, "max_usd", _usd(self.max_usd))
        if self.deadline is not None:
            object.__setattr__(self, "deadline", _deadline(self.deadline))
        for name in ("max_tokens", "max_steps", "max_tool_calls", "max_context_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.timeout_s is not None and not (0 < float(self.timeout_s) < math.inf):
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")
        if self.context_policy is not None:
            names = [n.strip() for n in self.context_policy.split(",")]
            if not all(n in CONTEXT_POLICIES for n in names):
                raise ValueError(
                    f"context_policy must name one or more of {', '.join(CONTEXT_POLICIES)} "
                    f"(comma-separated), got {self.context_policy!r}"
                )

    def for_call(self, operation_id: str | None = None, idempotency_key: str | None = None) -> RunHeaders:
        """The same run, for one tool call: a new `operation_id` repeats an operation on purpose
        with the same arguments; an `idempotency_key` replaces the one runcap derives."""
        return dataclasses.replace(self, operation_id=operation_id, idempotency_key=idempotency_key)

    def as_dict(self) -> dict[str, str]:
        h = {"X-Run-Id": self.run_id}
        if self.task is not None:
            h["X-Run-Task"] = self.task
        if self.max_usd is not None:
            h["X-Run-Max-Usd"] = str(self.max_usd)
        for header, value in (
            ("X-Run-Max-Tokens", self.max_tokens),
            ("X-Run-Max-Steps", self.max_steps),
            ("X-Run-Max-Tool-Calls", self.max_tool_calls),
            ("X-Run-Max-Context-Tokens", self.max_context_tokens),
        ):
            if value is not None:
                h[header] = str(value)
        if self.deadline is not None:
            h["X-Run-Deadline"] = str(self.deadline)
        if self.timeout_s is not None:
            h["X-Run-Timeout"] = f"{float(self.timeout_s):g}"
        if self.context_policy is not None:
            h["X-Run-Context-Policy"] = self.context_policy
        if self.operation_id is not None:
            h["X-Run-Operation-Id"] = self.operation_id
        if self.idempotency_key is not None:
            h["Idempotency-Key"] = self.idempotency_key
        return h


def _usd(value: Any) -> str:
    try:
        d = Decimal(str(value).strip()) if not isinstance(value, Decimal) else value
    except InvalidOperation:
        d = Decimal("NaN")
    if isinstance(value, bool) or not d.is_finite() or d < 0:
        raise ValueError(f"max_usd must be a dollar amount >= 0, got {value!r}")
    return format(d, "f")


def _deadline(value: Any) -> str:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("deadline: a datetime needs a time zone")
        return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{float(value):.3f}"
    if isinstance(value, str):
        return value
    raise ValueError(f"deadline must be a datetime, Unix seconds or an RFC 3339 string, got {value!r}")


# -- rejections -----------------------------------------------------------------------------------


class RuncapRejection(Exception):
    """runcap refused the call (DESIGN.md "Rejections"). Retrying the same call cannot succeed,
    so a durable engine should fail the step instead of retrying it (`non_retryable`)."""

    status: int = 400
    type: str = ""
    non_retryable = True

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        param: str | None = None,
        run_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.code = code
        self.param = param
        self.run_id = run_id
        self.idempotency_key = idempotency_key

    def __str__(self) -> str:
        code = f"/{self.code}" if self.code else ""
        return f"runcap {self.status} {self.type}{code}: {self.message}"

    def as_details(self) -> dict[str, Any]:
        """JSON-able fields, e.g. for `ApplicationError(..., details)`."""
        return {
            "status": self.status, "type": self.type, "code": self.code, "param": self.param,
            "message": self.message, "run_id": self.run_id, "idempotency_key": self.idempotency_key,
        }  # fmt: skip


class BudgetExceeded(RuncapRejection):
    """402: a cap is used up; `code` (also `.cap`) is max_usd, max_tokens, max_steps, max_tool_calls
    or max_context_tokens (one step over its context cap: shorten the context, the run goes on)."""

    status = 402
    type = "run_budget_exceeded"

    @property
    def cap(self) -> str | None:
        return self.code


class DeadlineExceeded(RuncapRejection):
    """504: the run's deadline has passed (before or during the call)."""

    status = 504
    type = "run_deadline_exceeded"


class RunCancelled(RuncapRejection):
    """410: the run was cancelled (`POST /runs/{id}/cancel`, `runcap cancel`)."""

    status = 410
    type = "run_cancelled"


class OutcomeUnknown(RuncapRejection):
    """409: an earlier attempt of this side-effecting tool call was cut after it may have reached
    the tool. Repeats get 409 until someone reconciles `idempotency_key` (`runcap reconcile`)."""

    status = 409
    type = "idempotency_outcome_unknown"


class ToolTimeout(OutcomeUnknown):
    """504: the tool did not answer within its `timeout_s`; the call was aborted and may have
    taken effect. A repeat gets 409 (`OutcomeUnknown`) until it is reconciled."""

    status = 504
    type = "tool_timeout"


class IdempotencyKeyReused(RuncapRejection):
    """422: the Idempotency-Key was already used for another operation of the run (another tool,
    path or arguments); nothing was executed. A retry with the same key is refused again: send a
    new key (or none)."""

    status = 422
    type = "idempotency_key_reused"


class InvalidRunRequest(RuncapRejection):
    """400: a malformed run header or a body runcap must parse; `param` names it."""

    status = 400
    type = "invalid_request"


_BY_TYPE: dict[str, type[RuncapRejection]] = {
    cls.type: cls
    for cls in (
        BudgetExceeded,
        DeadlineExceeded,
        RunCancelled,
        OutcomeUnknown,
        ToolTimeout,
        IdempotencyKeyReused,
        InvalidRunRequest,
    )
}

# Names for a retry policy that matches exceptions by type name (Temporal's
# `RetryPolicy(non_retryable_error_types=...)`, which sees an activity's exception class name).
_REJECTIONS: tuple[type[RuncapRejection], ...] = (RuncapRejection, *_BY_TYPE.values())
NON_RETRYABLE_ERROR_TYPES: tuple[str, ...] = tuple(cls.__name__ for cls in _REJECTIONS)


_CAP_HEADER = re.compile(r"X-Run-Max-(Usd|Tokens|Steps|Tool-Calls|Context-Tokens)", re.IGNORECASE)


def rejection_from_response(
    status: int, body: bytes | str | Mapping[str, Any] | None, headers: Mapping[str, str] | None = None
) -> RuncapRejection | None:
    """runcap's rejection in an HTTP answer (any route: model calls in the OpenAI or Anthropic
    shape, `/tools/...`), or None when the answer is not one — e.g. the upstream's own 400 or 500,
    or a tool's own error, which a retry policy may treat as it likes."""
    if status < 400 or body is None:
        return None
    if isinstance(body, (bytes, bytearray, str)):
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
    else:
        parsed = body
    if not isinstance(parsed, Mapping) or not isinstance(parsed.get("error"), Mapping):
        return None
    err = parsed["error"]
    cls = _BY_TYPE.get(str(err.get("type")))
    if cls is None:
        return None
    h = {k.lower(): v for k, v in (headers or {}).items()}
    message = str(err.get("message") or cls.type)
    code = err.get("code") if isinstance(err.get("code"), str) else None
    if code is None and cls is BudgetExceeded:
        # The Anthropic shape has no code; the message names the cap's header.
        m = _CAP_HEADER.search(message)
        code = "max_" + m.group(1).lower().replace("-", "_") if m else None
    return cls(
        message,
        status=status,
        code=code,
        param=err.get("param") if isinstance(err.get("param"), str) else None,
        run_id=h.get("x-run-id"),
        idempotency_key=h.get("idempotency-key"),
    )


def rejection_from_error(error: BaseException) -> RuncapRejection | None:
    """runcap's rejection inside an `openai.APIStatusError`, an `anthropic.APIStatusError` or an
    `httpx.HTTPStatusError` (anything with `.response` carrying `status_code`, `content` and
    `headers`), or None."""
    if isinstance(error, RuncapRejection):
        return error
    response = getattr(error, "response", None)
    status = getattr(error, "status_code", None) or getattr(response, "status_code", None)
    if not isinstance(status, int):
        return None
    body: Any = None
    headers: Mapping[str, str] = {}
    if response is not None:
        try:
            body = response.content
        except Exception:  # a streamed response whose body was not read
            body = None
        headers = getattr(response, "headers", None) or {}
    if body is None:
        body = getattr(error, "body", None)
        if isinstance(body, Mapping) and "error" not in body:
            body = {"error": body}  # openai's `.body` is the inner error object
    return rejection_from_response(status, body, headers)


def raise_for_rejection(
    status: int, body: bytes | str | Mapping[str, Any] | None, headers: Mapping[str, str] | None = None
) -> None:
    """Raise runcap's rejection in this answer, if it is one (e.g. after a `/tools` call)."""
    rejection = rejection_from_response(status, body, headers)
    if rejection is not None:
        raise rejection
