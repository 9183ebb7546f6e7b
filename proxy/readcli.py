"""The read side of the CLI: `runcap query`, `sql`, `runs`, `run` (`run --tree`) and `payload`.

Where the SQL goes (`open_reader`):

* `RUNCAP_CLICKHOUSE_URL` set: straight to that ClickHouse server.
* `--url` given: that runcap's `POST /admin/sql` (with `RUNCAP_ADMIN_TOKEN` when set).
* `--data-dir` given (no `--url`): the span shipper of that data directory, on its local socket
  (`data_dir/shipper.sock`: while `runcap serve` runs, the shipper owns the embedded chdb store);
  when no shipper answers, the embedded store in that directory, opened by this process; then
  the configured runcap's `/admin/sql`.
* neither: the configured data directory's shipper, then the configured runcap (`listen`) through
  `/admin/sql`; when nothing answers there, the configured data directory directly.

chdb lets one process open a data directory, hence the order. Every attempt that fails is named
in the final error. Output is a table on a terminal (rich) or, with `--json`, a JSON array of
objects (column → value).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Protocol

from proxy import admin_http
from proxy.clierrors import store_error
from proxy.config import Config, SpanSettings
from proxy.queryfiles import QueryFileError, bind, list_queries, load_query, parse_param_args
from proxy.server.auth import cli_admin_token
from proxy.spans.control import socket_path

Rows = list[list[Any]]


class ReadError(Exception):
    """The read command cannot reach a span store, or the store refused the query."""


class StoreUnreachable(ReadError):
    """Nothing answered where we looked (a next place may be tried)."""


class Reader(Protocol):
    where: str

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], Rows]: ...

    def close(self) -> None: ...


class AdminSqlReader:
    """SQL through a running runcap's `POST /admin/sql`."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.where = f"{self.base_url}/admin/sql"

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], Rows]:
        try:
            answer = admin_http.call_json(
                self.where, self.token, method="POST", body={"sql": sql, "params": params or {}},
                timeout=self.timeout_s,
            )  # fmt: skip
        except admin_http.Refused as e:
            raise ReadError(f"{self.where}: {e}") from None
        except admin_http.Unreachable as e:
            raise StoreUnreachable(f"no runcap answers at {self.base_url} ({e.reason})") from None
        return answer["columns"], answer["rows"]

    def close(self) -> None:
        pass


class ShipperReader:
    """SQL through the span shipper's local socket (proxy/spans/control.py): the shipper checks
    every query with sqlguard, as for `/admin/sql`."""

    def __init__(self, data_dir: Path) -> None:
        from proxy.spans.control import ShipperClient

        self._client = ShipperClient(Path(data_dir))
        self.where = str(self._client.path)

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], Rows]:
        from proxy.spans.control import ShipperQueryError, ShipperStoreError, ShipperUnavailable

        try:
            return self._client.query_sync(sql, params)
        except ShipperUnavailable as e:
            raise StoreUnreachable(f"no span shipper answers on {self.where} ({e})") from None
        except (ShipperQueryError, ShipperStoreError) as e:
            raise ReadError(f"query failed: {e}") from None

    def close(self) -> None:
        pass


class DirectReader:
    """SQL on the span store itself: a ClickHouse server, or the embedded chdb directory."""

    def __init__(self, config: SpanSettings, data_dir: Path) -> None:
        from proxy.spans.clickhouse import EMBEDDED_SUBDIR, SpanStoreError, open_span_store

        if config.clickhouse_url:
            self.where = "the ClickHouse server in RUNCAP_CLICKHOUSE_URL"
        else:
            path = Path(data_dir) / EMBEDDED_SUBDIR
            self.where = str(path)
            if not path.is_dir():
                raise StoreUnreachable(f"no embedded span store in {path} (wrong --data-dir?)")
        try:
            self._store = open_span_store(
                config.clickhouse_url, data_dir, read_url=config.clickhouse_read_url
            )
        except SpanStoreError as e:
            raise StoreUnreachable(str(e)) from None

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], Rows]:
        from proxy.spans.clickhouse import SpanStoreError

        try:
            return self._store.query(sql, params)
        except SpanStoreError as e:  # SpanQueryError included: ClickHouse's own message
            raise ReadError(str(e)) from None

    def close(self) -> None:
        self._store.close()


# A `runcap serve` that is starting (its span shipper not up yet) is waited for this long.
STARTING_WAIT_S = 10.0


def serve_running(data_dir: Path) -> bool:
    """Whether a `runcap serve` holds `data_dir` (its serve.lock, proxy/cli.py)."""
    from proxy.spans.wal import lock_held

    try:
        return lock_held(Path(data_dir) / "serve.lock") is True
    except OSError:
        return False


def open_reader(config: Config, url: str | None, data_dir_given: bool) -> Reader:
    """The first place that answers (see the module docstring). While a `runcap serve` of the
    data directory is starting — it holds the directory, its shipper does not answer yet — the
    attempts are repeated for up to STARTING_WAIT_S instead of failing at once."""
    import time

    deadline = time.monotonic() + STARTING_WAIT_S
    while True:
        try:
            return _open_reader(config, url, data_dir_given)
        except ReadError as e:
            starting = (
                isinstance(e, StoreUnreachable)
                or "span_store_unavailable" in str(e)
                or ("shipper" in str(e) and "HTTP 503" in str(e))
            )
            if url or not starting or time.monotonic() > deadline or not serve_running(config.data_dir):
                raise
            time.sleep(0.25)


def _open_reader(config: Config, url: str | None, data_dir_given: bool) -> Reader:
    token = cli_admin_token(config.admin_token, config.data_dir)
    if config.spans.clickhouse_url:
        return DirectReader(config.spans, config.data_dir)
    if url:
        return AdminSqlReader(url, token)
    configured = AdminSqlReader(f"http://{config.listen}", token)
    attempts: list[str] = []
    order = ("shipper", "direct", "http") if data_dir_given else ("shipper", "http", "direct")
    for kind in order:
        try:
            if kind == "shipper":
                if not socket_path(config.data_dir).exists():
                    continue
                shipper = ShipperReader(config.data_dir)
                shipper.query("SELECT 1")
                return shipper
            if kind == "direct":
                return DirectReader(config.spans, config.data_dir)
            configured.query("SELECT 1")
            return configured
        except StoreUnreachable as e:
            attempts.append(str(e))
        except ReadError:  # it answered, but refused (e.g. 401: http_error says what to do)
            raise
    raise StoreUnreachable(
        "cannot read the span store: "
        + "; ".join(attempts)
        + ". Start `runcap serve`, pass --url of a running runcap, --data-dir of its data directory, "
        "or set RUNCAP_CLICKHOUSE_URL."
    )


# -- commands -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableView:
    """How a terminal shows a query's rows (--json gets every column, as named in the SQL)."""

    show: tuple[str, ...]  # the columns, left to right (): all of them, as the SQL names them
    # Most important first: the last ones are left out first when narrow. (): the query file's
    # own `-- @priority` (proxy/queryfiles.py), else left to right.
    priority: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)  # shorter headers for wide-named columns


_VIEWS = {
    # The priority of both is the query file's (queries/runs.sql, queries/run_timeline.sql).
    "runs": TableView(
        show=("run_id", "task", "status", "cap_hit", "steps", "tool_calls", "input_tokens",
              "output_tokens", "cost_usd", "max_usd", "updated_at"),
        priority=load_query("runs").priority,
        labels={"input_tokens": "in_tok", "output_tokens": "out_tok", "tool_calls": "tools"},
    ),
    # request_hash / response_hash are the payloads' keys: `runcap payload PREFIX` prints them.
    "run_timeline": TableView(
        show=("started_at", "step", "kind", "model", "tool", "input_tokens", "output_tokens", "cost_usd",
              "cost_parts", "cumulative_usd", "outcome", "status_code", "duration_ms", "request_hash",
              "response_hash", "args_hash", "result_hash", "idempotency_key", "detail", "context"),
        priority=load_query("run_timeline").priority,
        labels={"input_tokens": "in_tok", "output_tokens": "out_tok", "status_code": "status",
                "duration_ms": "ms", "cumulative_usd": "total_usd", "request_hash": "request",
                "response_hash": "response", "cost_parts": "billed"},
    ),
}  # fmt: skip
# `runcap run ROOT --tree`: the `run` rows of queries/run_tree_cost.sql, indented by depth
# (`runcap query run_tree_cost` shows every row and column, as the file names them).
_TREE_VIEW = TableView(
    show=("run_id", "status", "steps", "tool_calls", "tokens", "cost_usd", "subtree_usd", "subtree_tokens",
          "max_usd", "max_tokens", "max_steps", "max_tool_calls", "task"),
    priority=("run_id", "cost_usd", "subtree_usd", "status", "max_usd", "steps", "tokens", "max_tokens",
              "max_steps", "subtree_tokens", "tool_calls", "max_tool_calls", "task"),
    labels={"tool_calls": "tools", "subtree_tokens": "subtree_tok", "max_tool_calls": "max_tools"},
)  # fmt: skip
_TREE_INDENT = "  "  # per depth, in `runcap run --tree`
_SHORT_HASH = 12
_ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00")


def run_read_command(args: argparse.Namespace, config: Config) -> int:
    try:
        if args.command == "payload":
            return _payload(args, config)
        if args.command == "query" and not args.name:
            return _list_queries(args)
        reader = open_reader(config, args.url, args.data_dir is not None)
        try:
            return _run(args, reader)
        finally:
            reader.close()
    except (QueryFileError, ReadError) as e:
        print(f"runcap {args.command}: {store_error(str(e))}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, reader: Reader) -> int:
    if args.command == "sql":
        columns, rows = reader.query(args.sql, parse_param_args(args.param or []))
        print_rows(columns, rows, args.json, wide=args.wide)
        return 0
    if args.command == "query":
        name, given = args.name, parse_param_args(args.param or [])
    elif args.command == "runs":
        name = "runs"
        given = {k: str(v) for k, v in (("task", args.task), ("status", args.status),
                                        ("limit", args.limit)) if v is not None}  # fmt: skip
        if args.since:
            given["since"] = args.since
    elif args.command == "run" and getattr(args, "tree", False):
        return _run_tree(args, reader)
    elif args.command == "run":
        name, given = "run_timeline", {"run_id": args.run_id}
    else:
        raise AssertionError(args.command)
    query = load_query(name)
    options = {k: f"--{k}" for k in ("task", "status", "limit", "since")} if args.command == "runs" else {}
    columns, rows = reader.query(query.sql, bind(query, given, reader, options))
    title = None
    if args.command == "run":
        if not rows:
            raise ReadError(f"no spans for run {args.run_id!r} in {reader.where}")
        total = rows[-1][columns.index("cumulative_usd")]
        title = f"run {args.run_id}: {len(rows)} spans, ${_fmt_decimal(total)}"
    view = _VIEWS.get(name, TableView(show=()))
    if not view.priority and query.priority:
        view = TableView(view.show, query.priority, view.labels)
    print_rows(columns, rows, args.json, view=view, title=title, wide=args.wide)
    return 0


def _run_tree(args: argparse.Namespace, reader: Reader) -> int:
    """`runcap run RUN_ID --tree`: the run tree RUN_ID is in (from its root down, whichever of its
    runs is named), one line per run, indented by depth: its own spend and its subtree's, tokens,
    steps, status and caps — the `run` rows of queries/run_tree_cost.sql."""
    query = load_query("run_tree_cost")
    columns, rows = reader.query(query.sql, bind(query, {"run_id": args.run_id}, reader))
    at = {c: i for i, c in enumerate(columns)}
    nodes = [row for row in rows if row[at["row"]] == "run"]
    if not any(row[at["run_id"]] == args.run_id for row in nodes):
        raise ReadError(
            f"no run {args.run_id!r} in the runs table of {reader.where} (a run has a row once its first "
            "step is recorded)"
        )
    root = nodes[0][at["root_run_id"]]
    [total] = [row for row in rows if row[at["row"]] == "tree"]
    runs = f"{len(nodes)} run{'s' if len(nodes) != 1 else ''}"
    title = f"run tree {root}: {runs}, ${_fmt_decimal(total[at['cost_usd']])}"
    if not args.json:
        for row in nodes:
            row[at["run_id"]] = _TREE_INDENT * row[at["depth"]] + row[at["run_id"]]
    print_rows(columns, nodes, args.json, view=_TREE_VIEW, title=title, wide=args.wide)
    return 0


def _list_queries(args: argparse.Namespace) -> int:
    queries = list_queries()
    if args.json:
        listing = [
            {
                "name": q.name,
                "question": q.question,
                "params": [
                    {"name": p.name, "type": p.type, "default": p.default, "doc": p.doc} for p in q.params
                ],
            }
            for q in queries
        ]
        print(json.dumps(listing, indent=2))
        return 0
    from proxy.termtable import terminal_width

    width = terminal_width()

    def say(line: str, indent: str) -> None:  # wrapped to the terminal, if there is one
        print(textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False) if width else line)

    for q in queries:
        first = q.question.split("? ")[0] + ("?" if "? " in q.question else "")
        say(f"{q.name}: {first}", "    ")
        for p in q.params:
            say(f"    --param {p.name}=…  {p.type}, default {p.default}" + (f" — {p.doc}" if p.doc else ""),
                " " * 8)  # fmt: skip
    return 0


_HEX = re.compile(r"[0-9a-f]+")
MIN_PREFIX = 4  # hex digits of a hash prefix `runcap payload` looks up
_CANDIDATES = 10


def _payload(args: argparse.Namespace, config: Config) -> int:
    from proxy.spans.payloads import open_payload_store

    given = args.hash.strip().lower()
    if not _HEX.fullmatch(given) or len(given) > 64:
        raise ReadError(
            f"{args.hash!r} is not a sha256 hash or a prefix of one (hex digits: the request_hash / "
            "response_hash that `runcap run RUN_ID` shows)"
        )
    if len(given) < MIN_PREFIX:
        raise ReadError(f"{args.hash!r} is too short: give at least {MIN_PREFIX} hex digits of the hash")
    where = config.spans.s3_url or str(Path(config.data_dir) / "payloads")
    store = open_payload_store(config.spans.s3_url, config.data_dir)
    try:
        digest = given
        if len(given) < 64:
            found = store.find(given, _CANDIDATES + 1)  # type: ignore[attr-defined]
            if not found:
                raise ReadError(f"no payload matches {given} in {where}")
            if len(found) > 1:
                more = " …" if len(found) > _CANDIDATES else ""
                raise ReadError(
                    f"{given} matches several payloads in {where}; give more digits: "
                    + ", ".join(found[:_CANDIDATES]) + more
                )  # fmt: skip
            digest = found[0]
        try:
            data = store.get(digest)
        except KeyError:
            raise ReadError(
                f"no payload {digest} in {where} (bodies are kept per the payloads setting and "
                "retention; a span's hash is '' when its body was not stored)"
            ) from None
    except ReadError:
        raise
    except Exception as e:  # the store's own failure (S3 unreachable, denied): one line, no traceback
        raise ReadError(f"cannot read the payload store {where}: {e}") from None
    finally:
        store.close()
    if args.json:
        print(json.dumps([{"sha256": digest, "bytes": len(data), "body": data.decode("utf-8", "replace")}]))
    else:
        sys.stdout.buffer.write(data)
        if sys.stdout.isatty() and not data.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()
    return 0


# -- output -----------------------------------------------------------------------------------


def print_rows(
    columns: Sequence[str], rows: Rows, as_json: bool, *, view: TableView | None = None,
    title: str | None = None, wide: bool = False,
) -> None:  # fmt: skip
    if as_json:
        print(json.dumps([dict(zip(columns, row, strict=True)) for row in rows], indent=1, default=str))
        return
    render_table(columns, rows, view=view, title=title, wide=wide)


def render_table(
    columns: Sequence[str], rows: Rows, *, show: Sequence[str] | None = None, view: TableView | None = None,
    title: str | None = None, wide: bool = False, width: int | None = None,
) -> None:  # fmt: skip
    """Print `rows` as a table fitted to the terminal (proxy/termtable.py); `wide`: every column,
    whole values and full hashes, whatever the width. `width` overrides the terminal's."""
    for line in table_lines(columns, rows, show=show, view=view, title=title, wide=wide, width=width):
        print(line)


def table_lines(
    columns: Sequence[str], rows: Rows, *, show: Sequence[str] | None = None, view: TableView | None = None,
    title: str | None = None, wide: bool = False, width: int | None = None,
) -> list[str]:  # fmt: skip
    from proxy.termtable import format_table, is_identifier, terminal_width

    shown = view.show if view is not None else show
    picked = [columns.index(c) for c in shown if c in columns] if shown else list(range(len(columns)))
    right = [  # numbers; never an id or a hash, even one that is all digits
        bool(rows)
        and not is_identifier(columns[i])
        and all(isinstance(r[i], (int, float)) or _is_decimal(r[i]) for r in rows if r[i] is not None)
        and not isinstance(next((r[i] for r in rows if r[i] is not None), None), bool)
        for i in picked
    ]
    return format_table(
        [columns[i] for i in picked],
        [[_cell(columns[i], row[i], wide) for i in picked] for row in rows],
        right=right,
        width=None if wide else (width or terminal_width()),
        priority=view.priority if view is not None else None,
        labels=view.labels if view is not None else None,
        title=title,
    )


def _cell(column: str, value: Any, wide: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_cell(column, v, wide) for v in value)
    if isinstance(value, float):
        return f"{value:g}" if abs(value) < 1e15 else str(value)
    if isinstance(value, str):
        if (column.endswith("_hash") or column == "idempotency_key" or column == "hash") and not wide:
            return value[:_SHORT_HASH]
        if _ISO_UTC.fullmatch(value):  # ISO 8601 UTC, to the millisecond
            return value.removesuffix("+00:00")[:23].replace("T", " ")
        if _is_decimal(value) and column.endswith("usd"):
            return _fmt_decimal(value)
    return str(value)


def _is_decimal(value: Any) -> bool:
    if not isinstance(value, str) or not value or value[0] not in "-0123456789":
        return False
    try:
        Decimal(value)
    except InvalidOperation:
        return False
    return True


def _fmt_decimal(value: Any) -> str:
    try:
        return format(Decimal(str(value)), "f")
    except InvalidOperation:
        return str(value)
