"""A ClickHouse HTTP endpoint for tests, backed by chdb (the real ClickHouse engine, in-process).

`ClickHouseHTTPServer` speaks enough of ClickHouse's HTTP interface for clickhouse-connect's HTTP
client to run unchanged against it: the start-up probes (version, timezone, `system.settings`,
protocol version), `SELECT ... FORMAT Native` (or any format, with a trailing FORMAT clause or
`default_format`), `{name:Type}` parameters sent as `param_name`, `INSERT ... FORMAT Native` bodies
compressed as the driver sends them (`Content-Encoding: lz4 | zstd | gzip | deflate | br`),
ClickHouse settings passed as URL parameters (so `insert_deduplication_token` really reaches the
engine), the `X-ClickHouse-*` response headers, and errors the way ClickHouse sends them (status,
`X-ClickHouse-Exception-Code`, `Code: N. DB::Exception: ...` body) so the driver raises its
`DatabaseError`.

Fault controls for sink tests: `set_down(True)` answers every request with 503,
`drop_responses_after_commit(n)` lets the next n INSERTs land and then cuts the connection before
answering (the "timeout after commit" case), and `stop()` / `start()` restart the server on the
same port (refused connections while stopped).

chdb hosts one engine per process, bound to one data directory: while this server runs, the test
process cannot open chdb on another directory (opening the same directory again is fine — it
shares the engine). `stop()` closes every chdb connection so another directory can be opened
afterwards.

Each request runs on a fresh chdb connection (about 1 ms) that gets the request's settings with
`SET` and is then thrown away: settings never leak between requests, as with a ClickHouse server
(HTTP sessions are accepted but keep no state). Statements run one at a time under a lock.

Run it on its own with `python -m tests.support.clickhouse_http DATA_DIR [PORT]` when a test needs
the endpoint in another process (for instance next to an embedded chdb on another directory).
"""

from __future__ import annotations

import atexit
import base64
import gzip
import json
import re
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import chdb

# URL parameters the HTTP layer consumes itself; everything else is a ClickHouse setting.
TRANSPORT_PARAMS = frozenset(
    {
        "query",
        "database",
        "default_format",
        "user",
        "password",
        "query_id",
        "session_id",
        "session_timeout",
        "session_check",
        "quota_key",
        "compress",
        "decompress",
        "buffer_size",
        "wait_end_of_query",
        "client_protocol_version",
        "role",
        "send_progress_in_http_headers",
        "http_headers_progress_interval_ms",
        "enable_http_compression",
        "http_response_headers",
    }
)

# ClickHouse answers some exception codes with a 4xx status; everything else is a 500.
_STATUS_BY_CODE = {
    27: 400,  # CANNOT_PARSE_INPUT_ASSERTION_FAILED
    36: 400,  # BAD_ARGUMENTS
    46: 404,  # UNKNOWN_FUNCTION
    47: 404,  # UNKNOWN_IDENTIFIER
    60: 404,  # UNKNOWN_TABLE
    62: 400,  # SYNTAX_ERROR
    81: 404,  # UNKNOWN_DATABASE
    115: 400,  # UNKNOWN_SETTING
    164: 403,  # READONLY
    192: 403,  # UNKNOWN_USER
    456: 400,  # UNKNOWN_QUERY_PARAMETER
    497: 403,  # ACCESS_DENIED
    516: 403,  # AUTHENTICATION_FAILED
}

_CODE_RE = re.compile(r"Code: (\d+)\.")
_SETTING_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# `INSERT INTO t (cols) [SETTINGS ...] FORMAT Name` followed by the data; the data starts after
# the format name, blanks, and at most one line break (binary formats may begin with any byte).
_INSERT_FORMAT_RE = re.compile(rb"^\s*(INSERT\s+INTO\s.*?)\bFORMAT\s+(\w+)[ \t]*(?:\r?\n)?", re.I | re.S)
_TRAILING_FORMAT_RE = re.compile(r"\bFORMAT\s+(\w+)\s*;?\s*$", re.I)
_LEADING_COMMENTS_RE = re.compile(r"^(?:\s+|--[^\n]*\n?|/\*.*?\*/)*", re.S)


class ClickHouseError(Exception):
    """An error to send the way ClickHouse does: exception code, HTTP status and message."""

    def __init__(self, code: int, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status or _STATUS_BY_CODE.get(code, 500)


def _error_from_chdb(ex: Exception) -> ClickHouseError:
    message = str(ex)
    start = message.find("Code: ")
    if start > 0:
        message = message[start:]
    match = _CODE_RE.search(message)
    code = int(match.group(1)) if match else 1001  # STD_EXCEPTION
    return ClickHouseError(code, message.strip())


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _decompress(body: bytes, encoding: str) -> bytes:
    """Undo a request Content-Encoding. clickhouse-connect compresses each insert block into its
    own frame, so lz4 and zstd bodies are sequences of concatenated frames."""
    encoding = encoding.strip().lower()
    if not body or encoding in ("", "identity"):
        return body
    if encoding == "lz4":
        import lz4.frame

        out = bytearray()
        rest = body
        while rest:
            decompressor = lz4.frame.LZ4FrameDecompressor()
            out += decompressor.decompress(rest)
            rest = decompressor.unused_data
        return bytes(out)
    if encoding == "zstd":
        from clickhouse_connect.driver.compression import _zstd_decompress

        return _zstd_decompress(body)
    if encoding in ("gzip", "x-gzip"):
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    if encoding == "br":
        import brotli  # type: ignore[import-not-found]

        return brotli.decompress(body)
    raise ClickHouseError(
        1, f"Code: 1. DB::Exception: Unknown Content-Encoding {encoding!r}. (UNSUPPORTED_METHOD)"
    )


def _compress_response(body: bytes, accept_encoding: str) -> tuple[bytes, str | None]:
    accepted = [part.split(";")[0].strip().lower() for part in accept_encoding.split(",") if part.strip()]
    for encoding in accepted:
        if encoding == "lz4":
            import lz4.frame

            return lz4.frame.compress(body), "lz4"
        if encoding == "gzip":
            return gzip.compress(body, compresslevel=1), "gzip"
        if encoding == "deflate":
            return zlib.compress(body, 1), "deflate"
    return body, None


class ClickHouseHTTPServer:
    """ClickHouse's HTTP interface over chdb on `data_dir`, on 127.0.0.1 and a free port.

    >>> server = ClickHouseHTTPServer(tmp_path / "ch")
    >>> url = server.start()   # "http://default:@127.0.0.1:PORT/runcap"
    >>> server.query("SELECT count() FROM runcap.spans")   # direct, even while "down"
    >>> server.stop()
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        database: str = "runcap",
        user: str = "default",
        password: str = "",
        port: int = 0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.database = database
        self.user = user
        self.password = password
        self.port = port
        self.requests: list[dict[str, Any]] = []  # one entry per handled request, for assertions
        self._down = False
        self._drop_after_commit = 0
        self._lock = threading.Lock()  # one statement at a time on the engine
        self._state_lock = threading.Lock()
        self._engine: Any = None  # keeps the chdb engine open between requests
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._sockets: set[socket.socket] = set()
        self._version = ""
        self._timezone = "UTC"

    # -- control -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.user}:{self.password}@127.0.0.1:{self.port}/{self.database}"

    def start(self) -> str:
        """Open chdb on the data directory and serve; returns the URL (same port on a restart)."""
        if self._httpd is not None:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._engine = chdb.connect(str(self.data_dir.resolve()))
        version, tz = self._engine.query("SELECT version(), timezone()", "TabSeparated").bytes().split(b"\t")
        self._version, self._timezone = version.decode(), tz.decode().strip()
        server = self

        class Handler(_Handler):
            owner = server

        ThreadingHTTPServer.allow_reuse_address = True
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        atexit.register(self.stop)  # chdb can crash at exit when an engine is left open
        return self.url

    def stop(self) -> None:
        """Stop serving, cut open keep-alive connections and close chdb (the port is kept)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        with self._state_lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        atexit.unregister(self.stop)
        with self._lock:
            self._engine.close()
            self._engine = None

    def set_down(self, down: bool) -> None:
        """While down, every request gets 503 Service Unavailable (nothing reaches the engine)."""
        self._down = down

    def drop_responses_after_commit(self, count: int = 1) -> None:
        """The next `count` INSERTs are committed, then the connection is closed unanswered."""
        self._drop_after_commit = count

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Run SQL on the engine directly (not over HTTP) and return rows as tuples of JSON
        values (64-bit integers as ints); works while the server is down."""
        if self._engine is None:
            raise RuntimeError("the ClickHouse HTTP fixture is stopped")
        conn = chdb.connect(str(self.data_dir.resolve()))
        try:
            with self._lock:
                conn.query("SET output_format_json_quote_64bit_integers = 0", "TabSeparated")
                out = conn.query(
                    sql, "JSONCompactEachRow", params={k: str(v) for k, v in (params or {}).items()}
                )
        except Exception as ex:
            raise _error_from_chdb(ex) from None
        finally:
            conn.close()
        return [tuple(json.loads(line)) for line in out.bytes().splitlines() if line]

    def __enter__(self) -> ClickHouseHTTPServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request execution -------------------------------------------------------------------

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._state_lock:
            (self._sockets.add if add else self._sockets.discard)(sock)

    def _take_drop(self) -> bool:
        with self._state_lock:
            if self._drop_after_commit > 0:
                self._drop_after_commit -= 1
                return True
            return False

    def execute(self, params: dict[str, str], body: bytes) -> tuple[bytes, dict[str, str]]:
        """Run one HTTP request's statement; returns (response body, X-ClickHouse headers)."""
        query_text = params.get("query", "").encode()
        if query_text and body:
            # ClickHouse reads the query parameter, then the body as its continuation (the data)
            statement = query_text + (b"" if query_text[-1:].isspace() else b"\n") + body
        else:
            statement = query_text or body
        if not statement.strip():
            raise ClickHouseError(62, "Code: 62. DB::Exception: Empty query. (SYNTAX_ERROR)")
        settings = {
            k: v for k, v in params.items() if k not in TRANSPORT_PARAMS and not k.startswith("param_")
        }
        binds = {k[6:]: v for k, v in params.items() if k.startswith("param_")}
        database = params.get("database") or "default"
        insert = _data_insert(statement)
        started = time.perf_counter()
        with self._lock:
            conn = chdb.connect(str(self.data_dir.resolve()))
            try:
                conn.query(f"USE `{database.replace('`', '``')}`", "TabSeparated")
                for name, value in settings.items():
                    if not _SETTING_NAME_RE.match(name):
                        raise ClickHouseError(
                            115, f"Code: 115. DB::Exception: Unknown setting {name}. (UNKNOWN_SETTING)"
                        )
                    conn.query(f"SET {name} = {_quote(value)}", "TabSeparated")
                if insert is not None:
                    fmt = insert.group(2).decode()
                    inserter = conn.send_insert(insert.group(1).decode().strip(), fmt)
                    try:
                        data = statement[insert.end() :]
                        if data:
                            inserter.append(data)
                        result = inserter.finish()
                    except BaseException:
                        inserter.cancel()
                        raise
                    summary = {
                        "read_rows": str(result.rows_written),
                        "read_bytes": str(result.bytes_written),
                        "written_rows": str(result.rows_written),
                        "written_bytes": str(result.bytes_written),
                        "total_rows_to_read": "0",
                        "result_rows": "0",
                        "result_bytes": "0",
                    }
                    out, fmt_header = b"", None
                else:
                    sql = statement.decode()
                    trailing = _TRAILING_FORMAT_RE.search(sql)
                    fmt = trailing.group(1) if trailing else params.get("default_format", "TabSeparated")
                    res = conn.query(sql, fmt, params=binds)
                    out = res.bytes() or b""
                    summary = {
                        "read_rows": str(res.rows_read()),
                        "read_bytes": str(res.bytes_read()),
                        "written_rows": str(res.rows_written()),
                        "written_bytes": str(res.bytes_written()),
                        "total_rows_to_read": str(res.rows_read()),
                        "result_rows": "0",
                        "result_bytes": str(len(out)),
                    }
                    fmt_header = fmt if _produces_result(sql) else None
            except ClickHouseError:
                raise
            except Exception as ex:
                raise _error_from_chdb(ex) from None
            finally:
                conn.close()
        summary["elapsed_ns"] = str(int((time.perf_counter() - started) * 1e9))
        headers = {"X-ClickHouse-Summary": json.dumps(summary, separators=(",", ":"))}
        if fmt_header:
            headers["X-ClickHouse-Format"] = fmt_header
        return out, headers


def _data_insert(statement: bytes) -> re.Match[bytes] | None:
    """Match `INSERT ... FORMAT Name <data>`; not INSERT ... VALUES / SELECT (plain SQL)."""
    match = _INSERT_FORMAT_RE.match(statement)
    if match is None or re.search(rb"\b(VALUES|SELECT)\b", match.group(1), re.I):
        return None
    return match


def _produces_result(sql: str) -> bool:
    """Whether a statement has a result set (ClickHouse then names its format in a header)."""
    head = _LEADING_COMMENTS_RE.sub("", sql, count=1)[:16].upper()
    return head.startswith(("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN", "(", "VALUES"))


class _Handler(BaseHTTPRequestHandler):
    owner: ClickHouseHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the driver's connection pool expects

    def setup(self) -> None:
        super().setup()
        self.owner._track(self.connection, True)

    def finish(self) -> None:
        self.owner._track(self.connection, False)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        owner = self.owner
        split = urlsplit(self.path)
        raw = self._read_body()
        if owner._down:
            self._reply(503, b"Service Unavailable\n", {"Content-Type": "text/plain"})
            return
        if split.path.rstrip("/") in ("/ping", "/replicas_status"):
            self._reply(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"})
            return
        params = dict(parse_qsl(split.query, keep_blank_values=True))
        query_id = params.get("query_id") or str(uuid.uuid4())
        base_headers = {
            "X-ClickHouse-Query-Id": query_id,
            "X-ClickHouse-Timezone": owner._timezone,
            "X-ClickHouse-Server-Display-Name": "runcap-test-clickhouse",
        }
        record: dict[str, Any] = {"params": params, "status": 200}
        owner.requests.append(record)
        try:
            self._authenticate(params)
            body = _decompress(raw, self.headers.get("Content-Encoding", ""))
            if self.headers.get_content_type() == "multipart/form-data":
                params, body = self._form(params, body)
                record["params"] = params
            record["query"] = (params.get("query", "").encode() or body[:200]).decode(errors="replace")
            is_insert = _data_insert(params["query"].encode() if params.get("query") else body) is not None
            out, headers = owner.execute(params, body)
        except ClickHouseError as ex:
            record["status"] = ex.status
            message = str(ex)
            if "(version " not in message:
                message = f"{message} (version {owner._version} (official build))"
            self._reply(
                ex.status,
                (message + "\n").encode(),
                {
                    **base_headers,
                    "X-ClickHouse-Exception-Code": str(ex.code),
                    "Content-Type": "text/plain; charset=UTF-8",
                },
            )
            return
        if is_insert and owner._take_drop():
            record["status"] = "dropped"
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        fmt = headers.get("X-ClickHouse-Format")
        content_type = (
            "application/octet-stream"
            if fmt in ("Native", "RowBinary", "Arrow", "Parquet")
            else ("text/plain; charset=UTF-8")
        )
        extra: dict[str, str] = {}
        if params.get("enable_http_compression") == "1" and out:
            out, encoding = _compress_response(out, self.headers.get("Accept-Encoding", ""))
            if encoding:
                extra["Content-Encoding"] = encoding
        self._reply(200, out, {**base_headers, **headers, **extra, "Content-Type": content_type})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            # the driver streams insert blocks from a generator: chunked transfer encoding
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _authenticate(self, params: dict[str, str]) -> None:
        user, password = self.owner.user, self.owner.password
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        user = self.headers.get("X-ClickHouse-User", params.get("user", user))
        password = self.headers.get("X-ClickHouse-Key", params.get("password", password))
        if user != self.owner.user or password != self.owner.password:
            raise ClickHouseError(
                516,
                f"Code: 516. DB::Exception: {user}: Authentication failed: password is incorrect, "
                "or there is no user with such name. (AUTHENTICATION_FAILED)",
            )

    def _form(self, params: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        """Form-encoded queries (long parameter payloads): fields become URL parameters."""
        from email.parser import BytesParser
        from email.policy import HTTP

        message = BytesParser(policy=HTTP).parsebytes(
            b"Content-Type: " + self.headers["Content-Type"].encode() + b"\r\n\r\n" + body
        )
        fields = dict(params)
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if name:
                fields[str(name)] = part.get_payload(decode=True).decode()
        return fields, b""

    def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True


def main() -> None:
    import sys

    data_dir = sys.argv[1] if len(sys.argv) > 1 else "./clickhouse-fixture"
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    server = ClickHouseHTTPServer(data_dir, port=port)
    print(server.start(), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
