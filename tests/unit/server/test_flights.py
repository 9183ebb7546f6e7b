"""`Flights` (proxy/server/flow.py): a cancel of a run cuts the calls in flight of its whole subtree
in this process — learnt from the run states the calls got from the ledger, or from the parent a
call names before the ledger answered — and the poll of other processes' cancels (SQLite) reads
the ancestors of the runs in flight too."""

from __future__ import annotations

import asyncio

from proxy.caps import RunCaps, RunRequest
from proxy.ledger.base import RunState
from proxy.server.flow import Flights
from proxy.toolcall.call import ToolCall


async def test_a_cancel_cuts_the_subtree_and_nothing_else() -> None:
    flights = Flights()
    hold = asyncio.Event()
    calls = {
        "child": ToolCall("t", state=RunState("child", parent_run_id="root", ancestors=("root",))),
        "grandchild": ToolCall(
            "t", state=RunState("grandchild", parent_run_id="child", ancestors=("child", "root"))
        ),
        # Its first call: no state yet, only the parent its request names.
        "newborn": ToolCall("t", run=RunRequest("newborn", False, "", RunCaps(), parent="child")),
        "stranger": ToolCall("t", state=RunState("stranger")),
    }
    tasks = {rid: asyncio.create_task(hold.wait()) for rid in calls}
    for rid, call in calls.items():
        flights.add(rid, tasks[rid], call)
    assert set(flights.run_ids()) == {"child", "grandchild", "newborn", "stranger", "root"}
    assert flights.cancel_run("child") == 3
    await asyncio.sleep(0)
    assert {rid for rid, t in tasks.items() if t.cancelled()} == {"child", "grandchild", "newborn"}
    assert calls["grandchild"].cut_reason == "cancel" and calls["stranger"].cut_reason is None
    assert flights.cancel_run("child") == 0  # already cut: not cut twice
    hold.set()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
