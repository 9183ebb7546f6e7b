"""Carry cancels made elsewhere to this process's in-flight calls.

`POST /runs/{id}/cancel` marks the run in the ledger and aborts the calls in flight in the process
that answered it. The run's calls in flight in *other* processes learn it here:

* Redis: every process subscribes to the ledger's cancel channel (pub/sub) and aborts at once;
  a slow poll (1 s) of the runs it has in flight catches a cancel published while it was
  reconnecting.
* SQLite (one host, maybe `--workers N`): no push; every 250 ms each process reads the cancel flag
  of the runs it has calls in flight for (one indexed read per such run, nothing when idle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from proxy.ledger.base import Ledger
from proxy.server.flow import Flights

log = logging.getLogger("runcap.cancel")

POLL_S = 0.25
POLL_WITH_PUSH_S = 1.0


class CancelPropagation:
    def __init__(self, ledger: Ledger, flights: Flights, poll_s: float | None = None) -> None:
        self.ledger = ledger
        self.flights = flights
        self.poll_s = poll_s
        self._tasks: list[asyncio.Task[None]] = []

    def add_to(self, app: web.Application) -> None:
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        events = self.ledger.cancel_events()
        if events is not None:
            self._tasks.append(asyncio.create_task(self._listen(events)))
        poll = self.poll_s or (POLL_WITH_PUSH_S if events is not None else POLL_S)
        self._tasks.append(asyncio.create_task(self._poll(poll)))

    async def _stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _listen(self, events) -> None:  # type: ignore[no-untyped-def]
        async for run_id in events:
            if self.flights.cancel_run(run_id):
                log.info('{"event": "cancel_propagated", "run_id": "%s", "via": "pubsub"}', run_id)

    async def _poll(self, interval: float) -> None:
        failing = False  # log an outage once, and its end, not every poll
        while True:
            await asyncio.sleep(interval)
            for run_id in self.flights.run_ids():
                try:
                    state = await self.ledger.get_run(run_id)
                except Exception as e:
                    if not failing:
                        log.warning("cancel poll: the ledger fails (%s); cancels made elsewhere wait", e)
                    failing = True
                    break
                if failing:
                    log.info("cancel poll: the ledger answers again")
                    failing = False
                if state is not None and state.cancelled and self.flights.cancel_run(run_id):
                    log.info('{"event": "cancel_propagated", "run_id": "%s", "via": "poll"}', run_id)
