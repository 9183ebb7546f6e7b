"""Payload stores against a real directory and a real S3 endpoint (moto in server mode):
byte-exact round trips, the key layout, idempotent writes, the recorded encoding, and payloads
surviving an S3 outage in the write-ahead log."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from proxy.spans.model import Payload
from proxy.spans.payloads import (
    LocalPayloadStore,
    PayloadPolicy,
    S3PayloadStore,
    open_payload_store,
)
from proxy.spans.shipper import PAYLOADS_LANE, Shipper
from proxy.spans.wal import WalWriter
from tests.support.s3 import CREDENTIALS, S3Server

BUCKET = "runcap-payloads"

BODIES = {
    "empty": b"",
    "small": b'{"ok":true}',
    "binary": bytes(range(256)) * 30,
    "json_1mb": orjson.dumps([{"role": "user", "content": "hello " * 20}] * 6000),
    "random": os.urandom(64 << 10),
}


def payload(data: bytes, content_type: str = "application/json") -> Payload:
    return Payload(hashlib.sha256(data).hexdigest(), data, content_type)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 4.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached in time")


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    if not s3_server.running:
        s3_server.start()
    s3_server.reset()
    s3_server.create_bucket(BUCKET)
    yield s3_server
    if not s3_server.running:  # a fault test left it down
        s3_server.start()


def count_requests(store: S3PayloadStore) -> list[str]:
    seen: list[str] = []
    store._client.meta.events.register(
        "before-send.s3", lambda request, **_: seen.append(f"{request.method} {request.url}")
    )
    return seen


# --- local -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BODIES))
def test_local_round_trip_and_layout(tmp_path: Path, name: str) -> None:
    store = LocalPayloadStore(tmp_path)
    p = payload(BODIES[name])
    store.put(p)
    assert store.get(p.sha256) == p.data
    path = tmp_path / "sha256" / p.sha256[:2] / p.sha256
    assert path.is_file()
    assert sorted(x.name for x in path.parent.iterdir()) == [p.sha256, p.sha256 + ".meta"]
    expected = "gzip" if name in ("binary", "json_1mb") else "identity"
    assert store.encoding(p.sha256) == expected
    if expected == "gzip":
        assert path.stat().st_size < len(p.data) / 2


def test_local_put_is_idempotent_and_atomic(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path)
    p = payload(BODIES["json_1mb"])
    store.put(p)
    path = store.path(p.sha256)
    before = path.stat()
    store.put(p)
    store.put(payload(p.data))
    after = path.stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)  # not rewritten
    assert not list(tmp_path.rglob("*.tmp"))
    # a temp file left by a crash mid-write never shadows the key
    (path.parent / f".{'ab' * 32}.123.tmp").write_bytes(b"partial")
    with pytest.raises(KeyError):
        store.get("ab" * 32)


def test_local_rejects_bad_hashes(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path)
    with pytest.raises(ValueError, match="hash to"):
        store.put(Payload("0" * 64, b"other bytes"))
    with pytest.raises(ValueError, match="not a sha256"):
        store.get("../../etc/passwd")
    with pytest.raises(KeyError):
        store.get("f" * 64)


def test_local_detects_damage(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path, compress=False)
    p = payload(b"exact bytes")
    store.put(p)
    store.path(p.sha256).write_bytes(b"exact bytez")
    with pytest.raises(ValueError, match="damaged"):
        store.get(p.sha256)


# --- S3 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BODIES))
def test_s3_round_trip_layout_and_metadata(s3: S3Server, tmp_path: Path, name: str) -> None:
    store = S3PayloadStore(BUCKET, "team-a/runcap/", endpoint_url=s3.endpoint_url)
    p = payload(BODIES[name])
    store.put(p)
    assert store.get(p.sha256) == p.data
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert keys == [f"team-a/runcap/sha256/{p.sha256[:2]}/{p.sha256}"]
    head = s3.client().head_object(Bucket=BUCKET, Key=keys[0])
    expected = "gzip" if name in ("binary", "json_1mb") else "identity"
    assert head["Metadata"] == {"runcap-encoding": expected, "runcap-size": str(len(p.data))}
    assert head.get("ContentEncoding") == ("gzip" if expected == "gzip" else None)
    assert head["ContentType"] == "application/json"
    raw = s3.client().get_object(Bucket=BUCKET, Key=keys[0])["Body"].read()
    assert (len(raw) < len(p.data)) == (expected == "gzip")


def test_s3_put_is_idempotent(s3: S3Server) -> None:
    store = S3PayloadStore(BUCKET, "", endpoint_url=s3.endpoint_url, head_threshold_bytes=100_000)
    sent = count_requests(store)
    small, big = payload(b"small body"), payload(BODIES["json_1mb"])
    store.put(small)
    store.put(small)  # remembered: no request at all
    assert [r.split()[0] for r in sent] == ["PUT"]
    store.put(big)
    assert [r.split()[0] for r in sent] == ["PUT", "HEAD", "PUT"]

    fresh = S3PayloadStore(BUCKET, "", endpoint_url=s3.endpoint_url, head_threshold_bytes=100_000)
    sent2 = count_requests(fresh)
    fresh.put(big)  # large and already there: HEAD only, no re-upload
    fresh.put(small)  # small: a plain PUT of the same bytes, harmless
    assert [r.split()[0] for r in sent2] == ["HEAD", "PUT"]
    assert len(s3.client().list_objects_v2(Bucket=BUCKET)["Contents"]) == 2
    assert fresh.get(big.sha256) == big.data and fresh.get(small.sha256) == small.data
    with pytest.raises(KeyError):
        fresh.get("e" * 64)


def test_open_payload_store_honours_aws_endpoint_url(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    store = open_payload_store(f"s3://{BUCKET}/runcap", tmp_path)
    assert isinstance(store, S3PayloadStore) and store.prefix == "runcap/"
    p = payload(b"via the environment")
    store.put(p)
    assert store.get(p.sha256) == p.data
    assert s3.client().head_object(Bucket=BUCKET, Key=f"runcap/sha256/{p.sha256[:2]}/{p.sha256}")
    local = open_payload_store(None, tmp_path)
    assert isinstance(local, LocalPayloadStore) and local.directory == tmp_path / "payloads"
    with pytest.raises(ValueError, match="RUNCAP_S3_URL"):
        open_payload_store("https://bucket/prefix", tmp_path)


def test_s3_outage_payloads_wait_in_the_wal_then_are_delivered(s3: S3Server, tmp_path: Path) -> None:
    def store() -> S3PayloadStore:
        return S3PayloadStore(
            BUCKET, "p/", endpoint_url=s3.endpoint_url, max_attempts=1, connect_timeout_s=0.5
        )

    fast = dict(retry_initial_s=0.05, retry_max_s=0.2, flush_interval_s=0.05, lock_timeout_s=5)
    s3.stop()
    writer = WalWriter(tmp_path / "wal")
    shipper = Shipper(tmp_path / "wal", payloads=store(), **fast)  # type: ignore[arg-type]
    shipper.start()
    bodies = [f"payload {i} ".encode() * 50 for i in range(6)] + [os.urandom(3000)]
    for body in bodies:
        writer.append_step((), (), [payload(body, "text/plain")])
    wait_until(lambda: shipper.stats()["sinks"][PAYLOADS_LANE]["errors"] >= 1)
    stats = shipper.stats()["sinks"][PAYLOADS_LANE]
    assert "Could not connect" in stats["last_error"]
    assert stats["unshipped_bytes"] > sum(len(b) for b in bodies)  # the bytes are in the WAL

    s3.start()  # S3 is back while the same shipper runs
    wait_until(lambda: shipper.stats()["sinks"][PAYLOADS_LANE]["unshipped_bytes"] == 0)
    reader = store()
    for body in bodies:
        assert reader.get(hashlib.sha256(body).hexdigest()) == body

    s3.stop()  # down again, and this time the shipper stops before S3 returns
    late = [b"late one " * 40, b"late two " * 40]
    for body in late:
        writer.append_step((), (), [payload(body)])
    wait_until(lambda: shipper.stats()["sinks"][PAYLOADS_LANE]["unshipped_bytes"] > 0)
    shipper.stop(drain_timeout_s=0.5)
    s3.start()
    shipper2 = Shipper(tmp_path / "wal", payloads=store(), **fast)  # type: ignore[arg-type]
    shipper2.start()
    wait_until(lambda: shipper2.stats()["sinks"][PAYLOADS_LANE]["unshipped_bytes"] == 0)
    shipper2.stop()
    writer.close()
    for body in late:
        assert reader.get(hashlib.sha256(body).hexdigest()) == body
    assert len(s3.client().list_objects_v2(Bucket=BUCKET)["Contents"]) == len(bodies) + len(late)


# --- policy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "max_bytes", "is_error", "size", "keep"),
    [
        ("off", None, True, 1, False),
        ("errors", None, False, 1, False),
        ("errors", None, True, 10**9, True),
        ("errors", 100, True, 101, False),
        ("all", 100, False, 100, True),
        ("all", 100, False, 101, False),
        ("all", None, False, 10**9, True),
        ("all", 0, False, 0, True),
    ],
)
def test_payload_policy(mode: str, max_bytes: int | None, is_error: bool, size: int, keep: bool) -> None:
    assert PayloadPolicy(mode, max_bytes).keep(is_error, size) is keep


def test_payload_policy_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="off, errors, all"):
        PayloadPolicy("sometimes")
