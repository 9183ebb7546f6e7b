"""A fixture run tree in the span store ("where did the $4 go across the sub-agents?"), written with
the store's own insert: a planner, two researchers, their sub-agents, one run whose parent has no
row yet, older versions of two runs, another (cheaper) tree and a run from before run trees. Used
by the run_tree_cost query's tests and `runcap run --tree`'s."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from proxy.spans.clickhouse import ClickHouseSink
from proxy.spans.model import RunSnapshot

# run → (parent, own spend, tokens, status, max_usd); every run's root is the planner
TREE: dict[str, tuple[str, str, int, str, str | None]] = {
    "planner": ("", "0.40", 4000, "completed", "5.00"),
    "researcher-a": ("planner", "1.00", 10000, "completed", "2.00"),
    "fact-checker": ("researcher-a", "0.60", 6000, "budget_exceeded", "0.60"),
    "summarizer": ("researcher-a", "0.20", 2000, "completed", None),
    "researcher-b": ("planner", "1.30", 13000, "completed", None),
    "coder": ("planner", "0.20", 2000, "active", None),
    "tester": ("editor", "0.30", 3000, "completed", None),  # editor has no row yet
}
# The parent without a row hangs under the root (its own parent is not known).
PARENTS = {run: parent for run, (parent, *_) in TREE.items()} | {"editor": "planner"}


def snapshot(run_id: str, parent: str, root: str, usd: str, tokens: int, status: str,
             max_usd: str | None, age_s: int = 60) -> RunSnapshot:  # fmt: skip
    now = datetime.now(UTC).replace(microsecond=0)
    return RunSnapshot(
        run_id=run_id, task="research" if parent else "plan", started_at=now - timedelta(hours=1),
        updated_at=now - timedelta(seconds=age_s), status=status, steps=tokens // 1000, tool_calls=1,
        input_tokens=tokens - 100, output_tokens=100, cost_usd=Decimal(usd),
        max_usd=None if max_usd is None else Decimal(max_usd), max_tokens=None, max_steps=None,
        max_tool_calls=None, deadline=None, parent_run_id=parent, root_run_id=root,
    )  # fmt: skip


def subtree(run_id: str) -> set[str]:
    """The runs at or below `run_id` by the parent links (the oracle), the row-less editor too."""
    below = {run_id}
    while True:
        more = {r for r, parent in PARENTS.items() if parent in below} - below
        if not more:
            return below
        below |= more


def write_tree(sink: ClickHouseSink) -> None:
    # Older versions of two runs (cheaper, earlier), in an insert of their own — one insert's
    # versions of a run are merged at once: a query must take the newest, not sum them.
    sink.write([], [snapshot("planner", "", "planner", "0.10", 1000, "active", "5.00", age_s=3000),
                    snapshot("researcher-b", "planner", "planner", "0.90", 9000, "active", None, age_s=3000)],
               "older-versions")  # fmt: skip
    runs = [snapshot(r, parent, "planner", *rest) for r, (parent, *rest) in TREE.items()]
    # another tree (cheaper), and a run written before run trees (no root of its own)
    runs += [snapshot("other", "", "other", "1.00", 1000, "completed", None),
             snapshot("other-kid", "other", "other", "0.50", 1000, "completed", None),
             snapshot("legacy", "", "", "3.00", 1000, "completed", None)]  # fmt: skip
    runs[-1].root_run_id = ""  # a row as one from before migration 0002 reads when written by hand
    sink.write([], runs, "tree-fixture")
