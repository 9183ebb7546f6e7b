"""The disk-full scenario of issue 27, counted by run id, round after round.

Per round: the data directory on a small tmpfs (root only) with a ballast file on it, the
ClickHouse store (the chdb-backed HTTP fixture) and S3 (moto, for the bodies) stopped so the WAL
grows, `runcap serve` under 16
closed-loop clients — half of them streaming, 1,500 output tokens each, every call a run of its
own — until the disk is full (WAL append errors and 503s), a little longer on the full disk; then
the ballast deleted (space freed), the stores started, the WAL drained, runcap restarted, and up to
`--ship-s` seconds to ship what the WAL holds.

A call counts as answered when it got 200 and, for a stream, its `[DONE]`. Counted by run id:

* answered without a model span in ClickHouse and not named in a drop line of the log
  (`WAL: N records of spans dropped ...; runs: ...`) — the goal is 0 every round;
* dropped (the runs the log names; the drop counter before the restart) against missing (the
  answered calls without a span), against the calls the WAL refused (503 / an error event with
  code ledger_disk_full saying the call could not be put on record) and against the calls that
  were not answered at all (those, plus the ledger's own 503s whose refusal span was dropped): the
  contract is that no answered call is missing, and no dropped run was answered.

    .venv/bin/python -m bench.disk_full [--rounds 5] [--tmpfs 20m] [--clients 16] [--json out.json]

Every phase is bounded in time; each round takes one to three minutes on two shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import RuncapProcess
from tests.support.s3 import CREDENTIALS, S3Server
from tests.support.tmpfs import small_tmpfs
from tests.system.test_spans import ClickHouseProcess

SCRIPT = "long"
DROP_LINE = re.compile(r"WAL: \d+ records? of spans dropped .*?; runs: (.*?) \(\d+ payload bodies")


@dataclass
class Calls:
    answered: set[str] = field(default_factory=set)  # 200, and a stream's [DONE]
    unanswered: set[str] = field(default_factory=set)  # anything else: refused, cut
    wal_refused: set[str] = field(default_factory=set)  # the WAL could not put it on record
    statuses: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    cut: int = 0


async def call(s: aiohttp.ClientSession, url: str, run: str, stream: bool, calls: Calls) -> None:
    body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": run}]}
    if stream:
        body["stream"] = True
    headers = {"X-Run-Id": run, "X-Mock-Script": SCRIPT}
    try:
        async with s.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            data = await r.read()
    except (TimeoutError, aiohttp.ClientError, OSError):
        calls.cut += 1
        calls.unanswered.add(run)
        await asyncio.sleep(0.05)
        return
    done = not stream or data.rstrip().endswith(b"data: [DONE]")
    kind = f"{r.status}{' stream' if stream else ''}"
    if r.status == 200 and done:
        calls.answered.add(run)
        calls.statuses[kind] += 1
        return
    calls.unanswered.add(run)
    if b"ledger_disk_full" in data and b"on record" in data:
        calls.wal_refused.add(run)
        kind += " wal_refused"
    elif b"ledger_disk_full" in data:
        kind += " ledger_disk_full"
    calls.statuses[kind] += 1


async def drive(url: str, prefix: str, calls: Calls, stop: asyncio.Event, clients: int, max_s: float) -> None:
    deadline = time.monotonic() + max_s

    async def client(c: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            i = 0
            while not stop.is_set() and time.monotonic() < deadline and calls.sent < 50_000:
                calls.sent += 1
                await call(s, url, f"{prefix}-{c}-{i}", c % 2 == 0, calls)
                i += 1

    await asyncio.gather(*(client(c) for c in range(clients)))


async def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
            text = await r.text()
    except (aiohttp.ClientError, OSError):
        return out
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def drained(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    good = 0
    while time.monotonic() < deadline:
        m = await metrics(url)
        left = [m.get(f'runcap_wal_unshipped_bytes{{sink="{s}"}}', -1) for s in ("clickhouse", "payloads")]
        ok = m.get("runcap_shipper_up") == 1 and left == [0, 0]
        good = good + 1 if ok else 0
        if good >= 2:
            return True
        await asyncio.sleep(0.5)
    return False


async def model_spans(proc: RuncapProcess, prefix: str) -> Counter[str]:
    sql = f"SELECT run_id FROM runcap.spans WHERE kind = 'model' AND startsWith(run_id, '{prefix}-')"
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{proc.url}/admin/sql", json={"sql": sql}, headers=proc.admin) as r,
    ):
        d = await r.json()
    return Counter(row[0] for row in d["rows"])


async def one_round(n: int, args: argparse.Namespace, upstream_url: str, s3: S3Server) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="runcap-disk-full-") as tmp:
        root = Path(tmp)
        ch = ClickHouseProcess(root / "ch")  # its data is not on the small disk; down until the end
        config = root / "runcap.toml"
        config.write_text(
            f'log_requests = false\nclickhouse_url = "{ch.url}"\nwal_segment_bytes = {512 << 10}\n'
            f's3_url = "s3://payloads/r{n}/"\n'
            f'[upstreams.openai]\nurl = "{upstream_url}"\n'
        )
        with small_tmpfs(root / "data", args.tmpfs) as data:
            (data / "ballast").write_bytes(b"\0" * (args.ballast_mb << 20))
            s3.stop()
            proc = RuncapProcess(config, data)
            proc.start()
            try:
                # the shipper up first, as in a running deployment (it cannot start on a full disk:
                # its cursor files need room)
                deadline = time.monotonic() + 60
                while (await metrics(proc.url)).get("runcap_shipper_up") != 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                calls, stop = Calls(), asyncio.Event()
                t0 = time.monotonic()
                load = drive(proc.url, f"r{n}", calls, stop, args.clients, args.fill_s)
                traffic = asyncio.create_task(load)
                m: dict[str, float] = {}
                while not traffic.done():  # until the WAL failed and calls were refused a while
                    m = await metrics(proc.url)
                    failing = sum(v for k, v in m.items() if k.startswith("runcap_wal_append_errors_total"))
                    refused = sum(v for k, v in calls.statuses.items() if "disk_full" in k)
                    if failing and refused >= 50:
                        break
                    await asyncio.sleep(0.2)
                await asyncio.sleep(args.full_s)  # and longer on the full disk
                stop.set()
                await traffic
                fill_s = time.monotonic() - t0
                m = await metrics(proc.url)
                dropped_metric = m.get('runcap_wal_dropped_total{what="record",writer="0"}', 0.0)
                (data / "ballast").unlink()  # space freed
                ch.start()  # the stores are back: the shipper ships and deletes segments
                s3.start()
                drained_before = await drained(proc.url, 180)
                proc.stop()  # the restart
                proc.start()
                drained_after = await drained(proc.url, args.ship_s)
                spans = await model_spans(proc, f"r{n}")
            finally:
                proc.stop()
                ch.stop()
                if not s3.running:
                    s3.start()
            log = (root / "runcap.log").read_text(errors="replace")
    dropped = {run for names in DROP_LINE.findall(log) for run in names.split()}
    missing = calls.answered - set(spans)
    result = {
        "round": n,
        "sent": calls.sent,
        "answered": len(calls.answered),
        "answered_with_span": len(calls.answered & set(spans)),
        "answered_without_span_not_dropped": len(missing - dropped),
        "missing": len(missing),
        "dropped_logged": len(dropped),
        "dropped_metric": dropped_metric,
        "unanswered": len(calls.unanswered),
        "wal_refused": len(calls.wal_refused),
        "dropped_but_answered": len(dropped & calls.answered),
        "wal_refused_not_dropped": len(calls.wal_refused - dropped),
        "duplicated": sum(1 for v in spans.values() if v > 1),
        "statuses": dict(calls.statuses),
        "cut": calls.cut,
        "fill_s": round(fill_s, 1),
        "drained_before_restart": drained_before,
        "drained_after_restart": drained_after,
        "examples_missing": sorted(missing)[:5],
    }
    print(json.dumps(result), flush=True)
    return result


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tmpfs", default="20m")
    ap.add_argument("--ballast-mb", type=int, default=4, help="freed after the fill (space returns)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=1500)
    ap.add_argument("--fill-s", type=float, default=120.0, help="bound of the load phase")
    ap.add_argument("--full-s", type=float, default=2.0, help="load kept on the full disk this long")
    ap.add_argument("--ship-s", type=float, default=60.0, help="after the restart, time to ship")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from proxy.scripted_upstream import ScriptedUpstream

    upstream = ScriptedUpstream({SCRIPT: [{"text_tokens": args.output_tokens}]}, record=False)
    await upstream.start()
    s3 = S3Server().start()
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": s3.endpoint_url})  # for runcap serve
    s3.client().create_bucket(Bucket="payloads")
    try:
        assert upstream.url is not None
        results = [await one_round(n, args, upstream.url, s3) for n in range(1, args.rounds + 1)]
    finally:
        await upstream.stop()
        s3.stop()
    print("round  answered  with span  without span & not dropped  missing  dropped (log/metric)  "
          "dropped & answered  refused by the WAL")  # fmt: skip
    for r in results:
        print(f"{r['round']:>5}  {r['answered']:>8}  {r['answered_with_span']:>9}  "
              f"{r['answered_without_span_not_dropped']:>26}  {r['missing']:>7}  "
              f"{r['dropped_logged']:>9} / {r['dropped_metric']:<8.0f}  {r['dropped_but_answered']:>18}  "
              f"{r['wal_refused']:>18}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
