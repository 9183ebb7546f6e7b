"""The Grafana dashboards in dashboards/: their JSON is well-formed for Grafana and the ClickHouse
data source plugin, and every panel's and variable's SQL — after the plugin's macro and variable
expansion (tests/support/grafana.py) — runs on a chdb span store holding the spans of real agent
runs made through runcap, returns what its panel type needs, and answers its question correctly."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from proxy.app import RUNTIME, build_app
from proxy.pricing import PriceBook
from proxy.providers.base import Usage
from proxy.scripted_upstream import ScriptedUpstream
from tests.conftest import FAST_SPANS, REPO, runcap_config
from tests.support.agent_runs import Fleet, run_fleet
from tests.support.grafana import ALL, Expander, TimeRange, Variable, shape_problems
from tests.support.tool_service import ToolService

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ASYNC = pytest.mark.asyncio(loop_scope="module")

DASHBOARDS = REPO / "dashboards"
BOARDS = {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}
PANELS = [(name, p) for name, board in BOARDS.items() for p in board["panels"]]
DS_FILE = DASHBOARDS / "provisioning" / "datasources" / "clickhouse.yaml"
PROVIDER_FILE = DASHBOARDS / "provisioning" / "dashboards" / "runcap.yaml"


def provisioned_datasource() -> dict[str, Any]:
    doc = yaml.safe_load(DS_FILE.read_text())
    assert doc["apiVersion"] == 1
    [ds] = doc["datasources"]
    return ds


# -- structure ---------------------------------------------------------------------------------


def test_there_are_cost_runs_and_tools_dashboards() -> None:
    assert set(BOARDS) == {"runcap-cost", "runcap-runs", "runcap-tools"}
    assert len({b["uid"] for b in BOARDS.values()}) == 3
    assert len({b["title"] for b in BOARDS.values()}) == 3


def test_datasource_provisioning_points_at_the_compose_clickhouse() -> None:
    ds = provisioned_datasource()
    assert ds["type"] == "grafana-clickhouse-datasource" and ds["uid"] == "runcap-clickhouse"
    j = ds["jsonData"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert j["host"] in compose["services"]  # a compose service name
    assert (j["protocol"], j["port"]) in (("http", 8123), ("native", 9000))
    assert j["defaultDatabase"] == "runcap"
    assert j["username"] and "password" in ds["secureJsonData"]


def test_dashboard_provider_loads_the_json_files() -> None:
    doc = yaml.safe_load(PROVIDER_FILE.read_text())
    [provider] = doc["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    # docker-compose.yml mounts dashboards/ at the provider's path
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = [v for v in compose["services"]["grafana"]["volumes"] if isinstance(v, str)]
    assert any(
        m.split(":")[0] in ("./dashboards", "./dashboards/") and m.split(":")[1] == path for m in mounts
    ), mounts


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_dashboard_json_structure(name: str) -> None:
    board = BOARDS[name]
    uid = provisioned_datasource()["uid"]
    assert board["uid"] == name and board["title"] and board["description"]
    assert board["schemaVersion"] >= 36 and board["time"]["from"].startswith("now-")
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    titles = [p["title"] for p in board["panels"]]
    assert len(titles) == len(set(titles)), f"duplicate panel titles in {name}"
    for p in board["panels"]:
        where = f"{name} panel {p['id']} ({p.get('title')})"
        assert p["title"], where
        assert "?" in p.get("description", ""), (
            f"{where}: the description must state the question the panel answers"
        )
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")) and g["x"] + g["w"] <= 24, where
        assert p["datasource"] == {"type": "grafana-clickhouse-datasource", "uid": uid}, where
        assert p["targets"], f"{where}: no query"
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], where
            assert t["editorType"] == "sql" and t["rawSql"].strip(), where
            assert t["rawSql"].lstrip().startswith("--"), f"{where}: the query starts with a comment"
            assert t["format"] == (0 if p["type"] == "timeseries" else 1), where
            assert t["queryType"] == ("timeseries" if t["format"] == 0 else "table"), where
    # panels do not overlap
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{name} panel {p['id']} overlaps another"
        cells |= mine
    variables = board["templating"]["list"]
    assert {v["name"] for v in variables} >= {"task"}
    for v in variables:
        assert v["type"] == "query" and v["datasource"]["uid"] == uid, v["name"]
        assert v["query"]["rawSql"].lstrip().startswith("--") and v["description"], v["name"]
        assert v["multi"] and v["includeAll"] and v.get("allValue") in (None, ""), (
            f"{v['name']}: All must expand to the options (no custom all value) so $__conditionalAll works"
        )
        assert v["refresh"] == 2, f"{v['name']}: refresh on time range change"
    used = {v["name"] for v in variables}
    for p in board["panels"]:
        for t in p["targets"]:
            for ref in ("${task", "${model", "${tool"):
                if ref in t["rawSql"]:
                    assert ref[2:] in used, f"{name} panel {p['id']} uses an undefined variable {ref}"


# -- running the SQL ---------------------------------------------------------------------------


@dataclass
class Store:
    url: str
    fleet: Fleet
    time: TimeRange
    admin: dict[str, str]

    async def sql(self, query: str) -> tuple[list[str], list[list[Any]]]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{self.url}/admin/sql", json={"sql": query}, headers=self.admin) as r,
        ):
            body = await r.json()
            assert r.status == 200, f"{body}\n--- SQL ---\n{query}"
        return body["columns"], body["rows"]

    async def rows(self, query: str) -> list[dict[str, Any]]:
        cols, rows = await self.sql(query)
        return [dict(zip(cols, r, strict=True)) for r in rows]

    async def types(self, query: str) -> list[tuple[str, str]]:
        _, rows = await self.sql(f"DESCRIBE TABLE (\n{query}\n)")
        return [(r[0], r[1]) for r in rows]


TOOLS_CONFIG = {
    "refund": {"side_effects": True, "key_fields": ["order_id", "amount"]},
    "lookup": {"side_effects": False},
    "charge": {"side_effects": True, "timeout_s": 0.4},
    "peek": {"side_effects": False, "timeout_s": 0.3},
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Store]:
    up = ScriptedUpstream()
    await up.start()
    tools = await ToolService().start()
    broken = await ToolService(status=500).start()
    assert up.url and tools.url and broken.url
    tool_cfg: dict[str, Any] = {n: {"url": f"{tools.url}/{n}", **c} for n, c in TOOLS_CONFIG.items()}
    tool_cfg["broken"] = {"url": f"{broken.url}/broken", "side_effects": True}
    config = runcap_config(
        up.url, tmp_path_factory.mktemp("dash") / "data", {"tracing": True, "tools": tool_cfg}
    )
    app = build_app(config, span_options=FAST_SPANS)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    # Keep every version of every run row (no background merge folds them): the dashboards'
    # deduplication must be right on the table as a query may find it, not as merges left it.
    sink = app[RUNTIME].spans.store
    assert sink is not None
    sink.get()._writer.command("SYSTEM STOP MERGES runcap.runs")
    start = datetime.now(UTC) - timedelta(minutes=5)
    admin = {"Authorization": f"Bearer {app[RUNTIME].config.admin_token}"}
    fleet = await run_fleet(url, up, admin)
    s = Store(url, fleet, TimeRange(start, datetime.now(UTC) + timedelta(minutes=5), interval_s=60), admin)
    # Wait for the pipeline: every run's latest version is its final status, spans stop growing.
    deadline = time.monotonic() + 45  # generous: CI shares two cores with everything else
    last = -1
    while time.monotonic() < deadline:
        latest = await s.rows(
            "SELECT run_id, argMax(status, updated_at) AS status FROM runcap.runs GROUP BY run_id"
        )
        [[n]] = (await s.sql("SELECT count() FROM runcap.spans"))[1]
        if {r["run_id"]: r["status"] for r in latest} == {
            k: v[1] for k, v in fleet.runs.items()
        } and n == last:
            break
        last = n
        await asyncio.sleep(0.2)
    else:
        raise AssertionError(f"span store did not settle: {latest}")
    yield s
    await runner.cleanup()
    for svc in (tools, broken):
        await svc.stop()
    await up.stop()


async def options(store: Store, board: dict[str, Any]) -> dict[str, list[str]]:
    """Each variable's options: its query, run the way Grafana does (time range, no selection)."""
    out = {}
    ex = Expander(store.time, {})
    for v in board["templating"]["list"]:
        cols, rows = await store.sql(ex.expand(v["query"]["rawSql"]))
        assert len(cols) == 1, f"variable {v['name']}: one column of values"
        out[v["name"]] = [r[0] for r in rows]
    return out


def expander(store: Store, opts: dict[str, list[str]], **selected: list[str]) -> Expander:
    return Expander(
        store.time,
        {name: Variable(name, values, selected.get(name, [ALL])) for name, values in opts.items()},
    )


def target(board: str, title: str) -> str:
    [p] = [p for p in BOARDS[board]["panels"] if p["title"] == title]
    return p["targets"][0]["rawSql"]


@ASYNC
async def test_variables_list_what_the_runs_used(store: Store) -> None:
    assert await options(store, BOARDS["runcap-cost"]) == {
        "task": ["refunds", "search"],
        "model": ["acme-llm-7b", "gpt-4.1-mini", "gpt-4o-mini"],
    }
    assert (await options(store, BOARDS["runcap-tools"]))["tool"] == [
        "broken",
        "charge",
        "lookup",
        "peek",
        "refund",
    ]


SELECTIONS: list[dict[str, list[str]]] = [
    {},  # everything All
    {"task": ["refunds"]},
    {"task": ["refunds", "search"], "model": ["gpt-4o-mini"], "tool": ["refund"]},
    {"task": ["nothing-matches"], "model": ["nothing-matches"], "tool": ["nothing-matches"]},
]


@ASYNC
@pytest.mark.parametrize(("board", "panel"), PANELS, ids=[f"{b}:{p['id']}" for b, p in PANELS])
async def test_panel_sql_runs_and_fits_its_panel(store: Store, board: str, panel: dict[str, Any]) -> None:
    opts = await options(store, BOARDS[board])
    for t in panel["targets"]:
        for sel in SELECTIONS:
            sql = expander(store, opts, **{k: v for k, v in sel.items() if k in opts}).expand(t["rawSql"])
            cols, rows = await store.sql(sql)
            problems = shape_problems(panel["type"], t["format"], await store.types(sql))
            assert not problems, f"{board} / {panel['title']} with {sel}: {problems}\n{sql}"
            if panel["type"] == "timeseries" and rows:
                times = [r[cols.index("time")] for r in rows]
                assert None not in times and times == sorted(times), "time series rows in time order"
            if panel["type"] in ("stat", "gauge") and not sel:
                assert len(rows) == 1, f"{panel['title']}: a stat reduces one row"


# -- answers -----------------------------------------------------------------------------------


async def panel_rows(store: Store, board: str, title: str, **selected: list[str]) -> list[dict[str, Any]]:
    opts = await options(store, BOARDS[board])
    return await store.rows(expander(store, opts, **selected).expand(target(board, title)))


async def ledger_run(store: Store, run_id: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{store.url}/runs/{run_id}", headers=store.admin) as r:
        return await r.json()


@ASYNC
async def test_spend_panels_add_up_to_the_spans(store: Store) -> None:
    [[total]] = (await store.sql("SELECT toString(sum(cost_usd)) FROM runcap.spans"))[1]
    total = Decimal(total)
    assert total > 0
    by_model = await panel_rows(store, "runcap-cost", "Spend over time by model")
    assert sum(Decimal(r["spend_usd"]) for r in by_model) == total
    assert {r["model"] for r in by_model} == {"gpt-4o-mini", "gpt-4.1-mini", "acme-llm-7b"}
    by_task = await panel_rows(store, "runcap-cost", "Spend over time by task")
    assert sum(Decimal(r["spend_usd"]) for r in by_task) == total
    [stat] = await panel_rows(store, "runcap-cost", "Spend")
    assert Decimal(stat["spend_usd"]) == total
    # the ledger's own account of every run adds up to the same dollars
    ledger = [Decimal((await ledger_run(store, run))["cost_usd"]) for run in store.fleet.runs]
    assert sum(ledger) == total
    # filters: one task, one model
    [[refunds]] = (
        await store.sql("SELECT toString(sum(cost_usd)) FROM runcap.spans WHERE task = 'refunds'")
    )[1]
    [stat] = await panel_rows(store, "runcap-cost", "Spend", task=["refunds"])
    assert Decimal(stat["spend_usd"]) == Decimal(refunds) < total
    [stat] = await panel_rows(store, "runcap-cost", "Spend", model=["acme-llm-7b"])
    assert Decimal(stat["spend_usd"]) == 0
    [pie] = await panel_rows(store, "runcap-cost", "Spend by provider")
    assert pie["provider"] == "openai" and Decimal(pie["spend_usd"]) == total


@ASYNC
async def test_runs_are_deduplicated_not_summed_over_versions(store: Store) -> None:
    [[versions, runs]] = (await store.sql("SELECT count(), uniqExact(run_id) FROM runcap.runs"))[1]
    assert versions > runs == len(store.fleet.runs)  # several versions per run are visible
    top = await panel_rows(store, "runcap-cost", "Most expensive runs")
    assert len(top) == runs
    for row in top:
        ledger = await ledger_run(store, row["run_id"])
        assert Decimal(row["cost_usd"]) == Decimal(ledger["cost_usd"]), row
        assert row["steps"] == ledger["steps"] and row["status"] == store.fleet.runs[row["run_id"]][1], row
    # The deadline-cut call is charged its whole reservation (the provider may bill what it did).
    assert top[0]["run_id"] == "srch-3"
    ref4 = next(r for r in top if r["run_id"] == "ref-4")
    assert Decimal(ref4["max_usd"]) == Decimal("0.0003") and 0 < ref4["cap_used"] <= 1
    [started] = await panel_rows(store, "runcap-runs", "Runs started")
    assert started["runs"] == runs
    by_status = await panel_rows(store, "runcap-runs", "Runs by final status")
    assert sum(r["runs"] for r in by_status) == runs


@ASYNC
async def test_run_outcome_panels(store: Store) -> None:
    async def one(title: str, **sel: list[str]) -> Any:
        [row] = await panel_rows(store, "runcap-runs", title, **sel)
        [value] = row.values()
        return value

    assert await one("Completed") == pytest.approx(4 / 8)
    assert await one("Cap hits") == 2  # ref-3 (steps), ref-4 (dollars)
    assert await one("Deadline hits") == 1
    assert await one("Cancellations") == 1
    assert await one("Still active") == 0
    assert await one("Cap hits", task=["search"]) == 0
    assert await one("Runs started", model=["acme-llm-7b"]) == 1
    [[budget]] = [
        list(r.values()) for r in await panel_rows(store, "runcap-cost", "Runs stopped by a budget cap")
    ]
    assert budget == 1
    outcomes = {r["task_label"]: r for r in await panel_rows(store, "runcap-runs", "Run outcomes by task")}
    assert (outcomes["refunds"]["completed"], outcomes["refunds"]["steps_exceeded"]) == (2, 1)
    assert (outcomes["search"]["deadline_exceeded"], outcomes["search"]["cancelled"]) == (1, 1)
    steps = {
        r["task_label"]: r for r in await panel_rows(store, "runcap-runs", "Steps to completion by task")
    }
    assert (steps["refunds"]["max"], steps["search"]["max"]) == (3, 5)  # ref-1, srch-1
    calls = {
        r["task_label"]: r for r in await panel_rows(store, "runcap-runs", "Tool calls to completion by task")
    }
    assert (calls["refunds"]["max"], calls["search"]["max"]) == (2, 4)
    wall = {
        r["task_label"]: r for r in await panel_rows(store, "runcap-runs", "Wall-clock to completion by task")
    }
    assert all(0 <= r["p50"] <= r["max"] < 60 for r in wall.values())
    stopped = {
        r["run_id"]: r["status"] for r in await panel_rows(store, "runcap-runs", "Runs that did not complete")
    }
    assert stopped == {
        "ref-3": "steps_exceeded",
        "ref-4": "budget_exceeded",
        "srch-3": "deadline_exceeded",
        "srch-4": "cancelled",
    }
    stops = await panel_rows(store, "runcap-runs", "Stops over time")
    assert sorted(r["outcome"] for r in stops) == ["budget_exceeded", "cancelled", "deadline_exceeded"]


@ASYNC
async def test_unpriced_share_and_cache_savings(store: Store) -> None:
    [[priced, unpriced]] = (
        await store.sql(
            "SELECT countIf(price_known), countIf(NOT price_known) FROM runcap.spans "
            "WHERE kind = 'model' AND status_code < 400"
        )
    )[1]
    [share] = await panel_rows(store, "runcap-cost", "Unpriced calls")
    assert unpriced == 1 and share["unpriced_share"] == pytest.approx(1 / (priced + unpriced))
    [table] = await panel_rows(store, "runcap-cost", "Calls without a known price, by model")
    assert (table["model"], table["calls"]) == ("acme-llm-7b", 1)

    # ref-2's second step read 384 of its 600 input tokens from the cache; the estimate is what
    # those tokens saved at gpt-4o-mini's real prices.
    prices = PriceBook()
    [[inp, out]] = (
        await store.sql(
            "SELECT input_tokens, output_tokens FROM runcap.spans "
            "WHERE run_id = 'ref-2' AND cache_read_tokens > 0"
        )
    )[1]
    saved = (
        prices.cost("openai", "gpt-4o-mini", Usage(inp, out)).usd
        - prices.cost("openai", "gpt-4o-mini", Usage(inp, out, cache_read_tokens=384)).usd
    )
    assert saved > 0
    [stat] = await panel_rows(store, "runcap-cost", "Cache savings (estimate)")
    assert stat["est_savings_usd"] == pytest.approx(float(saved), rel=0.01)
    [row] = await panel_rows(store, "runcap-cost", "Cache savings by model (estimate)")
    assert row["model"] == "gpt-4o-mini" and row["cache_read"] == 384
    ref = prices.cost("openai", "gpt-4o-mini", Usage(1_000_000, 0)).usd
    assert row["fitted_input_usd_per_mtok"] == pytest.approx(float(ref), rel=0.01)
    [empty] = await panel_rows(store, "runcap-cost", "Cache savings (estimate)", task=["search"])
    assert empty["est_savings_usd"] in (0, None)


@ASYNC
async def test_tool_panels(store: Store) -> None:
    async def one(title: str, **sel: list[str]) -> Any:
        [row] = await panel_rows(store, "runcap-tools", title, **sel)
        [value] = row.values()
        return value

    # refund ok + replayed, lookup ok x2, broken error, charge unknown (504), peek timeout (504)
    assert await one("Tool calls executed") == 7
    assert await one("Error rate") == pytest.approx(1 / 7)
    assert await one("Timeouts") == 2
    assert await one("Replays") == 1
    assert await one("Duplicate requests") == 1
    assert await one("Unknown outcomes") == 1
    assert await one("Tool calls executed", tool=["refund"]) == 2
    assert await one("Tool calls executed", task=["search"]) == 4
    summary = {r["tool_name"]: r for r in await panel_rows(store, "runcap-tools", "Tool summary")}
    assert (summary["refund"]["requested"], summary["refund"]["called"], summary["refund"]["replayed"]) == (
        2,
        2,
        1,
    )
    assert summary["charge"]["unknown"] == 1 and summary["peek"]["timeouts"] == 1
    assert summary["broken"]["errors"] == 1
    [dup] = await panel_rows(store, "runcap-tools", "Duplicate tool requests")
    assert (dup["run_id"], dup["tool_name"], dup["requested"], dup["executed"], dup["replayed"]) == (
        "ref-1", "refund", 2, 1, 1,
    )  # fmt: skip
    [unknown] = await panel_rows(store, "runcap-tools", "Calls with an unknown outcome")
    assert unknown["tool_name"] == "charge" and unknown["idempotency_key"] and unknown["status_code"] == 504
    failed = await panel_rows(store, "runcap-tools", "Failed calls over time")
    assert sorted(r["outcome"] for r in failed) == ["error", "timeout", "unknown"]
    latency = await panel_rows(store, "runcap-tools", "Latency by tool")
    assert {r["tool_name"] for r in latency} == {"refund", "lookup", "broken", "charge", "peek"}
    assert all(r["p95"] >= r["p50"] >= 0 for r in latency)
    slow = max(latency, key=lambda r: r["p95"])
    assert slow["tool_name"] in ("charge", "peek") and slow["p95"] >= 300  # cut at timeout_s


# -- the expander follows the plugin's documented expansions -----------------------------------


def test_expander_follows_the_plugin() -> None:
    t = TimeRange(datetime.fromtimestamp(1415792726, UTC), datetime.fromtimestamp(1447328726, UTC), 20)
    v = {
        "task": Variable("task", ["a", "b'c"], [ALL]),
        "model": Variable("model", ["m1", "m2"], ["m1", "m2"]),
        "one": Variable("one", ["x", "y"], ["x"], multi=False),
    }
    ex = Expander(t, v)
    assert (
        ex.expand("$__timeFilter(time)")
        == "time >= toDateTime(1415792726) AND time <= toDateTime(1447328726)"
    )
    assert ex.expand("$__timeFilter_ms(time)") == (
        "time >= fromUnixTimestamp64Milli(1415792726000) AND time <= fromUnixTimestamp64Milli(1447328726000)"
    )
    assert ex.expand("$__fromTime, $__toTime") == "toDateTime(1415792726), toDateTime(1447328726)"
    assert ex.expand("$__timeInterval(column)") == "toStartOfInterval(toDateTime(column), INTERVAL 20 second)"
    assert (
        ex.expand("$__timeInterval_ms(c)")
        == "toStartOfInterval(toDateTime64(c, 3), INTERVAL 20000 millisecond)"
    )
    assert ex.expand("$__interval_s") == "20"
    assert ex.expand("$__dateFilter(d)") == "d >= toDate('2014-11-12') AND d <= toDate('2015-11-12')"
    # conditionalAll: All → 1=1, a selection → the condition, nested parentheses kept whole
    assert ex.expand("$__conditionalAll(task IN (${task:singlequote}), $task)") == "1=1"
    assert ex.expand("$__conditionalAll(f(model, g(1)) IN (${model:singlequote}), $model)") == (
        "f(model, g(1)) IN ('m1','m2')"
    )
    # variable formats: All expands to every option; singlequote escapes; the plugin's default
    # format quotes lists and inserts a single value raw
    assert ex.expand("${task:singlequote}") == "'a','b\\'c'"
    assert ex.expand("$model|${model}|[[model]]|${model:csv}") == "'m1','m2'|'m1','m2'|'m1','m2'|m1,m2"
    assert ex.expand("$one") == "x"
    assert ex.expand("$unknown_var") == "$unknown_var"
    with pytest.raises(ValueError, match="unexpanded macro"):
        ex.expand("$__notAMacro(x)")


def test_variables_are_only_used_inside_conditional_all() -> None:
    """With All selected every filter must vanish (`1=1`): a variable used outside
    `$__conditionalAll` would expand to the full option list, or to `IN ()` when it has none."""
    for name, board in BOARDS.items():
        names = [v["name"] for v in board["templating"]["list"]]
        t = TimeRange(datetime.now(UTC) - timedelta(hours=1), datetime.now(UTC))
        ex = Expander(t, {n: Variable(n, [], [ALL]) for n in names})
        for p in board["panels"]:
            for target in p["targets"]:
                left = ex.conditional_all(target["rawSql"])
                for n in names:
                    assert f"${n}" not in left and f"${{{n}" not in left, f"{name} / {p['title']} uses ${n}"
