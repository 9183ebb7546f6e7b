"""How the local payload store writes its files: a name appears only once the bytes are all
there, whether the file was written unnamed and linked in place (`O_TMPFILE` + `linkat`) or
through a temp name renamed into place (the fallback); a body already on disk is not rewritten,
only touched; a store used in a forked child links its own files."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from proxy.spans.model import Payload
from proxy.spans.payloads import LocalPayloadStore

BODIES = [b'{"ok":true}', b"x" * 5000, b"", bytes(range(256)) * 30]


def payload(data: bytes, content_type: str = "") -> Payload:
    return Payload(hashlib.sha256(data).hexdigest(), data, content_type)


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def temp_and_rename(store: LocalPayloadStore) -> LocalPayloadStore:
    store._unnamed = None  # as on a file system without O_TMPFILE
    return store


@pytest.mark.parametrize("unnamed", [True, False], ids=["linked", "renamed"])
def test_both_ways_of_writing_give_the_same_store(tmp_path: Path, unnamed: bool) -> None:
    store = LocalPayloadStore(tmp_path / "a")
    if unnamed:
        assert store._unnamed is not None, "O_TMPFILE is expected on this test machine (Linux)"
    else:
        temp_and_rename(store)
    reference = temp_and_rename(LocalPayloadStore(tmp_path / "b"))
    batch = [payload(b, ct) for b, ct in zip(BODIES, ["", "application/json", "", "text/plain"], strict=True)]
    assert store.put_many(batch) == []
    assert reference.put_many(batch) == []
    assert files(tmp_path / "a") == files(tmp_path / "b")
    for p in batch:
        assert store.get(p.sha256) == p.data
        assert store.path(p.sha256).read_bytes() == reference.path(p.sha256).read_bytes()
    for name in files(tmp_path / "a"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("unnamed", [True, False], ids=["linked", "renamed"])
def test_a_write_that_fails_leaves_no_name_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unnamed: bool
) -> None:
    store = LocalPayloadStore(tmp_path)
    if not unnamed:
        temp_and_rename(store)
    real_write = os.write
    calls = 0

    def full_disk(fd: int, data: bytes | memoryview) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second body: the first is stored, the second never named
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    first, second = payload(b'{"first":1}'), payload(b'{"second":2}')
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        store.put_many([first, second])
    monkeypatch.setattr(os, "write", real_write)
    names = [Path(name).name for name in files(tmp_path)]
    assert second.sha256 not in names
    assert not [n for n in names if n.endswith(".tmp")]  # nor a temp file
    with pytest.raises(KeyError):
        store.get(second.sha256)
    assert store.put_many([first, second]) == []  # the lane's retry stores both
    assert store.get(first.sha256) == first.data
    assert store.get(second.sha256) == second.data


@pytest.mark.parametrize("data", [b'{"small":true}', b"y" * 5000], ids=["small", "compressed"])
def test_a_body_on_disk_is_touched_not_rewritten(tmp_path: Path, data: bytes) -> None:
    p = payload(data, "application/json")
    LocalPayloadStore(tmp_path).put(p)
    path = LocalPayloadStore(tmp_path).path(p.sha256)
    os.utime(path, (1_000_000, 1_000_000))
    before = path.stat()
    again = LocalPayloadStore(tmp_path)  # a new process: the hash is not among the recent ones
    again.put(p)
    after = path.stat()
    assert after.st_ino == before.st_ino
    assert after.st_mtime > before.st_mtime + 1e6  # retention counts from this store
    assert again.get(p.sha256) == data
    assert sorted(x.name for x in path.parent.iterdir()) == [p.sha256, p.sha256 + ".meta"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_links_its_own_files(tmp_path: Path) -> None:
    store = LocalPayloadStore(tmp_path)
    parent_body = payload(b'{"who":"parent"}')
    store.put(parent_body)  # the parent's /proc/self/fd is open now
    child_body = payload(b'{"who":"child"}')
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            store.put(child_body)
            os._exit(0 if store.get(child_body.sha256) == child_body.data else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get(child_body.sha256) == child_body.data
    assert store.get(parent_body.sha256) == parent_body.data
