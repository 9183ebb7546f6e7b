"""Plain-text tables that fit the terminal, for the read commands (`runcap runs`, `run`, `query`,
`sql`) and the demo.

A table is one line per row, always: a value's newlines and tabs become spaces. When the table is
wider than the terminal, the columns that matter least go first — those empty (or zero) in every
row, then in the order of importance the caller declares, else right to left — and long free-text values
(an error, a reason) are cut with an ellipsis; identifiers (`run_id`, `*_id`, `*_key`, `*_hash`),
numbers and short values are never cut (unless the terminal is narrower than one of them alone).
A free-text column the caller declares important (an error, a note) keeps room for up to
`WANT_TEXT_WIDTH` columns of its text before less important columns are let in: the column that
answers the table's question is read, not just glimpsed. A last line names what was left out.
No line is wider than the width.

The width: `COLUMNS` when set, else the terminal's width when stdout is a terminal, else none —
a pipe or a file gets the whole table, for grep and `less -S` (like `ps` and `systemctl`).
"""

from __future__ import annotations

import os
import shutil
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from typing import TextIO

GAP = "  "
# A free-text value is cut no shorter than this (or its header): enough to recognise it.
MIN_TEXT_WIDTH = 24
# ... and a declared-important one is given room for this much before less important columns.
WANT_TEXT_WIDTH = 48
_IDENTIFIER_SUFFIXES = ("_id", "_key", "_hash")
# What reaches the operator's terminal is text from agents, models and upstreams (errors, model and
# tool names): control characters (C0, DEL, C1 — ESC sequences could move the cursor, hide rows or
# write the clipboard) and bidi overrides are shown as U+FFFD; line and tab breaks as a space.
_CONTROL = {
    **{c: "\ufffd" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))},
    **{c: "\ufffd" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))},
    **{ord(c): " " for c in "\n\r\t\v\f"},
}


def terminal_width(stream: TextIO | None = None) -> int | None:
    """The width to fit (see the module docstring); None: no limit."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    stream = stream or sys.stdout
    try:
        if stream.isatty():
            return shutil.get_terminal_size().columns
    except (AttributeError, ValueError, OSError):  # a closed or replaced stream
        pass
    return None


def text_width(text: str) -> int:
    """Columns `text` takes on a terminal (East Asian wide characters take two)."""
    if text.isascii():
        return len(text)
    return sum(_char_width(c) for c in text)


def _char_width(c: str) -> int:
    if unicodedata.combining(c):
        return 0
    return 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1


def clip(text: str, width: int, ellipsis: str = "…") -> str:
    """`text` cut to `width` columns, ending in the ellipsis when it was cut."""
    if text_width(text) <= width:
        return text
    room = width - text_width(ellipsis)
    if room <= 0:
        return ellipsis[: max(width, 0)]
    out: list[str] = []
    used = 0
    for c in text:
        used += _char_width(c)
        if used > room:
            break
        out.append(c)
    return "".join(out).rstrip() + ellipsis


def one_line(text: str) -> str:
    return text.translate(_CONTROL)


def is_identifier(column: str) -> bool:
    return column == "hash" or column.endswith(_IDENTIFIER_SUFFIXES)


def format_table(
    columns: Sequence[str],
    cells: Sequence[Sequence[str]],
    *,
    right: Sequence[bool] | None = None,
    width: int | None = None,
    priority: Sequence[str] | None = None,
    labels: Mapping[str, str] | None = None,
    title: str | None = None,
) -> list[str]:
    """The table's lines: an optional title, the headers, a rule, one line per row (or
    `(no rows)`), and a note naming the columns that did not fit. `cells` are the rows' texts,
    `right` which columns are right-aligned (numbers), `width` None for no limit, `priority` the
    columns in order of importance (default: left to right), `labels` headers for some columns."""
    ellipsis, rule = _marks()
    headers = [one_line((labels or {}).get(c, c)) for c in columns]
    rows = [[one_line(v) for v in row] for row in cells]
    right = right or [False] * len(columns)
    natural = [max([text_width(h)] + [text_width(r[i]) for r in rows]) for i, h in enumerate(headers)]
    floor = [
        n
        if is_identifier(c) or right[i] or n <= MIN_TEXT_WIDTH
        else max(text_width(headers[i]), MIN_TEXT_WIDTH)
        for i, (c, n) in enumerate(zip(columns, natural, strict=True))
    ]
    kept = list(range(len(columns)))
    widths = list(natural)
    if width is not None and _total(natural) > width:
        empty = {i for i in range(len(columns)) if all(_blank(r[i]) for r in rows)}
        kept, widths = _fit(columns, natural, floor, width, priority, empty)
    lines: list[str] = []
    if title:
        lines.append(title)
        lines.append("")
    if kept:
        lines.append(_line([_pad(clip(headers[i], widths[i], ellipsis), widths[i], right[i]) for i in kept]))
        lines.append(_line([rule * widths[i] for i in kept]))
    for row in rows:
        lines.append(_line([_pad(clip(row[i], widths[i], ellipsis), widths[i], right[i]) for i in kept]))
    if not rows:
        lines.append("(no rows)")
    hidden = [headers[i] for i in range(len(columns)) if i not in kept]
    if hidden:
        lines.append(f"(--wide shows {len(hidden)} more: {', '.join(hidden)})")
    if width is not None:
        lines = [clip(line, width, ellipsis) for line in lines]
    return lines


def _fit(
    columns: Sequence[str],
    natural: list[int],
    floor: list[int],
    width: int,
    priority: Sequence[str] | None,
    empty: set[int],
) -> tuple[list[int], list[int]]:
    """Which columns fit, and how wide: in order of importance, each column that still fits at
    its floor width; then the room left widens the cut ones evenly, up to their natural width."""
    declared = [columns.index(c) for c in priority or () if c in columns]
    order = declared + [i for i in range(len(columns)) if i not in declared]
    order.sort(key=lambda i: i in empty)  # stable: a column empty in every row is left out first
    # What each column asks for while less important ones wait: a declared free-text column (cut
    # at its floor) up to WANT_TEXT_WIDTH, every other one its floor.
    want = list(floor)
    for i in declared:
        if natural[i] > floor[i]:
            want[i] = max(floor[i], min(natural[i], WANT_TEXT_WIDTH))
    kept: list[int] = []
    for i in order:
        if _total([want[j] for j in kept] + [floor[i]]) <= width:
            kept.append(i)
    if not kept and order:  # even the first column alone is too wide: it is cut
        kept = [order[0]]
        floor = list(floor)
        floor[order[0]] = width
    kept.sort()
    widths = list(natural)
    cap = max(natural[i] for i in kept)
    while cap > 0 and _total([min(natural[i], max(floor[i], cap)) for i in kept]) > width:
        cap -= 1
    for i in kept:
        widths[i] = min(natural[i], max(floor[i], cap))
    return kept, widths


def _blank(cell: str) -> bool:
    """Says nothing: empty, `-` (NULL) or a zero (`0`, `0.000000000`)."""
    return cell in ("", "-") or (cell[:1] == "0" and cell.strip("0.") == "" and cell.count(".") <= 1)


def _total(widths: Sequence[int]) -> int:
    return sum(widths) + len(GAP) * max(len(widths) - 1, 0)


def _pad(text: str, width: int, right: bool) -> str:
    room = " " * max(width - text_width(text), 0)
    return room + text if right else text + room


def _line(parts: list[str]) -> str:
    return GAP.join(parts).rstrip()


def _marks() -> tuple[str, str]:
    """The ellipsis and rule characters, in ASCII when stdout cannot encode them."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        "…─".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "...", "-"
    return "…", "─"
