"""Ledger writes that record what already happened, kept until the ledger takes them.

A settlement (the upstream answered and billed), a tool call's outcome (the tool ran), the release
of a reservation or an in-flight record whose write was in doubt (the call was refused): none of
these may be lost because the ledger was down at that moment. `PendingWrites` holds them in memory
and one background task retries them, oldest first, with backoff, under a lock (one round at a
time), removing each entry by identity once the ledger took it. Every write is idempotent — a
settlement by its reservation id, an outcome by the record's state — so a retry of a write whose
answer was lost does nothing twice.

What the process does not live to retry is not lost either: its reservations are durable records
in the ledger, settled at their reserved amount by the next start-up or a sibling's sweep (and
its in-flight tool calls become `unknown`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.ledger.base import IdempotencyRecord, Ledger, Reservation, Settlement

log = logging.getLogger("runcap.ledger")

RETRY_INITIAL_S = 0.2
RETRY_MAX_S = 5.0
# While writes keep failing, say so in the log this often (and in /metrics all the time).
STILL_FAILING_LOG_S = 60.0


@dataclass(eq=False)
class PendingWrite:
    """One write to retry. `eq=False`: entries are told apart by identity, never by value."""

    kind: str = field(init=False, default="")
    since: float = field(init=False, default_factory=time.monotonic)

    async def apply(self, ledger: Ledger) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(eq=False)
class PendingSettlement(PendingWrite):
    kind: str = field(init=False, default="settlement")
    reservation: Reservation
    settlement: Settlement
    now: float

    async def apply(self, ledger: Ledger) -> None:
        try:
            await ledger.settle(self.reservation, self.settlement, self.now)
        except KeyError:
            # The run is gone (expired, purged): there is nothing left to settle against.
            log.warning("run %s expired before its settlement could be written", self.reservation.run_id)

    def describe(self) -> str:
        r = self.reservation
        return f"settlement of run {r.run_id} step {r.step} (reservation {r.id})"


@dataclass(eq=False)
class PendingRelease(PendingWrite):
    """A reservation written in doubt for a call that was then refused: nothing was spent."""

    kind: str = field(init=False, default="release")
    reservation: Reservation

    async def apply(self, ledger: Ledger) -> None:
        with contextlib.suppress(KeyError):
            await ledger.release_reservation(self.reservation)

    def describe(self) -> str:
        return f"release of reservation {self.reservation.id} of run {self.reservation.run_id}"


@dataclass(eq=False)
class PendingToolRelease(PendingWrite):
    """An in-flight record written in doubt for a tool call that was then refused."""

    kind: str = field(init=False, default="tool_release")
    record: IdempotencyRecord

    async def apply(self, ledger: Ledger) -> None:
        await ledger.release_tool_call(self.record)

    def describe(self) -> str:
        return f"release of tool call {self.record.key} of run {self.record.run_id}"


@dataclass(eq=False)
class PendingToolOutcome(PendingWrite):
    kind: str = field(init=False, default="tool_outcome")
    run_id: str
    key: str
    status: int
    headers: dict[str, str]
    body: bytes
    now: float

    async def apply(self, ledger: Ledger) -> None:
        await ledger.complete_tool_call(self.run_id, self.key, self.status, self.headers, self.body, self.now)

    def describe(self) -> str:
        return f"outcome of tool call {self.key} of run {self.run_id}"


@dataclass(eq=False)
class PendingToolForget(PendingWrite):
    """The intent of a tool call that never reached its tool (connection refused): deleted, so
    the next attempt executes — once the ledger takes it (until then a repeat waits)."""

    kind: str = field(init=False, default="tool_forget")
    run_id: str
    key: str
    now: float

    async def apply(self, ledger: Ledger) -> None:
        await ledger.resolve_tool_call(self.run_id, self.key, done=False, now=self.now, force=True)

    def describe(self) -> str:
        return f"release of unreached tool call {self.key} of run {self.run_id}"


@dataclass(eq=False)
class PendingToolUnknown(PendingWrite):
    kind: str = field(init=False, default="tool_unknown")
    run_id: str
    key: str
    now: float
    reason: str

    async def apply(self, ledger: Ledger) -> None:
        await ledger.mark_unknown(self.run_id, self.key, self.now, self.reason)

    def describe(self) -> str:
        return f"unknown outcome of tool call {self.key} of run {self.run_id}"


RESERVATION_KINDS = frozenset({"settlement", "release"})


class PendingWrites:
    """The writes waiting for the ledger, and the task that retries them."""

    def __init__(
        self, ledger: Ledger, timeout_s: float, unavailable: Callable[[BaseException], str | None]
    ) -> None:
        """`unavailable(exc)`: the failure code when `exc` means the ledger is unavailable (the
        entry is kept), None when retrying cannot help (the entry is dropped, with its error)."""
        self.ledger = ledger
        self.timeout_s = timeout_s
        self._unavailable = unavailable
        self._entries: list[PendingWrite] = []
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failed_attempts: Counter[str] = Counter()  # by kind
        self.dropped = 0
        self._failing_since: float | None = None
        self._last_warning = 0.0

    # -- what is pending ------------------------------------------------------------------------

    def add(self, write: PendingWrite) -> None:
        self._entries.append(write)
        self._wake.set()

    def count(self, kinds: frozenset[str] | None = None) -> int:
        return sum(1 for e in self._entries if kinds is None or e.kind in kinds)

    def by_kind(self) -> Counter[str]:
        return Counter(e.kind for e in self._entries)

    def oldest_age_s(self) -> float:
        return time.monotonic() - self._entries[0].since if self._entries else 0.0

    # -- retrying -------------------------------------------------------------------------------

    async def flush(self) -> bool:
        """One round, oldest first: True when everything pending was taken; False at the first
        write the ledger could not take (it is unavailable: the rest waits for the next round)."""
        async with self._lock:
            for entry in list(self._entries):  # entries added meanwhile wait for the next round
                try:
                    async with asyncio.timeout(self.timeout_s):
                        await entry.apply(self.ledger)
                except Exception as e:
                    code = "ledger_timeout" if isinstance(e, TimeoutError) else self._unavailable(e)
                    if code is not None:
                        self.failed_attempts[entry.kind] += 1
                        self._note_failure(entry, code, e)
                        return False
                    self.dropped += 1
                    log.error("dropped the pending %s: %s: %s", entry.describe(), type(e).__name__, e)
                self._entries = [x for x in self._entries if x is not entry]
        if self._failing_since is not None:
            log.info(
                "the ledger took every pending write again after %.1f s of failures",
                time.monotonic() - self._failing_since,
            )
            self._failing_since = None
        return True

    def _note_failure(self, entry: PendingWrite, code: str, e: BaseException) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._last_warning >= STILL_FAILING_LOG_S:
            self._last_warning = now
            log.warning(
                "the ledger still cannot take %d pending writes (%d settlements), the oldest for "
                "%.1f s (%s): %s — retrying in the background",
                len(self._entries), self.count(RESERVATION_KINDS), now - entry.since, code,
                str(e) or type(e).__name__,
            )  # fmt: skip

    async def run(self) -> None:
        delay = RETRY_INITIAL_S
        while True:
            if not self._entries:
                await self._wake.wait()
            self._wake.clear()
            if await self.flush():
                delay = RETRY_INITIAL_S
                continue
            # Jittered, so replicas that lost the ledger together do not come back in lockstep.
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, RETRY_MAX_S)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="runcap-pending-ledger-writes")

    async def aclose(self) -> None:
        """Stop retrying; one last round for what is still pending."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._entries and not await self.flush():
            log.error(
                "shutting down with %d ledger writes not taken (%d settlements): their reservations "
                "stay in the ledger and are settled at their reserved amount by the next start-up "
                "or a sibling's sweep; in-flight tool calls become unknown",
                len(self._entries), self.count(RESERVATION_KINDS),
            )  # fmt: skip
