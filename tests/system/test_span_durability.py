"""The span path's guarantees with real processes, real stores and `kill -9`, under load from 16
concurrent clients (each request a run of its own, so spans are counted by request):

* `kill -9` of `runcap serve` and its shipper: after a restart every request that got a complete
  response has exactly one model span in ClickHouse and both bodies in the payload store;
* the shipper killed repeatedly under load: the same, without a restart of the proxy;
* ClickHouse (the HTTP fixture) and S3 (moto) down under load: requests unaffected, everything
  delivered exactly once when they return;
* a sink that stays down with a small `wal_max_bytes`: bodies dropped first (counted, hashes
  blanked), spans kept;
* the data directory on a small tmpfs that fills up: answers are 200 or 503 `ledger_unavailable`
  (never a bare 500), nothing written is damaged, and the sinks drain by themselves once the
  stores are back and the shipper frees the disk; counted by run id, every call answered in full
  has its span and every step the WAL dropped is named in the log and was not answered.

Every load loop is bounded in requests and time; nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.spans.control import ShipperClient, ShipperUnavailable
from proxy.spans.payloads import LocalPayloadStore
from tests.conftest import REPO, RuncapProcess
from tests.support.clickhouse import ClickHouseProcess
from tests.support.s3 import CREDENTIALS, S3Server
from tests.support.tmpfs import small_tmpfs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CLIENTS = 16
# ClickHouse and S3 are down this long under load. The issue asks for 60 s; the suite must stay
# within minutes on two cores, and nothing in the shipper depends on the length of an outage (the
# WAL only grows; ten seconds already spans many failed batches and segment rolls, and the drain
# afterwards is what takes time): RUNCAP_TEST_OUTAGE_S=60 runs the full minute.
OUTAGE_S = float(os.environ.get("RUNCAP_TEST_OUTAGE_S", "10"))


@dataclass
class Load:
    """What the clients saw: the run ids whose response arrived complete, statuses, errors."""

    prefix: str
    completed: set[str] = field(default_factory=set)
    statuses: Counter[int] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)  # error type of non-200 answers
    cut: int = 0  # connection errors (runcap killed, restarting)
    sent: int = 0


async def drive(
    url: str,
    load: Load,
    stop: asyncio.Event,
    *,
    max_requests: int,
    max_seconds: float,
    body_bytes: int = 0,
    pause_s: float = 0.0,
) -> None:
    """CLIENTS closed-loop clients until `stop`, `max_requests` or `max_seconds`. A third of the
    calls stream; a response counts as complete when all of it arrived ([DONE] for a stream)."""
    deadline = time.monotonic() + max_seconds
    text = "x" * body_bytes if body_bytes else "hi"

    async def client(c: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            i = 0
            while not stop.is_set() and load.sent < max_requests and time.monotonic() < deadline:
                run = f"{load.prefix}-{c}-{i}"
                i += 1
                load.sent += 1
                stream = i % 3 == 0
                body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"{run} {text}"}]}
                if stream:
                    body["stream"] = True
                try:
                    async with s.post(
                        f"{url}/v1/chat/completions", json=body, headers={"X-Run-Id": run}
                    ) as r:
                        data = await r.read()
                        load.statuses[r.status] += 1
                        if r.status == 200 and (not stream or b"data: [DONE]" in data):
                            load.completed.add(run)
                        elif r.status != 200:
                            try:
                                load.refusals[(await r.json(content_type=None))["error"]["type"]] += 1
                            except (ValueError, KeyError, TypeError):
                                load.refusals[f"unparsed {r.status}"] += 1
                except (TimeoutError, aiohttp.ClientError, OSError):
                    load.cut += 1
                    await asyncio.sleep(0.05)
                if pause_s:
                    await asyncio.sleep(pause_s)

    await asyncio.gather(*(client(c) for c in range(CLIENTS)))


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def summed(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


async def wait_drained(url: str, sinks: tuple[str, ...], timeout_s: float = 180.0) -> dict[str, float]:
    """Until the shipper answers and no sink has anything left in the WAL (twice in a row)."""
    deadline = time.monotonic() + timeout_s
    good = 0
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        try:
            m = await metrics(url)
        except (aiohttp.ClientError, OSError):
            m = {}
        done = m.get("runcap_shipper_up") == 1 and all(
            m.get(f'runcap_wal_unshipped_bytes{{sink="{sink}"}}', -1) == 0 for sink in sinks
        )
        good = good + 1 if done else 0
        if good >= 2:
            return m
        await asyncio.sleep(0.5)
    raise AssertionError(f"the WAL did not drain: {m}")


async def admin_sql(proc: RuncapProcess, sql: str) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{proc.url}/admin/sql", json={"sql": sql}, headers=proc.admin) as r,
    ):
        assert r.status == 200, await r.text()
        d = await r.json()
    return [dict(zip(d["columns"], row, strict=True)) for row in d["rows"]]


async def model_spans(proc: RuncapProcess, prefix: str) -> dict[str, list[dict[str, Any]]]:
    rows = await admin_sql(
        proc,
        "SELECT run_id, request_hash, response_hash FROM runcap.spans "
        f"WHERE kind = 'model' AND startsWith(run_id, '{prefix}-')",
    )
    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_run.setdefault(row["run_id"], []).append(row)
    return by_run


def assert_exactly_once(load: Load, spans: dict[str, list[dict[str, Any]]]) -> None:
    duplicated = {run: len(rows) for run, rows in spans.items() if len(rows) > 1}
    lost = load.completed - set(spans)
    assert not duplicated, (
        f"{len(duplicated)} runs with more than one model span: {list(duplicated.items())[:5]}"
    )
    assert not lost, f"{len(lost)} completed requests without a span: {sorted(lost)[:5]}"


def dropped_runs(log: str) -> set[str]:
    """The runs the WAL's drop lines name (`WAL: N records of spans dropped (...); runs: ...`)."""
    found = re.findall(r"WAL: \d+ records? of spans dropped .*?; runs: (.*?) \(\d+ payload bodies", log)
    return {run for names in found for run in names.split()}


def shipper_pid(data_dir: Path, not_pid: int = 0, timeout_s: float = 60.0) -> int:
    """The running shipper's pid (a new one when `not_pid` is given), once it answers."""
    deadline = time.monotonic() + timeout_s
    client = ShipperClient(data_dir, timeout_s=2)
    while time.monotonic() < deadline:
        with contextlib.suppress(ShipperUnavailable, OSError, ValueError):
            pid = int(client.request_sync({"op": "stats"})["stats"]["pid"])
            if pid != not_pid:
                return pid
        time.sleep(0.1)
    raise AssertionError("no span shipper came up")


def kill9(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def write_config(path: Path, upstream_url: str, extra: str = "") -> Path:
    path.write_text(f'log_requests = false\n{extra}\n[upstreams.openai]\nurl = "{upstream_url}"\n')
    return path


# --- the proxy process ---------------------------------------------------------------------------

IMPORTS = """
import sys
from proxy.config import build_config
from proxy.app import build_app
config = build_config(
    {"log_requests": False, "s3_url": "s3://bucket/p", "otlp_endpoint": "http://127.0.0.1:9"},
    {}, data_dir=sys.argv[1],
)
app = build_app(config, span_options={"shipper": "external"})  # as `runcap serve` builds it
clients = {"chdb", "clickhouse_connect", "boto3", "botocore", "opentelemetry"}
print(sorted({m.split(".")[0] for m in sys.modules} & clients))
"""


def test_a_traced_proxy_imports_no_store_client(tmp_path: Path) -> None:
    """The request path only appends: ClickHouse, S3 and OTLP clients live in the shipper."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS, str(tmp_path / "data")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- kill -9 ----------------------------------------------------------------------------------------


async def test_kill9_of_serve_and_shipper_under_load_loses_and_duplicates_nothing(upstream, tmp_path):  # type: ignore[no-untyped-def]
    config = write_config(tmp_path / "runcap.toml", upstream.url)
    data = tmp_path / "data"
    proc = RuncapProcess(config, data)
    proc.start()
    try:
        shipper = shipper_pid(data)
        assert proc.proc is not None
        # chdb lives in the shipper only
        assert "chdb" not in Path(f"/proc/{proc.proc.pid}/maps").read_text()
        assert "chdb" in Path(f"/proc/{shipper}/maps").read_text()
        load, stop = Load("k9"), asyncio.Event()
        traffic = asyncio.create_task(drive(proc.url, load, stop, max_requests=20_000, max_seconds=60))
        while len(load.completed) < 600 and not traffic.done():
            await asyncio.sleep(0.05)
        assert proc.proc is not None
        kill9(proc.proc.pid)  # both at once, mid-traffic: spans in flight, in the WAL, in a batch
        kill9(shipper)
        proc.proc.wait(10)
        stop.set()
        await traffic
        for _ in range(100):
            if not alive(shipper):
                break
            await asyncio.sleep(0.05)
        assert not alive(shipper)
        assert len(load.completed) >= 600 and load.cut > 0  # requests were cut by the kill

        proc.start()  # same data directory: a new shipper ships what the WAL holds
        await wait_drained(proc.url, ("clickhouse", "payloads"))
        spans = await model_spans(proc, "k9")
        assert_exactly_once(load, spans)
        runs = {r["run_id"] for r in await admin_sql(proc, "SELECT DISTINCT run_id FROM runcap.runs")}
        assert load.completed <= runs
        store = LocalPayloadStore(data / "payloads")
        for run in load.completed:
            (row,) = spans[run]
            for h in (row["request_hash"], row["response_hash"]):
                assert h and hashlib.sha256(store.get(h)).hexdigest() == h
        m = await metrics(proc.url)
        assert summed(m, "runcap_wal_damaged_records_total") == 0
    finally:
        proc.stop()


async def test_shipper_killed_repeatedly_under_load(upstream, tmp_path):  # type: ignore[no-untyped-def]
    config = write_config(tmp_path / "runcap.toml", upstream.url)
    data = tmp_path / "data"
    proc = RuncapProcess(config, data)
    proc.start()
    try:
        load, stop = Load("sk"), asyncio.Event()
        traffic = asyncio.create_task(drive(proc.url, load, stop, max_requests=30_000, max_seconds=120))
        pid = shipper_pid(data)
        kills = 0
        while kills < 4 and not traffic.done():
            await asyncio.sleep(1.0)  # it ships (and is maybe mid-insert) when it is killed
            kill9(pid)
            kills += 1
            pid = await asyncio.to_thread(shipper_pid, data, pid)  # restarted by serve
        stop.set()
        await traffic
        assert kills == 4 and load.cut == 0  # the proxy never noticed
        assert set(load.statuses) == {200}
        m = await wait_drained(proc.url, ("clickhouse", "payloads"))
        assert m["runcap_shipper_restarts_total"] == 4
        spans = await model_spans(proc, "sk")
        assert_exactly_once(load, spans)
        assert set(spans) == load.completed
    finally:
        proc.stop()
    log = (tmp_path / "runcap.log").read_text()
    assert len(re.findall(r"span shipper \(pid \d+\) exited with -9; restarting", log)) == 4


# --- stores down -----------------------------------------------------------------------------------


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    server = S3Server().start()
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    server.client().create_bucket(Bucket="payloads")
    yield server
    server.stop()


def s3_keys(s3: S3Server) -> set[str]:
    keys: set[str] = set()
    for page in s3.client().get_paginator("list_objects_v2").paginate(Bucket="payloads", Prefix="runcap/"):
        keys |= {o["Key"] for o in page.get("Contents", [])}
    return keys


async def test_clickhouse_and_s3_down_under_load_then_everything_once(upstream, tmp_path, s3):  # type: ignore[no-untyped-def]
    ch = ClickHouseProcess(tmp_path / "ch")  # down: not started yet
    s3.stop()
    config = write_config(
        tmp_path / "runcap.toml",
        upstream.url,
        f'clickhouse_url = "{ch.url}"\ns3_url = "s3://payloads/runcap/"',
    )
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        load, stop = Load("down"), asyncio.Event()
        # ~80 req/s: moto (in this process) takes ~130 PUTs/s, so the drain stays short
        await drive(proc.url, load, stop, max_requests=20_000, max_seconds=OUTAGE_S, pause_s=0.2)
        assert load.cut == 0 and set(load.statuses) == {200} and load.completed  # unaffected
        m = await metrics(proc.url)
        assert m['runcap_wal_unshipped_bytes{sink="clickhouse"}'] > 0
        assert m['runcap_wal_unshipped_bytes{sink="payloads"}'] > 0
        assert m['runcap_sink_errors_total{sink="clickhouse"}'] > 0
        assert m['runcap_wal_oldest_unshipped_age_seconds{sink="clickhouse"}'] > 0
        ch.start()
        s3.start()
        await wait_drained(proc.url, ("clickhouse", "payloads"))
        spans = await model_spans(proc, "down")
        assert_exactly_once(load, spans)
        assert set(spans) == load.completed
        keys = s3_keys(s3)
        hashes = {r[h] for rows in spans.values() for r in rows for h in ("request_hash", "response_hash")}
        assert "" not in hashes and {f"runcap/sha256/{h[:2]}/{h}" for h in hashes} <= keys
    finally:
        proc.stop()
        ch.stop()


async def test_wal_cap_with_a_sink_down_drops_bodies_first_never_spans(upstream, tmp_path):  # type: ignore[no-untyped-def]
    ch = ClickHouseProcess(tmp_path / "ch")  # down for the whole load
    cap = 4 << 20
    config = write_config(
        tmp_path / "runcap.toml", upstream.url,
        f'clickhouse_url = "{ch.url}"\nwal_max_bytes = {cap}\nwal_segment_bytes = {256 << 10}',
    )  # fmt: skip
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        load, stop = Load("cap"), asyncio.Event()
        traffic = asyncio.create_task(
            drive(proc.url, load, stop, max_requests=3000, max_seconds=90, body_bytes=8 << 10)
        )
        dropped = 0.0
        while not traffic.done():
            m = await metrics(proc.url)
            dropped = m['runcap_wal_dropped_total{what="payload",writer="0"}']
            if dropped >= 40:
                break
            await asyncio.sleep(0.2)
        stop.set()
        await traffic
        assert dropped > 0 and set(load.statuses) == {200}
        m = await metrics(proc.url)
        assert m['runcap_wal_dropped_total{what="record",writer="0"}'] == 0  # spans never dropped
        assert m["runcap_wal_bytes"] <= cap
        dropped = m['runcap_wal_dropped_total{what="payload",writer="0"}']
        ch.start()
        await wait_drained(proc.url, ("clickhouse", "payloads"))
        spans = await model_spans(proc, "cap")
        assert_exactly_once(load, spans)
        assert set(spans) == load.completed
        blank = sum(
            1 for rows in spans.values() for r in rows for h in ("request_hash", "response_hash") if not r[h]
        )
        assert blank == dropped  # every dropped body is a blank hash: no span names a body not stored
    finally:
        proc.stop()
        ch.stop()


# --- disk full ------------------------------------------------------------------------------------------




async def test_disk_full_under_load_then_the_sinks_drain_by_themselves(upstream, tmp_path, s3):  # type: ignore[no-untyped-def]
    ch = ClickHouseProcess(tmp_path / "ch")  # its data is not on the small disk; down until it fills
    s3.stop()
    config = write_config(
        tmp_path / "runcap.toml", upstream.url,
        f'clickhouse_url = "{ch.url}"\ns3_url = "s3://payloads/runcap/"\nwal_segment_bytes = {512 << 10}',
    )  # fmt: skip
    with small_tmpfs(tmp_path / "data", "24m") as data:
        proc = RuncapProcess(config, data)
        proc.start()
        try:
            # The shipper up before the disk fills, as in a running deployment: it cannot start on
            # a full disk (its cursor files need room), and then nothing would free it.
            await asyncio.to_thread(shipper_pid, data)
            load, stop = Load("full"), asyncio.Event()
            traffic = asyncio.create_task(
                drive(proc.url, load, stop, max_requests=20_000, max_seconds=120, body_bytes=16 << 10)
            )
            errors = 0.0
            while not traffic.done():  # until the WAL hit ENOSPC a while ago
                m = await metrics(proc.url)
                errors = summed(m, "runcap_wal_append_errors_total")
                if errors and load.statuses[503] >= 50:
                    break
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # and a little longer on the full disk
            stop.set()
            await traffic
            assert errors > 0
            ch.start()  # the stores return: the shipper ships, deletes segments, the disk frees up
            s3.start()
            await wait_drained(proc.url, ("clickhouse", "payloads"))
            more = Load("after")
            await drive(proc.url, more, asyncio.Event(), max_requests=200, max_seconds=30)
            # answered all along: 200, or 503 ledger_unavailable while the ledger could not write
            assert set(load.statuses) <= {200, 503} and load.cut == 0, (load.statuses, load.refusals)
            assert set(load.refusals) <= {"ledger_unavailable"}, load.refusals
            assert load.statuses[503] > 0
            assert set(more.statuses) == {200}  # the disk has room again, without a restart
            m = await wait_drained(proc.url, ("clickhouse", "payloads"))
            assert summed(m, "runcap_wal_damaged_records_total") == 0  # nothing written was damaged
            spans = await model_spans(proc, "full")
            lost = load.completed - set(spans)
            print(f"disk full: {load.sent} sent, {dict(load.statuses)}, {len(load.completed)} complete, "
                  f"{len(lost)} without spans; WAL: {summed(m, 'runcap_wal_append_errors_total'):.0f} "
                  f"failed appends, dropped {m}")  # fmt: skip
            # A response can complete while the WAL has no room even for its spans: counted.
            assert len(lost) <= m['runcap_wal_dropped_total{what="record",writer="0"}']
            assert not {run: rows for run, rows in spans.items() if len(rows) > 1}
            assert_exactly_once(more, await model_spans(proc, "after"))
        finally:
            proc.stop()
            ch.stop()
    # ... and now it cannot: a step is answered only once it is on record; one the WAL dropped
    # was refused (never answered), counted once per step, and named in the log.
    assert not lost, f"{len(lost)} completed requests without a span: {sorted(lost)[:5]}"
    dropped = dropped_runs((tmp_path / "runcap.log").read_text(errors="replace"))
    assert len(dropped) == m['runcap_wal_dropped_total{what="record",writer="0"}']
    assert not dropped & load.completed and not dropped & set(spans)
