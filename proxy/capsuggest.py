"""`runcap caps suggest`: per-task caps from the p99 of completed runs, printed as `[tasks."NAME"]`
TOML ready to paste into runcap.toml — the measurement loop of the `cap_recommendations` query,
closed. Each suggestion is the p99 with headroom (10 %, rounded up), and says which share of the
task's runs in the window would have exceeded it and how many completed runs it is based on. A
task with fewer completed runs than `--min-runs` (MIN_RUNS) gets no suggestion — a p99 of two runs
is their maximum, a 1 s timeout from one run would stop the next — unless asked for; below
FEW_RUNS the table says the numbers are thin. `--json`: the suggestions as a JSON array.

Run trees: a task whose runs start sub-agents (X-Run-Parent) gets its dollar and token caps from
its trees' totals — a run's `max_usd` / `max_tokens` bound its whole subtree already, so the p99 of
the run's own spend would stop its trees — and says so; the subtree caps on model and tool calls
(`tree_steps`, `tree_tool_calls`: the X-Run-Max-Tree-Steps / -Tree-Tool-Calls headers, which have no
`[tasks]` key) are printed as the headers for the agent host to send.
"""

from __future__ import annotations

import argparse
import json
import math
from decimal import ROUND_UP, Decimal
from typing import Any

from proxy.queryfiles import bind, load_query
from proxy.readcli import Reader

# metric of cap_recommendations → (TOML key, the runs column it measures)
_KEYS = {
    "steps": ("max_steps", "steps"),
    "tool_calls": ("max_tool_calls", "tool_calls"),
    "tokens": ("max_tokens", "input_tokens + output_tokens"),
    "usd": ("max_usd", "toFloat64(cost_usd)"),
    "wall_clock_s": ("timeout_s", "dateDiff('microsecond', started_at, updated_at) / 1e6"),
}
# ... for a run that started sub-agents, what the cap bounds: its tree's totals (the `trees` join)
_TREE_VALUES = {
    "tokens": "toFloat64(tree_tokens)",
    "usd": "toFloat64(tree_usd)",
    "tree_steps": "toFloat64(tree_steps)",
    "tree_tool_calls": "toFloat64(tree_tool_calls)",
}
# subtree caps without a `[tasks]` key: metric → the header (proxy/caps.py) that sets one
_TREE_HEADERS = {"tree_steps": "X-Run-Max-Tree-Steps", "tree_tool_calls": "X-Run-Max-Tree-Tool-Calls"}
_OWN = {"tree_steps": "steps", "tree_tool_calls": "tool_calls"}
HEADROOM = 1.1
MIN_RUNS = 5  # completed runs of a task below which nothing is suggested (unless --min-runs)
FEW_RUNS = 30  # ... below which the suggestion says it is based on few runs


def suggested(metric: str, p99: float) -> float | int:
    """The p99 with headroom, rounded up to a value an operator would write."""
    value = p99 * HEADROOM
    if metric in ("steps", "tool_calls", "tree_steps", "tree_tool_calls"):
        return max(math.ceil(value), math.floor(p99) + 1)
    if metric == "tokens":
        return math.ceil(value / 1000.0) * 1000
    if metric == "usd":
        return float(Decimal(str(value)).quantize(Decimal("0.01"), rounding=ROUND_UP))
    return math.ceil(value)


def caps_suggest(args: argparse.Namespace, reader: Reader) -> str:
    query = load_query("cap_recommendations")
    min_runs = MIN_RUNS if getattr(args, "min_runs", None) is None else args.min_runs
    given = {"task": args.task or ""}
    if args.since:
        given["since"] = args.since
    params = bind(query, given, reader, {"task": "--task", "since": "--since"})
    columns, rows = reader.query(query.sql, params)
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        rec = dict(zip(columns, row, strict=True))
        if rec["completed_runs"] and rec["p99"] is not None:
            by_task.setdefault(rec["task"], []).append(rec)
    since = params.get("since")
    suggestions: list[dict[str, Any]] = []
    lines = [
        "# runcap caps suggest: p99 of completed runs + 10 % headroom, per task"
        + (f" (runs updated since {since})" if since else ""),
        "# paste into runcap.toml; headers may lower these caps, [caps] ceilings clamp them",
    ]
    if not by_task:
        if getattr(args, "json", False):
            return "[]\n"
        lines.append("# no completed runs in the window: nothing to suggest yet")
        return "\n".join(lines) + "\n"
    for task, recs in sorted(by_task.items()):
        if not task:
            lines.append("\n# runs without X-Run-Task: send a task label to get per-task caps")
            continue
        completed = max(int(rec["completed_runs"]) for rec in recs)
        if completed < min_runs:
            lines.append(
                f'\n# [tasks."{task}"]: only {completed} completed run{"s" if completed != 1 else ""}, fewer '
                f"than --min-runs {min_runs}: no suggestion (a p99 of so few runs is their maximum); "
                f"pass --min-runs {completed} to get one anyway"
            )
            continue
        caps = {rec["metric"]: suggested(rec["metric"], float(rec["p99"])) for rec in recs}
        trees = any(rec["metric"] in _TREE_HEADERS for rec in recs)  # listed only when it has trees
        shares = _shares(reader, task, caps, params, trees)
        few = " — few runs: treat it as a first guess" if completed < FEW_RUNS else ""
        lines.append(f"\n# based on {completed} completed runs{few}")
        if trees:
            lines.append(
                "# its runs start sub-agents: max_usd and max_tokens are the p99 of the whole tree (the run "
                "and every run below it) — a run's dollar and token caps bound its subtree already"
            )
        lines.append(f'[tasks."{task}"]')
        settings = {
            rec["metric"]: f"{_KEYS[rec['metric']][0]} = {caps[rec['metric']]!r}" if rec["metric"] in _KEYS
            else f"#   {_TREE_HEADERS[rec['metric']]}: {caps[rec['metric']]!r}"
            for rec in recs
        }  # fmt: skip
        widths = [max((len(v) for m, v in settings.items() if (m in _TREE_HEADERS) == h), default=0)
                  for h in (False, True)]  # the table's comments line up, and the headers' apart
        headers: list[str] = []
        for rec in recs:
            metric = rec["metric"]
            of_what = " (of its trees)" if trees and metric in _TREE_VALUES else ""
            width = widths[metric in _TREE_HEADERS]
            line = (
                f"{settings[metric]:<{width}}  # p99 {_num(rec['p99'])}{of_what} of {rec['completed_runs']} "
                f"completed runs; {shares[metric]:.1%} of {rec['runs']} runs would have exceeded it"
            )
            (headers if metric in _TREE_HEADERS else lines).append(line)
            suggestions.append({
                "task": task, "setting": _KEYS[metric][0] if metric in _KEYS else _TREE_HEADERS[metric],
                "value": caps[metric], "metric": metric, "p99": float(rec["p99"]),
                "completed_runs": int(rec["completed_runs"]), "runs": int(rec["runs"]),
                "share_exceeding": shares[metric], **({"of_tree": True} if of_what else {}),
            })  # fmt: skip
        if headers:
            lines.append(
                "# subtree caps on model and tool calls (the run and its sub-agents together) have no "
                "[tasks] key: the agent host sends them as headers"
            )
            lines.extend(headers)
    if getattr(args, "json", False):
        return json.dumps(suggestions, indent=2) + "\n"
    return "\n".join(lines) + "\n"


_LATEST = (
    "(SELECT * FROM runcap.runs WHERE updated_at >= {since:DateTime64(6, 'UTC')}%s "
    "ORDER BY run_id, updated_at DESC, steps DESC LIMIT 1 BY run_id)"
)
# each tree's totals under its root's id, as queries/cap_recommendations.sql joins them
_TREES = (
    "(SELECT if(root_run_id = '', run_id, root_run_id) AS run_id, count() AS tree_runs, sum(cost_usd) AS "
    "tree_usd, sum(input_tokens + output_tokens) AS tree_tokens, sum(steps) AS tree_steps, sum(tool_calls) "
    f"AS tree_tool_calls FROM {_LATEST % ''} GROUP BY run_id)"
)


def _shares(
    reader: Reader, task: str, caps: dict[str, Any], params: dict[str, Any], trees: bool = False
) -> dict[str, float]:
    """The share of the task's runs (latest state) whose usage went past each suggested cap: for a
    task with run trees, the dollars, tokens and subtree calls of a run that started sub-agents
    are its tree's totals."""

    def value(m: str) -> str:
        own = _KEYS[m][1] if m in _KEYS else _OWN[m]
        return f"if(tree_runs > 1, {_TREE_VALUES[m]}, {own})" if trees and m in _TREE_VALUES else own

    parts = [f"countIf({value(m)} > {{cap_{m}:Float64}}) / count() AS share_{m}" for m in caps]
    joined = f" LEFT JOIN {_TREES} AS trees USING (run_id)" if trees else ""
    sql = f"SELECT {', '.join(parts)} FROM {_LATEST % ' AND task = {task:String}'} AS r{joined}"
    values = {"since": params["since"], "task": task, **{f"cap_{m}": float(v) for m, v in caps.items()}}
    columns, rows = reader.query(sql, values)
    if not rows:
        return dict.fromkeys(caps, 0.0)
    return {c.removeprefix("share_"): float(v or 0) for c, v in zip(columns, rows[0], strict=True)}


def _num(value: Any) -> str:
    f = float(value)
    return str(int(f)) if f.is_integer() else f"{f:.4g}"
