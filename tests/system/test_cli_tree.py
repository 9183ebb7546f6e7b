"""`runcap run RUN_ID --tree` end to end: `python -m proxy.cli` as a subprocess on a data directory
whose embedded span store holds a fixture tree (tests/support/run_trees.py) — the tree from its
root down whichever run is named, indented by depth, each run's own and subtree spend, tokens,
steps, status and caps; a run without children is one node; an unknown run is an error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from proxy.spans.clickhouse import open_span_store
from tests.conftest import REPO
from tests.support.run_trees import TREE, subtree, write_tree


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = Path(tmp_path_factory.mktemp("cli-tree"))
    store = open_span_store(None, path)
    write_tree(store)
    store.close()  # chdb: one process per directory — the CLI opens it next
    yield path


def cli(data_dir: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNCAP_") and k != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "run", *args, "--data-dir", str(data_dir)], cwd=REPO,
        env={**clean, "RUNCAP_LISTEN": "127.0.0.1:9"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def test_the_tree_indented_with_spend_status_and_caps(data_dir: Path) -> None:
    out = cli(data_dir, "fact-checker", "--tree").stdout  # any run of the tree: the whole tree
    lines = out.splitlines()
    assert lines[0] == "run tree planner: 8 runs, $4.000000000"
    header = lines[2].split()
    assert header[:7] == ["run_id", "status", "steps", "tools", "tokens", "cost_usd", "subtree_usd"]
    assert "max_usd" in header
    body = lines[4:]
    names = [line.split()[0] for line in body]
    assert names == ["planner", "coder", "editor", "tester", "researcher-a", "fact-checker", "summarizer",
                     "researcher-b"]  # fmt: skip
    depth = {"planner": 0, "coder": 1, "editor": 1, "tester": 2, "researcher-a": 1, "fact-checker": 2,
             "summarizer": 2, "researcher-b": 1}  # fmt: skip
    for line, name in zip(body, names, strict=True):
        assert line.startswith("  " * depth[name] + name + " "), line
    fact = body[names.index("fact-checker")].split()
    # status, steps, tools, tokens, own $, subtree $, then the dollar cap
    assert fact[1:7] == ["budget_exceeded", "6", "1", "6000", "0.600000000", "0.600000000"]
    assert "0.600000000" in fact[7:]
    researcher = body[names.index("researcher-a")].split()
    assert researcher[5:7] == ["1.000000000", "1.800000000"]


def test_json_has_every_run_with_its_subtree(data_dir: Path) -> None:
    rows = json.loads(cli(data_dir, "planner", "--tree", "--json").stdout)
    by_id = {r["run_id"]: r for r in rows}  # not indented in JSON
    assert set(by_id) == set(TREE) | {"editor"}
    for run_id in TREE:
        below = subtree(run_id) & set(TREE)
        assert Decimal(by_id[run_id]["subtree_usd"]) == sum(Decimal(TREE[r][1]) for r in below), run_id
        assert by_id[run_id]["status"] == TREE[run_id][3]


def test_a_run_without_children_is_one_node_and_an_unknown_run_an_error(data_dir: Path) -> None:
    out = cli(data_dir, "legacy", "--tree").stdout
    lines = out.splitlines()
    assert lines[0] == "run tree legacy: 1 run, $3.000000000"
    assert [line.split()[0] for line in lines[4:]] == ["legacy"]
    missing = cli(data_dir, "no-such-run", "--tree", ok=False)
    assert missing.returncode == 1
    assert "no run 'no-such-run' in the runs table of" in missing.stderr
