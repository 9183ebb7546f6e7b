"""The ClickHouse end of the span path: `ClickHouseSink` writes span and run batches (in the
shipper process, proxy/spans/shipper.py) and answers read-only SQL (the shipper's socket for
`POST /admin/sql` and the read CLI, or the CLI directly). Every read passes the guard of
proxy/spans/sqlguard.py first: one SELECT of runcap's tables with pure functions, nothing else.

One code path, two backends, both through clickhouse-connect:

* a ClickHouse server over HTTP (`RUNCAP_CLICKHOUSE_URL=http(s)://user:pass@host:8123/db`);
* embedded chdb under `{data_dir}/clickhouse`, through clickhouse-connect's chdb client
  (`interface="chdb"`, clickhouse-connect >= 1.x), which runs the same insert/query code over an
  in-process engine.

The shipper's batches go in as the WAL holds them, JSON lines of values (`write_jsonl`, `FORMAT
JSONCompactEachRow`: ClickHouse parses them, no Python per value); `write` takes record objects in
column-oriented, typed Native inserts. A retried batch never duplicates rows: each insert carries
`insert_deduplication_token = <batch_id>:<table>` — the shipper's batch id is made of the batch's
WAL position, `{segment}:{first offset}:{last offset}` — and the tables keep a deduplication
window (see migrations/0001_init.sql), so the engine drops a batch it has already committed — on
chdb and on a server, across restarts.

chdb hosts one engine per process, bound to one directory. Any number of connections to that
directory may be open in the process (they share the engine); opening a different directory while
they are open raises, and another process cannot open the directory at all. So the sink is the
single owner of the embedded store: it holds a writer connection and a read-only connection
(readonly=2) on the same engine, each behind its own lock, and everything else — `/admin/sql` and
the read CLI through the shipper's socket — reads through `ClickHouseSink.query`.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from ipaddress import IPv4Address, IPv6Address
from operator import attrgetter
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit
from uuid import UUID

import clickhouse_connect
import orjson
from clickhouse_connect.driver.exceptions import ClickHouseError, OperationalError

from proxy.config import redact_url
from proxy.spans.migrate import apply_migrations
from proxy.spans.model import RunSnapshot, Span
from proxy.spans.records import RUN_FIELDS, SPAN_FIELDS, json_lines
from proxy.spans.sink import SinkError
from proxy.spans.sqlguard import QueryRefused, check_read_query

# Column names, in `runcap.spans` order, with the ClickHouse types the inserts are encoded as.
SPAN_COLUMNS: tuple[tuple[str, str], ...] = (
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
    ("events", "Array(Tuple(name String, at DateTime64(6, 'UTC'), attributes Map(String, String)))"),
    ("parent_run_id", "String"),
    ("root_run_id", "String"),
)

RUN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("run_id", "String"),
    ("task", "LowCardinality(String)"),
    ("started_at", "DateTime64(6, 'UTC')"),
    ("updated_at", "DateTime64(6, 'UTC')"),
    ("status", "LowCardinality(String)"),
    ("steps", "UInt32"),
    ("tool_calls", "UInt32"),
    ("input_tokens", "UInt64"),
    ("output_tokens", "UInt64"),
    ("cost_usd", "Decimal(18, 9)"),
    ("max_usd", "Nullable(Decimal(18, 9))"),
    ("max_tokens", "Nullable(UInt64)"),
    ("max_steps", "Nullable(UInt32)"),
    ("max_tool_calls", "Nullable(UInt32)"),
    ("deadline", "Nullable(DateTime64(6, 'UTC'))"),
    ("parent_run_id", "String"),
    ("root_run_id", "String"),
)

EMBEDDED_SUBDIR = "clickhouse"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class SpanStoreError(Exception):
    """The span store cannot be opened or used as configured."""


class EmbeddedStoreUnavailable(SpanStoreError):
    """No RUNCAP_CLICKHOUSE_URL and chdb is not installed."""


class SpanQueryError(SpanStoreError):
    """ClickHouse rejected a read query; `code` is ClickHouse's exception code (0 when unknown)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class _Table:
    """One table's typed, column-oriented insert: names, types and how to read each column off
    the record objects."""

    def __init__(self, database: str, name: str, columns: tuple[tuple[str, str], ...]) -> None:
        self.name = name
        self.qualified = f"{_quote_identifier(database)}.{name}"
        self.column_names = [column for column, _ in columns]
        self.column_types = [ctype for _, ctype in columns]
        self._getters = [attrgetter(column) for column in self.column_names]

    def columns(self, records: Sequence[object]) -> list[list[Any]]:
        return [list(map(getter, records)) for getter in self._getters]


class ClickHouseSink:
    """SpanSink for ClickHouse (server or embedded chdb), plus the read interface of the store.

    `writer` and `reader` are clickhouse-connect clients on the same store; `reader` should be
    read-only (readonly=2). Build one with `open_span_store`, which also applies migrations.
    """

    name = "clickhouse"

    def __init__(self, writer: Any, reader: Any, database: str = "runcap", location: str = "") -> None:
        self.database = database
        self.location = location  # for messages: the server URL without password, or the directory
        self._writer = writer
        self._reader = reader
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._spans = _Table(database, "spans", SPAN_COLUMNS)
        self._runs = _Table(database, "runs", RUN_COLUMNS)
        self._closed = False
        # In the tokens of resumed batches (`write_jsonl`): never one a dead shipper may have left
        self._session = secrets.token_hex(8)
        # Deduplication on, whatever the user profile says: `insert_deduplicate` up to ClickHouse
        # 25.x, `deduplicate_insert` (which supersedes it) where the server has it.
        self._dedup_settings: dict[str, Any] = {"insert_deduplicate": 1}
        if "deduplicate_insert" in (getattr(writer, "server_settings", None) or {}):
            self._dedup_settings["deduplicate_insert"] = "enable"

    @contextlib.contextmanager
    def _batch(self, batch_id: str) -> Iterator[None]:
        """One batch's write: a deduplication token, under the write lock, on an open sink; any
        failure inside is a `SinkError` naming the batch."""
        if not batch_id:
            raise SinkError("clickhouse: a batch needs a non-empty batch_id (it is the deduplication token)")
        with self._write_lock:
            if self._closed:
                raise SinkError(f"clickhouse sink for {self.location} is closed")
            try:
                yield
            except Exception as ex:
                raise SinkError(f"clickhouse ({self.location}): batch {batch_id} not written: {ex}") from ex

    def write(self, spans: Sequence[Span], runs: Sequence[RunSnapshot], batch_id: str) -> None:
        """Insert one batch; writing the same `batch_id` again adds no rows (per-table tokens)."""
        with self._batch(batch_id):
            for table, records in ((self._spans, spans), (self._runs, runs)):
                if records:
                    self._insert(table, records, batch_id)

    def write_jsonl(self, spans: bytes, runs: bytes, batch_id: str, *, resumed: bool = False) -> None:
        """Insert one batch given as JSON lines of values (`JSONCompactEachRow`, in the order of
        records.SPAN_FIELDS / RUN_FIELDS), as the WAL holds them (proxy/spans/records.py):
        ClickHouse parses them, no Python per value. The same per-table deduplication tokens as
        `write`.

        `resumed`: the batch was in flight when the shipper died, so its token may be on record
        without its rows — a non-replicated MergeTree writes the token to its deduplication log
        just before it commits the part, and a `kill -9` between the two leaves the token and
        no part, so a repeat under that token would be dropped and the batch lost. Then the rows
        already in the table are left out and the rest goes in under a token of this sink's own
        (`_missing_lines`)."""
        with self._batch(batch_id):
            for table, columns, data in (
                (self._spans, SPAN_FIELDS, spans),
                (self._runs, RUN_FIELDS, runs),
            ):
                token = f"{batch_id}:{table.name}"
                if data and resumed:
                    data = self._missing_lines(table, data)
                    token = f"{token}:{self._session}"
                if data:
                    self._writer.raw_insert(
                        table.qualified,
                        columns,
                        data,
                        settings={
                            "insert_deduplication_token": token,
                            **self._dedup_settings,
                            # RFC 3339 times with a zone (`...Z`)
                            "date_time_input_format": "best_effort",
                            # span events are `[name, at, attributes]` arrays, not objects
                            "input_format_json_named_tuples_as_objects": 0,
                            # a batch of a few MB is parsed by several threads, not one
                            "min_chunk_bytes_for_parallel_parsing": 1 << 20,
                        },
                        fmt="JSONCompactEachRow",
                    )

    def _missing_lines(self, table: _Table, data: bytes) -> bytes:
        """The lines of `data` whose row is not in `table` yet: a span by (run_id, span_id), a
        run snapshot by (run_id, updated_at) — an older snapshot than the one stored is harmless
        (ReplacingMergeTree keeps the newest)."""
        key_field = "span_id" if table is self._spans else "updated_at"
        fields = SPAN_FIELDS if table is self._spans else RUN_FIELDS
        run_at, key_at = fields.index("run_id"), fields.index(key_field)
        lines = json_lines(data)
        keys = []
        for line in lines:
            values = orjson.loads(line)
            key = values[key_at]
            if key_field == "updated_at":  # as ClickHouse stores it: microseconds since the epoch
                moment = datetime.fromisoformat(key)
                key = (moment - _EPOCH) // timedelta(microseconds=1)
            keys.append((values[run_at], key))
        expression = "span_id" if key_field == "span_id" else "toUnixTimestamp64Micro(updated_at)"
        stored = self._writer.query(
            f"SELECT run_id, {expression} FROM {table.qualified} WHERE run_id IN {{runs:Array(String)}}",
            parameters={"runs": sorted({run for run, _ in keys})},
        ).result_rows
        present = {(run, key) for run, key in stored}
        return b"".join(line + b"\n" for line, key in zip(lines, keys, strict=True) if key not in present)

    def _insert(self, table: _Table, records: Sequence[object], batch_id: str) -> None:
        self._writer.insert(
            table.qualified,
            table.columns(records),
            column_names=table.column_names,
            column_type_names=table.column_types,
            column_oriented=True,
            settings={
                # the engine remembers this token in the table's deduplication window and drops a
                # repeat, also one that follows a commit whose answer was lost
                "insert_deduplication_token": f"{batch_id}:{table.name}",
                **self._dedup_settings,
            },
        )

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[list[Any]]]:
        """Run read-only SQL (`{name:Type}` parameters) and return (column names, rows), with
        JSON-friendly values: Decimal -> str, datetime/date -> ISO 8601 string, UUID/IP -> str.

        Every query passes `check_read_query` first (one SELECT of this database's tables, pure
        functions, no SETTINGS: proxy/spans/sqlguard.py) and what runs is its canonical form.
        Raises SpanQueryError when the guard refuses the query (164 READONLY for a statement that
        is not a read, 497 ACCESS_DENIED otherwise; the cause is the guard's QueryRefused) or
        ClickHouse rejects it (with ClickHouse's code), SpanStoreError when the store cannot be
        reached."""
        with self._read_lock:
            if self._closed:
                raise SpanStoreError(f"span store {self.location} is closed")
            try:
                checked = check_read_query(sql, self._read_column, params=params, database=self.database)
            except QueryRefused as ex:
                raise SpanQueryError(str(ex), ex.code) from ex
            result = self._read(checked.sql, checked.params)
            return list(result.column_names), [[_jsonable(v) for v in row] for row in result.result_rows]

    def _read(self, sql: str, params: dict[str, Any] | None) -> Any:
        """One statement on the read-only connection (the caller holds the read lock)."""
        try:
            return self._reader.query(sql, parameters=params or None)
        except OperationalError as ex:
            if not ex.code:  # transport failure, not an answer from ClickHouse
                raise SpanStoreError(f"span store {self.location} unreachable: {ex}") from ex
            raise SpanQueryError(str(ex), ex.code) from ex
        except ClickHouseError as ex:
            raise SpanQueryError(str(ex), getattr(ex, "code", None) or 0) from ex

    def _read_column(self, sql: str, params: Mapping[str, Any] | None) -> list[Any]:
        """The guard's `run_explain`: the first column of a statement's rows."""
        return [row[0] for row in self._read(sql, dict(params or {})).result_rows]

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            if self._closed:
                return
            self._closed = True
            for client in (self._reader, self._writer):
                try:
                    client.close()
                except Exception:  # closing is best effort; the engine goes with the process
                    pass


def open_span_store(
    url: str | None, data_dir: str | Path, database: str = "runcap", read_url: str | None = None
) -> ClickHouseSink:
    """Open the span store and bring its schema up to date.

    `url` is RUNCAP_CLICKHOUSE_URL (`http(s)://user:pass@host:8123/db`; the path's database wins
    over `database`); None means embedded chdb under `{data_dir}/clickhouse`. `read_url`, for a
    server only, is where read queries go instead, as another user — in production the
    `runcap_reader` user, whose grants and settings profile bound what a query can reach and cost
    (docs/admin-sql.md); its path, when it has one, must name the same database.
    """
    if url:
        return _open_server(url, database, read_url)
    return _open_embedded(Path(data_dir) / EMBEDDED_SUBDIR, database)


# Limits on every read-only query (/admin/sql, the CLI, dashboards through runcap). On a server
# the runcap_reader settings profile holds the same values as constants
# (deploy/clickhouse/users.d/runcap-reader.xml): clickhouse-connect then sends none of them, since
# they already have these values, and a query cannot change them.
QUERY_LIMITS = {
    "max_execution_time": 60,
    "max_memory_usage": 2_000_000_000,
    "max_result_rows": 1_000_000,
    "max_result_bytes": 512_000_000,
    "result_overflow_mode": "throw",
}


def _server_client_args(url: str, setting: str) -> tuple[dict[str, Any], str]:
    """clickhouse-connect arguments for a server URL, and the database its path names ('' if
    none)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpanStoreError(
            f"{setting} must look like http(s)://user:pass@host:8123/db, got {redact_url(url)!r}"
        )
    args = {
        "host": parts.hostname,
        "port": parts.port or (8443 if parts.scheme == "https" else 8123),
        "username": unquote(parts.username or "default"),
        "password": unquote(parts.password or ""),
        "interface": parts.scheme,
        # one client is shared by the shipper's lane and socket threads: no HTTP session state
        "autogenerate_session_id": False,
    }
    return args, unquote(parts.path.strip("/").split("/")[0])


def _open_server(url: str, database: str, read_url: str | None = None) -> ClickHouseSink:
    common, named = _server_client_args(url, "RUNCAP_CLICKHOUSE_URL")
    database = named or database
    read_args = common
    if read_url:
        read_args, read_named = _server_client_args(read_url, "the read URL")
        if read_named and read_named != database:
            raise SpanStoreError(
                f"the read URL {redact_url(read_url)} names database {read_named!r}, the span store is "
                f"{database!r}"
            )
    location = redact_url(url)
    try:
        # The database may not exist yet, so connect without it and qualify every table name.
        writer = clickhouse_connect.get_client(**common)
        apply_migrations(writer, database)
        # readonly=2: clickhouse-connect sets settings per request over HTTP, which readonly=1
        # forbids. What a query may reach is sqlguard's check (every query) and, with a read URL,
        # the reader user's grants; what it may cost, QUERY_LIMITS (constants in its profile).
        reader = clickhouse_connect.get_client(
            **read_args, database=database, settings={"readonly": 2, **QUERY_LIMITS}, tz_mode="aware"
        )
    except Exception as ex:
        raise SpanStoreError(
            f"cannot open the ClickHouse span store at {location} (RUNCAP_CLICKHOUSE_URL): {ex}"
        ) from ex
    return ClickHouseSink(writer, reader, database, location)


def _open_embedded(path: Path, database: str) -> ClickHouseSink:
    try:
        import chdb  # noqa: F401
    except ImportError:
        raise EmbeddedStoreUnavailable(
            "the embedded span store needs chdb: install the runcap[embedded] extra "
            "(pip install 'runcap[embedded]'), or set RUNCAP_CLICKHOUSE_URL to a ClickHouse server"
        ) from None
    path.mkdir(parents=True, exist_ok=True)
    location = str(path)
    writer = None
    try:
        writer = clickhouse_connect.get_client(interface="chdb", path=str(path))
        apply_migrations(writer, database)
        # A second handle on the same engine, read-only for the whole session: a SETTINGS clause
        # per query would not do, since clickhouse-connect applies some statements' settings to
        # the chdb session with SET, and readonly cannot be unset again. readonly=1, not 2: the
        # engine runs inside runcap, so table functions (file(), url(): runcap's environment,
        # its network) must stay out of reach of /admin/sql — readonly=1 alone does not stop the
        # scalar file(), sqlguard does; and bounded, since a runaway query would take runcap's
        # own memory and CPU.
        reader = clickhouse_connect.get_client(
            interface="chdb",
            path=str(path),
            database=database,
            chdb_options={"readonly": 1, **QUERY_LIMITS},
            tz_mode="aware",
        )
    except Exception as ex:
        if writer is not None:
            writer.close()
        raise SpanStoreError(
            f"cannot open the embedded span store in {location}: {ex} (chdb lets one process open a data "
            "directory: if `runcap serve` runs on it, read through its /admin/sql instead)"
        ) from ex
    return ClickHouseSink(writer, reader, database, location)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Decimal):
        return format(value, "f")  # fixed point: "0.000000000", never "0E-9"
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, (UUID, IPv4Address, IPv6Address)):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, dict):
        return {str(_jsonable(k)): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    return str(value)


def _quote_identifier(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"
