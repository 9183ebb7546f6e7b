"""The shipper's local socket, `data_dir/shipper.sock`: how proxy processes and the read CLI reach
the span store the shipper owns (embedded chdb lives in the shipper only) and its statistics.

Protocol: a stream of requests and answers on a unix socket, each one frame of
`u32 length (big-endian) | JSON`. Requests: `{"op": "query", "sql": ..., "params": {...}}`,
`{"op": "stats"}`, `{"op": "ping"}`. Answers: `{"ok": true, ...}` — for a query `columns` and
`rows` — or `{"ok": false, "error": {"kind": "query" | "unavailable" | "bad_request", "message",
"code"}}`. Every query goes through the span store's `query`, i.e. through the guard of
proxy/spans/sqlguard.py, whoever asks.

The socket file is mode 0600 in the data directory, next to `admin.token`: whoever can use it can
read the token too. AF_UNIX paths are limited to ~107 bytes; a longer path is reached through
`/proc/self/fd/N/shipper.sock` with N a descriptor of the data directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

SOCKET_NAME = "shipper.sock"
_LEN = struct.Struct(">I")
MAX_REQUEST_BYTES = 4 << 20
QUERY_TIMEOUT_S = 75.0  # above the span store's max_execution_time (60 s)


class ShipperUnavailable(Exception):
    """Nothing answers on the shipper's socket (not started yet, restarting, or tracing off)."""


class ShipperQueryError(Exception):
    """The span store refused or failed the query; `code` is ClickHouse's (or the guard's)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class ShipperStoreError(Exception):
    """The shipper answered, but its span store cannot be reached."""


def socket_path(data_dir: Path) -> Path:
    return Path(data_dir) / SOCKET_NAME


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """An AF_UNIX address for `path`, whatever its length."""
    raw = os.fsencode(path)
    if len(raw) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _answer(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ShipperUnavailable("the shipper sent something that is not an answer")
    if raw.get("ok"):
        return raw
    error = raw.get("error") or {}
    message = str(error.get("message", "unknown error"))
    kind = error.get("kind")
    if kind == "query":
        raise ShipperQueryError(message, int(error.get("code") or 0))
    if kind == "unavailable":
        raise ShipperStoreError(message)
    raise ShipperQueryError(message)


# --- client ------------------------------------------------------------------------------------------


class ShipperClient:
    """Asks the shipper of one data directory: async for the proxy, blocking for the CLI."""

    def __init__(self, data_dir: Path, timeout_s: float = QUERY_TIMEOUT_S) -> None:
        self.path = socket_path(data_dir)
        self.timeout_s = timeout_s
        self.where = str(self.path)

    async def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        data = orjson.dumps(message)
        try:
            async with asyncio.timeout(timeout_s or self.timeout_s):
                with _address(self.path) as address:
                    reader, writer = await asyncio.open_unix_connection(address, limit=1 << 30)
                try:
                    writer.write(_LEN.pack(len(data)) + data)
                    await writer.drain()
                    size = _LEN.unpack(await reader.readexactly(_LEN.size))[0]
                    raw = orjson.loads(await reader.readexactly(size))
                finally:
                    writer.close()
                    with contextlib.suppress(OSError, ConnectionError):
                        await writer.wait_closed()
        except (OSError, asyncio.IncompleteReadError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise ShipperUnavailable(f"the span shipper does not answer on {self.path}: {exc}") from None
        return _answer(raw)

    async def query(
        self, sql: str, params: dict[str, Any] | None = None
    ) -> tuple[list[str], list[list[Any]]]:
        answer = await self.request({"op": "query", "sql": sql, "params": params or {}})
        return answer["columns"], answer["rows"]

    async def stats(self, timeout_s: float = 1.0) -> dict[str, Any]:
        return (await self.request({"op": "stats"}, timeout_s))["stats"]

    def request_sync(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        data = orjson.dumps(message)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout_s or self.timeout_s)
                with _address(self.path) as address:
                    sock.connect(address)
                sock.sendall(_LEN.pack(len(data)) + data)
                size = _LEN.unpack(_recv_exactly(sock, _LEN.size))[0]
                raw = orjson.loads(_recv_exactly(sock, size))
        except (OSError, EOFError, orjson.JSONDecodeError) as exc:
            raise ShipperUnavailable(f"the span shipper does not answer on {self.path}: {exc}") from None
        return _answer(raw)

    def query_sync(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[list[Any]]]:
        answer = self.request_sync({"op": "query", "sql": sql, "params": params or {}})
        return answer["columns"], answer["rows"]


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# --- server ------------------------------------------------------------------------------------------

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False
    handle: Handler


class _Connection(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        while True:
            try:
                size = _LEN.unpack(_recv_exactly(sock, _LEN.size))[0]
                if size > MAX_REQUEST_BYTES:
                    return
                message = orjson.loads(_recv_exactly(sock, size))
            except (OSError, EOFError, orjson.JSONDecodeError):
                return
            if not isinstance(message, dict):
                answer: dict[str, Any] = {
                    "ok": False,
                    "error": {"kind": "bad_request", "message": "not an object"},
                }
            else:
                answer = self.server.handle(message)
            data = orjson.dumps(answer, default=str)
            try:
                sock.sendall(_LEN.pack(len(data)) + data)
            except OSError:
                return


class ControlServer:
    """Serves `handle(request) -> answer` on the socket, one thread per connection."""

    def __init__(self, path: Path, handle: Handler) -> None:
        self.path = Path(path)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a shipper that died; the caller holds the shipper lock
        with _address(self.path) as address:
            old = os.umask(0o177)
            try:
                self._server = _Server(address, _Connection, bind_and_activate=True)
            finally:
                os.umask(old)
        self._server.handle = handle
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="runcap-shipper-socket", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
