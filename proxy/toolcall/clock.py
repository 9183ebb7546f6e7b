"""How long a tool call may take: the one place the tool gateways (proxy/tools/gateway.py, proxy/mcp/)
turn the run's deadline — and a tool's own `timeout_s` — into a call's timeout and the
`X-Run-Deadline` / `X-Run-Remaining-Ms` a tool is told. The arithmetic is server/outbound.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from proxy.caps import RunRequest
from proxy.ledger.base import RunState
from proxy.server.outbound import call_timeout, deadline_headers, run_deadline


@dataclass(frozen=True, slots=True)
class CallClock:
    """One call's time: `seconds` None = unbounded; `by_deadline` = the run's deadline is what
    bounds it (a cut is then the run's deadline, not the call's own limit)."""

    deadline: float | None  # the run's, epoch seconds
    seconds: float | None
    by_deadline: bool
    now: float  # when the clock was read

    def headers(self) -> dict[str, str]:
        """What the tool is told of the run's deadline (none when the run has none)."""
        return deadline_headers(self.deadline, self.now)


def deadline_clock(
    deadline: float | None, limit_s: float | None = None, now: float | None = None
) -> CallClock:
    """A call bounded by `deadline` and by its own `limit_s`, whichever comes first."""
    now = time.time() if now is None else now
    timeout = call_timeout(deadline, limit_s, now)
    return CallClock(deadline, timeout.seconds, timeout.by_deadline, now)


def tool_clock(
    run: RunRequest, state: RunState | None, limit_s: float | None = None, now: float | None = None
) -> CallClock:
    """A call of `run` (`state`: the ledger's view, None when the call did not touch it)."""
    now = time.time() if now is None else now
    return deadline_clock(run_deadline(run, state, now), limit_s, now)
