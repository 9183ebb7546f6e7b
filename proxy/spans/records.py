"""What one write-ahead-log record holds — the records of one step: its spans, the run's newest
state, and the payload bodies — and their bytes.

The request path encodes (`encode_step`, a few µs per span, no ClickHouse types); the shipper
decodes only what each sink needs (`StepRecord`): the ClickHouse lane sends the span and run
lines as they are (`JSONCompactEachRow`), the OTLP lane rebuilds `Span`s, the payload lane takes
the bodies. Body layout (little-endian):

    u8 version (3) | 3 pad | u32 spans | u32 runs | u32 payloads | u32 spans_len | u32 runs_len | u32 meta_len
    spans: one JSON array per line: the values of SPAN_FIELDS (the `runcap.spans` columns), in order;
           `events` as an array of `[name, at, attributes]` (a SpanEvent, ClickHouse's Tuple)
    runs:  one JSON array per line: the values of RUN_FIELDS (the `runcap.runs` columns), in order
    meta:  JSON [[sha256, content_type, size], ...]
    the payload bodies, back to back, in meta order

Arrays, not objects: half the bytes to write, checksum, read and parse, and ClickHouse parses them
faster (bench/span_bench.py). Values are JSON as ClickHouse reads them: datetimes RFC 3339 in UTC
(`...Z`; a datetime in another zone is converted first — the instant is what counts), decimals as
fixed-point strings (`"0.001250000"`, exact), maps as objects. No pickle. The field lists are
those of this version: a change of `Span` or `RunSnapshot` fields is a new VERSION, and a reader
counts a record of a version it does not know as undecodable and skips it. New fields go last,
so an older version that a WAL may still hold after an upgrade is read by appending them: version
2 (before span events and run trees) has no `events`, `parent_run_id`, `root_run_id` — its spans
get no events, its rows are roots ('' and their own run id), and nothing written before the
upgrade is lost.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import fields
from datetime import UTC, datetime
from decimal import Decimal
from operator import attrgetter
from typing import Any

import orjson

from proxy.spans.model import Payload, RunSnapshot, Span, SpanEvent

VERSION = 3  # 3: spans carry `events`; spans and runs `parent_run_id`, `root_run_id`
_V2 = 2  # read too: the new fields appended (`_upgraded`)
SPAN_FIELDS = tuple(f.name for f in fields(Span))
RUN_FIELDS = tuple(f.name for f in fields(RunSnapshot))
# Fields that version 2 records lack (the last ones of both lists; spans' `events` before them).
_TREE_FIELDS = ("parent_run_id", "root_run_id")
assert SPAN_FIELDS[-3:] == ("events", *_TREE_FIELDS) and RUN_FIELDS[-2:] == _TREE_FIELDS
_span_values = attrgetter(*SPAN_FIELDS)
_run_values = attrgetter(*RUN_FIELDS)
_HEAD = struct.Struct("<B3xIIIIII")
_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_UTC_Z | orjson.OPT_NAIVE_UTC


class RecordError(ValueError):
    """A record whose checksum is fine but whose contents this version cannot read."""


def _default(value: Any) -> Any:
    if isinstance(value, SpanEvent):  # a NamedTuple: orjson hands tuple subclasses to us
        return [value.name, _utc(value.at), value.attributes]
    if isinstance(value, Decimal):
        # fixed point, trailing zeros kept: never "1E-9". `str` is the same string whenever it
        # has no exponent (the usual case: costs of a few cents) and less than half the work.
        text = str(value)
        return format(value, "f") if "E" in text or "e" in text else text
    raise TypeError(f"cannot encode {type(value).__name__} in a WAL record")


def _utc(moment: datetime) -> datetime:
    # orjson writes offsets to the minute; an instant is only exact in UTC
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def encode_step(
    spans: Sequence[Span], runs: Sequence[RunSnapshot], payloads: Sequence[Payload]
) -> list[bytes]:
    """The body of one record, as the parts one `writev` writes (the bodies are not copied)."""
    dumps = orjson.dumps
    lines = []
    for span in spans:
        if span.started_at.tzinfo is not UTC:
            span.started_at = _utc(span.started_at)
        lines.append(dumps(_span_values(span), default=_default, option=_OPTIONS))
    span_lines = b"".join(lines)
    lines = []
    for run in runs:
        if run.started_at.tzinfo is not UTC:
            run.started_at = _utc(run.started_at)
        if run.updated_at.tzinfo is not UTC:
            run.updated_at = _utc(run.updated_at)
        if run.deadline is not None and run.deadline.tzinfo is not UTC:
            run.deadline = _utc(run.deadline)
        lines.append(dumps(_run_values(run), default=_default, option=_OPTIONS))
    run_lines = b"".join(lines)
    meta = dumps([[p.sha256, p.content_type, len(p.data)] for p in payloads]) if payloads else b"[]"
    head = _HEAD.pack(
        VERSION, len(spans), len(runs), len(payloads), len(span_lines), len(run_lines), len(meta)
    )
    return [head, span_lines, run_lines, meta, *(p.data for p in payloads)]


def _times_and_decimals(names: tuple[str, ...], times: tuple[str, ...]) -> tuple[list[int], list[int]]:
    return [names.index(n) for n in times], [names.index(n) for n in ("cost_usd", "max_usd") if n in names]


_SPAN_TYPES = _times_and_decimals(SPAN_FIELDS, ("started_at",))
_RUN_TYPES = _times_and_decimals(RUN_FIELDS, ("started_at", "updated_at", "deadline"))
RUN_ID_INDEX = RUN_FIELDS.index("run_id")
RUN_UPDATED_AT_INDEX = RUN_FIELDS.index("updated_at")


def _restore(
    line: bytes | memoryview, names: tuple[str, ...], types: tuple[list[int], list[int]]
) -> dict[str, Any]:
    values = orjson.loads(line)
    if not isinstance(values, list) or len(values) != len(names):
        raise RecordError(
            f"a row of {len(values) if isinstance(values, list) else '?'} values, not {len(names)}"
        )
    times, decimals = types
    for i in times:
        if values[i] is not None:
            values[i] = datetime.fromisoformat(values[i])
    for i in decimals:
        if values[i] is not None:
            values[i] = Decimal(values[i])
    return dict(zip(names, values, strict=True))


def span_from_json(line: bytes | memoryview) -> Span:
    values = _restore(line, SPAN_FIELDS, _SPAN_TYPES)
    values["events"] = [
        SpanEvent(name, datetime.fromisoformat(at), attributes) for name, at, attributes in values["events"]
    ]
    return Span(**values)


def run_from_json(line: bytes | memoryview) -> RunSnapshot:
    return RunSnapshot(**_restore(line, RUN_FIELDS, _RUN_TYPES))


def json_lines(block: bytes | memoryview) -> list[bytes]:
    return bytes(block).splitlines()


def _upgraded(block: bytes | memoryview, width: int, *, events: bool) -> bytes:
    """Version-2 rows (one JSON array per line) as version-3 rows: a span gets no `events`, and
    every row is a root — parent '' and root = its own run id (the first value of both lists)."""
    missing = len(_TREE_FIELDS) + (1 if events else 0)
    lines = []
    for line in json_lines(block):
        values = orjson.loads(line)
        if not isinstance(values, list) or len(values) != width - missing:
            raise RecordError(f"a version 2 row of {len(values) if isinstance(values, list) else '?'} values")
        added = [[], "", values[0]] if events else ["", values[0]]
        lines.append(orjson.dumps([*values, *added], option=orjson.OPT_APPEND_NEWLINE))
    return b"".join(lines)


class StepRecord:
    """One decoded record: views into the buffer it was read from, parsed on demand."""

    __slots__ = ("_meta", "_payloads_view", "n_payloads", "n_runs", "n_spans", "runs_jsonl", "spans_jsonl")

    def __init__(self, body: memoryview) -> None:
        if len(body) < _HEAD.size:
            raise RecordError(f"record body of {len(body)} bytes is shorter than its header")
        version, n_spans, n_runs, n_payloads, spans_len, runs_len, meta_len = _HEAD.unpack_from(body)
        if version not in (_V2, VERSION):
            raise RecordError(f"record version {version} is not one this runcap reads ({_V2}, {VERSION})")
        at = _HEAD.size
        end = at + spans_len + runs_len + meta_len
        if end > len(body):
            raise RecordError("record sections are longer than the record")
        self.n_spans, self.n_runs, self.n_payloads = n_spans, n_runs, n_payloads
        self.spans_jsonl: bytes | memoryview = body[at : at + spans_len]
        self.runs_jsonl: bytes | memoryview = body[at + spans_len : at + spans_len + runs_len]
        if version == _V2:  # written before span events and run trees: no events, rows of roots
            self.spans_jsonl = _upgraded(self.spans_jsonl, len(SPAN_FIELDS), events=True)
            self.runs_jsonl = _upgraded(self.runs_jsonl, len(RUN_FIELDS), events=False)
        self._meta = body[at + spans_len + runs_len : end]
        self._payloads_view = body[end:]

    def spans(self) -> list[Span]:
        return [span_from_json(line) for line in json_lines(self.spans_jsonl)]

    def runs(self) -> list[RunSnapshot]:
        return [run_from_json(line) for line in json_lines(self.runs_jsonl)]

    def payloads(self) -> list[Payload]:
        if not self.n_payloads:
            return []
        out = []
        at = 0
        view = self._payloads_view
        for sha256, content_type, size in orjson.loads(self._meta):
            if at + size > len(view):
                raise RecordError("payload bodies are shorter than the record says")
            out.append(Payload(sha256, bytes(view[at : at + size]), content_type))
            at += size
        return out
