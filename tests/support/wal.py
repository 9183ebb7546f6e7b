"""Spans, runs and payloads to write to the WAL, and readers of what a WAL holds."""

from __future__ import annotations

import hashlib
import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.records import StepRecord
from proxy.spans.wal import read_frames, segment_sealed, segments

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def make_span(i: int, run_id: str = "run-1", **kw: object) -> Span:
    fields: dict[str, object] = dict(
        run_id=run_id,
        kind="model",
        step=i,
        started_at=T0 + timedelta(microseconds=i),
        model="gpt-4o-mini",
        cost_usd=Decimal("0.000123450") * i,
        attributes={"i": str(i)},
    )
    fields.update(kw)
    return Span(**fields)  # type: ignore[arg-type]


def make_run(i: int, run_id: str = "run-1") -> RunSnapshot:
    return RunSnapshot(
        run_id=run_id, task="triage", started_at=T0, updated_at=T0 + timedelta(seconds=i),
        status="active", steps=i, tool_calls=0, input_tokens=10 * i, output_tokens=i,
        cost_usd=Decimal("0.5"), max_usd=None, max_tokens=1000, max_steps=None, max_tool_calls=None,
        deadline=None,
    )  # fmt: skip


def payload(data: bytes) -> Payload:
    return Payload(hashlib.sha256(data).hexdigest(), data, "application/json")


def all_records(wal: Path) -> list[StepRecord]:
    out = []
    for name in segments(wal):
        res = read_frames(wal / name, 0, sealed=segment_sealed(wal / name), max_bytes=1 << 30)
        out += [StepRecord(f.body) for f in res.frames]
    return out


def count_writevs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From here on, the number of buffers of each `os.writev` (which still writes), in order."""
    writes: list[int] = []
    real = os.writev

    def counting(fd: int, parts: list[bytes]) -> int:
        writes.append(len(parts))
        return real(fd, parts)

    monkeypatch.setattr(os, "writev", counting)
    return writes
