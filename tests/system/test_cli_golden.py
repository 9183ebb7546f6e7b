"""Every query and read command, as an operator's terminal shows it at 80 and 120 columns
(issue 25, items 4 and 5): golden output on a fixed night of spans, and — what makes a golden
file more than a snapshot — each table keeps the column that answers its question.

The spans are written into an embedded chdb store with the span sink runcap's shipper uses;
`runcap query` / `run` / `runs` render them through the same code as the CLI (`readcli._run`).
Set RUNCAP_UPDATE_GOLDEN=1 to rewrite the files in tests/system/golden/ after a deliberate change
(and read the diff).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from proxy import readcli
from proxy.hashing import canonical_json
from proxy.queryfiles import list_queries
from proxy.spans.clickhouse import ClickHouseSink, open_span_store
from proxy.spans.model import RunSnapshot, Span
from proxy.spans.recorder import sha256_hex

GOLDEN = Path(__file__).parent / "golden" / "cli"
WIDTHS = (80, 120)
T0 = datetime(2026, 11, 30, 2, 0, 0, tzinfo=UTC)
SINCE = "2026-11-01"
UNTIL = "2026-12-31"
REFUND_HASH = sha256_hex(canonical_json({"amount": 40, "order_id": "A-1009"}))
SEARCH_HASH = sha256_hex(canonical_json({"q": "refund policy"}))
SLOW_HASH = sha256_hex(canonical_json({"order_id": "A-2210"}))


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ids(n: int) -> dict[str, str]:
    return {"span_id": f"{n:016x}"}


def night() -> tuple[list[Span], list[RunSnapshot]]:
    """What an on-call engineer finds at 2 a.m.: a refund run that spent its money (a replayed
    refund, a provider blip, an operator's top-up, a cancelled stream, a refusal), a run whose
    tool call timed out and was refused again, a poller storming a read-only tool, a long
    summarising run on an unpriced model, and a few completed runs for the cap statistics."""
    s: list[Span] = []
    n = iter(range(1, 10_000))

    def span(run: str, kind: str, step: int, t: float, **kw: Any) -> None:
        s.append(Span(run_id=run, kind=kind, step=step, started_at=at(t), **ids(next(n)), **kw))

    r = "ticket-4711"
    model = {"provider": "openai", "model": "gpt-4o", "endpoint": "chat", "task": "refunds"}

    def call(step: int, t: float, ms: float, status: int = 200, **kw: Any) -> None:
        span(r, "model", step, t, **model, duration_ms=ms, status_code=status, **kw)

    def priced(step: int, t: float, ms: float, tokens: tuple[int, int], cost: str, **kw: Any) -> None:
        call(step, t, ms, input_tokens=tokens[0], output_tokens=tokens[1], cost_usd=Decimal(cost), **kw)

    def asked(step: int, t: float, call_id: str) -> None:
        span(r, "tool_call", step, t, **model, status_code=200, tool_name="refund", tool_call_id=call_id,
             args_hash=REFUND_HASH)  # fmt: skip

    def tool(step: int, t: float, ms: float, status: int, **kw: Any) -> None:
        span(r, "tool", step, t, task="refunds", endpoint="POST", status_code=status, duration_ms=ms, **kw)

    refund = {
        "tool_name": "refund",
        "args_hash": REFUND_HASH,
        "result_hash": "c1" * 32,
        "idempotency_key": "k" * 32,
    }
    priced(1, 0, 812.4, (1200, 80), "0.003800000", request_hash="a1" * 32, response_hash="b1" * 32)
    asked(1, 0.9, "call_1")
    tool(1, 1.2, 140.0, 200, **refund, attributes={"tool.reached": "true"})
    priced(2, 2, 905.0, (1450, 60), "0.004225000")
    asked(2, 2.9, "call_2")
    tool(2, 3.1, 2.1, 200, **refund, outcome="replayed", attributes={"tool.reached": "false"})
    call(3, 4, 30.5, 502, outcome="error",
         error="upstream 'openai' (https://api.openai.com) failed: ClientConnectorError",
         attributes={"step.counted": "false", "upstream.failures": "1"})  # fmt: skip
    priced(3, 5, 700.0, (1500, 40), "0.004150000")
    span(
        r,
        "caps_change",
        3,
        60,
        task="refunds",
        endpoint="POST /runs/{id}/caps",
        status_code=200,
        attributes={
            "caps.by": "alice",
            "caps.reason": "customer escalation",
            "caps.old": '{"max_usd":"0.020000000","max_tokens":null,"max_steps":6,'
            '"max_tool_calls":null,"deadline":null}',
            "caps.new": '{"max_usd":"0.030000000","max_tokens":null,"max_steps":8,'
            '"max_tool_calls":null,"deadline":null}',
        },
    )
    priced(4, 61, 1500.0, (55, 1600), "0.016137500", outcome="cancelled",
           error="run ticket-4711 was cancelled during the call to upstream 'openai'; the call was aborted",
           attributes={"usage.input": "reserved", "usage.output": "reserved",
                       "usage.seen_input_tokens": "0", "usage.seen_output_tokens": "0"})  # fmt: skip
    call(5, 62, 1.2, 402, outcome="budget_exceeded",
         error="X-Run-Max-Usd: run ticket-4711 has $0.001687500 left of its $0.030000000 cap; this call "
         "needs at least $0.004000000. The run is out of budget: end it or start a new run.")  # fmt: skip

    r = "ticket-4712"
    slow = {
        "tool_name": "slow_refund",
        "args_hash": SLOW_HASH,
        "idempotency_key": "u" * 32,
        "outcome": "unknown",
    }
    tool(0, 100, 30001.0, 504, **slow,
         error="tool 'slow_refund' did not answer within its timeout_s = 30 s; the call was aborted and may "
         "or may not have taken effect — a repeat gets 409 until it is reconciled",
         attributes={"tool.reached": "unknown"})  # fmt: skip
    tool(0, 140, 1.0, 409, **slow,
         error="tool call uuuu (slow_refund) of run ticket-4712 was interrupted (tool timeout) and may or "
         "may not have taken effect; it will not be executed again until an operator resolves it",
         attributes={"tool.reached": "false"})  # fmt: skip

    r = "poller-7"
    for i in range(4):
        span(
            r,
            "tool",
            0,
            200 + i * 0.4,
            endpoint="GET",
            status_code=200,
            duration_ms=80.0 + i,
            tool_name="search",
            args_hash=SEARCH_HASH,
            result_hash="d1" * 32,
            attributes={"tool.reached": "true"},
        )

    r = "digest-31"
    local = {
        "provider": "local",
        "model": "my-finetune",
        "endpoint": "chat",
        "task": "summarize",
        "price_known": False,
    }
    for step, tokens in enumerate((900, 2400, 5100, 9800), start=1):
        span(
            r,
            "model",
            step,
            300 + step * 10,
            **local,
            duration_ms=2000.0 + step,
            status_code=200,
            input_tokens=tokens,
            output_tokens=300,
            attributes={
                "context.tokens": str(tokens),
                "context.growth": f"{tokens / 900:.3f}",
                "context.tool_output_share": "0.6100",
            },
        )

    runs: list[RunSnapshot] = []

    def run(run_id: str, task: str, status: str, t: float, **kw: Any) -> None:
        fields: dict[str, Any] = dict(
            steps=0,
            tool_calls=0,
            input_tokens=0,
            output_tokens=0,
            cost_usd=Decimal(0),
            max_usd=None,
            max_tokens=None,
            max_steps=None,
            max_tool_calls=None,
            deadline=None,
        )
        fields.update(kw)
        runs.append(
            RunSnapshot(run_id=run_id, task=task, started_at=at(0), updated_at=at(t), status=status, **fields)
        )

    run(
        "ticket-4711",
        "refunds",
        "budget_exceeded",
        62,
        steps=4,
        tool_calls=2,
        input_tokens=4205,
        output_tokens=1780,
        cost_usd=Decimal("0.028312500"),
        max_usd=Decimal("0.03"),
        max_steps=8,
    )
    run("ticket-4712", "refunds", "active", 140, tool_calls=2)
    run("poller-7", "", "active", 202, tool_calls=4)
    run(
        "digest-31",
        "summarize",
        "steps_exceeded",
        340,
        steps=4,
        input_tokens=18200,
        output_tokens=1200,
        max_steps=4,
    )
    for i, steps in enumerate((3, 4, 4, 6, 9)):
        run(
            f"ticket-46{i:02d}",
            "refunds",
            "completed",
            400 + i,
            steps=steps,
            tool_calls=steps - 1,
            input_tokens=1000 * steps,
            output_tokens=60 * steps,
            cost_usd=Decimal("0.0032") * steps,
            max_usd=Decimal("0.05"),
            max_steps=10,
        )

    # A refund over 100 held for a person: approved by alice after 4 minutes; another denied.
    def approval(t: float, ms: float, approval_id: str, event: str, state: str, **kw: str) -> None:
        attributes = {"approval.id": approval_id, "approval.event": event, "approval.state": state,
                      "approval.rule": "large", **kw}  # fmt: skip
        span("ticket-4720", "approval", 1, t, endpoint="approval", duration_ms=ms, tool_name="refund",
             args_hash=REFUND_HASH, attributes=attributes)  # fmt: skip

    approval(300, 0.0, "a1" * 16, "requested", "pending")
    approval(300, 240000.0, "a1" * 16, "decided", "approved", **{"approval.by": "alice"})
    approval(300, 240010.0, "a1" * 16, "released", "approved", **{"approval.by": "alice"})
    approval(320, 0.0, "b2" * 16, "requested", "pending")
    approval(320, 60000.0, "b2" * 16, "decided", "denied",
             **{"approval.by": "bob", "approval.reason": "duplicate of A-1009"})  # fmt: skip
    return s, runs


# -- the store and the commands ------------------------------------------------------------------


class StoreReader:
    """The read commands' `Reader` on the test's store (what DirectReader is on a data directory)."""

    def __init__(self, store: ClickHouseSink) -> None:
        self.store = store
        self.where = "the test's span store"

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[list[Any]]]:
        return self.store.query(sql, params)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreReader]:
    store = open_span_store(None, tmp_path_factory.mktemp("golden"))
    spans, runs = night()
    store.write(spans, runs, "golden-night")
    yield StoreReader(store)
    store.close()


def query_params(name: str) -> list[str]:
    """Every query over the fixed night (its window, not the default `now() - 24h`)."""
    (q,) = [q for q in list_queries() if q.name == name]
    given = {"since": SINCE, "until": UNTIL}
    if name in ("run_cost", "run_timeline"):
        given["run_id"] = "ticket-4711"
    return [f"{k}={v}" for k, v in given.items() if q.param(k) is not None]


COMMANDS: dict[str, list[str]] = {
    **{f"query-{q.name}": ["query", q.name, *(a for p in query_params(q.name) for a in ("--param", p))]
       for q in list_queries()},
    "run": ["run", "ticket-4711"],
    "run-tree": ["run", "ticket-4711", "--tree"],  # a run without children: one node
    "runs": ["runs", "--since", SINCE],
}  # fmt: skip


# The column(s) that answer each table's question: kept at 80 columns (issue 25, item 4).
ANSWERS = {
    "query-approvals": ("approval_id", "state"),
    "query-cap_hits": ("cap", "runs_stopped"),
    "query-cap_recommendations": ("metric", "p99", "current_cap"),
    "query-context_growth": ("run_id", "avg_growth_per_step"),
    "query-context_outgrown": ("run_id", "growth"),
    "query-duplicate_side_effects": ("tool_name", "ran", "unknown", "replays", "refused"),
    "query-loops": ("run_id", "tool", "requests"),
    "query-retry_storms": ("target", "calls"),
    "query-run_cost": ("step", "cost_usd"),
    "query-run_timeline": ("kind", "outcome", "detail"),
    "query-runs": ("run_id", "status", "cost_usd"),
    "query-slow_tools": ("tool_name", "p99_ms"),
    "query-timeouts": ("target", "outcome", "error"),
    "query-top_spend": ("key", "cost_usd"),
    "query-unknown_outcomes": ("idempotency_key", "why"),
    "query-unpriced_models": ("model", "calls"),
    "query-run_tree_cost": ("run_id", "cost_usd", "subtree_usd"),
    "run": ("kind", "outcome", "detail"),
    "run-tree": ("run_id", "cost_usd", "subtree_usd", "max_usd"),
    "runs": ("run_id", "status", "cost_usd"),
}


def test_every_query_and_read_command_is_covered() -> None:
    assert set(ANSWERS) == set(COMMANDS)


def test_every_priority_names_columns_of_its_query(reader: StoreReader) -> None:
    from proxy.queryfiles import bind

    for q in list_queries():
        assert q.priority, f"{q.name}: no -- @priority line"
        given = dict(p.split("=", 1) for p in query_params(q.name))
        columns, _ = reader.query(q.sql, bind(q, given, reader))
        assert set(q.priority) <= set(columns), (q.name, set(q.priority) - set(columns))


def render(reader: StoreReader, argv: list[str], width: int, capsys: pytest.CaptureFixture[str],
           monkeypatch: pytest.MonkeyPatch) -> str:  # fmt: skip
    from proxy.cli import build_parser

    args: argparse.Namespace = build_parser().parse_args(argv)
    monkeypatch.setenv("COLUMNS", str(width))
    capsys.readouterr()
    assert readcli._run(args, reader) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_golden(name: str, width: int, reader: StoreReader, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    out = render(reader, COMMANDS[name], width, capsys, monkeypatch)
    assert all(len(line) <= width for line in out.splitlines()), out
    header = next(line for line in out.splitlines() if line and not line.startswith("run "))
    assert set(ANSWERS[name]) <= set(header.split()), (name, header)
    path = GOLDEN / f"{name}.{width}.txt"
    if os.environ.get("RUNCAP_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out)
    assert out == path.read_text(), f"{path} differs (RUNCAP_UPDATE_GOLDEN=1 rewrites it)"


# -- runcap reconcile ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ledger_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ledger with two tool calls cut after they may have reached the tool."""
    import asyncio

    from proxy.app import open_ledger
    from proxy.caps import RunCaps
    from proxy.config import build_config
    from proxy.ledger.base import ToolCallRequest

    data = tmp_path_factory.mktemp("golden-ledger")
    config = build_config({}, {}, data_dir=str(data))

    async def fill() -> None:
        ledger = open_ledger(config)
        try:
            for n, (run_id, tool, path, why) in enumerate((
                ("ticket-4712", "slow_refund", "", "tool timeout"),
                ("ticket-4799", "charge", "accounts/42/charges?currency=EUR", "run cancelled mid-call"),
            )):  # fmt: skip
                now = T0.timestamp() + 100 * n
                req = ToolCallRequest(run_id, "refunds", RunCaps(), now, tool, ("9f3a", "c07e")[n] * 8,
                                      f"{n + 7:x}" * 64, method="POST", path=path)  # fmt: skip
                await ledger.begin_tool_call(req)
                await ledger.mark_unknown(run_id, req.key or "", now + 30, why)
        finally:
            await ledger.close()

    asyncio.run(fill())
    return data


@pytest.mark.parametrize("width", WIDTHS)
def test_golden_reconcile(width: int, ledger_dir: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from proxy.cli import main

    monkeypatch.setenv("COLUMNS", str(width))
    capsys.readouterr()
    assert main(["reconcile", "--data-dir", str(ledger_dir)]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= width for line in out.splitlines()), out
    assert {"key", "run_id", "tool", "state"} <= set(out.splitlines()[0].split())
    path = GOLDEN / f"reconcile.{width}.txt"
    if os.environ.get("RUNCAP_UPDATE_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text(), f"{path} differs (RUNCAP_UPDATE_GOLDEN=1 rewrites it)"


# -- runcap caps suggest ------------------------------------------------------------------------


def suggest(reader: StoreReader, *argv: str) -> str:
    from proxy.capsuggest import caps_suggest
    from proxy.cli import build_parser

    return caps_suggest(build_parser().parse_args(["caps", "suggest", "--since", SINCE, *argv]), reader)


def test_golden_caps_suggest(reader: StoreReader) -> None:
    """Aligned comments, how many runs each table is based on, and a warning when they are few."""
    import json

    out = suggest(reader)
    path = GOLDEN / "caps-suggest.txt"
    if os.environ.get("RUNCAP_UPDATE_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text(), f"{path} differs (RUNCAP_UPDATE_GOLDEN=1 rewrites it)"
    table = [line for line in out.splitlines() if " = " in line and not line.startswith("#")]
    assert len({line.index("#") for line in table}) == 1  # the comments line up
    assert "# based on 5 completed runs — few runs" in out
    rows = json.loads(suggest(reader, "--json"))
    assert {(r["task"], r["setting"]) for r in rows} >= {("refunds", "max_steps"), ("refunds", "max_usd")}
    assert all(r["completed_runs"] == 5 for r in rows)
    refused = suggest(reader, "--min-runs", "6")
    assert '[tasks."refunds"]: only 5 completed runs, fewer than --min-runs 6: no suggestion' in refused
    assert "\n[tasks." not in refused and json.loads(suggest(reader, "--min-runs", "6", "--json")) == []
