"""What Grafana and its ClickHouse data source plugin (grafana-clickhouse-datasource v4) do to a
panel's `rawSql` before ClickHouse sees it, so that tests can run dashboard SQL against chdb.

Three stages, in the order Grafana applies them:

1. `$__conditionalAll(condition, $var)` — the plugin's front end (`applyConditionalAll`), from the
   last occurrence backwards: replaced by `condition`, or by `1=1` when the variable's current value
   is "All" (`$__all`) or empty. Arguments are split at top-level commas, parentheses nest.
2. Template variables — Grafana's `templateSrv.replace` with the plugin's format function:
   `$var`, `${var}`, `${var:format}`, `[[var]]`. With no explicit format a multi-value selection
   becomes `'a','b'` and a single value is inserted raw; `singlequote` quotes every value
   (escaping `'` as `\\'`) and joins with `,`; `csv` joins raw values; `raw` inserts them as they
   are. "All" without a custom all value expands to every option (formatted the same way); a custom
   all value is inserted unformatted. Unknown names are left alone, as Grafana does.
   Built-ins: `$__from`/`$__to` (epoch ms), `$__interval_ms`, `$__range_s`.
3. The plugin's back-end macros (pkg/macros/macros.go via sqlds, `\\$__name\\b` plus a bracketed,
   nesting-aware argument list): `$__timeFilter(c)` → `c >= toDateTime(from) AND c <= toDateTime(to)`
   (Unix seconds), `$__timeFilter_ms(c)` (fromUnixTimestamp64Milli), `$__dateFilter(c)`,
   `$__fromTime`/`$__toTime` (`toDateTime(s)`), `$__fromTime_ms`/`$__toTime_ms`,
   `$__timeInterval(c)` → `toStartOfInterval(toDateTime(c), INTERVAL n second)` with n = the
   panel interval in whole seconds (at least 1), `$__timeInterval_ms(c)`, `$__interval_s` → n.
   An unknown `$__name` left after all three stages is an error here (ClickHouse would reject it
   anyway, with a less helpful message).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

ALL = "$__all"


@dataclass(frozen=True)
class Variable:
    """A dashboard variable's state: its options (what its query returned) and the selection."""

    name: str
    options: Sequence[str] = ()
    selected: Sequence[str] = (ALL,)
    all_value: str | None = None  # a custom "All" value (templating `allValue`)
    multi: bool = True  # a multi-value variable's value is a list even with one item selected

    @property
    def is_all(self) -> bool:
        return list(self.selected) in ([ALL], [], [""])

    def values(self) -> list[str]:
        if list(self.selected) == [ALL]:
            return list(self.options)
        return list(self.selected)


@dataclass(frozen=True)
class TimeRange:
    start: datetime  # timezone-aware
    end: datetime
    interval_s: float = 60.0  # the panel's $__interval, in seconds

    @property
    def from_ms(self) -> int:
        return int(self.start.timestamp() * 1000)

    @property
    def to_ms(self) -> int:
        return int(self.end.timestamp() * 1000)


@dataclass
class Expander:
    time: TimeRange
    variables: Mapping[str, Variable] = field(default_factory=dict)

    def expand(self, sql: str) -> str:
        sql = self.conditional_all(sql)
        sql = self.template(sql)
        sql = self.macros(sql)
        left = re.search(r"\$__\w+", sql)
        if left:
            raise ValueError(f"unexpanded macro {left.group(0)} in: {sql}")
        return sql

    # -- 1. $__conditionalAll (front end) -----------------------------------------------------

    def conditional_all(self, sql: str) -> str:
        macro = "$__conditionalAll("
        while (i := sql.rfind(macro)) != -1:
            args, length = _args(sql[i + len(macro) - 1 :])
            if args is None or len(args) != 2:
                raise ValueError(f"$__conditionalAll needs (condition, $variable): {sql[i : i + 120]}")
            condition, var_ref = args
            m = re.search(r"\$\{(\w+)\}|\$(\w+)", var_ref)
            phrase = condition
            if m:
                var = self.variables.get(m.group(1) or m.group(2))
                if var is not None and var.is_all:
                    phrase = "1=1"
            sql = sql[:i] + phrase + sql[i + len(macro) - 1 + length :]
        return sql

    # -- 2. template variables (Grafana's templateSrv) -----------------------------------------

    def template(self, sql: str) -> str:
        builtins = {
            "__from": str(self.time.from_ms),
            "__to": str(self.time.to_ms),
            "__interval_ms": str(int(self.time.interval_s * 1000)),
            "__range_s": str(int((self.time.end - self.time.start).total_seconds())),
        }

        def sub(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(2) or m.group(4)
            fmt = m.group(3) or m.group(5)
            if name in builtins:
                return builtins[name]
            var = self.variables.get(name)
            if var is None:
                return m.group(0)
            if list(var.selected) == [ALL] and var.all_value is not None:
                return var.all_value
            return _format(var.values(), fmt, multi=var.multi or list(var.selected) == [ALL])

        return re.sub(r"\$(\w+)|\$\{(\w+)(?::(\w+))?\}|\[\[(\w+)(?::(\w+))?\]\]", sub, sql)

    # -- 3. the plugin's back-end macros --------------------------------------------------------

    def macros(self, sql: str) -> str:
        t = self.time
        n = int(max(t.interval_s, 1))
        n_ms = int(max(t.interval_s * 1000, 1))
        s_from, s_to = int(t.start.timestamp()), int(t.end.timestamp())

        def filt(lo: str, hi: str) -> object:
            return lambda a: f"{_one(a)} >= {lo} AND {_one(a)} <= {hi}"

        table = {
            "timeFilter": filt(f"toDateTime({s_from})", f"toDateTime({s_to})"),
            "timeFilter_ms": filt(
                f"fromUnixTimestamp64Milli({t.from_ms})", f"fromUnixTimestamp64Milli({t.to_ms})"
            ),
            "dateFilter": filt(f"toDate('{t.start:%Y-%m-%d}')", f"toDate('{t.end:%Y-%m-%d}')"),
            "fromTime": lambda a: f"toDateTime({s_from})",
            "toTime": lambda a: f"toDateTime({s_to})",
            "fromTime_ms": lambda a: f"fromUnixTimestamp64Milli({t.from_ms})",
            "toTime_ms": lambda a: f"fromUnixTimestamp64Milli({t.to_ms})",
            "timeInterval": lambda a: f"toStartOfInterval(toDateTime({_one(a)}), INTERVAL {n} second)",
            "timeInterval_ms": lambda a: (
                f"toStartOfInterval(toDateTime64({_one(a)}, 3), INTERVAL {n_ms} millisecond)"
            ),
            "interval_s": lambda a: str(n),
        }
        for name, fn in table.items():
            pattern = re.compile(r"\$__" + name + r"\b")
            while m := pattern.search(sql):
                args, length = _args(sql[m.end() :])
                if args is None:
                    raise ValueError(f"$__{name}: unbalanced parentheses")
                sql = sql[: m.start()] + fn(args) + sql[m.end() + length :]  # type: ignore[operator]
        return sql


def _one(args: list[str]) -> str:
    if len(args) != 1:
        raise ValueError(f"expected 1 argument, got {len(args)}: {args}")
    return args[0]


def _args(s: str) -> tuple[list[str] | None, int]:
    """A bracketed argument list at the start of `s`: (trimmed args, its length); ([], 0) when
    there is none; (None, -1) when it does not close."""
    if not s.startswith("("):
        return [], 0
    depth, cur, args = 0, [], []
    for i, ch in enumerate(s):
        if ch == "(":
            depth += 1
            if depth == 1:
                continue
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append("".join(cur).strip())
                return args, i + 1
        elif ch == "," and depth == 1:
            args.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    return None, -1


def _format(values: list[str], fmt: str | None, *, multi: bool) -> str:
    if fmt == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    if fmt == "doublequote":
        return ",".join('"' + v.replace('"', '\\"') + '"' for v in values)
    if fmt in ("csv", "raw"):
        return ",".join(values)
    if fmt is not None:
        raise ValueError(f"variable format {fmt!r} is not modelled here")
    # The plugin's own format function: arrays quoted and joined, a single value raw.
    if multi:
        return "'" + "','".join(values) + "'"
    return values[0] if values else ""


# -- what a panel type needs from a query's result ---------------------------------------------

_NUMERIC = re.compile(r"^(Nullable\()?(U?Int\d+|Float\d+|Decimal(\d+)?\(.*\)|Bool)\)?$")
_TIME = re.compile(r"^(Nullable\()?(DateTime(64)?(\(.*\))?|Date(32)?)\)?$")
_STRING = re.compile(r"^(Nullable\()?(LowCardinality\()?(String|FixedString\(\d+\)|Enum\w*\(.*\))\)?\)?$")


def is_numeric(ch_type: str) -> bool:
    return bool(_NUMERIC.match(ch_type))


def is_time(ch_type: str) -> bool:
    return bool(_TIME.match(ch_type))


def is_string(ch_type: str) -> bool:
    return bool(_STRING.match(ch_type))


def shape_problems(panel_type: str, fmt: int, columns: Sequence[tuple[str, str]]) -> list[str]:
    """Why a result with `columns` [(name, ClickHouse type)] cannot feed `panel_type`; [] when it can.

    * timeseries (format 0, time series): a column named `time` of a date/time type — the plugin's
      back end looks it up by that name and refuses the frame without it — and ≥ 1 numeric column;
      string columns are series labels (long format, pivoted by the plugin).
    * stat / gauge / bargauge: ≥ 1 numeric column.
    * barchart: a string (or time) column for the x axis and ≥ 1 numeric column.
    * piechart: ≥ 1 numeric column (a string column names the slices).
    * table: anything.
    """
    names = [n for n, _ in columns]
    types = dict(columns)
    numeric = [n for n, t in columns if is_numeric(t)]
    out = []
    if panel_type == "timeseries":
        if fmt != 0:
            out.append("timeseries panel whose query is not format 0 (time series)")
        if "time" not in types or not is_time(types["time"]):
            out.append(f"no date/time column named `time` (columns: {columns})")
        if not [n for n in numeric if n != "time"]:
            out.append("no numeric value column")
        for n, t in columns:
            if n != "time" and not (is_numeric(t) or is_string(t)):
                out.append(f"column {n} of type {t} is neither a value nor a label")
    elif panel_type in ("stat", "gauge", "bargauge", "piechart"):
        if not numeric:
            out.append(f"no numeric column (columns: {columns})")
    elif panel_type == "barchart":
        if not any(is_string(types[n]) or is_time(types[n]) for n in names):
            out.append(f"no string/time column for the x axis (columns: {columns})")
        if not numeric:
            out.append("no numeric column")
    elif panel_type != "table":
        out.append(f"panel type {panel_type!r} is not modelled")
    return out


def interval_seconds(value: str) -> float:
    """'30s', '1m', '1h' → seconds (for panel `interval` settings)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", value)
    if not m:
        raise ValueError(f"not a Grafana interval: {value!r}")
    unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    return float(m.group(1)) * unit
