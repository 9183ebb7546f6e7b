"""One-line messages for the CLI's failures: what went wrong and what to do, never a dump.

The CLI reports three kinds of foreign text: runcap's own HTTP answers (a JSON error body), the
span store's exceptions (ClickHouse's `Code: 62. DB::Exception: ... Expected one of: <40 tokens>
... In scope ... (SYNTAX_ERROR)`), and Python exceptions. `http_error` and `store_error` turn each
into one line an operator can act on at 2 a.m.; the details stay in the server's log and in
`--json` answers.
"""

from __future__ import annotations

import json
import re

# ClickHouse's exception text: `Code: N. DB::Exception: MESSAGE. (NAME) (version X)`.
_CODE = re.compile(r"^\s*Code:\s*\d+\.\s*(?:DB::Exception:\s*)?")
_NAME = re.compile(r"\s*\(([A-Z][A-Z0-9_]+)\)(?:\s*\(version [^)]*\))?\s*\.?\s*$")
# Parts that only a ClickHouse developer reads: the parser's list of expected tokens, the query
# it happened in (runcap's own wrapper, often), the function being executed.
_NOISE = (
    re.compile(r"[.:]?\s*Expected one of:.*$", re.S),
    re.compile(r"[.:]?\s*In scope .*$", re.S),
    re.compile(r":\s*while executing '.*$", re.S),
    re.compile(r":\s*Cannot parse DateTime64?\(\d*\) from String.*$", re.S),
)
_HINTS = {
    "SYNTAX_ERROR": "check the SQL (one SELECT; the tables are runcap.spans and runcap.runs)",
    "UNKNOWN_IDENTIFIER": "check the column names (docs/reference.md, 'Span store')",
    "UNKNOWN_TABLE": "the tables are runcap.spans and runcap.runs",
    "CANNOT_PARSE_DATETIME": "give a date like 2026-01-01 or 2026-01-01T00:00:00Z",
    "CANNOT_PARSE_TEXT": "check the --param values against the query's @param types",
    "TIMEOUT_EXCEEDED": "narrow the query (a shorter --since, a run_id)",
    "TOO_MANY_ROWS_OR_BYTES": "narrow the query or add a LIMIT",
}
_MAX = 300


def store_error(text: str) -> str:
    """A span store's exception text as one line: ClickHouse's message without its parser dump,
    plus what to do for the common kinds. Text that is not ClickHouse's is folded to one line."""
    text = text.strip()
    prefix = ""
    code = _CODE.search(text)
    if code is None:
        # "where: Code: 62. DB::Exception: ..." (a reader naming the store first)
        at = text.find("Code: ")
        if at > 0 and _CODE.match(text[at:]):
            prefix, text = text[:at], text[at:]
            code = _CODE.match(text)
    if code is None:
        return _fold(prefix + text)
    body = text[code.end() :]
    name = ""
    found = _NAME.search(body)
    if found is not None:
        name = found.group(1)
        body = body[: found.start()]
    for noise in _NOISE:
        body = noise.sub("", body)
    body = body.rstrip(" .:")
    hint = _HINTS.get(name)
    line = f"{prefix}ClickHouse: {body}" + (f" — {hint}" if hint else "")
    return _fold(line)


def http_error(code: int, text: str, *, token_hint: str = "") -> str:
    """One line for runcap's HTTP error answer: its `error.message` (OpenAI or Anthropic shape),
    and for a 401 where the admin token comes from."""
    message = text.strip()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(body.get("message"), str):
            message = body["message"]
    line = f"HTTP {code}: {store_error(message) if 'DB::Exception' in message else message}"
    if code == 401:
        line += (
            " — set RUNCAP_ADMIN_TOKEN to the server's admin token (it is in the server's "
            "data_dir/admin.token), or pass --data-dir of the server's data directory"
            if not token_hint
            else f" — {token_hint}"
        )
    return _fold(line)


def _fold(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX else line[: _MAX - 1].rstrip() + "…"
