"""`runcap reconcile`: the operator's side of unknown tool-call outcomes.

Lists idempotency records (the `unknown` ones by default) and resolves one: `--done` records the
outcome a repeat will replay, `--not-done` deletes the record so the next attempt executes.
Through a running runcap's admin routes (`--url`), or directly on the ledger with `--data-dir`
(the SQLite file, or Redis when RUNCAP_REDIS_URL is set) — no server needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from proxy import admin_http
from proxy.config import Config
from proxy.server.auth import cli_admin_token

_COLUMNS = ("run_id", "key", "tool", "method", "path", "args_hash", "state", "updated_at", "error")


def reconcile(args: argparse.Namespace, config: Config) -> int:
    if args.key is None and (args.done or args.not_done):
        print("runcap reconcile: --done / --not-done need the KEY to resolve", file=sys.stderr)
        return 2
    if args.key is not None and not (args.done or args.not_done):
        print("runcap reconcile: say --done (it took effect) or --not-done (it did not)", file=sys.stderr)
        return 2
    body = args.body
    if args.body_file:
        body = Path(args.body_file).read_text()
    resolution = None
    if args.key is not None:
        resolution = {
            "outcome": "done" if args.done else "not_done",
            "status": args.status,
            "body": body or "",
        }
        if args.run_id:
            resolution["run_id"] = args.run_id
        if args.content_type:
            resolution["content_type"] = args.content_type
    direct = args.data_dir is not None and args.url is None
    try:
        if direct:
            result = asyncio.run(_direct(config, args, resolution))
        else:
            result = _http(config, args, resolution)
    except _Failed as e:
        print(f"runcap reconcile: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result if isinstance(result, list) else [result], indent=2))
    elif isinstance(result, list):
        _table(result)
    else:
        print(
            f"{result['key']} (run {result['run_id']}, tool {result['tool']}): "
            f"{result['previous_state']} → {result['resolved']}"
        )
    return 0


class _Failed(Exception):
    pass


def _http(config: Config, args: argparse.Namespace, resolution: dict[str, Any] | None) -> Any:
    base = (args.url or f"http://{config.listen}").rstrip("/")
    token = cli_admin_token(config.admin_token, config.data_dir)
    if resolution is None:
        query = {"state": args.state}
        if args.run_id:
            query["run_id"] = args.run_id
        url, method = f"{base}/admin/idempotency?{urllib.parse.urlencode(query)}", "GET"
    else:
        url, method = f"{base}/admin/idempotency/{urllib.parse.quote(args.key, safe='')}/resolve", "POST"
    try:
        return admin_http.call_json(url, token, method=method, body=resolution)
    except admin_http.Refused as e:
        raise _Failed(str(e)) from None
    except admin_http.Unreachable as e:
        raise _Failed(
            f"cannot reach runcap at {base}: {e.reason} (is `runcap serve` running? use --url, or "
            "--data-dir to open the ledger directly)"
        ) from None


async def _direct(config: Config, args: argparse.Namespace, resolution: dict[str, Any] | None) -> Any:
    from proxy.app import open_ledger
    from proxy.ledger.base import RecordNotUnknown
    from proxy.server.reconcile import record_json

    ledger = open_ledger(config)
    try:
        if resolution is None:
            state = None if args.state == "all" else args.state
            return [record_json(r) for r in await ledger.list_tool_calls(state, args.run_id)]
        run_id = args.run_id
        if run_id is None:
            runs = {r.run_id for r in await ledger.list_tool_calls() if r.key == args.key}
            if len(runs) != 1:
                raise _Failed(
                    f"no record with key {args.key!r}"
                    if not runs
                    else f"key {args.key!r} is in several runs ({', '.join(sorted(runs))}): pass --run"
                )
            run_id = runs.pop()
        body = resolution["body"]
        content_type = args.content_type or (
            "application/json" if body[:1] in ("{", "[") else "text/plain; charset=utf-8"
        )
        try:
            before = await ledger.resolve_tool_call(
                run_id, args.key, done=resolution["outcome"] == "done", now=time.time(),
                status=args.status, headers={"content-type": content_type}, body=body.encode(),
            )  # fmt: skip
        except RecordNotUnknown as e:
            raise _Failed(
                f"{args.key} is {e.record.state}, not unknown: only an unknown outcome can be resolved"
            ) from None
        if before is None:
            raise _Failed(f"no record {args.key!r} in run {run_id!r}")
        return {**record_json(before), "resolved": resolution["outcome"], "previous_state": before.state}
    finally:
        await ledger.close()


def _table(rows: list[dict[str, Any]]) -> None:
    """The records as a table fitted to the terminal (proxy/termtable.py): the key an operator
    resolves, its run, tool, state and why first; the rest as the width allows."""
    from proxy.readcli import render_table

    if not rows:
        print("no records")
        return
    cells = [[_cell(c, r.get(c)) for c in _COLUMNS] for r in rows]
    render_table(list(_COLUMNS), cells, view=_view())


_VIEW_PRIORITY = ("key", "run_id", "tool", "state", "error", "updated_at", "method", "path", "args_hash")


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    if column == "path" and len(text) > 40:
        return text[:39] + "…"
    return text[:16] if column == "args_hash" else text


def _view() -> Any:
    from proxy.readcli import TableView

    return TableView(show=_COLUMNS, priority=_VIEW_PRIORITY)
