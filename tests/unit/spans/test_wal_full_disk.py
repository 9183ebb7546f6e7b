"""The WAL's contract under a disk that fills, counted by run id: a call is answered only once
its record is in the WAL.

runcap in-process (tracing on, no shipper: the WAL only grows, as with the store down), the
official wire formats from the scripted upstream, 16 clients — half of them streaming — each call
a run of its own. The disk fills at the WAL's system call (tests/support/disk.py: `writev` gets
a short write, then ENOSPC): group writes are torn, records are held, then dropped. Then space
returns and runcap restarts. Every call that was answered in full (200 and, for a stream, its
`[DONE]`) has exactly one model span in the WAL; every other call was refused (503
`ledger_disk_full`, or that error event in place of a stream's `[DONE]`), and those are exactly
the runs the drop counter counts and the log names. The data directory on a real small tmpfs is
tests/system/test_span_durability.py's disk-full test and bench/disk_full.py.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.app import RUNTIME, Runtime, build_app
from proxy.scripted_upstream import ScriptedUpstream
from proxy.spans.wal import read_frames, segment_sealed, segments
from tests.conftest import runcap_config
from tests.support.disk import FillingDisk
from tests.support.wal import all_records

CLIENTS = 16


@dataclass
class Calls:
    """What the clients saw, by run id."""

    answered: set[str] = field(default_factory=set)  # 200, and a stream's [DONE]
    refused: set[str] = field(default_factory=set)  # 503 ledger_disk_full, or its error event
    other: Counter[str] = field(default_factory=Counter)
    # answered calls that were in flight when space returned (held, then appended first)
    across_free: set[str] = field(default_factory=set)
    freed_at: float = float("inf")


async def call(s: aiohttp.ClientSession, url: str, run: str, stream: bool, calls: Calls) -> None:
    body: dict[str, object] = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": run}]}
    if stream:
        body["stream"] = True
    started = time.monotonic()
    async with s.post(f"{url}/v1/chat/completions", json=body, headers={"X-Run-Id": run}) as r:
        data = await r.read()
    if r.status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n")):
        calls.answered.add(run)
        if started < calls.freed_at < time.monotonic():
            calls.across_free.add(run)
    elif b'"ledger_disk_full"' in data and b"[DONE]" not in data and r.status == (200 if stream else 503):
        calls.refused.add(run)
    else:
        calls.other[f"{r.status} {data[:200]!r}"] += 1


async def load(url: str, prefix: str, calls: Calls, stop: asyncio.Event, max_calls: int) -> None:
    sent = 0

    async def client(c: int) -> None:
        nonlocal sent
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            i = 0
            while not stop.is_set() and sent < max_calls:
                sent += 1
                await call(s, url, f"{prefix}-{c}-{i}", c % 2 == 0, calls)
                i += 1

    await asyncio.gather(*(client(c) for c in range(CLIENTS)))


async def start(
    upstream: ScriptedUpstream, data: Path, **settings: object
) -> tuple[str, Runtime, web.AppRunner]:
    assert upstream.url is not None
    config = runcap_config(upstream.url, data, {"tracing": True, "wal_hold_ms": 300, **settings})
    app = build_app(config, span_options={"shipper": "external"})  # nothing ships: the WAL grows
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", app[RUNTIME], runner


async def until(condition, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not reached: {what}"
        await asyncio.sleep(0.02)


async def dropped_metric(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    (value,) = re.findall(r'^runcap_wal_dropped_total\{what="record",writer="0"\} (\S+)$', text, re.M)
    return float(value)


def logged_runs(text: str) -> list[str]:
    return [run for names in re.findall(r"runs: (.*?) \(\d+ payload bodies", text) for run in names.split()]


async def test_a_filling_disk_answers_only_what_is_on_record_across_a_restart(
    upstream: ScriptedUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    caplog.set_level("ERROR", logger="runcap.wal")
    upstream.scripts["default"] = [{"text_tokens": 300}]  # answers of some size: groups of KiBs
    data = tmp_path / "data"
    url, runtime, runner = await start(upstream, data)
    writer = runtime.spans.writer
    assert writer is not None
    disk = FillingDisk(monkeypatch)
    calls, stop = Calls(), asyncio.Event()
    try:
        traffic = asyncio.create_task(load(url, "full", calls, stop, max_calls=20_000))
        await until(lambda: len(calls.answered) >= 100 or traffic.done(), "answers before the disk fills")
        disk.fill(room=48 << 10)  # the disk fills a few groups from now: a torn group write
        held_peak = 0

        def full_for_a_while() -> bool:
            nonlocal held_peak
            held_peak = max(held_peak, writer.stats().held_records)
            return traffic.done() or (disk.short_writes >= 1 and len(calls.refused) >= 40 and held_peak > 0)

        await until(full_for_a_while, "calls held, then refused, on the full disk")
        await until(lambda: writer.stats().held_records > 0 or traffic.done(), "calls held at the free")
        calls.freed_at = time.monotonic()
        disk.free()
        answered_at_free = len(calls.answered)
        await until(lambda: len(calls.answered) >= answered_at_free + 100 or traffic.done(), "answers again")
        stop.set()
        await traffic
        dropped = await dropped_metric(url)
        stats = writer.stats()
    finally:
        stop.set()
        await runner.cleanup()  # shutting down: nothing is held any more (it all found room)
    # the restart: a new process on the same slot and data directory
    url, runtime, runner = await start(upstream, data)
    try:
        after = Calls()
        await load(url, "after", after, asyncio.Event(), max_calls=32)
    finally:
        await runner.cleanup()

    print(f"filling disk: {len(calls.answered)} answered, {len(calls.refused)} refused, "
          f"{len(calls.across_free)} held across the free, peak held {held_peak}, dropped {dropped:.0f}, "
          f"{disk.short_writes} short writes, {disk.failed_writes} failed writes")  # fmt: skip
    assert not calls.other and not after.other, (calls.other, after.other)
    assert disk.short_writes >= 1 and disk.failed_writes >= 1
    assert held_peak > 0 and calls.across_free  # held while full, appended (and answered) after
    assert stats.held_records == 0

    model_spans = Counter(
        s.run_id for r in all_records(data / "wal") for s in r.spans() if s.kind == "model"
    )
    # every call answered in full has its span, exactly once — across the restart
    lost = calls.answered - set(model_spans)
    assert not lost, f"{len(lost)} answered calls without a span: {sorted(lost)[:5]}"
    assert set(after.answered) <= set(model_spans) and len(after.answered) == 32
    assert not [run for run, n in model_spans.items() if n > 1]
    # every call without a span was refused, counted once per step and named in the log
    assert calls.refused and not calls.refused & set(model_spans)
    assert dropped == stats.dropped_records == len(calls.refused)
    assert sorted(logged_runs(caplog.text)) == sorted(calls.refused)
    # nothing written was torn or damaged
    for name in segments(data / "wal"):
        path = data / "wal" / name
        res = read_frames(path, 0, sealed=segment_sealed(path), max_bytes=1 << 30)
        assert res.damaged == 0 and res.torn_bytes == 0, name


# (path, body, the stream's closing event) per wire format: none of it may reach the agent when
# the call is not on record — whether or not the stream is complete (a chat stream without usage).
STREAMS = {
    "chat": ("/v1/chat/completions", {"model": "gpt-4o-mini", "stream": True,
             "messages": [{"role": "user", "content": "hi"}]}, b"data: [DONE]"),
    "chat, no usage": ("/v1/chat/completions", {"model": "gpt-4o-mini", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}, b"data: [DONE]"),
    "responses": ("/v1/responses", {"model": "gpt-4o-mini", "input": "hi", "stream": True},
                  b"event: response.completed"),
    "anthropic": ("/anthropic/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 64, "stream": True,
                  "messages": [{"role": "user", "content": "hi"}]}, b"event: message_stop"),
}  # fmt: skip


async def test_no_room_and_no_hold_refuses_every_format_without_its_closing_event(
    upstream: ScriptedUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream.scripts["no-usage"] = [{"text": "an answer", "omit_usage": True}]
    url, runtime, runner = await start(upstream, tmp_path / "data", wal_hold_bytes=0)
    disk = FillingDisk(monkeypatch, room=0)
    try:
        async with aiohttp.ClientSession() as s:
            for name, (path, body, closing) in STREAMS.items():
                headers = {"X-Run-Id": f"run-{name.replace(' ', '').replace(',', '-')}"}
                if name == "chat, no usage":
                    headers["X-Mock-Script"] = "no-usage"
                async with s.post(f"{url}{path}", json=body, headers=headers) as r:
                    data = await r.read()
                assert r.status == 200 and closing not in data, (name, data[-300:])
                # the error in the format's shape (Anthropic's carries no code)
                assert b'"ledger_unavailable"' in data and b"could not put this call" in data, name
                assert name == "anthropic" or b'"ledger_disk_full"' in data, name
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"X-Run-Id": "run-buffered"}
            async with s.post(f"{url}/v1/chat/completions", headers=headers, json=body) as r:
                refused = await r.json()
            assert r.status == 503 and r.headers["x-should-retry"] == "true"
            assert refused["error"]["type"] == "ledger_unavailable"
            assert refused["error"]["code"] == "ledger_disk_full"
        assert runtime.spans.writer is not None and runtime.spans.writer.stats().dropped_records == 5
        disk.free()
        async with aiohttp.ClientSession() as s:  # room again: the same calls, answered in full
            for name, (path, body, closing) in STREAMS.items():
                headers = {"X-Mock-Script": "no-usage"} if name == "chat, no usage" else {}
                async with s.post(f"{url}{path}", json=body, headers=headers) as r:
                    data = await r.read()
                assert r.status == 200 and closing in data and b"ledger_disk_full" not in data, name
    finally:
        await runner.cleanup()
