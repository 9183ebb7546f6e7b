"""The Runs dashboard's run-tree panel ("Where the money went across sub-agents") on the fixture
tree (tests/support/run_trees.py) in an embedded chdb store, its SQL expanded as the ClickHouse
plugin does (tests/support/grafana.py): the most expensive trees first, each run's own and subtree
spend proven against the parent links, in tree order, indented by depth, and the task filter on the
tree's root. (Its SQL also runs on real agent runs with every selection: tests/system/test_dashboards.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from proxy.spans.clickhouse import ClickHouseSink, open_span_store
from tests.conftest import REPO
from tests.support.grafana import ALL, Expander, TimeRange, Variable
from tests.support.run_trees import TREE, subtree, write_tree

BOARD = json.loads((REPO / "dashboards" / "runcap-runs.json").read_text())
[PANEL] = [p for p in BOARD["panels"] if p["title"] == "Where the money went across sub-agents"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseSink]:
    sink = open_span_store(None, Path(tmp_path_factory.mktemp("tree-panel")))
    write_tree(sink)
    yield sink
    sink.close()


def panel_rows(store: ClickHouseSink, task: list[str]) -> list[dict[str, Any]]:
    now = datetime.now(UTC)
    variables = {"task": Variable("task", ["plan", "research"], task)}
    sql = Expander(TimeRange(now - timedelta(hours=6), now), variables).expand(PANEL["targets"][0]["rawSql"])
    columns, rows = store.query(sql)
    return [dict(zip(columns, row, strict=True)) for row in rows]


def test_the_most_expensive_trees_with_each_runs_subtree_spend(store: ClickHouseSink) -> None:
    rows = panel_rows(store, [ALL])
    assert [r["root_run_id"] for r in rows] == ["planner"] * 8 + ["legacy", "other", "other"]
    planner = rows[:8]
    assert [r["run"] for r in planner] == [
        "planner", ". coder", ". editor", ". . tester", ". researcher-a", ". . fact-checker",
        ". . summarizer", ". researcher-b",
    ]  # fmt: skip
    for r in planner:
        run_id = r["run"].replace(". ", "")
        below = subtree(run_id) & set(TREE)
        assert Decimal(r["subtree_usd"]) == sum(Decimal(TREE[x][1]) for x in below), run_id
        assert r["share"] == round(float(r["subtree_usd"]) / 4.0, 4), run_id
        assert r["depth"] == r["run"].count(". ")
    assert Decimal(rows[-2]["subtree_usd"]) == Decimal("1.50")  # other + other-kid


def test_the_task_filter_picks_trees_by_their_roots_task(store: ClickHouseSink) -> None:
    # every root here is a "plan" run; the sub-agents' "research" selects no tree
    assert {r["root_run_id"] for r in panel_rows(store, ["plan"])} == {"planner", "legacy", "other"}
    assert panel_rows(store, ["research"]) == []
