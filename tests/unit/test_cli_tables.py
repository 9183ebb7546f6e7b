"""The read commands' tables fit the terminal: golden output of `runcap run` and `runcap runs` at
80 and 120 columns on fixed rows (as the queries return them), a generic `runcap sql` table whose
free text is cut with an ellipsis, `--wide`, and no line wider than the width at any width."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from proxy.readcli import _VIEWS, table_lines
from proxy.termtable import clip, format_table, text_width

H = [hashlib.sha256(b"%d" % n).hexdigest() for n in range(7)]  # request_hash, args_hash, ...

# run_timeline.sql's columns and rows of a run that repeated a refund (JSON values, as served)
TIMELINE_COLUMNS = [
    "started_at", "step", "kind", "model", "tool", "input_tokens", "output_tokens", "cost_usd",
    "cumulative_usd", "args_hash", "result_hash", "outcome", "status_code", "duration_ms",
    "idempotency_key", "request_hash", "response_hash", "error", "context", "detail", "run_id",
]  # fmt: skip


def span(at: str, step: int, kind: str, tool: str, tokens: tuple[int, int], cost: str, total: str,
         outcome: str, status: int, ms: float, hashes: tuple[str, str, str, str] = ("", "", "", ""),
         error: str = "") -> list[Any]:  # fmt: skip
    args_h, result_h, request_h, response_h = hashes
    model = "" if kind == "tool" else "gpt-4o-mini"
    return [f"2026-03-04T05:06:{at}+00:00", step, kind, model, tool, *tokens, cost, total, args_h, result_h,
            outcome, status, ms, "", request_h, response_h, error, "", error.replace("\n", " "),
            "ticket-4711"]  # fmt: skip


MODEL = ("0.000012300", "0.000012300")  # cost, cumulative
FREE = ("0", "0.000012300")
ERROR = "X-Run-Max-Usd: run ticket-4711 has $0.000464200 left;\nthe call needs $0.000090"
TIMELINE = [
    span("07.100000", 1, "model", "", (54, 7), *MODEL, "ok", 200, 8.9, ("", "", H[0], H[1])),
    span("07.109000", 1, "tool_call", "refund", (0, 0), *FREE, "ok", 200, 0, (H[2], "", "", "")),
    span("07.120500", 1, "tool", "refund", (0, 0), *FREE, "ok", 200, 6.2, (H[2], H[3], H[4], H[5])),
    span("07.140000", 1, "tool_result", "refund", (0, 0), *FREE, "ok", 200, 0, ("", H[3], "", "")),
    span("07.140000", 2, "model", "", (1090, 600), "0.000523500", "0.000535800", "budget_exceeded", 402, 0.4,
         ("", "", H[6], ""), ERROR),
]  # fmt: skip

RUNS_COLUMNS = [
    "run_id", "task", "status", "cap_hit", "steps", "tool_calls", "input_tokens", "output_tokens", "cost_usd",
    "max_usd", "max_tokens", "max_steps", "max_tool_calls", "deadline", "started_at", "updated_at",
]  # fmt: skip


def run_row(
    run_id: str, task: str, status: str, cap_hit: str, counts: tuple[int, int, int, int], cost: str,
    max_usd: str | None, at: str,
) -> list[Any]:  # fmt: skip
    """steps, tool calls, input and output tokens; no caps but max_usd"""
    when = f"2026-03-04T05:{at}+00:00"
    return [run_id, task, status, cap_hit, *counts, cost, max_usd, None, None, None, None, when, when]


RUNS = [
    run_row("ticket-4711", "refund-triage", "budget_exceeded", "X-Run-Max-Usd", (2, 1, 1144, 607),
            "0.000535800", "0.001000000", "06:07.140000"),
    run_row("7d9f2c4e-1b3a-4c5d-9e8f-0a1b2c3d4e5f", "triage", "tool_calls_exceeded", "X-Run-Max-Tool-Calls",
            (3, 4, 20417, 1312), "0.003850000", None, "05:59.002000"),
    run_row("nightly-sync", "", "active", "", (0, 12, 0, 0), "0", None, "05:01.000001"),
]  # fmt: skip


def render(name: str, columns: list[str], rows: list[list[Any]], width: int | None, **kw: Any) -> str:
    return "\n".join(table_lines(columns, rows, view=_VIEWS[name], width=width, **kw))


TITLE = "run ticket-4711: 5 spans, $0.000535800"

TIMELINE_80 = """\
run ticket-4711: 5 spans, $0.000535800

step  kind         tool    outcome          detail
────  ───────────  ──────  ───────────────  ────────────────────────────────────
   1  model                ok
   1  tool_call    refund  ok
   1  tool         refund  ok
   1  tool_result  refund  ok
   2  model                budget_exceeded  X-Run-Max-Usd: run ticket-4711 has…
(--wide shows 14 more: started_at, model, in_tok, out_tok, cost_usd, total_usd,…"""

TIMELINE_120 = """\
run ticket-4711: 5 spans, $0.000535800

step  kind         tool       cost_usd  outcome          status   ms  detail
────  ───────────  ──────  ───────────  ───────────────  ──────  ───  ──────────────────────────────────────────────────
   1  model                0.000012300  ok                  200  8.9
   1  tool_call    refund            0  ok                  200    0
   1  tool         refund            0  ok                  200  6.2
   1  tool_result  refund            0  ok                  200    0
   2  model                0.000523500  budget_exceeded     402  0.4  X-Run-Max-Usd: run ticket-4711 has $0.000464200 l…
(--wide shows 11 more: started_at, model, in_tok, out_tok, total_usd, request, response, args_hash, result_hash, idempo…"""  # noqa: E501

RUNS_80 = """\
run_id                                status               steps     cost_usd
────────────────────────────────────  ───────────────────  ─────  ───────────
ticket-4711                           budget_exceeded          2  0.000535800
7d9f2c4e-1b3a-4c5d-9e8f-0a1b2c3d4e5f  tool_calls_exceeded      3  0.003850000
nightly-sync                          active                   0            0
(--wide shows 7 more: task, cap_hit, tools, in_tok, out_tok, max_usd, updated_a…"""

RUNS_120 = """\
run_id                                task           status               cap_hit               steps     cost_usd
────────────────────────────────────  ─────────────  ───────────────────  ────────────────────  ─────  ───────────
ticket-4711                           refund-triage  budget_exceeded      X-Run-Max-Usd             2  0.000535800
7d9f2c4e-1b3a-4c5d-9e8f-0a1b2c3d4e5f  triage         tool_calls_exceeded  X-Run-Max-Tool-Calls      3  0.003850000
nightly-sync                                         active                                         0            0
(--wide shows 5 more: tools, in_tok, out_tok, max_usd, updated_at)"""  # noqa: E501


@pytest.mark.parametrize(
    ("name", "width", "golden"),
    [("run_timeline", 80, TIMELINE_80), ("run_timeline", 120, TIMELINE_120), ("runs", 80, RUNS_80),
     ("runs", 120, RUNS_120)],
)  # fmt: skip
def test_golden_tables(name: str, width: int, golden: str) -> None:
    columns, rows = (TIMELINE_COLUMNS, TIMELINE) if name == "run_timeline" else (RUNS_COLUMNS, RUNS)
    title = TITLE if name == "run_timeline" else None
    assert render(name, columns, rows, width, title=title) == golden


def test_no_line_is_wider_than_the_terminal_at_any_width() -> None:
    for width in range(1, 260):
        for name, columns, rows in (
            ("run_timeline", TIMELINE_COLUMNS, TIMELINE),
            ("runs", RUNS_COLUMNS, RUNS),
        ):
            lines = render(name, columns, rows, width, title=TITLE).splitlines()
            assert all(text_width(line) <= width for line in lines), (width, lines)
            note = len(lines) - (4 + len(rows))  # title, blank, header, rule, one line per row
            assert note in (0, 1) and (note == 0 or width < 20 or lines[-1].startswith("(--wide shows"))


def test_wide_shows_every_column_whole() -> None:
    lines = render("run_timeline", TIMELINE_COLUMNS, TIMELINE, 80, title=TITLE, wide=True).splitlines()
    header = lines[2].split()
    # (every column of the fixture; cost_parts, added to run_timeline.sql later, is not in it)
    shown = [c for c in _VIEWS["run_timeline"].show if c in TIMELINE_COLUMNS]
    assert header == [_VIEWS["run_timeline"].labels.get(c, c) for c in shown]
    assert len(lines) == 4 + len(TIMELINE)  # one line per row, no "more" note
    text = "\n".join(lines)
    assert all(h in text for h in H)  # full hashes, for `runcap payload` on any store
    # the error is whole, its newline folded into the row's one line
    assert lines[-1].endswith(
        "X-Run-Max-Usd: run ticket-4711 has $0.000464200 left; the call needs $0.000090"
    )


def test_a_query_without_a_view_cuts_free_text_not_identifiers() -> None:
    """`runcap sql` / `runcap query`: columns go right to left, free text is cut with an ellipsis,
    ids and hashes are not; wide characters take two columns."""
    columns = ["started_at", "run_id", "tool_name", "outcome", "why", "request_hash"]
    why = "tool 'charge' did not answer within its timeout_s = 0.3 s;\nthe call was aborted"
    rows = [["2026-03-04T05:06:07.100000+00:00", "ticket-4711", "charge", "unknown", why, H[0]],
            ["2026-03-04T05:06:08.000000+00:00", "注文-42", "refund", "ok", "", None]]  # fmt: skip
    assert table_lines(columns, rows, width=96) == [
        "started_at               run_id       tool_name  outcome  why                       request_hash",
        "───────────────────────  ───────────  ─────────  ───────  ────────────────────────  ────────────",
        "2026-03-04 05:06:07.100  ticket-4711  charge     unknown  tool 'charge' did not a…  5feceb66ffc8",
        "2026-03-04 05:06:08.000  注文-42      refund     ok                                 -",
    ]
    assert table_lines(columns, rows, width=60)[-1] == "(--wide shows 2 more: why, request_hash)"


def test_empty_columns_go_first_and_short_values_stay_whole() -> None:
    columns = ["a", "empty", "b"]
    lines = format_table(columns, [["alpha", "", "tool_calls_exceeded"]], width=28)
    assert lines == ["a      b", "─────  ───────────────────", "alpha  tool_calls_exceeded",
                     "(--wide shows 1 more: empty)"]  # fmt: skip
    assert clip("注文注文", 5) == "注文…" and text_width(clip("注文注文", 5)) == 5


def test_width_comes_from_columns_or_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from proxy.termtable import terminal_width

    monkeypatch.setenv("COLUMNS", "93")
    assert terminal_width(io.StringIO()) == 93
    monkeypatch.delenv("COLUMNS")
    assert terminal_width(io.StringIO()) is None  # a pipe or a file: the whole table


def test_the_query_list_wraps_to_the_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy.cli import main

    monkeypatch.setenv("COLUMNS", "60")
    assert main(["query"]) == 0
    wrapped = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in wrapped) <= 60
    assert all(line.startswith("    ") for line in wrapped if not line[0].isalpha())  # indented, not cut
    monkeypatch.delenv("COLUMNS")
    assert main(["query"]) == 0
    whole = capsys.readouterr().out.splitlines()
    assert len(whole) < len(wrapped)
    assert " ".join(" ".join(whole).split()) == " ".join(" ".join(wrapped).split())  # the same words


def test_control_characters_never_reach_the_terminal() -> None:
    """Errors, model and tool names come from agents, models and upstreams: an ESC sequence (cursor
    moves, OSC 52 clipboard writes), a C1 control or a bidi override is shown as U+FFFD."""
    hostile = "gpt\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2A\x9b31m\u202etxt.exe"
    lines = format_table(["model", "outcome"], [[hostile, "ok"]], width=120)
    text = "\n".join(lines)
    assert not any(c in text for c in "\x1b\x07\x9b\u202e")
    assert lines[2].startswith("gpt\ufffd]52;c;cm0gLXJmIH4=\ufffd\ufffd[2A\ufffd31m\ufffdtxt.exe")
