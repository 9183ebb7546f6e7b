"""`POST /admin/sql` reads runcap's tables and nothing else (DESIGN.md "Trust model",
docs/admin-sql.md, proxy/spans/sqlguard.py).

Attack queries — files, URLs, S3, remote servers, executables, `input()`, dictionaries, system
tables, `information_schema`, other databases, SETTINGS that would lift the limits, a second
statement, writes, INTO OUTFILE, FORMAT, and the same hidden in subqueries, CTEs, lambdas, `IN`,
comments and odd casing — are refused with 400 `invalid_request` naming what was refused, through
the route and through the store directly (the CLI's read path), on embedded chdb and on a
ClickHouse HTTP endpoint. A canary file, a URL probe and an OUTFILE path show nothing got out; a
control shows that the same queries do get out on the engine without the guard. Every on-call
query file and every dashboard query still runs, and the server's `runcap_reader` profile holds
exactly the limits runcap sends."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from proxy.app import RUNTIME, build_app
from proxy.queryfiles import bind, list_queries
from proxy.readcli import AdminSqlReader
from proxy.spans.clickhouse import QUERY_LIMITS, SpanQueryError, SpanStoreError, open_span_store
from proxy.spans.clickhouse import _jsonable as jsonable
from proxy.spans.model import RunSnapshot, Span
from proxy.spans.sqlguard import (
    AGGREGATE_FUNCTIONS,
    CASE_INSENSITIVE,
    SCALAR_FUNCTIONS,
    QueryRefused,
    function_allowed,
)
from tests.conftest import FAST_SPANS, REPO, runcap_config
from tests.support.clickhouse import ClickHouseProcess
from tests.support.compose import interpolate, raw_compose, sample_env
from tests.support.grafana import Expander, TimeRange, Variable
from tests.support.sql_attacks import ATTACKS, FORBIDDEN, Attack

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ASYNC = pytest.mark.asyncio(loop_scope="module")

TOKEN = "sql-guard-admin-token-of-32-chars"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SECRET = f"canary-{secrets.token_hex(8)}"


RUNS, SPANS_PER_RUN = 12, 30
SPANS_WRITTEN = RUNS * SPANS_PER_RUN


def synthetic_batch() -> tuple[list[Span], list[RunSnapshot]]:
    """Spans and run versions of every kind and outcome the on-call queries look for, in the last
    hour, so that the answers compared below are not all empty."""
    rnd = random.Random(7)
    t0 = datetime.now(UTC) - timedelta(hours=1)
    outcomes = ["ok", "ok", "budget_exceeded", "deadline_exceeded", "unknown", "replayed", "error", "timeout"]
    status_of = {
        "budget_exceeded": 402,
        "deadline_exceeded": 504,
        "unknown": 409,
        "error": 500,
        "timeout": 504,
    }
    spans, runs = [], []
    for r in range(RUNS):
        run_id = f"run-{r}"
        for i in range(SPANS_PER_RUN):
            kind = rnd.choice(["model", "model", "tool", "tool_call", "tool_result"])
            outcome = rnd.choice(outcomes)
            spans.append(
                Span(
                    run_id=run_id,
                    kind=kind,
                    step=i // 3 + 1,
                    started_at=t0 + timedelta(seconds=100 * r + i),
                    duration_ms=rnd.random() * 1000,
                    task=rnd.choice(["refunds", "triage", ""]),
                    provider="openai",
                    model=rnd.choice(["gpt-4o-mini", "gpt-x"]) if kind == "model" else "",
                    endpoint="chat/completions",
                    status_code=status_of.get(outcome, 200),
                    outcome=outcome,
                    error=rnd.choice(["", "X-Run-Max-Steps: cap reached", "X-Run-Max-Usd: cap reached"]),
                    input_tokens=100 * (i + 1) + rnd.randint(0, 99),
                    output_tokens=rnd.randint(1, 500),
                    cache_read_tokens=rnd.randint(0, 100),
                    cost_usd=Decimal(rnd.randint(0, 10**6)) / Decimal(10**9),
                    price_known=rnd.random() < 0.8,
                    tool_name=rnd.choice(["refund", "lookup"]) if kind != "model" else "",
                    tool_call_id=f"call-{rnd.randint(0, 5)}",
                    args_hash=f"{rnd.randint(0, 3):064x}",
                    request_hash=f"{rnd.randint(0, 3):064x}",
                    idempotency_key=rnd.choice(["", "key-1", "key-2"]),
                    attributes={"i": str(i % 4)},
                )
            )
        for version in range(3):
            runs.append(
                RunSnapshot(
                    run_id=run_id,
                    task=rnd.choice(["refunds", "triage"]),
                    started_at=t0 + timedelta(seconds=100 * r),
                    updated_at=t0 + timedelta(seconds=100 * r + 10 * version),
                    status=rnd.choice(
                        ["active", "completed", "budget_exceeded", "steps_exceeded", "cancelled"]
                    ),
                    steps=version + 1,
                    tool_calls=version,
                    input_tokens=100 * version,
                    output_tokens=10 * version,
                    cost_usd=Decimal("0.01") * version,
                    max_usd=Decimal("5"),
                    max_tokens=None,
                    max_steps=50,
                    max_tool_calls=None,
                    deadline=t0 + timedelta(hours=2),
                )
            )
    return spans, runs


@dataclass
class Target:
    """A runcap with tracing on (the route) and its span store (the CLI's direct path)."""

    backend: str
    url: str
    store: Any  # ClickHouseSink
    canary: Path  # a file holding SECRET: its content must never come back
    probe_url: str  # a URL that counts the requests it gets: there must be none
    hits: list[str]
    outfile: Path  # where INTO OUTFILE would write
    clickhouse_url: str | None = None

    def fill(self, sql: str) -> str:
        return (
            sql.replace("@CANARY@", str(self.canary))
            .replace("@PROBE@", self.probe_url)
            .replace("@OUT@", str(self.outfile))
        )


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["chdb", "http"])
async def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Target]:
    tmp = tmp_path_factory.mktemp(f"sqlguard-{request.param}")
    canary = tmp / "canary.txt"
    canary.write_text(SECRET + "\n")
    hits: list[str] = []

    async def probe(req: web.Request) -> web.Response:
        hits.append(req.path_qs)
        return web.Response(text=SECRET + "\n")

    probe_app = web.Application()
    probe_app.router.add_route("*", "/{tail:.*}", probe)
    probe_runner = web.AppRunner(probe_app, access_log=None)
    await probe_runner.setup()
    await web.TCPSite(probe_runner, "127.0.0.1", 0).start()
    probe_url = f"http://127.0.0.1:{probe_runner.addresses[0][1]}/leak.txt"

    extra: dict[str, Any] = {"tracing": True, "admin_token": TOKEN}
    ch = None
    if request.param == "http":
        ch = ClickHouseProcess(tmp / "ch")
        ch.start()
        extra["clickhouse_url"] = ch.url
    config = runcap_config("http://127.0.0.1:9", tmp / "data", extra)
    app = build_app(config, span_options=FAST_SPANS)
    runner = web.AppRunner(app, access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        span_store = app[RUNTIME].spans.store
        assert span_store is not None
        span_store.get().write(*synthetic_batch(), "sqlguard-synthetic")
        yield Target(
            request.param,
            f"http://127.0.0.1:{runner.addresses[0][1]}",
            span_store.get(),
            canary,
            probe_url,
            hits,
            tmp / "out.csv",
            ch.url if ch else None,
        )
    finally:
        await runner.cleanup()
        await probe_runner.cleanup()
        if ch is not None:
            ch.stop()


async def admin_sql(
    t: Target, sql: str, params: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any], str]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{t.url}/admin/sql", json={"sql": sql, "params": params or {}}, headers=ADMIN) as r,
    ):
        text = await r.text()
        return r.status, json.loads(text), text


# -- attacks -------------------------------------------------------------------------------------




@ASYNC
@pytest.mark.parametrize("attack", ATTACKS, ids=[a.id for a in ATTACKS])
async def test_attack_is_refused(target: Target, attack: Attack) -> None:
    # The target is shared by the module (a ClickHouse server is slow to start): what an earlier
    # test leaked is that test's failure, not this one's.
    target.hits.clear()
    target.outfile.unlink(missing_ok=True)
    sql = target.fill(attack.sql)
    status, body, text = await admin_sql(target, sql, attack.params)
    assert status == 400, text
    assert body["error"]["type"] == "invalid_request", text
    assert attack.refused in body["error"]["message"], text
    assert SECRET not in text

    # the CLI's path: the store itself, no route in front
    with pytest.raises(SpanQueryError) as info:
        await asyncio.to_thread(target.store.query, sql, attack.params)
    assert attack.refused in str(info.value)
    assert isinstance(info.value.__cause__, QueryRefused) == attack.by_guard
    assert SECRET not in str(info.value)

    assert target.hits == [], "a query reached the URL probe"
    assert not target.outfile.exists(), "a query wrote a file"


@ASYNC
async def test_the_holes_are_real_without_the_guard(target: Target) -> None:
    """The attacks above are not refused by accident: the same engine, asked directly on runcap's
    read connection without the guard, reads the canary file (and, over HTTP with readonly=2,
    fetches the URL). So the refusals are the guard's doing."""
    reader = target.store._reader
    leaked = await asyncio.to_thread(lambda: reader.query(f"SELECT file('{target.canary}')").result_rows)
    assert SECRET in str(leaked)
    if target.backend == "http":  # readonly=2: table functions and SETTINGS work on a server
        got = await asyncio.to_thread(
            lambda: reader.query(f"SELECT * FROM url('{target.probe_url}', 'LineAsString')").result_rows
        )
        try:
            assert SECRET in str(got)
            assert target.hits, "the probe saw the request"
        finally:
            target.hits.clear()  # the module's other tests expect a quiet probe
        limit = await asyncio.to_thread(
            lambda: (
                reader.query(
                    "SELECT getSetting('max_execution_time') SETTINGS max_execution_time = 0"
                ).result_rows
            )
        )
        assert [list(row) for row in limit] == [[0]], "a SETTINGS clause lifts the limit"


# -- what still works ----------------------------------------------------------------------------

# (id, sql, params, rows): rows None = whatever the engine answers without the guard
READS: list[tuple[str, str, dict[str, Any], list[list[Any]] | None]] = [
    ("count", "SELECT count() FROM runcap.spans", {}, [[SPANS_WRITTEN]]),
    ("unqualified", "SELECT count() FROM spans", {}, [[SPANS_WRITTEN]]),
    ("trailing-semicolon", "SELECT count() FROM runcap.runs;", {}, None),
    ("comment-mentions-settings", "SELECT 1 AS one -- SETTINGS max_execution_time = 0\n", {}, [[1]]),
    (
        "parameters",
        "SELECT {run_id:String} AS r, count() AS n FROM runcap.spans WHERE run_id = {run_id:String}",
        {"run_id": "it's\nme'); DROP TABLE runcap.spans; --"},
        [["it's\nme'); DROP TABLE runcap.spans; --", 0]],
    ),
    ("parameter-match", "SELECT count() FROM runcap.spans WHERE run_id = {r:String}", {"r": "run-3"}, [[30]]),
    (
        "case-insensitive-names",
        "SELECT COUNT(*) AS n, Sum(1) AS s, IF(1, 'a', 'b') AS i FROM runcap.runs",
        {},
        None,
    ),
    ("aggregate-name", "SELECT arrayReduce('median', [1, 2, 3]) AS m", {}, [[2.0]]),
    (
        "combinators",
        "SELECT countIf(kind = 'model') AS a, quantileExactIf(0.5)(input_tokens, kind = 'tool') AS b, "
        "groupUniqArrayArray([task]) AS c, sumArray([1, 2]) AS d FROM runcap.spans",
        {},
        None,
    ),
    (
        "cte-union-window",
        "WITH r AS (SELECT DISTINCT run_id FROM runcap.runs) SELECT * FROM ("
        "SELECT run_id, row_number() OVER (ORDER BY run_id) AS n FROM r UNION ALL SELECT 'x', 0) ORDER BY n",
        {},
        None,
    ),
    (
        "in-own-table",
        "WITH ids AS (SELECT run_id FROM runcap.runs WHERE status = 'completed') "
        "SELECT count() FROM runcap.spans WHERE run_id IN ids",
        {},
        None,
    ),
    (
        "join-own-tables",
        "SELECT count() FROM runcap.spans AS s JOIN runcap.runs AS r USING (run_id)",
        {},
        None,
    ),
    ("quoted-name", 'SELECT 1 AS "one run"', {}, [[1]]),
    (
        "map-and-json",
        "SELECT attributes['i'] AS i, toJSONString(map('k', 1)) AS j FROM spans LIMIT 1 BY i",
        {},
        None,
    ),
]


def engine_answer(t: Target, sql: str, params: dict[str, Any]) -> list[list[Any]]:
    """The rows the engine gives for `sql` on runcap's read connection with no guard in front."""
    result = t.store._reader.query(sql.rstrip().rstrip(";"), parameters=params or None)
    return [[jsonable(v) for v in row] for row in result.result_rows]


@ASYNC
@pytest.mark.parametrize("read", READS, ids=[r[0] for r in READS])
async def test_reads_still_run_and_answer_as_without_the_guard(
    target: Target, read: tuple[str, str, dict[str, Any], list[list[Any]] | None]
) -> None:
    _, sql, params, rows = read
    status, body, text = await admin_sql(target, sql, params)
    assert status == 200, text
    _, direct = await asyncio.to_thread(target.store.query, sql, params)
    assert direct == await asyncio.to_thread(engine_answer, target, sql, params)
    assert len(body["rows"]) == len(direct) and direct
    if rows is not None:
        assert body["rows"] == rows and direct == rows


@ASYNC
async def test_describe_of_a_table_and_of_a_query(target: Target) -> None:
    status, body, text = await admin_sql(target, "DESCRIBE TABLE runcap.spans")
    assert status == 200, text
    assert [r[0] for r in body["rows"]][:3] == ["run_id", "trace_id", "span_id"]
    status, body, text = await admin_sql(target, "DESCRIBE TABLE (SELECT count() AS n FROM runcap.spans)")
    assert status == 200, text
    assert [r[:2] for r in body["rows"]] == [["n", "UInt64"]]


@ASYNC
async def test_every_query_file_runs_and_answers_as_without_the_guard(target: Target) -> None:
    """The guard runs ClickHouse's canonical form of a query, not the text sent: every on-call
    query gives the same answer through it as the engine gives for the file as written."""
    queries = list_queries()  # proxy/sql, a link to queries/ in a checkout
    assert {q.name for q in queries} == {p.stem for p in (REPO / "queries").glob("*.sql")}
    reader = AdminSqlReader(target.url, TOKEN)
    answered = 0
    for q in queries:
        given = {"since": "2000-01-01"} if q.param("since") else {}
        # `runcap query NAME`: the defaults are evaluated through the same route, then the file runs
        params = await asyncio.to_thread(bind, q, given, reader)
        status, body, text = await admin_sql(target, q.sql, params)
        assert status == 200, f"{q.name}: {text}"
        # and directly on the store, as the CLI does without a running runcap
        direct = await asyncio.to_thread(target.store.query, q.sql, bind(q, given, target.store))
        assert len(body["rows"]) == len(direct[1]), q.name
        assert direct[1] == await asyncio.to_thread(engine_answer, target, q.sql, params), q.name
        answered += bool(direct[1])
    assert answered >= len(queries) - 2, "the synthetic spans should give most queries something to say"


@ASYNC
async def test_every_dashboard_query_passes(target: Target) -> None:
    """What Grafana sends after its macro and variable expansion, and the DESCRIBE wrapping
    tests/system/test_dashboards.py uses for panel shapes."""
    end = datetime.now(UTC)
    time_range = TimeRange(end - timedelta(hours=6), end)
    # The guard decides on ClickHouse's own canonical form and AST, which the embedded engine and
    # a server produce alike: the full matrix (both variable selections, the DESCRIBE wrapping)
    # runs on chdb; a server answers each panel once, as Grafana sends it — a server round trip
    # per guard step makes the full matrix the slowest test of the suite for nothing new.
    full = target.backend == "chdb"
    count = 0
    for path in sorted((REPO / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        names = [v["name"] for v in board["templating"]["list"]]
        sqls = [v["query"]["rawSql"] for v in board["templating"]["list"]]
        sqls += [t["rawSql"] for p in board["panels"] for t in p["targets"]]
        for selection in ([], ["it's", "b"]) if full else (["it's", "b"],):
            variables = {n: Variable(n, ["it's", "b"], selection or ["$__all"]) for n in names}
            for raw in sqls:
                sql = Expander(time_range, variables).expand(raw)
                for statement in (sql, f"DESCRIBE TABLE (\n{sql}\n)") if full else (sql,):
                    await asyncio.to_thread(target.store.query, statement)
                    count += 1
    assert count > (50 if full else 20)


# -- the allow-list against the engine -----------------------------------------------------------



@ASYNC
@pytest.mark.parametrize("target", ["chdb"], indirect=True)  # one engine's function list is enough
async def test_the_allow_list_holds_no_function_that_reaches_out(target: Target) -> None:
    writer = target.store._writer
    functions = {
        r[0]: {"ci": bool(r[1]), "alias_to": r[2], "aggregate": bool(r[3])}
        for r in writer.query(
            "SELECT name, case_insensitive, alias_to, is_aggregate FROM system.functions"
        ).result_rows
    }
    table_functions = {r[0] for r in writer.query("SELECT name FROM system.table_functions").result_rows}
    allowed = SCALAR_FUNCTIONS | AGGREGATE_FUNCTIONS

    for name in FORBIDDEN:
        for spelling in (name, name.lower(), name.upper()):
            assert not function_allowed(spelling), spelling
    for name in table_functions - {"format"}:  # format(): also a pure string function
        assert not function_allowed(name), f"table function {name}"

    def resolve(spelling: str) -> str | None:
        """What ClickHouse calls for this spelling: the exact name, else a case-insensitive one."""
        if spelling in functions:
            return spelling
        matches = [n for n, f in functions.items() if f["ci"] and n.lower() == spelling.lower()]
        return matches[0] if matches else None

    for name in functions:
        for spelling in {name, name.lower(), name.upper()}:
            resolved = resolve(spelling)
            if not function_allowed(spelling) or resolved is None:
                continue
            target_name = functions[resolved]["alias_to"] or resolved
            # An accepted spelling is a function on the list, never one reached through a case
            # variant or an aggregate combinator suffix (e.g. a scalar that ends in "If").
            assert resolved in allowed or target_name in allowed, (spelling, resolved, target_name)
            assert not (target_name in table_functions and target_name != "format"), spelling
    for name in CASE_INSENSITIVE:
        known = [n for n in functions if n.lower() == name]
        assert known and all(functions[n]["ci"] for n in known), name


# -- the server side: runcap_reader --------------------------------------------------------------


def test_runcap_reader_profile_holds_the_limits_runcap_sends() -> None:
    xml = ET.parse(REPO / "deploy/clickhouse/users.d/runcap-reader.xml").getroot()
    profile = xml.find("profiles/runcap_reader")
    assert profile is not None
    settings = {child.tag: (child.text or "").strip() for child in profile if child.tag != "constraints"}
    # equal, or clickhouse-connect's per-request value would hit a constant and fail every read
    assert settings == {"readonly": "2", **{k: str(v) for k, v in QUERY_LIMITS.items()}}
    constraints = profile.find("constraints")
    assert constraints is not None
    assert {c.tag for c in constraints} == set(settings)
    assert all([k.tag for k in c] == ["readonly"] for c in constraints)  # `readonly` = constant
    user = xml.find("users/runcap_reader")
    assert user is not None
    assert user.findtext("profile") == "runcap_reader"
    assert [q.text for q in user.findall("grants/query")] == ["GRANT SELECT ON runcap.*"]
    password = user.find("password")
    assert password is not None and password.get("from_env") == "RUNCAP_READER_CLICKHOUSE_PASSWORD"
    access = ET.parse(REPO / "deploy/clickhouse/config.d/runcap-access.xml").getroot()
    for switch in ("select_from_system_db_requires_grant", "select_from_information_schema_requires_grant"):
        assert access.findtext(f"access_control_improvements/{switch}") == "true", switch


def test_compose_reads_as_runcap_reader() -> None:
    compose = interpolate(raw_compose(), sample_env())
    runcap, clickhouse = compose["services"]["runcap"], compose["services"]["clickhouse"]
    mounts = dict(reversed(v.split(":")[:2]) for v in clickhouse["volumes"])
    assert (
        mounts["/etc/clickhouse-server/users.d/runcap-reader.xml"]
        == "./deploy/clickhouse/users.d/runcap-reader.xml"
    )
    assert (
        mounts["/etc/clickhouse-server/config.d/runcap-access.xml"]
        == "./deploy/clickhouse/config.d/runcap-access.xml"
    )
    read = urlsplit(runcap["environment"]["RUNCAP_CLICKHOUSE_READ_URL"])
    write = urlsplit(runcap["environment"]["RUNCAP_CLICKHOUSE_URL"])
    assert read.username == "runcap_reader" and read.hostname == write.hostname and read.path == write.path
    assert read.password == clickhouse["environment"]["RUNCAP_READER_CLICKHOUSE_PASSWORD"]
    assert read.password != write.password


@ASYNC
@pytest.mark.parametrize("target", ["http"], indirect=True)  # a read URL is for a ClickHouse server
async def test_reads_go_to_the_read_url(target: Target, tmp_path: Path) -> None:
    """`open_span_store(..., read_url=)` opens the reader with the read URL's credentials: a wrong
    password there fails, though the writer's URL is fine; a read URL naming another database is
    refused."""
    url = target.clickhouse_url
    assert url is not None
    wrong = url.replace("default:@", "default:wrong@")
    with pytest.raises(SpanStoreError, match=r"AUTHENTICATION_FAILED|Authentication failed"):
        await asyncio.to_thread(open_span_store, url, tmp_path, read_url=wrong)
    with pytest.raises(SpanStoreError, match="names database 'elsewhere'"):
        await asyncio.to_thread(open_span_store, url, tmp_path, read_url=url.rsplit("/", 1)[0] + "/elsewhere")
    store = await asyncio.to_thread(open_span_store, url, tmp_path, read_url=url)
    try:
        assert (await asyncio.to_thread(store.query, "SELECT count() FROM runcap.spans"))[1] == [
            [SPANS_WRITTEN]
        ]
    finally:
        store.close()
