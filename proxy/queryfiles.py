"""The on-call SQL files in `queries/`: finding them, reading their parameter declarations, and
filling in the defaults the engineer did not give.

A query file is plain ClickHouse SQL with `{name:Type}` query parameters, so it runs unchanged with
`clickhouse-client --param_name=...`, clickhouse-connect, chdb and `runcap query`. Its header
comment says the on-call question (the first line: `-- NAME: question`) and declares every
parameter, one per line:

    -- @param NAME TYPE = DEFAULT  -- description

and may say which of its columns answer the question, most important first — what a terminal
table keeps when it is too narrow for all of them (`runcap query` at 80 columns):

    -- @priority COLUMN COLUMN ...

and may list the values a parameter takes (anything else is refused before the query runs, with
a message naming the parameter; its default is always allowed):

    -- @choices NAME VALUE VALUE ...

TYPE is the ClickHouse type used in the SQL (`{NAME:TYPE}`); DEFAULT is a ClickHouse expression
(`''`, `20`, `now() - INTERVAL 24 HOUR`). `runcap query` evaluates the defaults of the parameters
not given on the command line in one `SELECT toString(CAST((DEFAULT) AS TYPE)), ...` on the same
store, and passes every value as ClickHouse text, which the server parses per TYPE.

Where the files are: `proxy/sql` is a symlink to the repository's `queries/` directory, so a
source checkout (or an editable install) reads `queries/` itself, and a built wheel ships the files
as package data under `proxy/sql/` (pyproject.toml `[tool.setuptools.package-data]`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

_PARAM_LINE = re.compile(
    r"^--\s*@param\s+(?P<name>\w+)\s+(?P<type>.+?)\s+=\s+(?P<default>.+?)(?:\s+--\s+(?P<doc>.*))?$"
)
_USED_PARAM = re.compile(r"\{(\w+):([^{}]+)\}")
_PRIORITY_LINE = re.compile(r"^--\s*@priority\s+(?P<columns>.+)$")
_CHOICES_LINE = re.compile(r"^--\s*@choices\s+(?P<name>\w+)\s+(?P<values>.+)$")
_TITLE = re.compile(r"^--\s*(?P<name>[\w-]+):\s*(?P<question>.*)$")


class QueryFileError(Exception):
    """A query file is missing or malformed, or a parameter given does not fit it."""


@dataclass(frozen=True)
class QueryParam:
    name: str
    type: str
    default: str  # a ClickHouse expression
    doc: str = ""


@dataclass(frozen=True)
class QueryFile:
    name: str
    path: Path
    sql: str  # the whole file, comments included: it runs as is
    question: str  # the header's first paragraph
    params: tuple[QueryParam, ...]
    # The columns that answer the question, most important first (`-- @priority`); () = none said.
    priority: tuple[str, ...] = ()
    # The values a parameter takes (`-- @choices`), by parameter; absent: any value of its type.
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def param(self, name: str) -> QueryParam | None:
        return next((p for p in self.params if p.name == name), None)


class SqlReader(Protocol):
    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[list[Any]]]: ...


def queries_dir() -> Path:
    """The directory holding the packaged / checked-out query files."""
    return Path(str(resources.files("proxy") / "sql"))


def list_queries(directory: Path | None = None) -> list[QueryFile]:
    d = directory or queries_dir()
    return [parse_query(p.stem, p.read_text(encoding="utf-8"), p) for p in sorted(d.glob("*.sql"))]


def load_query(name: str, directory: Path | None = None) -> QueryFile:
    """`name` is a query in the queries directory (`duplicate_side_effects`) or a path to a .sql file."""
    as_path = Path(name)
    if name.endswith(".sql") and as_path.is_file():
        return parse_query(as_path.stem, as_path.read_text(encoding="utf-8"), as_path)
    d = directory or queries_dir()
    path = d / f"{name}.sql"
    if not re.fullmatch(r"[\w-]+", name) or not path.is_file():
        known = ", ".join(p.stem for p in sorted(d.glob("*.sql"))) or "none"
        raise QueryFileError(f"no query named {name!r} in {d} (known: {known})")
    return parse_query(name, path.read_text(encoding="utf-8"), path)


def parse_query(name: str, sql: str, path: Path) -> QueryFile:
    params: list[QueryParam] = []
    priority: list[str] = []
    choices: dict[str, tuple[str, ...]] = {}
    question: list[str] = []
    in_title = False
    for line in sql.splitlines():
        stripped = line.strip()
        if not stripped.startswith("--"):
            if stripped:
                break  # the header comment ends at the first SQL line
            continue
        text = stripped[2:].strip()
        if not question and (m := _TITLE.match(stripped)):
            question, in_title = [m["question"]], True
        elif in_title:
            in_title = bool(text) and not text.startswith("@param")  # the paragraph ends at a blank
            if in_title:
                question.append(text)
        if (pm := _PRIORITY_LINE.match(stripped)) is not None:
            priority.extend(pm["columns"].split())
        if (c := _CHOICES_LINE.match(stripped)) is not None:
            choices[c["name"]] = tuple(c["values"].split())
        if "@param" in stripped:
            m = _PARAM_LINE.match(stripped)
            if m is None:
                raise QueryFileError(
                    f"{path}: cannot read {stripped!r} (want: -- @param NAME TYPE = DEFAULT -- doc)"
                )
            params.append(
                QueryParam(m["name"], m["type"].strip(), m["default"].strip(), (m["doc"] or "").strip())
            )
    declared = {p.name: p for p in params}
    for used, used_type in _USED_PARAM.findall(_strip_comments(sql)):
        p = declared.get(used)
        if p is None:
            raise QueryFileError(
                f"{path}: parameter {{{used}:{used_type}}} is used but not declared with @param"
            )
        if _norm(p.type) != _norm(used_type):
            raise QueryFileError(f"{path}: parameter {used} is declared {p.type} but used as {used_type}")
    for choice in choices:
        if choice not in declared:
            raise QueryFileError(f"{path}: @choices {choice}: no such parameter")
    return QueryFile(name, path, sql, " ".join(question), tuple(params), tuple(priority), choices)


def bind(
    query: QueryFile, given: dict[str, str], reader: SqlReader, names: dict[str, str] | None = None
) -> dict[str, str]:
    """Every parameter of `query`: the given ones as they are, the others from their defaults,
    evaluated by ClickHouse and returned as its text form of the declared type. Given date-times
    are read leniently (`2026-01-02`, `2026-01-02T03:04:05Z`, ...; UTC unless they say otherwise).

    A given value that does not fit its parameter — not one of its `@choices`, not a number for a
    number, not a date-time for a date-time — is a `QueryFileError` naming it as the user gave it
    (`names`: parameter → a command's own option, e.g. `--since`; else `--param NAME`), before
    the query runs."""
    unknown = sorted(set(given) - {p.name for p in query.params})
    if unknown:
        declared = ", ".join(p.name for p in query.params) or "none"
        raise QueryFileError(
            f"query {query.name} has no parameter {', '.join(unknown)} (its parameters: {declared})"
        )
    for p in query.params:
        if p.name in given:
            _check_value(query, p, given[p.name], (names or {}).get(p.name) or f"--param {p.name}")
    values = dict(given)
    exprs: dict[str, str] = {}
    raw: dict[str, str] = {}
    for p in query.params:
        if p.name not in given:
            exprs[p.name] = f"toString(CAST(({p.default}) AS {p.type}))"
        elif p.type.replace(" ", "").startswith("DateTime"):
            raw[f"raw_{p.name}"] = given[p.name]
            exprs[p.name] = (
                f"toString(CAST(parseDateTime64BestEffort({{raw_{p.name}:String}}, 6, 'UTC') AS {p.type}))"
            )
    if exprs:
        select = ", ".join(f"{expr} AS `{name}`" for name, expr in exprs.items())
        try:
            _, rows = reader.query(f"SELECT {select}", raw or None)
        except Exception:
            _name_bad_date(query, raw, reader, names or {})
            raise
        values.update(zip(exprs, rows[0], strict=True))
    return {p.name: values[p.name] for p in query.params}


_INTEGER = re.compile(r"-?[0-9]+")
DATE_EXAMPLES = "2026-01-01, '2026-01-01 00:00:00' or 2026-01-01T00:00:00Z (UTC unless it says otherwise)"


def _check_value(query: QueryFile, p: QueryParam, value: str, shown: str) -> None:
    choices = query.choices.get(p.name)
    default = p.default.strip("'")
    if choices is not None and value not in choices and value != default:
        also = " (or '' for all)" if p.default == "''" else ""
        listed = ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]
        raise QueryFileError(f"{shown} must be {listed}{also}, not {value!r}")
    kind = _norm(p.type)
    if kind.startswith(("UInt", "Int")):
        if not _INTEGER.fullmatch(value) or (kind.startswith("UInt") and value.startswith("-")):
            raise QueryFileError(f"{shown}: expected a whole number ({p.type}), got {value!r}")
    elif kind.startswith(("Float", "Decimal")):
        try:
            float(value)
        except ValueError:
            raise QueryFileError(f"{shown}: expected a number ({p.type}), got {value!r}") from None


def _name_bad_date(query: QueryFile, raw: dict[str, str], reader: SqlReader, names: dict[str, str]) -> None:
    """The defaults' SELECT failed: find the given date-time ClickHouse cannot read, and say so
    (a QueryFileError); return when none is to blame."""
    for key, value in raw.items():
        name = key.removeprefix("raw_")
        try:
            reader.query("SELECT parseDateTime64BestEffort({v:String}, 6, 'UTC')", {"v": value})
        except Exception:
            shown = names.get(name) or f"--param {name}"
            raise QueryFileError(
                f"{shown}: {value!r} is not a date-time ClickHouse reads; give e.g. {DATE_EXAMPLES}"
            ) from None


def parse_param_args(pairs: list[str]) -> dict[str, str]:
    """`--param k=v` values (the value may contain `=`)."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise QueryFileError(f"--param {pair!r}: expected NAME=VALUE")
        out[name.strip()] = value
    return out


def _strip_comments(sql: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in sql.splitlines())


def _norm(t: str) -> str:
    return re.sub(r"\s+", "", t).replace('"', "'")
