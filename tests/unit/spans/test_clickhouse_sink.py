"""ClickHouseSink against embedded chdb and against a ClickHouse HTTP endpoint (the chdb-backed
fixture server, through clickhouse-connect's HTTP client): schema, round trip, read-only queries,
and no duplicate rows when a batch is written again — also after a restart or a lost answer."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from proxy.spans.clickhouse import (
    EmbeddedStoreUnavailable,
    SpanQueryError,
    SpanStoreError,
    open_span_store,
)
from proxy.spans.migrate import apply_migrations
from proxy.spans.model import RunSnapshot, Span
from proxy.spans.sink import SinkError
from tests.support.clickhouse_http import ClickHouseHTTPServer

T0 = datetime(2026, 3, 31, 23, 59, 59, 123456, tzinfo=UTC)  # batches straddle a month: 2 partitions

# DESIGN.md, "Span store": the column contract of runcap.spans.
SPAN_CONTRACT = [
    ("run_id", "String"),
    ("trace_id", "String"),
    ("span_id", "String"),
    ("parent_span_id", "String"),
    ("kind", "LowCardinality(String)"),
    ("step", "UInt32"),
    ("started_at", "DateTime64(6, 'UTC')"),
    ("duration_ms", "Float64"),
    ("ttft_ms", "Nullable(Float64)"),
    ("task", "LowCardinality(String)"),
    ("provider", "LowCardinality(String)"),
    ("model", "LowCardinality(String)"),
    ("endpoint", "LowCardinality(String)"),
    ("status_code", "UInt16"),
    ("outcome", "LowCardinality(String)"),
    ("error", "String"),
    ("input_tokens", "UInt64"),
    ("output_tokens", "UInt64"),
    ("cache_read_tokens", "UInt64"),
    ("cache_write_tokens", "UInt64"),
    ("reasoning_tokens", "UInt64"),
    ("cost_usd", "Decimal(18, 9)"),
    ("price_known", "Bool"),
    ("tool_name", "String"),
    ("tool_call_id", "String"),
    ("args_hash", "String"),
    ("result_hash", "String"),
    ("idempotency_key", "String"),
    ("request_hash", "String"),
    ("response_hash", "String"),
    ("attributes", "Map(LowCardinality(String), String)"),
    ("parent_run_id", "String"),
    ("root_run_id", "String"),
    # an extra column (migration 0003): the span's events
    (
        "events",
        "Array(Tuple(\n    name String,\n    at DateTime64(6, 'UTC'),\n    attributes Map(String, String)))",
    ),
]
RUN_COLUMNS = [
    "run_id", "task", "started_at", "updated_at", "status", "steps", "tool_calls", "input_tokens",
    "output_tokens", "cost_usd", "max_usd", "max_tokens", "max_steps", "max_tool_calls", "deadline",
    "parent_run_id", "root_run_id",
]  # fmt: skip


class Store:
    """One backend under test: how to open the sink, restart the store, and count rows."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.server = ClickHouseHTTPServer(tmp_path / "server") if kind == "http" else None
        self.url = self.server.start() if self.server else None
        self.sink = self.open()

    def open(self):
        return open_span_store(self.url, self.tmp_path / "data")

    def restart(self) -> None:
        """A new engine session on the same data: chdb reopened, or the server restarted."""
        if self.server is not None:
            self.server.stop()
            self.server.start()
        else:
            self.sink.close()
            self.sink = self.open()

    def count(self, sql: str) -> int:
        return int(self.sink.query(sql, None)[1][0][0])

    def close(self) -> None:
        self.sink.close()
        if self.server is not None:
            self.server.stop()


@pytest.fixture(params=["chdb", "http"])
def store(request, tmp_path):
    store = Store(request.param, tmp_path)
    yield store
    store.close()


def make_batch(n: int, run: str = "run-a", offset: int = 0) -> tuple[list[Span], list[RunSnapshot]]:
    spans = [
        Span(
            run_id=run,
            kind="model" if i % 2 == 0 else "tool",
            step=i // 2 + 1,
            started_at=T0 + timedelta(milliseconds=i),
            duration_ms=12.5,
            ttft_ms=3.25 if i % 2 == 0 else None,
            task="refunds",
            provider="openai",
            model="gpt-4o-mini",
            endpoint="chat/completions",
            status_code=200,
            input_tokens=1000 + i,
            output_tokens=20,
            cost_usd=Decimal("0.001250000"),
            price_known=i % 3 != 0,
            tool_name="refund" if i % 2 else "",
            args_hash=f"{i % 4:064x}",
            attributes={"i": str(i + offset)},
        )
        for i in range(n)
    ]
    runs = [
        RunSnapshot(
            run_id=run,
            task="refunds",
            started_at=T0,
            updated_at=T0 + timedelta(seconds=offset + 1),
            status="active",
            steps=n // 2,
            tool_calls=n // 2,
            input_tokens=1000 * n,
            output_tokens=20 * n,
            cost_usd=Decimal("0.00125") * n,
            max_usd=Decimal("5"),
            max_tokens=None,
            max_steps=50,
            max_tool_calls=None,
            deadline=T0 + timedelta(minutes=10),
        )
    ]
    return spans, runs


def test_schema_matches_the_contract_and_migrations_are_idempotent(store):
    # DESCRIBE, not system.columns: the read path answers runcap's tables only (sqlguard.py).
    spans = [(row[0], row[1]) for row in store.sink.query("DESCRIBE TABLE runcap.spans", None)[1]]
    runs = [row[0] for row in store.sink.query("DESCRIBE TABLE runcap.runs", None)[1]]
    assert spans == SPAN_CONTRACT
    assert runs == RUN_COLUMNS
    versions = "SELECT DISTINCT version FROM runcap.schema_migrations ORDER BY version"
    assert store.sink.query(versions, None)[1] == [[1], [2], [3]]
    # A second start-up finds nothing to do and records nothing twice.
    store.sink.close()
    store.sink = store.open()
    assert apply_migrations(store.sink._writer, "runcap") == []
    assert store.count("SELECT count() FROM runcap.schema_migrations") == 3


def test_round_trip_with_json_friendly_values(store):
    spans, runs = make_batch(4)
    store.sink.write(spans, runs, "batch-1")
    columns, rows = store.sink.query(
        "SELECT span_id, started_at, cost_usd, ttft_ms, price_known, attributes, input_tokens "
        "FROM runcap.spans WHERE run_id = {run:String} AND step = {step:UInt32} ORDER BY started_at",
        {"run": "run-a", "step": 1},
    )
    assert columns == [
        "span_id",
        "started_at",
        "cost_usd",
        "ttft_ms",
        "price_known",
        "attributes",
        "input_tokens",
    ]
    assert rows == [
        [spans[0].span_id, "2026-03-31T23:59:59.123456+00:00", "0.001250000", 3.25, False, {"i": "0"}, 1000],
        [spans[1].span_id, "2026-03-31T23:59:59.124456+00:00", "0.001250000", None, True, {"i": "1"}, 1001],
    ]
    _, run_rows = store.sink.query("SELECT max_usd, max_tokens, deadline FROM runcap.runs", None)
    assert run_rows == [["5.000000000", None, "2026-04-01T00:09:59.123456+00:00"]]


def test_tree_columns_round_trip_through_both_inserts(store):
    """A child's spans and run rows keep their parent and root, through the object insert and
    the JSON-lines insert the shipper uses; a root's rows carry '' and its own id."""
    from proxy.spans.records import StepRecord, encode_step

    spans, runs = make_batch(2, run="child-1")
    for record in (*spans, *runs):
        record.parent_run_id, record.root_run_id = "planner", "planner"
    store.sink.write(spans, runs, "batch-1")
    root_spans, root_runs = make_batch(2, run="planner")
    record = StepRecord(memoryview(b"".join(encode_step(root_spans, root_runs, []))))
    store.sink.write_jsonl(bytes(record.spans_jsonl), bytes(record.runs_jsonl), "batch-2")
    for table in ("spans", "runs"):
        _, rows = store.sink.query(
            f"SELECT DISTINCT run_id, parent_run_id, root_run_id FROM runcap.{table} ORDER BY run_id", None
        )
        assert rows == [["child-1", "planner", "planner"], ["planner", "", "planner"]], table


def test_rows_written_before_run_trees_read_as_roots(tmp_path):
    """Rows inserted under the first schema only (before migration 0002) read, after it, as
    roots of their own: root_run_id = run_id, parent_run_id = ''."""
    import clickhouse_connect

    from proxy.spans.clickhouse import EMBEDDED_SUBDIR
    from proxy.spans.migrate import load_migrations

    path = tmp_path / "data" / EMBEDDED_SUBDIR
    path.mkdir(parents=True)
    old = clickhouse_connect.get_client(interface="chdb", path=str(path))
    assert apply_migrations(old, "runcap", load_migrations()[:1]) == [1]
    spans, runs = make_batch(2, run="old-run")
    span_columns = [c for c, _ in SPAN_CONTRACT if c not in ("parent_run_id", "root_run_id", "events")]
    old.insert("runcap.spans", [[getattr(s, c) for c in span_columns] for s in spans],
               column_names=span_columns)  # fmt: skip
    old.insert("runcap.runs", [[getattr(r, c) for c in RUN_COLUMNS[:-2]] for r in runs],
               column_names=RUN_COLUMNS[:-2])  # fmt: skip
    old.close()
    sink = open_span_store(None, tmp_path / "data")  # applies 0002 and 0003
    try:
        for table in ("spans", "runs"):
            sql = f"SELECT DISTINCT run_id, parent_run_id, root_run_id FROM runcap.{table}"
            _, rows = sink.query(sql, None)
            assert rows == [["old-run", "", "old-run"]], table
    finally:
        sink.close()


def test_span_events_are_kept_through_both_write_paths(store):
    """A span's events (a policy's verdict, an approval) land in the `events` column whole, from
    typed inserts and from the WAL's JSON lines alike; a span without events has an empty array."""
    from proxy.spans.model import SpanEvent
    from proxy.spans.records import StepRecord, encode_step

    spans, _ = make_batch(3)
    spans[1].events = [
        SpanEvent("policy.decision", T0 + timedelta(microseconds=7), {"effect": "approve", "rule": "0"}),
        SpanEvent("approval.decided", T0 + timedelta(seconds=3), {"approval.state": "approved"}),
    ]
    spans[2].events = [SpanEvent("policy.decision", T0, {"effect": "deny"})]
    store.sink.write(spans[:2], [], "typed")
    record = StepRecord(memoryview(b"".join(encode_step(spans[2:], [], []))))
    store.sink.write_jsonl(bytes(record.spans_jsonl), b"", "jsonl")
    _, rows = store.sink.query(
        "SELECT span_id, events.name, events.at, events.attributes FROM runcap.spans ORDER BY started_at",
        None,
    )
    assert rows == [
        [spans[0].span_id, [], [], []],
        [
            spans[1].span_id,
            ["policy.decision", "approval.decided"],
            ["2026-03-31T23:59:59.123463+00:00", "2026-04-01T00:00:02.123456+00:00"],
            [{"effect": "approve", "rule": "0"}, {"approval.state": "approved"}],
        ],
        [spans[2].span_id, ["policy.decision"], ["2026-03-31T23:59:59.123456+00:00"], [{"effect": "deny"}]],
    ]


def test_a_record_written_before_span_events_ships_whole(store):
    """A WAL record of version 2 (spans without `events`, written by the runcap before the
    upgrade) is read with empty events, and its JSON lines go into ClickHouse as they are read."""
    import struct

    import orjson

    from proxy.spans.records import StepRecord, encode_step

    spans, runs = make_batch(2)
    _, span_lines, run_lines, meta = encode_step(spans, runs, [])
    # What version 2 wrote: span rows without events and the run tree, run rows without the tree.
    old_lines, old_runs = (
        b"".join(orjson.dumps(orjson.loads(line)[:-drop], option=orjson.OPT_APPEND_NEWLINE)
                 for line in block.splitlines())
        for block, drop in ((span_lines, 3), (run_lines, 2))
    )  # fmt: skip
    assert old_lines.count(b"[]") == 0
    old_head = struct.pack("<B3xIIIIII", 2, 2, 1, 0, len(old_lines), len(old_runs), len(meta))
    record = StepRecord(memoryview(b"".join([old_head, old_lines, old_runs, meta])))
    assert [s.events for s in record.spans()] == [[], []]
    assert [s.span_id for s in record.spans()] == [s.span_id for s in spans]
    store.sink.write_jsonl(bytes(record.spans_jsonl), bytes(record.runs_jsonl), "old")
    assert store.count("SELECT count() FROM runcap.spans WHERE empty(events)") == 2


def test_same_batch_twice_adds_no_rows(store):
    spans, runs = make_batch(1500)
    store.sink.write(spans, runs, "batch-1")
    store.sink.write(spans, runs, "batch-1")  # the pipeline's retry of a batch that did land
    assert store.count("SELECT count() FROM runcap.spans") == 1500
    assert store.count("SELECT count() FROM runcap.runs") == 1

    # A retry after the store restarted (a new chdb session on the same directory, or a server
    # restart) is still recognised: the deduplication window lives with the table's data.
    store.restart()
    store.sink.write(spans, runs, "batch-1")
    assert store.count("SELECT count() FROM runcap.spans") == 1500
    assert store.count("SELECT count() FROM runcap.runs") == 1

    # Another batch is new data, even with identical rows: the token, not the content, decides.
    store.sink.write(spans[:10], runs, "batch-2")
    assert store.count("SELECT count() FROM runcap.spans") == 1510
    assert store.count("SELECT count() FROM runcap.runs") == 2


def jsonl_batch(n: int, run: str = "run-a", offset: int = 0) -> tuple[bytes, bytes]:
    """A batch as the shipper sends it: the JSON lines of a WAL record."""
    from proxy.spans.records import StepRecord, encode_step

    record = StepRecord(memoryview(b"".join(encode_step(*make_batch(n, run, offset), []))))
    return bytes(record.spans_jsonl), bytes(record.runs_jsonl)


def test_a_resumed_batch_fills_in_what_is_missing_and_adds_nothing_twice(store):
    """A batch in flight when the shipper died is sent again with `resumed`: rows already in a
    table are not inserted again (whatever the token), the missing ones are."""
    spans, runs = jsonl_batch(6)
    store.sink.write_jsonl(spans[: spans.index(b"\n") + 1], b"", "seg:1:9")  # one span landed
    store.restart()
    for _ in range(2):  # resumed twice: a second crash, or a retry after a lost answer
        store.sink.write_jsonl(spans, runs, "seg:1:9", resumed=True)
        assert store.count("SELECT count() FROM runcap.spans") == 6
        assert store.count("SELECT count() FROM runcap.runs") == 1
        store.restart()
    # an older snapshot of a run than the stored one is not added back
    _, newer = jsonl_batch(2, offset=5)
    store.sink.write_jsonl(b"", newer, "seg:2:3")
    store.sink.write_jsonl(b"", runs, "seg:1:9", resumed=True)
    assert store.count("SELECT count() FROM runcap.runs") == 2


def test_a_batch_whose_token_outlived_its_part_is_not_lost_when_resumed(tmp_path):
    """`kill -9` of chdb's process between the two steps of a commit — the token into the
    table's deduplication log, then the part renamed into place — leaves the token and no part
    (the engine deletes the temporary part at start-up). A repeat under that token is dropped;
    the shipper resends such a batch with `resumed`, which brings its rows in. The crash's state
    on disk is made here by removing the committed parts and keeping the deduplication logs."""
    import shutil

    from proxy.spans.clickhouse import EMBEDDED_SUBDIR

    store = Store("chdb", tmp_path)
    try:
        spans, runs = jsonl_batch(4)
        store.sink.write_jsonl(spans, runs, "seg:1:9")
        store.sink.close()
        for table in ("spans", "runs"):
            data = (tmp_path / "data" / EMBEDDED_SUBDIR / "data" / "runcap" / table).resolve()
            parts = [d for d in data.iterdir() if d.is_dir() and d.name[:6].isdigit()]
            assert parts and (data / "deduplication_logs").is_dir()
            for part in parts:
                shutil.rmtree(part)
        store.sink = store.open()
        store.sink.write_jsonl(spans, runs, "seg:1:9")  # the plain repeat: dropped by the engine
        assert store.count("SELECT count() FROM runcap.spans") == 0
        store.sink.write_jsonl(spans, runs, "seg:1:9", resumed=True)
        assert store.count("SELECT count() FROM runcap.spans") == 4
        assert store.count("SELECT count() FROM runcap.runs") == 1
    finally:
        store.close()


def test_latest_run_state_is_read_with_argmax(store):
    for version in range(3):
        spans, runs = make_batch(2 * (version + 1), offset=version)
        runs[0].status = "completed" if version == 2 else "active"
        store.sink.write(spans[-2:], runs, f"batch-{version}")
    _, rows = store.sink.query(
        "SELECT run_id, argMax(status, updated_at), argMax(steps, updated_at), count() "
        "FROM runcap.runs GROUP BY run_id",
        None,
    )
    assert rows[0][:3] == ["run-a", "completed", 3]


def test_query_is_read_only_and_reports_clickhouse_errors(store):
    spans, runs = make_batch(2)
    store.sink.write(spans, runs, "batch-1")
    for sql in (
        "INSERT INTO runcap.spans (run_id) VALUES ('x')",
        "DROP TABLE runcap.spans",
        "ALTER TABLE runcap.spans DELETE WHERE 1",
    ):
        with pytest.raises(SpanQueryError) as info:
            store.sink.query(sql, None)
        assert info.value.code == 164  # READONLY
    with pytest.raises(SpanQueryError) as info:
        store.sink.query("SELECT no_such_column FROM runcap.spans", None)
    assert info.value.code == 47  # UNKNOWN_IDENTIFIER
    # the read connection still works after errors, and writes were untouched
    assert store.count("SELECT count() FROM runcap.spans;") == 2
    store.sink.write(*make_batch(2, run="run-b"), "batch-2")
    assert store.count("SELECT count() FROM runcap.spans") == 4


def test_server_lost_answer_then_retry_lands_once(tmp_path):
    """The insert commits but its answer never arrives (twice: clickhouse-connect resends once on
    a cut connection). The sink reports failure; the pipeline's retry adds nothing."""
    store = Store("http", tmp_path)
    try:
        spans, runs = make_batch(1000)
        store.server.drop_responses_after_commit(2)
        with pytest.raises(SinkError, match="batch-1"):
            store.sink.write(spans, runs, "batch-1")
        assert store.server.query("SELECT count() FROM runcap.spans") == [(1000,)]
        sent = [
            r for r in store.server.requests if r.get("query", "").startswith("INSERT INTO `runcap`.spans")
        ]
        assert [r["status"] for r in sent] == ["dropped", "dropped"]
        assert sent[0]["params"]["insert_deduplication_token"] == "batch-1:spans"

        store.sink.write(spans, runs, "batch-1")
        assert store.server.query("SELECT count() FROM runcap.spans") == [(1000,)]
        assert store.server.query("SELECT count() FROM runcap.runs") == [(1,)]
    finally:
        store.close()


def test_server_down_is_a_sink_error_and_recovers(tmp_path):
    store = Store("http", tmp_path)
    try:
        spans, runs = make_batch(10)
        store.server.set_down(True)
        with pytest.raises(SinkError, match="clickhouse"):
            store.sink.write(spans, runs, "batch-1")
        with pytest.raises(SpanStoreError, match="unreachable") as info:
            store.sink.query("SELECT 1", None)
        assert not isinstance(info.value, SpanQueryError)
        store.server.set_down(False)
        store.sink.write(spans, runs, "batch-1")
        assert store.count("SELECT count() FROM runcap.spans") == 10
    finally:
        store.close()


def test_custom_database_name(tmp_path):
    sink = open_span_store(None, tmp_path, database="runcap_test")
    try:
        sink.write(*make_batch(3), "batch-1")
        assert sink.query("SELECT count() FROM spans", None)[1] == [[3]]  # reader's default database
        assert sink.query("SELECT count() FROM runcap_test.runs", None)[1] == [[1]]
    finally:
        sink.close()


def test_embedded_without_chdb_names_the_extra_and_the_setting(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "chdb", None)  # as if chdb were not installed
    with pytest.raises(EmbeddedStoreUnavailable) as info:
        open_span_store(None, tmp_path)
    assert "runcap[embedded]" in str(info.value)
    assert "RUNCAP_CLICKHOUSE_URL" in str(info.value)
