"""queries/run_tree_cost.sql on embedded chdb, on a fixture tree written through the span store's
own insert: every node's own and subtree spend (the subtree sums proven against the tree), depth,
tree order, the per-depth and total rows, the tree found from any of its runs, the most expensive
tree by default, newest versions only, old rows as roots, and a parent without a row of its own.
(Every query also runs with its defaults on data made through runcap: tests/system/test_queries.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from proxy.queryfiles import bind, load_query
from proxy.spans.clickhouse import ClickHouseSink, open_span_store
from tests.support.run_trees import TREE, subtree, write_tree


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseSink]:
    sink = open_span_store(None, Path(tmp_path_factory.mktemp("tree")))
    write_tree(sink)
    assert sink.query("SELECT count() FROM runcap.runs WHERE run_id = 'planner'")[1] == [[2]]
    yield sink
    sink.close()


def tree_cost(store: ClickHouseSink, **params: str) -> list[dict[str, Any]]:
    query = load_query("run_tree_cost")
    columns, rows = store.query(query.sql, bind(query, params, store))
    return [dict(zip(columns, row, strict=True)) for row in rows]


def test_every_node_has_its_own_and_its_subtree_spend_in_tree_order(store: ClickHouseSink) -> None:
    rows = tree_cost(store, run_id="planner")
    nodes = [r for r in rows if r["row"] == "run"]
    assert [(r["depth"], r["run_id"]) for r in nodes] == [
        (0, "planner"), (1, "coder"), (1, "editor"), (2, "tester"), (1, "researcher-a"),
        (2, "fact-checker"), (2, "summarizer"), (1, "researcher-b"),
    ]  # fmt: skip
    by_id = {r["run_id"]: r for r in nodes}
    for run_id, (parent, usd, tokens, status, max_usd) in TREE.items():
        r = by_id[run_id]
        assert (r["parent_run_id"], Decimal(r["cost_usd"]), r["tokens"], r["status"]) == (
            parent, Decimal(usd), tokens, status,
        ), run_id  # fmt: skip
        assert r["max_usd"] == (None if max_usd is None else f"{Decimal(max_usd):.9f}")
        below = subtree(run_id)
        assert Decimal(r["subtree_usd"]) == sum(Decimal(TREE[x][1]) for x in below if x in TREE), run_id
        assert r["subtree_tokens"] == sum(TREE[x][2] for x in below if x in TREE), run_id
        assert r["subtree_runs"] == len(below & set(TREE)), run_id
        assert r["tree_path"][0] == "planner" and r["tree_path"][-1] == run_id
    assert Decimal(by_id["planner"]["subtree_usd"]) == Decimal("4.00")  # the newest versions only
    assert Decimal(by_id["researcher-a"]["subtree_usd"]) == Decimal("1.80")
    assert by_id["researcher-a"]["share_pct"] == 45.0
    # the parent that has no row: no spend of its own, its child's under it, hung under the root
    editor = by_id["editor"]
    assert (editor["status"], Decimal(editor["cost_usd"] or 0), editor["parent_run_id"]) == ("", 0, "planner")
    assert (Decimal(editor["subtree_usd"]), editor["subtree_runs"]) == (Decimal("0.30"), 1)


def test_depth_subtotals_and_the_total(store: ClickHouseSink) -> None:
    rows = tree_cost(store, run_id="planner")
    depths = {r["depth"]: r for r in rows if r["row"] == "depth"}
    nodes = [r for r in rows if r["row"] == "run"]
    for depth, r in depths.items():
        at = [n for n in nodes if n["depth"] == depth]
        assert Decimal(r["cost_usd"]) == sum(Decimal(n["cost_usd"] or 0) for n in at), depth
        at_or_below = [n for n in nodes if n["depth"] >= depth]
        assert Decimal(r["subtree_usd"]) == sum(Decimal(n["cost_usd"] or 0) for n in at_or_below)
        assert r["subtree_runs"] == len(at)
    assert sorted(depths) == [0, 1, 2]
    [total] = [r for r in rows if r["row"] == "tree"]
    assert (Decimal(total["cost_usd"]), total["subtree_runs"], total["tokens"]) == (Decimal("4.00"), 7, 40000)
    assert [r["row"] for r in rows] == ["run"] * 8 + ["depth"] * 3 + ["tree"]
    assert {r["root_run_id"] for r in rows} == {"planner"}


def test_the_tree_from_any_of_its_runs_and_by_default_the_most_expensive(store: ClickHouseSink) -> None:
    def names(rows: list[dict[str, Any]]) -> set[str]:
        return {r["run_id"] for r in rows if r["row"] == "run"}

    assert names(tree_cost(store, run_id="fact-checker")) == names(tree_cost(store, run_id="planner"))
    assert names(tree_cost(store, run_id="other-kid")) == {"other", "other-kid"}
    assert names(tree_cost(store)) == set(TREE) | {"editor"}  # $4 beats legacy's $3 and other's $1.50
    # a run from before run trees is a tree of one
    [legacy] = [r for r in tree_cost(store, run_id="legacy") if r["row"] == "run"]
    assert (legacy["depth"], legacy["subtree_usd"], legacy["subtree_runs"]) == (0, "3.000000000", 1)
    assert tree_cost(store, run_id="no-such-run")[-1]["subtree_runs"] == 0
