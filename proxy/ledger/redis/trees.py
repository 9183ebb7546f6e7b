"""One writer at a time per run tree in this process (the Redis ledger's `TreeLocks`).

Every call of a run tree writes the tree's root (its subtree totals), so the compare-and-set of
concurrent calls of one tree conflict on it: with dozens of calls in flight in one process the
retries starve each other (one call can wait seconds). The calls of one tree in one process
therefore take turns — each then reads its states from this process's cache, right since this
process wrote them last, so a turn is one script — and only calls on other replicas still meet
at the compare-and-set, where the script keeps them correct. A run alone (no parent, no child)
takes no lock: its calls conflict only among themselves, as before run trees.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from proxy.ledger.base import RunState

KEPT = 10_000  # trees whose runs this process remembers


class TreeLocks:
    def __init__(self) -> None:
        self._roots: OrderedDict[str, str] = OrderedDict()  # run id → its tree's root
        self._locks: OrderedDict[str, asyncio.Lock] = OrderedDict()

    def learn(self, state: RunState, chain: Sequence[RunState | None]) -> None:
        """`state` and its ancestors belong to a tree (called only for runs in one)."""
        for node in (state, *chain):
            if node is not None:
                self._roots[node.run_id] = state.root
                self._roots.move_to_end(node.run_id)
        while len(self._roots) > KEPT:
            self._roots.popitem(last=False)

    def lock(self, run_id: str, parent: str = "") -> contextlib.AbstractAsyncContextManager[Any]:
        """The lock of the tree `run_id` (or its `parent`) is known to belong to — or, for the
        first calls of a new child, of its parent, so that siblings starting at once take turns
        too; none for a run this process never saw in a tree (a lock evicted while held, or two
        keys for one tree, cost only compare-and-set retries)."""
        root = self._roots.get(run_id) or (self._roots.get(parent, parent) if parent else None)
        if root is None:
            return contextlib.nullcontext()
        lock = self._locks.get(root)
        if lock is None:
            lock = self._locks[root] = asyncio.Lock()
            while len(self._locks) > KEPT:
                self._locks.popitem(last=False)
        return lock
