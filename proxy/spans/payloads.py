"""The payload store: request and response bodies, content-addressed by sha256.

Key layout (DESIGN.md "Payload store"): `{prefix}sha256/{hash[0:2]}/{hash}` — in an S3 bucket
(`S3PayloadStore`, production) or under a directory (`LocalPayloadStore`, embedded). Bodies may
be stored gzip-compressed (stdlib, deterministic with mtime=0, readable with `gunzip`); the
encoding is recorded beside the object — S3 object metadata, or a `{hash}.meta` sidecar file —
never in the key. `get` returns the exact original bytes and checks them against the hash.

The shipper's payload lane (proxy/spans/shipper.py) calls `put_many` from its own thread; a
failing store raises and the lane retries the batch later (the body waits in the WAL meanwhile).
`PayloadPolicy` is what the request path asks before keeping a body at all.

Retention of the local store (`payload_retention_days`, `payload_store_max_bytes`): from the same
thread, at most every few minutes, `LocalPayloadStore.prune` deletes the bodies not stored (or
stored again) for longer than the retention, then the oldest ones until the store is under its size
cap — on a disk shared with the ledger, payloads must not be what fills it. A body put again is
touched, so one still in use ages from its latest use. S3: use the bucket's lifecycle rules.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import itertools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from proxy.spans.model import Payload
from proxy.spans.sink import PayloadStore, SinkError

PAYLOAD_MODES = ("off", "errors", "all")
IDENTITY = "identity"
GZIP = "gzip"
META_ENCODING = "runcap-encoding"  # S3 user metadata keys (sent as x-amz-meta-...)
META_SIZE = "runcap-size"
_HASH = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger("runcap.spans")


@dataclass(frozen=True, slots=True)
class PayloadPolicy:
    """Which bodies to keep: `off`, only those of failed steps (`errors`), or `all`; and none
    larger than `max_bytes` (None: no limit)."""

    mode: str = "all"
    max_bytes: int | None = 10 << 20

    def __post_init__(self) -> None:
        if self.mode not in PAYLOAD_MODES:
            raise ValueError(f"payload mode must be one of {', '.join(PAYLOAD_MODES)} (got {self.mode!r})")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"payload max_bytes must be >= 0 (got {self.max_bytes})")

    def keep(self, is_error: bool, size: int) -> bool:
        if self.mode == "off" or (self.mode == "errors" and not is_error):
            return False
        return self.max_bytes is None or size <= self.max_bytes


def payload_key(sha256: str, prefix: str = "") -> str:
    """`{prefix}sha256/{hash[0:2]}/{hash}`; the hash must be 64 lowercase hex characters."""
    if not _HASH.fullmatch(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256[:80]!r}")
    return f"{prefix}sha256/{sha256[:2]}/{sha256}"


def _checked_hash(payload: Payload) -> str:
    actual = hashlib.sha256(payload.data).hexdigest()
    if payload.sha256 != actual:
        # storing it under the claimed key would break content addressing for good
        raise ValueError(f"payload claims sha256 {payload.sha256[:16]}… but its bytes hash to {actual[:16]}…")
    return actual


def _encode(data: bytes, compress: bool, min_bytes: int) -> tuple[bytes, str]:
    if compress and len(data) >= min_bytes:
        packed = gzip.compress(data, compresslevel=6, mtime=0)
        if len(packed) <= len(data) * 0.9:  # not worth a decode step for less than 10%
            return packed, GZIP
    return data, IDENTITY


def _decode(stored: bytes, encoding: str, sha256: str) -> bytes:
    if encoding == GZIP:
        data = gzip.decompress(stored)
    elif encoding == IDENTITY:
        data = stored
    else:
        raise ValueError(f"payload {sha256} has unknown encoding {encoding!r}")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"payload {sha256} is damaged: its bytes no longer match the hash")
    return data


@dataclass(frozen=True, slots=True)
class PruneResult:
    removed_files: int
    removed_bytes: int
    kept_bytes: int


class LocalPayloadStore:
    """Payloads under a directory (embedded mode). A file gets its name only once its bytes are
    all written (and fsync'd when `fsync`), sidecar first, data last, so a file at the key is
    always complete: on Linux an unnamed `O_TMPFILE` file linked in place (`linkat`) — no temp
    name to create and rename, none left behind by a crash; elsewhere (or on a file system
    without `O_TMPFILE`) a temp file renamed into place.

    `retention_days` / `max_total_bytes` (0: no limit) bound what it keeps (see `prune`)."""

    name = "local"

    def __init__(
        self,
        directory: Path,
        *,
        prefix: str = "",
        compress: bool = True,
        min_compress_bytes: int = 1024,
        fsync: bool = True,
        retention_days: float = 0.0,
        max_total_bytes: int = 0,
        prune_interval_s: float = 300.0,
    ) -> None:
        self.directory = Path(directory)
        self.prefix = prefix
        self._compress = compress
        self._min_compress_bytes = min_compress_bytes
        self._fsync = fsync
        self._dirs: set[str] = set()  # shard directories known to exist
        self._recent: OrderedDict[str, None] = OrderedDict()  # hashes stored lately, oldest first
        self.retention_s = retention_days * 86400.0
        self.max_total_bytes = max_total_bytes
        self.prune_interval_s = prune_interval_s
        self._next_prune = 0.0  # monotonic; the first put prunes what an earlier run left
        self._written_since_prune = 0
        self._unnamed = _UnnamedFiles() if _UnnamedFiles.supported else None  # None: temp + rename

    def path(self, sha256: str) -> Path:
        return self.directory / payload_key(sha256, self.prefix)

    def put(self, payload: Payload) -> None:
        rejected = self.put_many([payload])
        if rejected:
            raise ValueError(rejected[0][1])

    def put_many(self, payloads: Sequence[Payload]) -> list[tuple[Payload, str]]:
        """Store a batch: each file named only once complete (see the class), sidecar first.
        Returns the payloads that can never be stored (wrong hash), with the reason."""
        # String paths and os-level calls: a body is a handful of system calls, and pathlib and
        # io.open cost as much again in Python (bench/span_bench.py: the shipper's main cost).
        rejected: list[tuple[Payload, str]] = []
        moves: list[tuple[str, str]] = []
        seen: set[str] = set()
        root = f"{self.directory}/{self.prefix}sha256/"
        try:
            for payload in payloads:
                try:
                    sha256 = _checked_hash(payload)
                except ValueError as exc:
                    rejected.append((payload, str(exc)))
                    continue
                shard = root + sha256[:2]
                path = f"{shard}/{sha256}"
                # same hash, same bytes: nothing to do (recent hashes are known without a stat;
                # an older file is touched, so retention counts from its latest use). Linking an
                # unnamed file fails on an existing name anyway: a body too small to compress is
                # written without looking first (a path lookup less per new body, the usual case).
                look_first = self._unnamed is None or (
                    self._compress and len(payload.data) >= self._min_compress_bytes
                )
                if sha256 in seen or sha256 in self._recent or (look_first and _touch(path)):
                    continue
                seen.add(sha256)
                stored, encoding = _encode(payload.data, self._compress, self._min_compress_bytes)
                self._written_since_prune += len(stored)
                if shard not in self._dirs:  # 256 directories: made once, not per body
                    os.makedirs(shard, exist_ok=True)
                    self._dirs.add(shard)
                if encoding != IDENTITY or payload.content_type:
                    # sidecar first: whoever sees the data file also finds its encoding (no
                    # sidecar: identity, no content type — one file less per body)
                    meta = {
                        "encoding": encoding,
                        "size": len(payload.data),
                        "content_type": payload.content_type,
                    }
                    meta_path = path + ".meta"
                    self._write_new(meta_path, orjson.dumps(meta), moves)
                if not self._write_new(path, stored, moves):  # it was there already
                    self._written_since_prune -= len(stored)
                    _touch(path)
            for tmp, final in moves:
                os.replace(tmp, final)
            moves = []
            for sha256 in seen:
                self._recent[sha256] = None
            while len(self._recent) > 10_000:
                self._recent.popitem(last=False)
        finally:
            for tmp, _ in moves:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        if self._prune_due():
            self.prune()
        return rejected

    def _prune_due(self) -> bool:
        if not (self.retention_s or self.max_total_bytes):
            return False
        if self.max_total_bytes and self._written_since_prune >= self.max_total_bytes // 10:
            return True
        return time.monotonic() >= self._next_prune

    def prune(self, now: float | None = None) -> PruneResult:
        """Delete bodies older than the retention (by their last store), then the oldest until
        the store holds at most 90% of its size cap. Returns what was removed and kept."""
        now = time.time() if now is None else now
        self._next_prune = time.monotonic() + self.prune_interval_s
        self._written_since_prune = 0
        files: list[tuple[float, int, Path]] = []  # (last stored, bytes with sidecar, data file)
        sidecars: dict[str, int] = {}
        for shard in _subdirs(self.directory / f"{self.prefix}sha256"):
            with os.scandir(shard) as entries:
                for entry in entries:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    name = entry.name
                    if name.startswith(".") and name.endswith(".tmp"):
                        if now - st.st_mtime > 3600:  # left by a process that died mid-write
                            Path(entry.path).unlink(missing_ok=True)
                    elif name.endswith(".meta"):
                        sidecars[name[: -len(".meta")]] = st.st_size
                    elif _HASH.fullmatch(name):
                        files.append((st.st_mtime, st.st_size, Path(entry.path)))
        files = [(mtime, size + sidecars.get(path.name, 0), path) for mtime, size, path in files]
        files.sort()
        total = sum(size for _, size, _ in files)
        removed = removed_bytes = 0
        # Over the cap: down to 90% of it, so the next bodies do not start the pruning again.
        cap = self.max_total_bytes
        target = int(cap * 0.9) if cap and total > cap else None
        for mtime, size, path in files:
            expired = self.retention_s and now - mtime > self.retention_s
            if not expired and (target is None or total - removed_bytes <= target):
                break  # oldest first: the rest is younger and fits
            path.unlink(missing_ok=True)
            _meta_path(path).unlink(missing_ok=True)
            self._recent.pop(path.name, None)  # stored again if it comes back
            removed += 1
            removed_bytes += size
        if removed:
            log.info(
                "payload store %s: removed %d bodies (%d bytes) past payload_retention_days or "
                "payload_store_max_bytes; %d bytes kept",
                self.directory, removed, removed_bytes, total - removed_bytes,
            )  # fmt: skip
        return PruneResult(removed, removed_bytes, total - removed_bytes)

    def get(self, sha256: str) -> bytes:
        path = self.path(sha256)
        try:
            stored = path.read_bytes()
        except FileNotFoundError:
            raise KeyError(sha256) from None
        try:
            encoding = orjson.loads(_meta_path(path).read_bytes())["encoding"]
        except FileNotFoundError:
            encoding = IDENTITY  # written by hand or by a tool that does not compress
        return _decode(stored, encoding, sha256)

    def find(self, prefix: str, limit: int = 10) -> list[str]:
        """Stored hashes starting with `prefix` (at least 2 hex digits), at most `limit`, sorted."""
        directory = self.directory / f"{self.prefix}sha256" / prefix[:2]
        return sorted(p.name for p in directory.glob(f"{prefix}*") if _HASH.fullmatch(p.name))[:limit]

    def encoding(self, sha256: str) -> str:
        """How the object is stored (`identity` or `gzip`)."""
        try:
            return str(orjson.loads(_meta_path(self.path(sha256)).read_bytes())["encoding"])
        except FileNotFoundError:
            raise KeyError(sha256) from None

    def _write_new(self, path: str, data: bytes, moves: list[tuple[str, str]]) -> bool:
        """`data` as the file `path`, named once complete: linked in place at once (an unnamed
        file), or written to a temp file added to `moves` (renamed by the caller). False when
        `path` existed already (same hash, same bytes: left as it was)."""
        if self._unnamed is not None:
            try:
                return self._unnamed.write(path, data, self._fsync)
            except _NoUnnamedFiles:
                self._unnamed = None  # this file system has no O_TMPFILE: temp + rename from now on
        moves.append((self._write_tmp(path, data), path))
        return True

    def _write_tmp(self, path: str, data: bytes) -> str:
        shard, _, name = path.rpartition("/")
        tmp = f"{shard}/.{name}.{os.getpid()}.{next(_tmp_ids)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def close(self) -> None:
        if self._unnamed is not None:
            self._unnamed.close()


class _NoUnnamedFiles(Exception):
    """The directory's file system cannot make `O_TMPFILE` files (or /proc is not mounted)."""


class _UnnamedFiles:
    """Files written unnamed (`O_TMPFILE`) and linked under their final name once complete:
    `open` + `write` + `linkat` + `close` per body, against `open` + `write` + `close` + `rename`
    of a named temp file — one directory entry made instead of two changes, and nothing left to
    clean up when the process dies mid-write (the kernel frees an unlinked inode). The link goes
    through `/proc/self/fd/N` (`linkat` with AT_SYMLINK_FOLLOW needs no privilege, unlike
    AT_EMPTY_PATH)."""

    supported = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")

    def __init__(self) -> None:
        # (fork generation, fd of /proc/self/fd): "self" is resolved when it is opened, so a
        # forked child opens its own (a getpid per body was 3 % of the payload lane)
        self._fds: tuple[int, int] | None = None

    def _proc_fds(self) -> int:
        if self._fds is None or self._fds[0] != _forks[0]:
            try:
                fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise _NoUnnamedFiles() from exc
            self._fds = (_forks[0], fd)
        return self._fds[1]

    def write(self, path: str, data: bytes, fsync: bool) -> bool:
        """`data` as the new file `path`; False when `path` exists (it is left as it was)."""
        shard = path.rpartition("/")[0]
        proc_fds = self._proc_fds()
        try:
            fd = os.open(shard, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise _NoUnnamedFiles() from exc
            raise
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
            try:
                # with a directory fd for the source, os.link calls linkat (and follows the link)
                os.link(str(fd), path, src_dir_fd=proc_fds)
            except FileExistsError:
                return False  # same hash, same bytes: stored before (a repeat, another shipper)
        finally:
            os.close(fd)
        return True

    def close(self) -> None:
        if self._fds is not None and self._fds[0] == _forks[0]:  # a parent's fd is the parent's
            os.close(self._fds[1])
        self._fds = None


_forks = [0]  # forks this process is from: bumped in every child
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".meta")


_tmp_ids = itertools.count()


def _touch(path: Path | str) -> bool:
    """Refresh the file's time (retention counts from a body's latest store); False when absent.
    Most bodies are new: `access` answers that without raising (a failed `utime` and its
    exception were a fifth of the payload writer's time)."""
    if not os.access(path, os.F_OK):
        return False
    try:
        os.utime(path)
    except FileNotFoundError:  # removed by retention in between
        return False
    return True


def _subdirs(path: Path) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if e.is_dir()]
    except FileNotFoundError:
        return []


class S3PayloadStore:
    """Payloads in S3 or an S3-compatible store (MinIO, moto) via boto3.

    Credentials, region and endpoint come from boto3's normal configuration (`AWS_ENDPOINT_URL`,
    `AWS_ACCESS_KEY_ID`, profiles, instance roles...) unless passed here.

    Idempotence: a PUT of the same key always carries the same bytes, so a repeat is harmless and
    a plain PUT is one request where HEAD-then-PUT would be two for every new body (the common
    case: each step's request differs). Only bodies of at least `head_threshold_bytes` are checked
    with HEAD first, where skipping a re-upload is worth the extra round trip; a small in-process
    memory of recently stored hashes skips repeats without any request.

    `put_many` uploads up to `put_concurrency` bodies at once (boto3 clients are thread-safe): a
    PUT is a round trip, and one at a time a remote bucket takes a few dozen bodies a second.
    """

    name = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        *,
        compress: bool = True,
        min_compress_bytes: int = 1024,
        head_threshold_bytes: int = 1 << 20,
        region_name: str | None = None,
        max_attempts: int = 3,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        addressing_style: str = "auto",
        client: Any = None,
        put_concurrency: int = 16,
    ) -> None:
        import boto3  # type: ignore[import-untyped]  # no stubs installed
        from botocore.config import Config  # type: ignore[import-untyped]

        if not bucket:
            raise ValueError("S3 payload store needs a bucket name")
        self.bucket = bucket
        self.prefix = prefix
        self._compress = compress
        self._min_compress_bytes = min_compress_bytes
        self._head_threshold = head_threshold_bytes
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._recent_max = 4096
        self._recent_lock = threading.Lock()
        self._put_concurrency = max(1, put_concurrency)
        self._pool: ThreadPoolExecutor | None = None
        self._client = client or boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region_name,
            config=Config(
                retries={"max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                s3={"addressing_style": addressing_style},
                max_pool_connections=max(10, self._put_concurrency),
            ),
        )

    def key(self, sha256: str) -> str:
        return payload_key(sha256, self.prefix)

    def put_many(self, payloads: Sequence[Payload]) -> list[tuple[Payload, str]]:
        def put(payload: Payload) -> tuple[Payload, str] | None:
            try:
                self.put(payload)
            except ValueError as exc:
                return payload, str(exc)
            return None

        if len(payloads) <= 1 or self._put_concurrency == 1:
            results = [put(p) for p in payloads]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._put_concurrency, thread_name_prefix="runcap-s3-put")
            results = list(self._pool.map(put, payloads))  # the first failure raises, after all ran
        return [r for r in results if r is not None]

    def put(self, payload: Payload) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

        sha256 = _checked_hash(payload)
        with self._recent_lock:
            if sha256 in self._recent:
                return
        key = self.key(sha256)
        try:
            if len(payload.data) >= self._head_threshold and self._exists(key):
                self._remember(sha256)
                return
            stored, encoding = _encode(payload.data, self._compress, self._min_compress_bytes)
            extra: dict[str, Any] = {"ContentEncoding": GZIP} if encoding == GZIP else {}
            self._client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=stored,
                ContentType=payload.content_type or "application/octet-stream",
                Metadata={META_ENCODING: encoding, META_SIZE: str(len(payload.data))},
                **extra,
            )
        except (BotoCoreError, ClientError) as exc:
            raise SinkError(f"S3 payload store s3://{self.bucket}/{key}: {exc}") from exc
        self._remember(sha256)

    def get(self, sha256: str) -> bytes:
        from botocore.exceptions import ClientError

        key = self.key(sha256)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise KeyError(sha256) from None
            raise
        stored = resp["Body"].read()
        return _decode(stored, resp.get("Metadata", {}).get(META_ENCODING, IDENTITY), sha256)

    def find(self, prefix: str, limit: int = 10) -> list[str]:
        """Stored hashes starting with `prefix` (at least 2 hex digits), at most `limit`, sorted."""
        listed = self._client.list_objects_v2(
            Bucket=self.bucket, Prefix=f"{self.prefix}sha256/{prefix[:2]}/{prefix}", MaxKeys=limit
        )
        names = (obj["Key"].rsplit("/", 1)[-1] for obj in listed.get("Contents", []))
        return sorted(n for n in names if _HASH.fullmatch(n))

    def encoding(self, sha256: str) -> str:
        """How the object is stored (`identity` or `gzip`), from its metadata."""
        from botocore.exceptions import ClientError

        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self.key(sha256))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise KeyError(sha256) from None
            raise
        return str(head.get("Metadata", {}).get(META_ENCODING, IDENTITY))

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def _remember(self, sha256: str) -> None:
        with self._recent_lock:
            self._recent[sha256] = None
            if len(self._recent) > self._recent_max:
                self._recent.popitem(last=False)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._client.close()


def open_payload_store(s3_url: str | None, data_dir: Path, **options: Any) -> PayloadStore:
    """`RUNCAP_S3_URL` (`s3://bucket/prefix`) → S3; absent → `{data_dir}/payloads`."""
    if not s3_url:
        return LocalPayloadStore(Path(data_dir) / "payloads", **options)
    parts = urlsplit(s3_url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"RUNCAP_S3_URL must look like s3://bucket/prefix (got {s3_url!r})")
    prefix = parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return S3PayloadStore(parts.netloc, prefix, **options)
