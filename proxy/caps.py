"""Run headers → `RunRequest`: the run id, its task, and the caps this request asks for.

Header values are validated strictly (a malformed value is a 400 naming the header, never a cap
silently ignored), clamped by the operator's ceilings, and completed with the operator's defaults
when absent. Whether the caps are new or lower an existing run's caps is the ledger's business:
caps are fixed when the run is first seen and later requests may only lower them.
"""

from __future__ import annotations

import difflib
import os
import random
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from proxy.bounds import ASCII_INT, MAX_CAP, MAX_USD, PLAIN_DECIMAL
from proxy.config import CapsConfig
from proxy.errors import InvalidRequest
from proxy.money import usd_to_nanos

# One run-id grammar, matched in full whichever way it is called (`\Z`, not `$`, which also
# matches before a trailing newline: `abc\n` was a run id on the admin routes).
RUN_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}\Z")
# A run id as the ledger and the admin routes know it: with `[auth] client_tokens` it is
# `{tenant}:{run id}` (tenant names have no ':', so no two tenants' ids can meet).
# The caps in whole numbers an operator may set on a run (`POST /runs/{id}/caps`, `runcap caps`),
# its dollars and deadline aside: the run's own, and the caps of its subtree (run trees).
OPERATOR_WHOLE_CAPS = (
    "max_tokens", "max_steps", "max_tool_calls", "max_depth", "max_children", "max_tree_steps",
    "max_tree_tool_calls",
)  # fmt: skip
LEDGER_RUN_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,200}\Z")
_INT_RE = ASCII_INT
_DECIMAL_RE = PLAIN_DECIMAL
# Every run header an agent may send: any other `X-Run-*` is a 400 naming the closest of these
# (a misspelled cap must not leave the run without its cap).
RUN_HEADERS = (
    "X-Run-Id",
    "X-Run-Task",
    "X-Run-Max-Usd",
    "X-Run-Max-Tokens",
    "X-Run-Max-Steps",
    "X-Run-Max-Tool-Calls",
    "X-Run-Max-Context-Tokens",
    "X-Run-Deadline",
    "X-Run-Timeout",
    "X-Run-Context-Policy",
    "X-Run-Operation-Id",
    "X-Run-Client-Token",
    "X-Run-Max-Repeats",
    # Run trees (issue 22)
    "X-Run-Parent",
    "X-Run-Max-Depth",
    "X-Run-Max-Children",
    "X-Run-Max-Tree-Steps",
    "X-Run-Max-Tree-Tool-Calls",
)
_RUN_HEADERS = {name.lower(): name for name in RUN_HEADERS}
# Headers read once per request that a second copy would silently lose to the first.
_SINGLE = ("Idempotency-Key",)
_MAX_UNIX_SECONDS = 253402300800.0  # 10000-01-01: beyond what dates (and RFC 3339) can say


@dataclass(frozen=True, slots=True)
class RunCaps:
    """Per-run caps; None = no cap. Money in nano-dollars, deadline in Unix seconds."""

    max_usd_nanos: int | None = None
    max_tokens: int | None = None
    max_steps: int | None = None
    max_tool_calls: int | None = None
    deadline: float | None = None
    # Relative deadline (seconds after the run's first request); resolved by the ledger when the
    # run is created, because only the ledger knows when that was.
    timeout_s: float | None = None
    # Cap on ONE step's input tokens (`X-Run-Max-Context-Tokens`), enforced before forwarding by
    # proxy/server/steps/context.py with each request's own value (header, task, [caps] default and
    # ceiling). A per-step limit, not a budget the run uses up: the ledger does not store it.
    max_context_tokens: int | None = None
    # `X-Run-Max-Repeats`: identical tool calls / model requests a run may repeat
    # (proxy/ledger/repeats.py).
    max_repeats: int | None = None
    # Run trees (issue 22): how many levels of sub-runs below this run, how many direct children
    # it may start, and caps on the model calls / tool calls of its whole subtree (itself included).
    max_depth: int | None = None
    max_children: int | None = None
    max_tree_steps: int | None = None
    max_tree_tool_calls: int | None = None

    def lowered_by(self, other: RunCaps) -> RunCaps:
        """The tighter of two sets of caps, cap by cap (None is no cap)."""
        return RunCaps(
            _min(self.max_usd_nanos, other.max_usd_nanos),
            _min(self.max_tokens, other.max_tokens),
            _min(self.max_steps, other.max_steps),
            _min(self.max_tool_calls, other.max_tool_calls),
            _min(self.deadline, other.deadline),
            None,
            _min(self.max_context_tokens, other.max_context_tokens),
            _min(self.max_repeats, other.max_repeats),
            _min(self.max_depth, other.max_depth),
            _min(self.max_children, other.max_children),
            _min(self.max_tree_steps, other.max_tree_steps),
            _min(self.max_tree_tool_calls, other.max_tree_tool_calls),
        )

    def with_budget(
        self,
        max_usd_nanos: int | None,
        max_tokens: int | None,
        max_steps: int | None,
        max_tool_calls: int | None,
    ) -> RunCaps:
        """These caps with the four budgets a run tree lowers (`base._tree_view`) replaced:
        built positionally, as every call of a sub-run does (`dataclasses.replace` costs
        several times more)."""
        return RunCaps(
            max_usd_nanos,
            max_tokens,
            max_steps,
            max_tool_calls,
            self.deadline,
            self.timeout_s,
            self.max_context_tokens,
            self.max_repeats,
            self.max_depth,
            self.max_children,
            self.max_tree_steps,
            self.max_tree_tool_calls,
        )

    def resolve_deadline(self, started_at: float) -> RunCaps:
        if self.timeout_s is None:
            return self
        return RunCaps(
            self.max_usd_nanos,
            self.max_tokens,
            self.max_steps,
            self.max_tool_calls,
            _min(self.deadline, started_at + self.timeout_s),
            None,
            self.max_context_tokens,
            self.max_repeats,
            self.max_depth,
            self.max_children,
            self.max_tree_steps,
            self.max_tree_tool_calls,
        )


# Caps as the ledgers decode them on every call of a run: the same few sets recur, and a frozen
# RunCaps built field by field costs more than a lookup (`stored_caps`).
_STORED: dict[tuple[Any, ...], RunCaps] = {}
STORED_KEPT = 4096


def stored_caps(*values: Any) -> RunCaps:
    """`RunCaps(*values)` (positional), the same object for the same values (it is immutable)."""
    caps = _STORED.get(values)
    if caps is None:
        if len(_STORED) >= STORED_KEPT:
            _STORED.clear()
        caps = _STORED[values] = RunCaps(*values)
    return caps


def _min(a, b):  # type: ignore[no-untyped-def]
    if a is None:
        return b
    if b is None:
        return a
    return a if a <= b else b


@dataclass(frozen=True, slots=True)
class RunRequest:
    run_id: str
    generated: bool  # runcap made the id up: the request is its own one-step run
    task: str
    caps: RunCaps
    operation_id: str | None = None
    idempotency_key: str | None = None
    # The parent run (`X-Run-Parent`, namespaced by tenant like `run_id`); "" for none.
    parent: str = ""


# Generated run ids (a request without X-Run-Id is its own run) need to be unique, not secret —
# the id is only ever a name in the caller's own tenant, returned to it — so, as span ids, they
# come from a PRNG seeded from the OS (re-seeded in a forked child) instead of a getrandom()
# syscall per request.
_run_ids = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _run_ids.seed(secrets.randbits(128)))


def claimed_run_id(headers: Mapping[str, str]) -> str | None:
    """The request's X-Run-Id when it is a valid run id — also when another run header was bad
    and the request refused (the access log names the run it was for); None otherwise."""
    run_id = headers.get("X-Run-Id")
    return run_id if run_id is not None and RUN_ID_RE.match(run_id) else None


def parse_run_headers(
    headers: Mapping[str, str],
    config: CapsConfig,
    *,
    require_run_id: bool = False,
    tenant: str | None = None,
) -> RunRequest:
    """`tenant` (from the client token, when `[auth] client_tokens` is set) namespaces the run id:
    one tenant can neither see, lower, cancel nor collide with another's run."""
    if not check_run_header_names(headers) and not require_run_id:
        # No run header at all (most requests of an agent that sets none): its own run, under the
        # operator's defaults — what the rest of this function makes of no headers, made once.
        own = f"run_{_run_ids.getrandbits(96):024x}"
        return RunRequest(own if tenant is None else f"{tenant}:{own}", True, "", _default_caps(config))
    run_id = headers.get("X-Run-Id")
    generated = False
    if run_id is None:
        if require_run_id:
            raise InvalidRequest(
                "X-Run-Id: required by this runcap (require_run_id = true); send the run's id "
                "(1-128 characters of A-Z a-z 0-9 . _ : -)",
                param="X-Run-Id",
            )
        run_id = f"run_{_run_ids.getrandbits(96):024x}"
        generated = True
    elif not RUN_ID_RE.match(run_id):
        raise InvalidRequest(
            f"X-Run-Id: {run_id[:140]!r} is not a run id (1-128 characters of A-Z a-z 0-9 . _ : -)",
            param="X-Run-Id",
        )

    task = headers.get("X-Run-Task", "")
    if len(task) > 256 or not task.isprintable():
        raise InvalidRequest("X-Run-Task: at most 256 printable characters", param="X-Run-Task")

    usd = _usd(headers.get("X-Run-Max-Usd"))
    max_tokens = _count(headers.get("X-Run-Max-Tokens"), "X-Run-Max-Tokens")
    max_steps = _count(headers.get("X-Run-Max-Steps"), "X-Run-Max-Steps")
    max_tool_calls = _count(headers.get("X-Run-Max-Tool-Calls"), "X-Run-Max-Tool-Calls")
    max_context = _count(headers.get("X-Run-Max-Context-Tokens"), "X-Run-Max-Context-Tokens")
    max_repeats = _count(headers.get("X-Run-Max-Repeats"), "X-Run-Max-Repeats")
    if max_repeats == 0:
        raise InvalidRequest(
            "X-Run-Max-Repeats: 0 would stop a run at its first tool call; send at least 1 (the times "
            "the same tool call or model request may repeat)",
            param="X-Run-Max-Repeats",
        )
    deadline = _deadline(headers.get("X-Run-Deadline"))
    timeout_s = _seconds(headers.get("X-Run-Timeout"), "X-Run-Timeout")
    longest = config.max_run_seconds
    if timeout_s is not None and timeout_s > longest:
        raise InvalidRequest(
            f"X-Run-Timeout: {timeout_s:g} s is beyond the longest run this runcap allows "
            f"(caps.max_run_seconds = {longest:g} s)",
            param="X-Run-Timeout",
        )
    if deadline is not None and deadline - time.time() > longest:
        raise InvalidRequest(
            f"X-Run-Deadline: {headers['X-Run-Deadline'][:60]!r} is more than caps.max_run_seconds = "
            f"{longest:g} s away",
            param="X-Run-Deadline",
        )

    parent = headers.get("X-Run-Parent", "")
    if parent and not RUN_ID_RE.match(parent):
        raise InvalidRequest(
            f"X-Run-Parent: {parent[:140]!r} is not a run id (1-128 characters of A-Z a-z 0-9 . _ : -)",
            param="X-Run-Parent",
            code="parent_invalid",
        )
    if parent and parent == run_id:
        raise InvalidRequest(
            f"X-Run-Parent: run {run_id!r} names itself as its parent (a cycle); name the run that "
            "started this one",
            param="X-Run-Parent",
            code="parent_cycle",
        )
    tree_caps = {
        name: _apply(_count(headers.get(header), header), getattr(config, default), getattr(config, ceiling))
        for name, header, default, ceiling in _TREE_CAPS
    }

    has_time_header = deadline is not None or timeout_s is not None
    caps = RunCaps(
        max_usd_nanos=_apply(usd, config.default_max_usd_nanos, config.ceiling_max_usd_nanos),
        max_tokens=_apply(max_tokens, config.default_max_tokens, config.ceiling_max_tokens),
        max_steps=_apply(max_steps, config.default_max_steps, config.ceiling_max_steps),
        max_tool_calls=_apply(max_tool_calls, config.default_max_tool_calls, config.ceiling_max_tool_calls),
        deadline=deadline,
        timeout_s=_min(
            timeout_s if has_time_header else config.default_timeout_s,
            config.ceiling_timeout_s,
        ),
        max_context_tokens=_apply(
            max_context, config.default_max_context_tokens, config.ceiling_max_context_tokens
        ),
        max_repeats=_apply(max_repeats, config.default_max_repeats, config.ceiling_max_repeats),
        **tree_caps,
    )
    per_task = config.tasks.get(task) if task else None
    if per_task is not None:
        # The task's caps replace the operator's defaults and bound what a header asks for.
        caps = RunCaps(
            max_usd_nanos=_task_cap(
                usd, per_task.max_usd_nanos, config.ceiling_max_usd_nanos, caps.max_usd_nanos
            ),
            max_tokens=_task_cap(max_tokens, per_task.max_tokens, config.ceiling_max_tokens, caps.max_tokens),
            max_steps=_task_cap(max_steps, per_task.max_steps, config.ceiling_max_steps, caps.max_steps),
            max_tool_calls=_task_cap(
                max_tool_calls, per_task.max_tool_calls, config.ceiling_max_tool_calls, caps.max_tool_calls
            ),
            deadline=deadline,
            timeout_s=_task_cap(timeout_s, per_task.timeout_s, config.ceiling_timeout_s, caps.timeout_s),
            max_context_tokens=_task_cap(
                max_context,
                per_task.max_context_tokens,
                config.ceiling_max_context_tokens,
                caps.max_context_tokens,
            ),
            max_repeats=caps.max_repeats,
            **tree_caps,
        )

    operation_id = headers.get("X-Run-Operation-Id")
    if operation_id is not None and not 1 <= len(operation_id) <= 256:
        raise InvalidRequest("X-Run-Operation-Id: 1-256 characters", param="X-Run-Operation-Id")
    key = headers.get("Idempotency-Key")
    if key is not None and not 1 <= len(key) <= 256:
        raise InvalidRequest("Idempotency-Key: 1-256 characters", param="Idempotency-Key")
    if tenant is not None:
        # The parent is looked up in the tenant's own namespace: another tenant's run is unknown.
        run_id = f"{tenant}:{run_id}"
        parent = f"{tenant}:{parent}" if parent else ""
    return RunRequest(run_id, generated, task, caps, operation_id, key, parent)


# The tree caps: the RunCaps field, its header, and its `[caps]` default and ceiling (max_children
# is `max_fan_out` there), spelled once rather than formatted on every request.
_TREE_CAPS = tuple(
    (name, header, f"default_{setting}", f"ceiling_{setting}")
    for name, header, setting in (
        ("max_depth", "X-Run-Max-Depth", "max_depth"),
        ("max_children", "X-Run-Max-Children", "max_fan_out"),
        ("max_tree_steps", "X-Run-Max-Tree-Steps", "max_tree_steps"),
        ("max_tree_tool_calls", "X-Run-Max-Tree-Tool-Calls", "max_tree_tool_calls"),
    )
)


# `parse_run_headers` of no headers, per `[caps]` configuration (the object: a reload makes another).
_DEFAULT_CAPS: dict[int, tuple[CapsConfig, RunCaps]] = {}


def _default_caps(config: CapsConfig) -> RunCaps:
    kept = _DEFAULT_CAPS.get(id(config))
    if kept is None or kept[0] is not config:
        if len(_DEFAULT_CAPS) >= 64:
            _DEFAULT_CAPS.clear()
        kept = _DEFAULT_CAPS[id(config)] = (config, parse_run_headers({"X-Run-Id": "r"}, config).caps)
    return kept[1]


def check_run_header_names(headers: Mapping[str, str]) -> int:
    """Each run header at most once, and no `X-Run-*` runcap does not know: a platform that
    appends its cap after the agent's must not get the agent's, and `X-Run-Max-Dollars` must not
    leave the run without a cap. Returns how many run headers there are."""
    seen: dict[str, int] = {}
    for name, _ in headers.items():  # every copy of a repeated header (a multidict's keys() has one)
        lower = name.lower()
        if lower.startswith("x-run-") or lower in ("idempotency-key",):
            seen[lower] = seen.get(lower, 0) + 1
    for lower, n in seen.items():
        known = _RUN_HEADERS.get(lower) or next((h for h in _SINGLE if h.lower() == lower), None)
        if known is None:
            close = difflib.get_close_matches(_synonyms(lower), list(_RUN_HEADERS), n=1, cutoff=0.6)
            hint = f"did you mean {_RUN_HEADERS[close[0]]}?" if close else f"known: {', '.join(RUN_HEADERS)}"
            shown = next(k for k in headers.keys() if k.lower() == lower)
            raise InvalidRequest(
                f"{shown[:80]}: not a run header runcap knows ({hint}); runcap consumes every X-Run-* "
                "header, so a misspelled one would be a cap silently missing",
                param=shown[:80],
            )
        if n > 1:
            raise InvalidRequest(
                f"{known}: sent {n} times; send it once (which copy should win is not runcap's guess)",
                param=known,
            )
    return len(seen)


# Words for a header's subject that difflib cannot see are the same (X-Run-Max-Dollars: usd).
_SYNONYMS = (("dollars", "usd"), ("dollar", "usd"), ("budget", "usd"), ("cost", "usd"), ("spend", "usd"),
             ("toolcalls", "tool-calls"), ("tools", "tool-calls"), ("seconds", "timeout"))  # fmt: skip


def _synonyms(name: str) -> str:
    for word, known in _SYNONYMS:
        name = name.replace(word, known)
    return name


def _apply(value, default, ceiling):  # type: ignore[no-untyped-def]
    return _min(value if value is not None else default, ceiling)


def _task_cap(header, task_cap, ceiling, otherwise):  # type: ignore[no-untyped-def]
    """A cap the task configures: the header may only lower it; else what [caps] gave."""
    if task_cap is None:
        return otherwise
    return _min(_min(header, task_cap), ceiling)


def _usd(raw: str | None) -> int | None:
    if raw is None:
        return None
    text = raw.strip(" \t")
    d = Decimal(text) if _DECIMAL_RE.fullmatch(text) else None
    if d is None:
        raise InvalidRequest(
            f"X-Run-Max-Usd: {raw[:40]!r} is not a dollar amount (a decimal like 2.50: plain ASCII "
            "digits and one point, no sign, exponent or separator)",
            param="X-Run-Max-Usd",
        )
    if d > MAX_USD:
        raise InvalidRequest(
            f"X-Run-Max-Usd: {raw[:40]!r} is above the largest dollar cap runcap accepts ({MAX_USD})",
            param="X-Run-Max-Usd",
        )
    return usd_to_nanos(d)



def _count(raw: str | None, header: str) -> int | None:
    if raw is None:
        return None
    text = raw.strip(" \t")
    if not _INT_RE.fullmatch(text):
        raise InvalidRequest(
            f"{header}: {raw[:40]!r} is not a whole number ≥ 0 (ASCII digits only)", param=header
        )
    if len(text) > 16 or int(text) > MAX_CAP:
        raise InvalidRequest(
            f"{header}: {raw[:40]!r} is above the largest cap runcap accepts ({MAX_CAP})", param=header
        )
    return int(text)


def _seconds(raw: str | None, header: str) -> float | None:
    if raw is None:
        return None
    text = raw.strip(" \t")
    value = float(text) if _DECIMAL_RE.fullmatch(text) and len(text) <= 40 else float("nan")
    if not value > 0:
        raise InvalidRequest(
            f"{header}: {raw[:40]!r} is not a number of seconds > 0 (ASCII digits, optionally one point)",
            param=header,
        )
    return value


def _deadline(raw: str | None) -> float | None:
    if raw is None:
        return None
    text = raw.strip(" \t")
    try:
        if not text.isascii():
            raise ValueError("not ASCII")
        if _DECIMAL_RE.fullmatch(text):
            value = float(text)
            if value >= _MAX_UNIX_SECONDS:
                raise ValueError("after year 9999")
            return value
        dt = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        if dt.tzinfo is None:
            raise ValueError("no time zone")
        return dt.timestamp()
    except ValueError:
        raise InvalidRequest(
            f"X-Run-Deadline: {raw[:60]!r} is not an RFC 3339 time with a zone "
            "(2026-01-02T15:04:05Z) or Unix seconds",
            param="X-Run-Deadline",
        ) from None
