"""What both backends' recovery sweeps say: the operator's log lines for what a dead process left,
and the reason recorded on the tool calls it left in flight.

How a backend finds dead owners and settles their rows is its own (redis/recovery.py,
sqlite/recovery.py); the rule for a recovered reservation is base.py's `apply_recovery`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from proxy.ledger.base import RecoveredReservation

log = logging.getLogger("runcap.ledger")

# The error of a tool call turned unknown because the process executing it died.
DIED = "the runcap process executing it died"


def log_recovered(recovered: Iterable[RecoveredReservation]) -> None:
    for r in recovered:
        log.warning(
            "run %s: settled reservation %s of a process that died at its reserved amount "
            "($%s, %d tokens) — the call's real usage is unknown",
            r.run_id, r.reservation_id, r.usd_nanos / 1e9, r.tokens,
        )  # fmt: skip


def log_turned_unknown(run_id: str, key: str, tool: str) -> None:
    log.warning(
        "run %s: tool call %s (%s) was in flight in a process that died; its outcome is "
        "unknown until reconciled (runcap reconcile)", run_id, key, tool,
    )  # fmt: skip
