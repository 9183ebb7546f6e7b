"""Retention of the local payload store (issue 10, item 4: payload files were most of what filled
the disk): bodies older than `payload_retention_days` go, then the oldest until the store is under
`payload_store_max_bytes`; a body stored again counts from its latest store."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from proxy.config import build_config
from proxy.spans.model import Payload
from proxy.spans.payloads import LocalPayloadStore

DAY = 86400.0


def payload(i: int, size: int = 4096) -> Payload:
    data = (f"body {i} ".encode() * size)[:size]
    return Payload(hashlib.sha256(data).hexdigest(), data)


def age(store: LocalPayloadStore, p: Payload, days: float) -> None:
    t = time.time() - days * DAY
    os.utime(store.path(p.sha256), (t, t))


def stored(store: LocalPayloadStore) -> set[str]:
    return {path.name for path in Path(store.directory).rglob("*") if len(path.name) == 64}


def test_bodies_past_the_retention_are_removed_and_a_reused_one_is_kept(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path, compress=False, fsync=False, retention_days=30)
    old, reused, fresh = payload(1), payload(2), payload(3)
    store.put_many([old, reused, fresh])
    age(store, old, 31)
    age(store, reused, 31)
    store._recent.clear()  # as after a restart: the store must look at the file
    store.put_many([reused])  # stored again today: retention counts from now
    result = store.prune()
    assert result.removed_files == 1
    assert stored(store) == {reused.sha256, fresh.sha256}
    store.put_many([old])  # a removed body that comes back is stored again
    assert store.get(old.sha256) == old.data


def test_the_size_cap_removes_the_oldest_bodies_first(tmp_path: Path) -> None:
    store = LocalPayloadStore(
        tmp_path, compress=False, fsync=False, max_total_bytes=10 * 4096, prune_interval_s=1e9
    )
    bodies = [payload(i) for i in range(8)]
    store.put_many(bodies)
    for i, p in enumerate(bodies):
        age(store, p, 10 - i)  # bodies[0] is the oldest
    store.put_many([payload(i) for i in range(8, 14)])  # over the cap: pruned on the way
    kept = stored(store)
    total = sum(f.stat().st_size for f in Path(tmp_path).rglob("*") if f.is_file())
    assert total <= 10 * 4096
    assert bodies[0].sha256 not in kept and bodies[1].sha256 not in kept
    assert {payload(i).sha256 for i in range(8, 14)} <= kept  # the newest stay


def test_retention_settings_are_validated_and_default_to_30_days(tmp_path: Path) -> None:
    config = build_config({})
    assert config.spans.payload_retention_days == 30 and config.spans.payload_store_max_bytes == 1 << 30
    for bad in ({"payload_retention_days": -1}, {"payload_store_max_bytes": -5}):
        try:
            build_config(bad)
        except Exception as e:
            assert str(e).startswith(next(iter(bad))), e
        else:
            raise AssertionError(f"{bad} accepted")
