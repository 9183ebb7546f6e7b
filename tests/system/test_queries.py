"""The on-call queries in queries/*.sql, answered exactly on data from agent runs made through
runcap with the official openai client (tests/support/oncall_scenarios.py) — on embedded chdb and
on a ClickHouse HTTP endpoint — through `POST /admin/sql` with the defaults `runcap query` fills."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from proxy.hashing import args_hash, canonical_json, idempotency_key
from proxy.pricing import PriceBook
from proxy.queryfiles import QueryFileError, bind, list_queries, load_query, parse_query
from proxy.readcli import AdminSqlReader
from tests.support.oncall_scenarios import (
    REFUND,
    UNPRICED_MODEL,
    Facts,
    Services,
    play,
    step_cost,
    wait_for_spans,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PRICES = PriceBook()
REFUND_HASH = hashlib.sha256(canonical_json(REFUND)).hexdigest()
SEARCH_HASH = args_hash(b'{"q": "refund policy"}')


@dataclass
class Env:
    backend: str
    reader: AdminSqlReader
    facts: Facts

    def q(self, name: str, **params: Any) -> list[dict[str, Any]]:
        query = load_query(name)
        columns, rows = self.reader.query(
            query.sql, bind(query, {k: str(v) for k, v in params.items()}, self.reader)
        )
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def sql(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        columns, rows = self.reader.query(sql, params)
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def rid(self, name: str) -> str:
        return f"{self.facts.prefix}-{name}"


@pytest.fixture(scope="module", params=["chdb", "http"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp: Path = tmp_path_factory.mktemp(f"queries-{request.param}")
    svc = Services()
    ch = None
    try:
        extra: dict[str, Any] = {}
        if request.param == "http":
            from tests.support.clickhouse import ClickHouseProcess

            ch = ClickHouseProcess(tmp / "ch")
            ch.start()
            extra["clickhouse_url"] = ch.url
        url, rt = svc.start_runcap(tmp / "data", **extra)
        facts = play(url, "oc", rt.config.admin_token)
        reader = AdminSqlReader(url, rt.config.admin_token)
        total = facts.model_spans + facts.tool_spans + facts.tool_call_spans + facts.tool_result_spans
        wait_for_spans(lambda sql: reader.query(sql)[1], total)
        yield Env(request.param, reader, facts)
    finally:
        svc.close()
        if ch is not None:
            ch.stop()


def run_seen(env: Env, name: str):  # type: ignore[no-untyped-def]
    return env.facts.runs[name]


# -- the files themselves ---------------------------------------------------------------------


def test_every_query_declares_its_question_and_parameters() -> None:
    queries = {q.name: q for q in list_queries()}
    assert set(queries) >= {
        "duplicate_side_effects", "run_cost", "top_spend", "cap_hits", "cap_recommendations",
        "slow_tools", "timeouts", "retry_storms", "context_growth", "unknown_outcomes",
        "unpriced_models", "runs", "run_timeline", "run_tree_cost", "loops",
    }  # fmt: skip
    for q in queries.values():
        assert q.question.split("?")[0], q.name
        assert q.params, q.name
        assert all(p.doc for p in q.params), q.name
    since = queries["duplicate_side_effects"].param("since")
    assert since is not None and (since.type, since.default) == (
        "DateTime64(6, 'UTC')", "now() - INTERVAL 24 HOUR",
    )  # fmt: skip


def test_undeclared_or_mistyped_parameters_are_refused(tmp_path: Path) -> None:
    with pytest.raises(QueryFileError, match="not declared"):
        parse_query("x", "-- x: q?\nSELECT {a:String}", tmp_path / "x.sql")
    with pytest.raises(QueryFileError, match="declared UInt32 but used as String"):
        parse_query("x", "-- x: q?\n-- @param a UInt32 = 1  -- a\nSELECT {a:String}", tmp_path / "x.sql")
    with pytest.raises(QueryFileError, match="no query named 'nope'"):
        load_query("nope")


def test_a_query_file_of_ones_own(env: Env, tmp_path: Path) -> None:
    own = tmp_path / "spans_of_run.sql"
    own.write_text(
        "-- spans_of_run: How many spans has this run?\n"
        "-- @param run_id String = ''  -- the run\n"
        "SELECT count() AS n FROM runcap.spans WHERE run_id = {run_id:String}\n"
    )
    query = load_query(str(own))
    assert (query.name, query.question) == ("spans_of_run", "How many spans has this run?")
    _, rows = env.reader.query(query.sql, bind(query, {"run_id": env.rid("dup")}, env.reader))
    assert rows == [[9]]


def test_every_query_runs_with_its_defaults(env: Env) -> None:
    """No error, and a result of named, distinct columns (the answers are checked below)."""
    queries = list_queries()
    assert len(queries) >= 5
    for q in queries:
        columns, rows = env.reader.query(q.sql, bind(q, {}, env.reader))
        assert columns and len(set(columns)) == len(columns) and all(columns), (q.name, columns)
        assert all(len(row) == len(columns) for row in rows), q.name


def test_unknown_parameter_names_the_declared_ones(env: Env) -> None:
    with pytest.raises(QueryFileError, match=r"has no parameter bogus \(its parameters: run_id, since"):
        env.q("duplicate_side_effects", bogus=1)


# -- duplicate side effects -------------------------------------------------------------------


def test_duplicate_side_effects(env: Env) -> None:
    rows = env.q("duplicate_side_effects")
    keys = (
        "run_id", "task", "tool_name", "args_hash", "seen_as", "times", "requested_times",
        "executed_times", "replays", "later_all_replayed", "idempotency_keys", "steps", "outcomes",
    )  # fmt: skip
    assert [tuple(r[k] for k in keys) for r in rows] == [
        # a read-only tool polled four times through /tools: all executed, no idempotency
        (env.rid("storm"), "", "search", SEARCH_HASH, "executed", 4, 0, 4, 0, False, 0, [0], ["ok"] * 4),
        # an agent that runs its tools itself: only the model's requests are seen
        (env.rid("dup-model"), "refunds", "refund", REFUND_HASH, "requested", 2, 2, 0, None, None, None,
         [1, 2], ["ok", "ok"]),
        # requested twice AND executed twice through /tools: the second execution was a replay
        (env.rid("dup"), "refunds", "refund", REFUND_HASH, "requested", 2, 2, 2, None, None, None,
         [1, 2], ["ok", "ok"]),
        (env.rid("dup"), "refunds", "refund", REFUND_HASH, "executed", 2, 2, 2, 1, True, 1,
         [1, 2], ["ok", "replayed"]),
    ]  # fmt: skip
    spans = env.sql(
        "SELECT kind, min(started_at) AS a, max(started_at) AS b FROM runcap.spans "
        "WHERE run_id = {r:String} AND kind IN ('tool', 'tool_call') GROUP BY kind ORDER BY kind",
        r=env.rid("dup"),
    )
    assert [(r["first_at"], r["last_at"]) for r in rows[2:]] == [
        (spans[1]["a"], spans[1]["b"]),  # tool_call
        (spans[0]["a"], spans[0]["b"]),  # tool
    ]

    one = env.q("duplicate_side_effects", run_id=env.rid("dup"), since="2999-01-01T00:00:00Z")  # run wins
    assert [(r["run_id"], r["seen_as"]) for r in one] == [
        (env.rid("dup"), "requested"),
        (env.rid("dup"), "executed"),
    ]
    assert [r["run_id"] for r in env.q("duplicate_side_effects", tool="search")] == [env.rid("storm")]
    assert env.q("duplicate_side_effects", min_count=5) == []
    assert env.q("duplicate_side_effects", since="2999-01-01") == []


# -- cost ---------------------------------------------------------------------------------------


def test_run_cost_of_one_run(env: Env) -> None:
    seen = run_seen(env, "dup")
    rows = env.q("run_cost", run_id=seen.run_id)
    costs = [step_cost(PRICES, s) for s in seen.steps]
    total = sum(costs, Decimal(0))
    assert total > 0
    expected = []
    cumulative = Decimal(0)
    for s, c in zip(seen.steps, costs, strict=True):
        cumulative += c
        u = s.usage
        expected.append({
            "run": seen.run_id, "row": "step", "step": s.step, "model": s.model, "calls": 1,
            "outcomes": ["ok"], "input_tokens": u.input_tokens, "cache_read_tokens": u.cache_read_tokens,
            "cache_write_tokens": 0,
            "output_tokens": u.output_tokens, "reasoning_tokens": u.reasoning_tokens,
            "cost_usd": c, "cumulative_usd": cumulative, "share_pct": round(100 * float(c) / float(total), 2),
            "most_expensive": c == max(costs), "price_known": True,
        })  # fmt: skip
    sums = {
        k: sum(e[k] for e in expected)
        for k in ("input_tokens", "cache_read_tokens", "output_tokens", "reasoning_tokens")
    }
    for row, model in (("model", seen.steps[0].model), ("run", "")):
        expected.append({
            "run": seen.run_id, "row": row, "step": 0, "model": model, "calls": 3, "outcomes": ["ok"],
            **sums, "cache_write_tokens": 0, "cost_usd": total, "cumulative_usd": None, "share_pct": 100.0,
            "most_expensive": False, "price_known": True,
        })  # fmt: skip
    got = [
        {**r, "cost_usd": Decimal(r["cost_usd"]),
         "cumulative_usd": None if r["cumulative_usd"] is None else Decimal(r["cumulative_usd"])}
        for r in rows
    ]  # fmt: skip
    # What made up each cost (checked below): the other columns are compared as they were.
    parts = [(r.pop("cost_parts"), r.pop("billed_units")) for r in got]
    assert got == expected
    assert seen.steps[1].usage.cache_read_tokens == 40  # the scripted cache hit is in there
    for (text, units), row in zip(parts, got, strict=True):
        kinds = dict(part.rsplit(" ", 1) for part in text.split(", "))
        assert set(kinds) <= {"input", "cache_read", "output"} and units == ""
        assert sum(Decimal(v) for v in kinds.values()) == row["cost_usd"]
    assert "cache_read" in dict(p.rsplit(" ", 1) for p in parts[1][0].split(", "))


def test_run_cost_defaults_to_the_most_expensive_run(env: Env) -> None:
    costs = {s.run_id: s.cost(PRICES) for s in env.facts.runs.values()}
    top = max(costs, key=lambda r: costs[r])
    rows = env.q("run_cost")
    assert {r["run"] for r in rows} == {top} == {env.rid("usd")}
    steps = [(r["step"], r["outcomes"], r["most_expensive"]) for r in rows if r["row"] == "step"]
    assert steps == [(1, ["ok"], True), (2, ["ok"], False), (3, ["budget_exceeded"], False)]  # refused: 402
    assert Decimal(rows[-1]["cost_usd"]) == costs[top]


def test_top_spend_by_run_task_and_model(env: Env) -> None:
    runs = list(env.facts.runs.values())
    cost = {s.run_id: s.cost(PRICES) for s in runs}
    window = sum(cost.values(), Decimal(0))

    by_run = env.q("top_spend")
    assert {r["by"] for r in by_run} == {"run"}
    assert {r["key"]: Decimal(r["cost_usd"]) for r in by_run} == cost
    assert [r["key"] for r in by_run if Decimal(r["cost_usd"]) > 0] == sorted(
        (k for k, v in cost.items() if v > 0), key=lambda k: -cost[k]
    )
    calls = {s.run_id: len(s.steps) + len(s.refusals) for s in runs}
    assert {r["key"]: r["model_calls"] for r in by_run} == calls
    for r in by_run:
        assert r["share_pct"] == round(100 * float(cost[r["key"]]) / float(window), 2)
    assert [r["key"] for r in by_run if r["unpriced_calls"]] == [env.rid("unpriced")]
    assert len(env.q("top_spend", limit=3)) == 3

    by_task = env.q("top_spend", by="task")
    tasks: dict[str, Decimal] = {}
    task_runs: dict[str, int] = {}
    for s in runs:
        tasks[s.task] = tasks.get(s.task, Decimal(0)) + cost[s.run_id]
        task_runs[s.task] = task_runs.get(s.task, 0) + 1
    assert [(r["key"], Decimal(r["cost_usd"]), r["runs"]) for r in by_task] == sorted(
        ((t, c, task_runs[t]) for t, c in tasks.items()), key=lambda x: -x[1]
    )
    assert Decimal(by_task[0]["avg_usd_per_run"]) == (tasks["essays"] / 2).quantize(
        Decimal("1e-9"), "ROUND_DOWN"
    )

    by_model = env.q("top_spend", by="model")
    assert [(r["key"], Decimal(r["cost_usd"]), r["unpriced_calls"]) for r in by_model] == [
        ("gpt-4o-mini", window, 0), (UNPRICED_MODEL, Decimal(0), 1),
    ]  # fmt: skip

    with pytest.raises(Exception, match="by must be run, task or model"):
        env.q("top_spend", by="tool")


def test_unpriced_models(env: Env) -> None:
    seen = run_seen(env, "unpriced")
    (u,) = [s.usage for s in seen.steps]
    rows = env.q("unpriced_models")
    assert [{k: v for k, v in r.items() if not k.endswith("_at")} for r in rows] == [{
        "provider": "openai", "model": UNPRICED_MODEL, "calls": 1, "ok_calls": 1, "refused_calls": 0,
        "runs": 1, "tasks": ["triage"], "uncharged_input_tokens": u.input_tokens,
        "uncharged_output_tokens": u.output_tokens,
        "example_runs": [seen.run_id],
    }]  # fmt: skip


# -- caps ---------------------------------------------------------------------------------------


def test_cap_hits(env: Env) -> None:
    rows = env.q("cap_hits")
    merged: dict[tuple[str, str], list[Any]] = {}  # over buckets: the test may straddle an hour
    for r in rows:
        m = merged.setdefault((r["task"], r["cap"]), [0, 0, set(), set()])
        m[0] += r["runs_stopped"]
        m[1] += r["refused_calls"]
        m[2] |= set(r["headers"])
        m[3] |= set(r["example_runs"])
    R = env.rid
    assert merged == {
        ("essays", "budget_exceeded"): [2, 2, {"X-Run-Max-Usd", "X-Run-Max-Tokens"}, {R("usd"), R("tokens")}],
        ("triage", "steps_exceeded"): [1, 1, {"X-Run-Max-Steps"}, {R("steps")}],
        # the model call refused, and the /tools call over the cap refused too
        ("triage", "tool_calls_exceeded"): [1, 2, {"X-Run-Max-Tool-Calls"}, {R("toolcap")}],
        ("triage", "deadline_exceeded"): [1, 1, set(), {R("deadline")}],
        ("triage", "cancelled"): [1, 1, set(), {R("cancel")}],
    }
    assert all(r["runs_refused"] == r["runs_stopped"] for r in rows)
    assert {r["cap"] for r in env.q("cap_hits", task="essays")} == {"budget_exceeded"}
    # The refusals the client saw are the ones counted.
    refused = sorted(code for s in env.facts.runs.values() for _, code in s.refusals)
    assert refused == ["cancelled", "deadline", "max_steps", "max_tokens", "max_tool_calls", "max_usd"]


def _latest_runs(env: Env) -> dict[str, dict[str, Any]]:
    """The newest version of each run, picked in Python from every stored version."""
    latest: dict[str, dict[str, Any]] = {}
    for r in env.sql("SELECT * FROM runcap.runs ORDER BY updated_at"):
        latest[r["run_id"]] = r
    return latest


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]  # quantileExact: the element at floor(q * n)


def test_cap_recommendations(env: Env) -> None:
    latest = _latest_runs(env)
    rows = {(r["task"], r["metric"]): r for r in env.q("cap_recommendations")}
    # runs that only called /tools sent no X-Run-Task: task ''
    assert {t for t, _ in rows} == {"refunds", "triage", "essays", ""}

    def completed(task: str, metric: str) -> list[float]:
        out = []
        for r in latest.values():
            if r["task"] != task or r["status"] != "completed":
                continue
            out.append({
                "steps": float(r["steps"]), "tool_calls": float(r["tool_calls"]),
                "tokens": float(r["input_tokens"] + r["output_tokens"]), "usd": float(Decimal(r["cost_usd"])),
            }[metric])  # fmt: skip
        return out

    for task, n_runs, n_completed in (("refunds", 3, 3), ("triage", 7, 3)):
        for metric in ("steps", "tool_calls", "tokens", "usd"):
            values = completed(task, metric)
            r = rows[(task, metric)]
            assert (r["runs"], r["completed_runs"]) == (n_runs, n_completed)
            assert (r["p50"], r["p95"], r["p99"], r["max"]) == (
                _q(values, 0.5), _q(values, 0.95), _q(values, 0.99), max(values),
            ), (task, metric)  # fmt: skip
    assert [rows[("refunds", "steps")][k] for k in ("p50", "p95", "max")] == [3.0, 3.0, 3.0]

    # Caps of the task's newest run: refunds' is ok-lookup (10 steps, $1); triage's is the unpriced run
    # (no caps), so only the stop statuses count there.
    assert {m: rows[("refunds", m)]["current_cap"] for m in ("steps", "tool_calls", "tokens", "usd",
                                                            "wall_clock_s")} == {
        "steps": 10.0, "tool_calls": None, "tokens": None, "usd": 1.0, "wall_clock_s": None,
    }  # fmt: skip
    assert all(rows[("refunds", m)]["runs_stopped"] == 0 for m in ("steps", "tool_calls", "tokens", "usd"))
    assert {m: (rows[("triage", m)]["runs_stopped"], rows[("triage", m)]["share_stopped"])
            for m in ("steps", "tool_calls", "tokens", "usd", "wall_clock_s")} == {
        "steps": (1, round(1 / 7, 4)), "tool_calls": (1, round(1 / 7, 4)), "tokens": (0, 0.0),
        "usd": (0, 0.0), "wall_clock_s": (1, round(1 / 7, 4)),
    }  # fmt: skip
    # essays: no completed run; the newest (tokens) run's 1500-token cap stops both runs — the
    # dollar-capped one used 1526 tokens — and the dollar cap (a 402 naming X-Run-Max-Usd) one.
    e_tokens, e_usd = rows[("essays", "tokens")], rows[("essays", "usd")]
    assert (e_tokens["completed_runs"], e_tokens["p50"], e_tokens["max"]) == (0, None, None)
    assert (e_tokens["current_cap"], e_tokens["runs_stopped"], e_tokens["share_stopped"]) == (1500.0, 2, 1.0)
    assert (e_usd["current_cap"], e_usd["runs_stopped"], e_usd["share_stopped"]) == (None, 1, 0.5)

    wall = [r for r in latest.values() if r["task"] == "refunds"]
    assert rows[("refunds", "wall_clock_s")]["max"] == pytest.approx(
        max((_ts(r["updated_at"]) - _ts(r["started_at"])) for r in wall), abs=1e-6
    )
    assert {r["task"] for r in env.q("cap_recommendations", task="essays")} == {"essays"}


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def test_runs_deduplicates_versions(env: Env) -> None:
    # The pipeline writes a run's state with every batch, and merges drop old versions whenever
    # they like: whatever versions are stored, the query answers with the newest of each run.
    latest = _latest_runs(env)
    rows = env.q("runs")
    assert {r["run_id"] for r in rows} == set(latest) == env.facts.all_run_ids()
    assert len(rows) == 16
    assert {r["run_id"]: (r["status"], r["steps"], Decimal(r["cost_usd"])) for r in rows} == {
        k: (v["status"], v["steps"], Decimal(v["cost_usd"])) for k, v in latest.items()
    }
    by_id = {r["run_id"]: r for r in rows}
    assert by_id[env.rid("tokens")]["cap_hit"] == "X-Run-Max-Tokens"  # the cap, named as it was set
    assert Decimal(by_id[env.rid("tokens")]["cost_usd"]) == run_seen(env, "tokens").cost(PRICES)
    assert by_id[env.rid("dup")]["cap_hit"] == ""
    assert [r["run_id"] for r in env.q("runs", status="steps_exceeded")] == [env.rid("steps")]
    assert len(env.q("runs", limit=2)) == 2


# -- tools ------------------------------------------------------------------------------------


def test_slow_tools(env: Env) -> None:
    rows = env.q("slow_tools")
    by = {(r["source"], r["tool_name"]): r for r in rows}
    assert {k: (r["calls"], r["runs"], r["timeouts"], r["errors"]) for k, r in by.items()} == {
        # charge: two cut by timeout_s (outcome unknown), one ok; the 409 repeat is not a call
        ("executed", "charge"): (3, 2, 2, 0),
        ("executed", "search"): (5, 2, 1, 0),
        # the duplicate run's call and the tool-cap run's first call; the replay and the 402 are not
        ("executed", "refund"): (2, 2, 0, 0),
        ("requested", "refund"): (4, 2, 0, 0),
        ("requested", "lookup_order"): (4, 4, 0, 0),
    }
    executed = env.sql(
        "SELECT tool_name, duration_ms FROM runcap.spans WHERE kind = 'tool' AND outcome != 'replayed' "
        "AND status_code NOT IN (402, 409, 410, 428)"
    )
    for tool in ("charge", "search", "refund"):
        ms = [r["duration_ms"] for r in executed if r["tool_name"] == tool]
        r = by[("executed", tool)]
        assert (r["p50_ms"], r["p95_ms"], r["max_ms"]) == (
            round(_q(ms, 0.5), 1), round(_q(ms, 0.95), 1), round(max(ms), 1),
        )  # fmt: skip
    assert by[("executed", "charge")]["max_ms"] >= 300  # timeout_s = 0.3
    assert [r["p95_ms"] for r in rows] == sorted((r["p95_ms"] for r in rows), reverse=True)
    assert {r["tool_name"] for r in env.q("slow_tools", tool="search")} == {"search"}


def test_timeouts(env: Env) -> None:
    rows = env.q("timeouts")
    assert [(r["run_id"], r["kind"], r["target"], r["outcome"], r["status_code"]) for r in rows] == [
        (env.rid("search-timeout"), "tool", "search", "timeout", 504),
        (env.rid("resolved"), "tool", "charge", "unknown", 504),
        (env.rid("unknown"), "tool", "charge", "unknown", 504),
        (env.rid("deadline"), "model", "gpt-4o-mini", "deadline_exceeded", 504),
    ]
    assert rows[2]["idempotency_key"] == idempotency_key(
        env.rid("unknown"), "charge", {"order_id": "Z9"}, None
    )
    assert "timeout_s = 0.3" in rows[0]["error"] and "deadline" in rows[3]["error"]
    assert [r["run_id"] for r in env.q("timeouts", run_id=env.rid("deadline"))] == [env.rid("deadline")]


def test_retry_storms(env: Env) -> None:
    (storm,) = env.q("retry_storms")
    got = [storm[k] for k in ("run_id", "kind", "target", "hash", "calls", "calls_in_quick_succession")]
    assert got == [env.rid("storm"), "tool", "search", SEARCH_HASH, 4, 4]
    assert storm["min_gap_s"] < 60
    pairs = env.q("retry_storms", min_repeats=2)
    assert [(r["run_id"], r["kind"], r["calls"]) for r in pairs] == [  # by size, then newest first
        (env.rid("storm"), "tool", 4),
        (env.rid("dup-model"), "tool_call", 2),
        (env.rid("dup"), "tool", 2),
        (env.rid("dup"), "tool_call", 2),
    ]
    # a window shorter than any gap: nothing is quick
    assert env.q("retry_storms", min_repeats=2, window_s=0.000001) == []


def test_context_growth(env: Env) -> None:
    rows = env.q("context_growth")
    expected = []
    for name in ("dup", "dup-model"):
        seen = run_seen(env, name)
        inputs = [s.usage.input_tokens for s in seen.steps]
        cached = sum(s.usage.cache_read_tokens for s in seen.steps)
        expected.append({
            "run_id": seen.run_id, "task": "refunds", "steps": 3, "first_input_tokens": inputs[0],
            "last_input_tokens": inputs[-1], "max_input_tokens": max(inputs),
            "avg_growth_per_step": round((inputs[-1] - inputs[0]) / 2, 1), "grows_every_step": True,
            "total_input_tokens": sum(inputs),
            "total_output_tokens": sum(s.usage.output_tokens for s in seen.steps),
            "cached_share": round(cached / sum(inputs), 4), "input_by_step": inputs,
            "models": ["gpt-4o-mini"],
        })  # fmt: skip
    expected.sort(key=lambda e: -e["total_input_tokens"])
    assert rows == expected
    one = env.q("context_growth", run_id=env.rid("steps"), min_steps=1)
    assert [(r["steps"], r["grows_every_step"]) for r in one] == [
        (2, False)
    ]  # the final step drops the tools


def test_unknown_outcomes(env: Env) -> None:
    run_id = env.rid("unknown")
    rows = env.q("unknown_outcomes")
    # the resolved key executed after its reconcile, so only the unresolved one is listed
    assert [{k: r[k] for k in ("run_id", "idempotency_key", "tool_name", "args_hash", "step", "attempts",
                               "refused_repeats")} for r in rows] == [{
        "run_id": run_id, "idempotency_key": idempotency_key(run_id, "charge", {"order_id": "Z9"}, None),
        "tool_name": "charge", "args_hash": args_hash(b'{"order_id": "Z9", "sleep_s": 1.0}'), "step": 0,
        "attempts": 2, "refused_repeats": 1,
    }]  # fmt: skip
    assert "timeout_s" in rows[0]["why"] and len(rows[0]["request_hash"]) == 64


def test_run_timeline(env: Env) -> None:
    seen = run_seen(env, "dup")
    rows = env.q("run_timeline", run_id=seen.run_id)
    assert [(r["step"], r["kind"], r["tool"], r["outcome"]) for r in rows] == [
        (1, "model", "", "ok"), (1, "tool_call", "refund", "ok"), (1, "tool", "refund", "ok"),
        (1, "tool_result", "refund", "ok"),
        (2, "model", "", "ok"), (2, "tool_call", "refund", "ok"), (2, "tool", "refund", "replayed"),
        (2, "tool_result", "refund", "ok"),
        (3, "model", "", "ok"),
    ]  # fmt: skip
    costs = [step_cost(PRICES, s) for s in seen.steps]
    cumulative = [Decimal(r["cumulative_usd"]) for r in rows if r["kind"] == "model"]
    assert cumulative == [sum(costs[: i + 1], Decimal(0)) for i in range(3)]
    assert Decimal(rows[-1]["cumulative_usd"]) == seen.cost(PRICES)
    assert all(r["args_hash"] == REFUND_HASH for r in rows if r["kind"] in ("tool", "tool_call"))
    # default: the most recently active run
    assert {r["run_id"] for r in env.q("run_timeline")} == {env.rid("search-timeout")}


def test_approvals(env: Env) -> None:
    """The payout held for a person and never decided: pending, nobody's, no wait measured yet."""
    rows = env.q("approvals")
    columns = ("run_id", "tool_name", "rule", "state", "decided_by", "waited_ms")
    seen = [tuple(r[c] for c in columns) for r in rows]
    assert seen == [(env.rid("storm"), "payout", "large", "pending", "", None)]
    assert rows[0]["args_hash"] == args_hash(b'{"order_id": "P1", "amount": 500}')
    assert len(rows[0]["approval_id"]) == 32 and rows[0]["held_calls"] == 0
    assert env.q("approvals", state="approved") == []
