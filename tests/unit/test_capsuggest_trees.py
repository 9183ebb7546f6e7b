"""`runcap caps suggest` for tasks whose runs start sub-agents, on the fixture tree
(tests/support/run_trees.py) plus a runaway tree in embedded chdb: a root task's dollar and token
caps come from its trees' totals (a run's cap bounds its subtree) and the output says so, the
shares of runs a suggestion would stop count trees too, the subtree call caps are printed as the
X-Run-Max-Tree-* headers, and a task without trees is suggested as before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.capsuggest import caps_suggest
from proxy.cli import build_parser
from proxy.spans.clickhouse import ClickHouseSink, open_span_store
from tests.support.run_trees import snapshot, write_tree


class StoreReader:
    where = "the test's span store"

    def __init__(self, store: ClickHouseSink) -> None:
        self.store = store

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[list[Any]]]:
        return self.store.query(sql, params)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreReader]:
    sink = open_span_store(None, Path(tmp_path_factory.mktemp("suggest-trees")))
    write_tree(sink)
    # a plan run stopped mid-way whose sub-agent spent $5: cheap itself ($1), its tree is not
    sink.write([], [snapshot("runaway", "", "runaway", "1.00", 1000, "budget_exceeded", "6.00"),
                    snapshot("runaway-kid", "runaway", "runaway", "5.00", 50000, "completed", None)],
               "runaway")  # fmt: skip
    yield StoreReader(sink)
    sink.close()


def suggest(reader: StoreReader, *argv: str) -> str:
    return caps_suggest(build_parser().parse_args(["caps", "suggest", "--min-runs", "3", *argv]), reader)


def test_a_root_tasks_dollar_and_token_caps_are_its_trees(reader: StoreReader) -> None:
    rows = {(r["task"], r["setting"]): r for r in json.loads(suggest(reader, "--json"))}
    # completed plan roots: other ($1.50 with its kid), legacy ($3, alone), planner ($4 with 6 runs below)
    usd = rows[("plan", "max_usd")]
    assert (usd["p99"], usd["value"], usd["of_tree"]) == (4.0, 4.4, True)
    assert rows[("plan", "max_tokens")]["p99"] == 40000.0  # the planner tree's tokens
    # the runaway's own $1 is under the cap; its tree's $6 is not: 1 of the 4 plan runs
    assert usd["share_exceeding"] == 0.25
    assert rows[("plan", "max_steps")]["p99"] == 4.0  # steps count per run
    assert rows[("plan", "X-Run-Max-Tree-Steps")]["p99"] == 40.0  # ... and per tree in the header
    assert rows[("plan", "X-Run-Max-Tree-Tool-Calls")]["value"] == 8
    # sub-agents' own task: their own spend, no tree headers
    research = {s for t, s in rows if t == "research"}
    assert research == {"max_steps", "max_tool_calls", "max_tokens", "max_usd", "timeout_s"}
    assert "of_tree" not in rows[("research", "max_usd")]
    assert rows[("research", "max_usd")]["p99"] == 5.0  # runaway-kid's own $5


def test_the_table_says_what_a_tree_cap_bounds_and_prints_the_headers(reader: StoreReader) -> None:
    out = suggest(reader, "--task", "plan")
    table = out[out.index('[tasks."plan"]') :].splitlines()
    assert "# its runs start sub-agents: max_usd and max_tokens are the p99 of the whole tree" in out
    assert table[4].startswith("max_usd = 4.4 ") and "(of its trees)" in table[4]
    assert "25.0% of 4 runs would have exceeded it" in table[4]
    assert any(line.startswith("#   X-Run-Max-Tree-Steps: 44 ") for line in table)
    assert "have no [tasks] key: the agent host sends them as headers" in out
    settings = [line for line in table[1:] if " = " in line and not line.startswith("#")]
    assert len({line.index("#") for line in settings}) == 1  # the comments line up
