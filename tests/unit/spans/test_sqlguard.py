"""The `/admin/sql` guard on its own (proxy/spans/sqlguard.py `check_read_query`), against the
engine's own parser (its canonical form and `EXPLAIN AST`, as the store runs them, over HTTP):
every attack of tests/support/sql_attacks.py is refused naming what it tried, every on-call query,
dashboard query and ordinary read passes, and no function that reaches outside runcap's tables is
on the allow-list. The system test (tests/system/test_admin_sql_guard.py) proves the same end to
end on both engines — the route, the CLI's path, canaries and a URL probe; this is the fast
selection of the mutation target `sqlguard` (docs/mutation.md)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from proxy.queryfiles import bind, list_queries
from proxy.spans.clickhouse import ClickHouseSink, open_span_store
from proxy.spans.sqlguard import (
    QueryRefused,
    _mask_quoted,
    _parse_tree,
    _Walk,
    check_read_query,
    function_allowed,
)
from tests.conftest import REPO
from tests.support.clickhouse import ClickHouseProcess
from tests.support.grafana import Expander, TimeRange, Variable
from tests.support.sql_attacks import ATTACKS, FORBIDDEN, Attack

# A running endpoint to use instead of starting one: scripts/mutation.py starts one for the whole
# target rather than one per mutant (each mutant's run is a fresh pytest session).
SHARED_SERVER = "RUNCAP_TEST_CLICKHOUSE_URL"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseSink]:
    # The engine behind ClickHouse's HTTP interface, in a process of its own: chdb in this process
    # would not survive the fork of each mutant's run (scripts/mutation.py), and hung there.
    server = None
    url = os.environ.get(SHARED_SERVER)
    if not url:
        server = ClickHouseProcess(tmp_path_factory.mktemp("sqlguard-server"))
        server.start()
        url = server.url
    sink = open_span_store(url, tmp_path_factory.mktemp("sqlguard"))
    yield sink
    sink.close()
    if server is not None:
        server.stop()


def check(store: ClickHouseSink, sql: str, params: dict[str, Any] | None = None) -> Any:
    return check_read_query(sql, store._read_column, params=params, database="runcap")


def fill(sql: str) -> str:
    return (
        sql.replace("@CANARY@", "/tmp/canary")
        .replace("@PROBE@", "http://127.0.0.1:9/x")
        .replace("@OUT@", "/tmp/out")
    )


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.id for a in ATTACKS])
def test_attack_is_refused_by_the_guard(store: ClickHouseSink, attack: Attack) -> None:
    if attack.by_guard:
        with pytest.raises(QueryRefused) as info:
            check(store, fill(attack.sql), attack.params)
        assert attack.refused in str(info.value)
        assert info.value.code in (164, 497), info.value.code  # READONLY, ACCESS_DENIED
    else:  # ClickHouse's own parser refuses it before the guard decides anything
        with pytest.raises(Exception) as info:
            check(store, fill(attack.sql), attack.params)
        assert not isinstance(info.value, QueryRefused)


READS = [
    "SELECT count() FROM runcap.spans",
    "SELECT count() FROM spans",
    "WITH t AS (SELECT run_id FROM runcap.runs) SELECT count() FROM t",
    "SELECT run_id, sum(cost_usd) FROM runcap.spans GROUP BY run_id ORDER BY 2 DESC LIMIT 5",
    "SELECT attributes['i'] AS i, toJSONString(map('k', 1)) AS j FROM spans LIMIT 1 BY i",
    'SELECT 1 AS "one run"',
    "SELECT settings FROM (SELECT 1 AS settings)",
    "DESCRIBE TABLE runcap.spans",
    "DESCRIBE TABLE (SELECT count() AS n FROM runcap.spans)",
    "SELECT * FROM runcap.spans AS s INNER JOIN runcap.runs AS r ON s.run_id = r.run_id LIMIT 1",
    "SELECT quantile(0.99)(duration_ms) FROM runcap.spans WHERE started_at > now() - INTERVAL 1 DAY",
    # quoted tokens as the canonical text writes them, each read past exactly, escapes and all
    "SELECT '' AS e, 'x' AS f",
    "SELECT 'it''s', 'a''' AS q",  # canonical 'it\'s', 'a\'': an escaped quote, also a last one
    "SELECT 'x.y (z)' AS s",  # dots and parentheses are refused in names, not in strings
    "SELECT tuple(`a b`) FROM (SELECT 1 AS `a b`)",  # a name right after a parenthesis
    "SELECT 1 AS `X marks`",
    "SELECT * EXCEPT (run_id) FROM runcap.spans LIMIT 1",
]


@pytest.mark.parametrize("sql", READS)
def test_reads_pass_as_their_canonical_form(store: ClickHouseSink, sql: str) -> None:
    checked = check(store, sql)
    assert checked.sql and checked.params == {}
    assert check(store, checked.sql).sql == checked.sql  # the canonical form is a fixed point


def test_parameters_pass_only_where_the_query_takes_them(store: ClickHouseSink) -> None:
    checked = check(
        store, "SELECT count() FROM runcap.spans WHERE run_id = {run:String}", {"run": "a", "x": 1}
    )
    assert checked.params == {"run": "a"}
    with pytest.raises(QueryRefused, match="Identifier"):
        check(store, "SELECT count() FROM {t:Identifier}", {"t": "spans"})


def test_every_query_file_passes(store: ClickHouseSink) -> None:
    queries = list_queries()
    assert queries
    for q in queries:
        given = {"since": "2000-01-01"} if q.param("since") else {}
        check(store, q.sql, bind(q, given, store))


def test_every_dashboard_query_passes(store: ClickHouseSink) -> None:
    end = datetime.now(UTC)
    time_range = TimeRange(end - timedelta(hours=6), end)
    count = 0
    for path in sorted((REPO / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        names = [v["name"] for v in board["templating"]["list"]]
        sqls = [v["query"]["rawSql"] for v in board["templating"]["list"]]
        sqls += [t["rawSql"] for p in board["panels"] for t in p["targets"]]
        variables = {n: Variable(n, ["it's", "b"], ["it's", "b"]) for n in names}
        for raw in sqls:
            check(store, Expander(time_range, variables).expand(raw))
            count += 1
    assert count > 20


@pytest.mark.parametrize("name", FORBIDDEN)
def test_no_function_that_reaches_out_is_allowed(name: str) -> None:
    assert not function_allowed(name)
    assert not function_allowed(name.lower()) and not function_allowed(name.upper())


def test_pure_functions_are_allowed() -> None:
    for name in ("count", "sum", "toDate", "JSONExtractString", "quantile", "if", "concat", "lower"):
        assert function_allowed(name), name


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("sum", True), ("SUM", True), ("Sum", True),  # case-insensitive in ClickHouse: any case
        ("uniqExact", True), ("UNIQEXACT", False),  # case-sensitive: only as written
        ("sumIf", True), ("countState", True), ("quantilesMerge", True), ("uniqExactIfState", True),
        ("sumIfOrNull", True), ("OrNull", False), ("State", False),  # a combinator alone is no function
        ("fileIf", False), ("dictGetIf", False), ("uniqExactIF", False),
        ("avgIf", True), ("AVGIf", True),  # a case-insensitive aggregate under a combinator
        ("ABS", True), ("Concat", True), ("coalesce", True),  # case-insensitive scalars, any case
    ],
)  # fmt: skip
def test_aggregates_and_their_combinators(name: str, allowed: bool) -> None:
    assert function_allowed(name) is allowed


@pytest.mark.parametrize(
    ("sql", "refused"),
    [
        ("SELECT arrayReduce('sum', [1, 2])", None),
        ("SELECT arrayReduce('sum', range(3))", None),  # the aggregate's name is the first argument
        ("SELECT arrayReduce('sumIf', [1, 2], [1, 0])", None),
        ("SELECT initializeAggregation('uniqState', 1)", None),
        ("SELECT arrayReduce('file', ['/etc/passwd'])", "arrayReduce('file', ...)"),
        ("SELECT arrayReduce(concat('s', 'um'), [1])", "arrayReduce(concat"),
        ("SELECT arrayReduce()", "arrayReduce(nothing, ...)"),
        ("SELECT 1 IN spans", None),
        ("SELECT 1 IN system.tables", "the table system.tables"),
        ("SELECT 1 IN format(JSONEachRow, '{\"a\": 1}')", "the table function format() on the right of IN"),
        ("SELECT format('{} {}', 'a', 'b')", None),  # the scalar format() is a pure function
        (
            "SELECT * FROM format(JSONEachRow, '{\"a\": 1}')",
            "the table function format(): /admin/sql reads the tables of the runcap database only",
        ),
        (
            "SELECT hostName()",
            "the function hostName(): it is not on the allow-list of functions /admin/sql may call "
            "(nothing that reads files, URLs, other servers, dictionaries or the server's state)",
        ),
        ("SELECT system.one.dummy", "the name system.one.dummy"),
        ("SELECT runcap.spans.run_id FROM runcap.spans LIMIT 1", None),
        ("SELECT count() FROM runcap.spans SETTINGS max_threads = 1", "a SETTINGS clause"),
        (
            "SELECT * APPLY(toString) FROM runcap.spans LIMIT 1",
            "the APPLY column transformer: call the function on the columns by name",
        ),
        ("SELECT system.one.*", "the table system.one"),  # a qualified asterisk reads its table
        ("SELECT system.one.COLUMNS(dummy)", "the table system.one"),
        ("SELECT system.one.COLUMNS('du.*')", "the table system.one"),
        ("SELECT s.* FROM runcap.spans AS s LIMIT 1", None),
        ("SELECT * FROM (EXPLAIN SELECT 1)", "the table function viewExplain()"),  # EXPLAIN as a table
        # the roots: one SELECT (UNION included) or DESCRIBE, nothing after it
        ("SELECT 1 INTO OUTFILE '/tmp/x'", "INTO OUTFILE: /admin/sql does not write files"),
        ("SELECT 1 FORMAT JSON", "FORMAT JSON: /admin/sql chooses the format of its answer"),
        ("SHOW TABLES", "the statement SHOW"),
        ("DESCRIBE TABLE runcap.spans", None),
        ("SELECT 1 UNION ALL SELECT 2", None),
    ],
)
def test_the_walk_refuses_what_reads_elsewhere(store: ClickHouseSink, sql: str, refused: str | None) -> None:
    if refused is None:
        assert check(store, sql).sql
        return
    with pytest.raises(QueryRefused) as info:
        check(store, sql)
    assert refused in str(info.value), str(info.value)
    assert info.value.what == str(info.value) or refused in info.value.what


def test_a_parameter_left_without_a_value_is_refused(store: ClickHouseSink) -> None:
    with pytest.raises(Exception) as info:
        check(store, "SELECT {x:UInt8}")
    assert "x" in str(info.value)


# -- reading EXPLAIN AST's text, and the roots the walk accepts ----------------------------------

LONG = "x" * 150  # a node's text longer than the 120 characters a refusal quotes of its line

TREE = [
    "SelectWithUnionQuery (children 1)",
    " ExpressionList (children 1)",
    "  SelectQuery (children 1)",
    "   ExpressionList (children 2)",
    "    Literal 'a (alias b)'",
    "    Identifier run_id (alias r)",
]


def test_the_parse_tree_is_read_with_names_aliases_and_children() -> None:
    root = _parse_tree([*TREE, "", "  "])  # trailing blank lines are not nodes
    select = root.children[0].children[0]
    literal, ident = select.children[0].children
    assert (root.kind, root.declared, select.kind) == ("SelectWithUnionQuery", 1, "SelectQuery")
    assert (literal.kind, literal.name, literal.alias) == ("Literal", "'a (alias b)'", "")  # a literal's text
    assert (ident.kind, ident.name, ident.alias) == ("Identifier", "run_id", "r")


@pytest.mark.parametrize(
    "lines",
    [
        [*TREE[:3], "     ExpressionList"],  # indented past its parent
        [*TREE, "SelectWithUnionQuery"],  # a second root
        [*TREE[:-1]],  # fewer children than declared
        [*TREE, "    Identifier x"],  # more children than declared
        [*TREE[:-1], "    Identifier(run_id)"],  # text glued to the kind
        [*TREE[:-1], "    ?"],  # not a node
        ["", " "],  # nothing
    ],
)
def test_a_tree_runcap_cannot_read_is_refused(lines: list[str]) -> None:
    with pytest.raises(
        QueryRefused, match=r"a query (whose parse tree runcap cannot read|ClickHouse returned no)"
    ):
        _parse_tree(lines)


# -- each refusal word for word, and the code it carries ------------------------------------------

NOT_A_READ = "/admin/sql runs one SELECT (or DESCRIBE)"
OUTSIDE = "/admin/sql reads the tables of the runcap database only"
WRITES_FILES = "INTO OUTFILE: /admin/sql does not write files"
OWN_FORMAT = "/admin/sql chooses the format of its answer"
SETTINGS = "a SETTINGS clause: the time, memory and result limits of /admin/sql are not the query's to change"


@pytest.mark.parametrize(
    ("sql", "params", "what", "code"),
    [
        (" \n ", None, "an empty query", 164),
        ("INSERT INTO runcap.spans (run_id) VALUES ('x')", None, f"the statement INSERT: {NOT_A_READ}", 164),
        ("SELECT count() FROM runcap.spans SETTINGS max_threads = 1", None, SETTINGS, 497),
        # (its tail is `FORMAT Native` then Set: only the check on the canonical text names it)
        ("DESCRIBE TABLE runcap.spans SETTINGS max_threads = 1", None, SETTINGS, 497),
        (
            "SELECT * FROM {t:Identifier}", {"t": "spans"},
            "the parameter {t:Identifier}: name tables in the SQL, not in parameters", 497,
        ),
        ("SELECT 1 INTO OUTFILE '/tmp/x'", None, WRITES_FILES, 497),
        ("SELECT 1 INTO OUTFILE '/tmp/x' FORMAT CSV", None, WRITES_FILES, 497),  # the first of the tail
        ("SELECT 1 FORMAT JSON", None, f"FORMAT JSON: {OWN_FORMAT}", 497),
        ("DESCRIBE TABLE runcap.spans INTO OUTFILE '/tmp/x'", None, WRITES_FILES, 497),
        ("DESCRIBE TABLE runcap.spans FORMAT CSV", None, f"FORMAT CSV: {OWN_FORMAT}", 497),
        (
            "SELECT * APPLY(toString) FROM runcap.spans", None,
            "the APPLY column transformer: call the function on the columns by name", 497,
        ),
        ("SELECT name FROM system.tables", None, f"the table system.tables: {OUTSIDE}", 497),
        ("SELECT * FROM spans AS s, other.t", None, f"the table other.t: {OUTSIDE}", 497),
        (
            "SELECT system.one.dummy", None,
            "the name system.one.dummy: a name of three or more parts must start with the runcap database",
            497,
        ),
        ("SELECT * FROM url('http://x', 'LineAsString')", None, f"the table function url(): {OUTSIDE}", 497),
        (
            "SELECT 1 AS `.b` FROM spans", None,
            "the quoted name `.b`: names with escapes (line breaks, quotes), dots or parentheses are not "
            "accepted",
            497,
        ),
        (
            "SELECT arrayReduce('file', [1])", None,
            "arrayReduce('file', ...): the aggregate function must be an allowed one, named in a string",
            497,
        ),
        ("SELECT 1 IN format(CSV, '1')", None, "the table function format() on the right of IN", 497),
    ],
)  # fmt: skip
def test_each_refusal_in_the_words_an_operator_reads(
    store: ClickHouseSink, sql: str, params: dict[str, Any] | None, what: str, code: int
) -> None:
    with pytest.raises(QueryRefused) as info:
        check(store, sql, params)
    assert (info.value.what, info.value.code, str(info.value)) == (what, code, f"refused: {what}")


# -- the walk behind the checks on the canonical text --------------------------------------------


def walk(store: ClickHouseSink, sql: str) -> None:
    """The walk alone over the engine's `EXPLAIN AST` of `sql` (over HTTP, with the `FORMAT Native`
    the driver appends): the second line of the guard, which the checks on the canonical text
    (the statement's keyword, a SETTINGS clause) answer first in `check_read_query`."""
    _Walk("runcap").root(_parse_tree([str(line) for line in store._read_column(f"EXPLAIN AST {sql}", None)]))


@pytest.mark.parametrize(
    ("sql", "what", "code"),
    [
        ("SELECT 1 SETTINGS max_threads = 1", SETTINGS, 497),  # a Set node in the SelectQuery
        ("SELECT 1 FORMAT JSON SETTINGS max_threads = 1", SETTINGS, 497),  # a Set in the tail, before FORMAT
        ("INSERT INTO runcap.spans (run_id) VALUES ('x')", f"the statement Insert: {NOT_A_READ}", 164),
        ("EXISTS TABLE runcap.spans", f"the statement ExistsTable: {NOT_A_READ}", 164),
        ("SHOW TABLES", f"the statement ShowTables: {NOT_A_READ}", 164),
    ],
)
def test_the_walk_alone_refuses_settings_and_statements(
    store: ClickHouseSink, sql: str, what: str, code: int
) -> None:
    with pytest.raises(QueryRefused) as info:
        walk(store, sql)
    assert (info.value.what, info.value.code) == (what, code)


def test_the_walk_takes_a_tree_without_the_drivers_format() -> None:
    """Embedded chdb's EXPLAIN AST has no `FORMAT Native` child: nothing after the body."""
    _Walk("runcap").root(_parse_tree(TREE))


@pytest.mark.parametrize(
    ("lines", "what"),
    [
        (
            [f"SelectWithUnionQuery {LONG} (children 1)", " Identifier x"],
            f"a query whose parse tree runcap cannot read (at {f'SelectWithUnionQuery {LONG}'[:120]!r})",
        ),
        (
            ["DescribeQuery (children 1)", " Identifier x"],
            "a DESCRIBE of something other than a table or a subquery",
        ),
        # kinds a newer ClickHouse may bring: refused until they are on NODE_KINDS or read in the tail
        ([*TREE[:-1], "    NewKindOfNode x"], "NewKindOfNode in a query"),
        (["SelectWithUnionQuery (children 2)", *TREE[1:], " NewKindOfTail"], "NewKindOfTail after the query"),
    ],
)
def test_the_walk_refuses_trees_no_read_has(lines: list[str], what: str) -> None:
    with pytest.raises(QueryRefused) as info:
        _Walk("runcap").root(_parse_tree(lines))
    assert (info.value.what, info.value.code) == (what, 497)


def test_the_database_is_runcaps_unless_told(store: ClickHouseSink) -> None:
    """`database` defaults to runcap: its tables pass by their full name, another's do not."""
    assert check_read_query("SELECT count() FROM runcap.spans", store._read_column).sql
    with pytest.raises(QueryRefused, match=r"the table other\.spans: .* the runcap database only"):
        check_read_query("SELECT count() FROM other.spans", store._read_column)


def test_a_tree_deeper_than_the_check_can_walk_is_refused(store: ClickHouseSink) -> None:
    """The walk recurses once per level of the tree: a tree deeper than Python's stack allows is
    refused, not an internal error. (The engine allows 1000 levels; the limit is lowered to a few
    hundred frames above this test's own, so 800 levels are too deep here.)"""
    sql = "SELECT " + "[" * 400 + "now()" + "]" * 400
    frames, frame = 0, sys._getframe()
    while frame is not None:
        frames, frame = frames + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(frames + 300)
    try:
        with pytest.raises(QueryRefused) as info:
            check(store, sql)
    finally:
        sys.setrecursionlimit(limit)
    assert (info.value.what, info.value.code) == ("a query nested deeper than runcap's check reads", 497)


@pytest.mark.parametrize(
    ("lines", "what"),
    [
        ([], "a query ClickHouse returned no parse tree for"),
        (["", " "], "a query ClickHouse returned no parse tree for"),  # then: glued, a child missing
        ([*TREE[:-1], f"    Identifier({LONG})"], f"    Identifier({LONG})"),
        ([*TREE[:-1], f"    Identifier {LONG} (children 1)"], f"    Identifier {LONG} (children 1)"),
        ([*TREE[:-1], f"    ?{LONG}"], f"    ?{LONG}"),  # not a node at all
    ],
)
def test_an_unreadable_tree_is_refused_quoting_at_most_120_characters(lines: list[str], what: str) -> None:
    with pytest.raises(QueryRefused) as info:
        _parse_tree(lines)
    if what.startswith(" "):  # the line it could not read
        what = f"a query whose parse tree runcap cannot read (at {what[:120]!r})"
    assert info.value.what == what


def test_one_trailing_blank_line_is_not_a_node() -> None:
    root = _parse_tree([*TREE, ""])
    assert root.children[0].children[0].children[0].declared == 2


@pytest.mark.parametrize(
    ("canonical", "what"),
    [
        ("SELECT 'abc", 'an unterminated quote in "\'abc"'),
        ("SELECT `ab\\`", "an unterminated quote in '`ab\\\\`'"),  # the escape takes the closing quote
        (f"SELECT '{LONG}", f"an unterminated quote in {chr(39) + LONG[:59]!r}"),  # 60 characters
    ],
)
def test_an_unterminated_quote_is_refused(canonical: str, what: str) -> None:
    """The canonical text always closes its quotes; the guard refuses one it cannot read all the same."""
    with pytest.raises(QueryRefused) as info:
        _mask_quoted(canonical)
    assert info.value.what == what


def test_a_literal_whose_text_ends_like_an_alias_is_kept_whole() -> None:
    """EXPLAIN AST of `SELECT ('b (alias c', 1)`: a Literal's text is its value, read to the end
    (arrayReduce's first argument is judged on it), never split at an `(alias ...)` inside it."""
    root = _parse_tree([*TREE[:4], "    Literal Tuple_('b (alias c', UInt64_1)", TREE[5]])
    literal = root.children[0].children[0].children[0].children[0]
    assert (literal.kind, literal.name, literal.alias) == ("Literal", "Tuple_('b (alias c', UInt64_1)", "")
