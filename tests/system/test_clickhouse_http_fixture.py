"""The ClickHouse HTTP fixture works for clickhouse-connect's own HTTP client: start-up, DDL,
compressed Native inserts, parameterised Native selects, settings in the URL, errors, faults."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from tests.support.clickhouse_http import ClickHouseHTTPServer

COLUMNS = ["id", "name", "at", "cost", "ok", "attrs"]
TYPES = [
    "UInt64",
    "LowCardinality(String)",
    "DateTime64(6, 'UTC')",
    "Decimal(18, 9)",
    "Bool",
    "Map(String, String)",
]


@pytest.fixture
def server(tmp_path):
    with ClickHouseHTTPServer(tmp_path / "ch") as srv:
        yield srv


def _client(server: ClickHouseHTTPServer, **kwargs):
    # The URL names database runcap, which does not exist yet: connect without it.
    return clickhouse_connect.get_client(dsn=server.url.rsplit("/", 1)[0], **kwargs)


def _create_table(client) -> None:
    client.command("CREATE DATABASE IF NOT EXISTS runcap")
    client.command(
        "CREATE TABLE runcap.t (id UInt64, name LowCardinality(String), at DateTime64(6, 'UTC'), "
        "cost Decimal(18, 9), ok Bool, attrs Map(String, String)) ENGINE = MergeTree ORDER BY id "
        "SETTINGS non_replicated_deduplication_window = 100"
    )


def _rows(n: int, start: int = 0) -> list[list[object]]:
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    return [
        [i, f"n{i % 3}", at, Decimal("0.000000123") * i, i % 2 == 0, {"k": str(i)}]
        for i in range(start, start + n)
    ]


@pytest.mark.parametrize("compress", ["lz4", "zstd", "gzip", False])
def test_native_insert_and_parameterised_select(server, compress):
    client = _client(server, compress=compress)
    assert client.server_version == server.query("SELECT version()")[0][0]
    _create_table(client)
    summary = client.insert("runcap.t", _rows(2000), column_names=COLUMNS, column_type_names=TYPES)
    assert summary.written_rows == 2000
    assert server.query("SELECT count(), sum(id) FROM runcap.t") == [(2000, sum(range(2000)))]

    result = client.query(
        "SELECT id, name, at, cost, ok, attrs FROM runcap.t WHERE id = {id:UInt64} OR name = {name:String} "
        "ORDER BY id LIMIT 2",
        parameters={"id": 7, "name": "n0"},
    )
    assert result.column_names == tuple(COLUMNS)
    first, second = result.result_rows
    assert first[0] == 0 and second[0] == 3
    assert second[3] == Decimal("0.000000369") and second[5] == {"k": "3"}
    assert second[2].replace(tzinfo=UTC) == datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    insert_requests = [r for r in server.requests if r.get("query", "").startswith("INSERT")]
    assert insert_requests, "the insert went through the HTTP fixture"


def test_settings_in_url_reach_the_engine(server):
    """insert_deduplication_token travels as a URL parameter; the engine deduplicates with it."""
    client = _client(server)
    _create_table(client)
    for token in ("batch-1", "batch-1", "batch-2"):  # the second batch-1 is a duplicate
        client.insert(
            "runcap.t",
            _rows(10),
            column_names=COLUMNS,
            column_type_names=TYPES,
            settings={"insert_deduplication_token": token},
        )
    assert server.query("SELECT count() FROM runcap.t") == [(20,)]
    assert client.command("SELECT getSetting('max_threads')", settings={"max_threads": 3}) == 3
    # settings of one request do not leak into the next
    assert client.command("SELECT getSetting('max_threads')") != 3


def test_errors_surface_as_database_errors(server):
    client = _client(server)
    with pytest.raises(DatabaseError) as info:
        client.query("SELECT * FROM runcap.missing")
    assert info.value.code == 81  # UNKNOWN_DATABASE, from X-ClickHouse-Exception-Code
    assert "UNKNOWN_DATABASE" in str(info.value)
    with pytest.raises(DatabaseError, match="SYNTAX_ERROR"):
        client.command("SELEKT 1")
    with pytest.raises(DatabaseError, match="AUTHENTICATION_FAILED"):
        clickhouse_connect.get_client(
            host="127.0.0.1", port=server.port, username="default", password="wrong"
        )


def test_down_restart_and_dropped_response(server):
    client = _client(server)
    _create_table(client)
    server.set_down(True)
    with pytest.raises(OperationalError):
        client.insert("runcap.t", _rows(5), column_names=COLUMNS, column_type_names=TYPES)
    assert server.query("SELECT count() FROM runcap.t") == [(0,)]
    server.set_down(False)

    # clickhouse-connect resends an insert once when the connection closes before the answer;
    # both attempts commit here, and the table's deduplication window drops the identical resend.
    server.drop_responses_after_commit(2)
    with pytest.raises(OperationalError):
        client.insert("runcap.t", _rows(5), column_names=COLUMNS, column_type_names=TYPES)
    assert [r["status"] for r in server.requests[-2:]] == ["dropped", "dropped"]
    assert server.query("SELECT count() FROM runcap.t") == [(5,)], "committed although unanswered"

    port = server.port
    server.stop()
    with pytest.raises(OperationalError):
        client.command("SELECT 1")
    server.start()
    assert server.port == port
    assert client.command("SELECT count() FROM runcap.t") == 5
