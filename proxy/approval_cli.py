"""`runcap approvals`, `runcap approve ID`, `runcap deny ID --reason`: the operator's side of tool
calls held for a person (DESIGN.md "Tool policies and approvals"), through a running runcap's
`GET /approvals` and `POST /approvals/{id}` (proxy/toolcall/approval_routes.py) with the admin token,
as `runcap cancel` and `caps` do. The arguments shown are the call's body from the payload store
when it was kept (`args`; else only `args_hash`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
from typing import Any

from proxy import admin_http
from proxy.config import Config
from proxy.server.auth import cli_admin_token
from proxy.termtable import format_table, terminal_width

COLUMNS = ("id", "run_id", "tool", "state", "requested_at", "rule", "args", "by", "reason")


class _Failed(Exception):
    pass


def approvals(args: argparse.Namespace, config: Config) -> int:
    """The three verbs; exit 0, 1 (refused / unreachable) or 2 (usage)."""
    try:
        if args.command == "approvals":
            query: dict[str, str] = {"state": "all" if args.all else "pending"}
            if args.run_id:
                query["run"] = args.run_id
            answer = _call(config, args, f"/approvals?{urllib.parse.urlencode(query)}", None)
            rows = answer["approvals"]
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                _table(rows, all_states=args.all)
            return 0
        if args.command == "deny" and not (args.reason or "").strip():
            print("runcap deny: say why with --reason (the agent is told it)", file=sys.stderr)
            return 2
        body = {
            "decision": "approve" if args.command == "approve" else "deny",
            "by": args.by or os.environ.get("USER") or "operator",
            "reason": args.reason or "",
        }
        approval_id = urllib.parse.quote(args.approval_id, safe="")
        record = _call(config, args, f"/approvals/{approval_id}", body)
    except _Failed as e:
        print(f"runcap {args.command}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([record], indent=2))
    else:
        print(
            f"approval {record['id']} (run {record['run_id']}, tool {record['tool']}): {record['state']} "
            f"by {record['by']}" + (f": {record['reason']}" if record["reason"] else "")
        )
    return 0


def _call(config: Config, args: argparse.Namespace, path: str, body: dict[str, Any] | None) -> Any:
    base = (args.url or f"http://{config.listen}").rstrip("/")
    # A tenant's person decides with the tenant's approver token; an operator with the admin token.
    token = os.environ.get("RUNCAP_APPROVER_TOKEN") or cli_admin_token(config.admin_token, config.data_dir)
    try:
        return admin_http.call_json(
            f"{base}{path}", token, method="GET" if body is None else "POST", body=body
        )
    except admin_http.Refused as e:
        raise _Failed(str(e)) from None
    except admin_http.Unreachable as e:
        raise _Failed(
            f"cannot reach runcap at {base}: {e.reason} (is `runcap serve` running? use --url)"
        ) from None


def _table(rows: list[dict[str, Any]], *, all_states: bool) -> None:
    cells = []
    for r in rows:
        args = r["args"]
        shown = f"sha256:{r['args_hash'][:12]}"
        if args is not None:
            shown = json.dumps(args, ensure_ascii=False, sort_keys=True)
        cells.append(
            [r["id"], r["run_id"], r["tool"], r["state"], r["requested_at"] or "", r["rule"], shown,
             r["by"], r["reason"]]
        )  # fmt: skip
    columns = COLUMNS if all_states else tuple(c for c in COLUMNS if c not in ("by", "reason"))
    cells = [row[: len(columns)] if all_states else row[:7] for row in cells]
    title = None if rows or all_states else "no approval is pending"
    for line in format_table(
        columns, cells, width=terminal_width(sys.stdout),
        priority=("id", "tool", "args", "run_id", "state", "rule", "requested_at", "by", "reason"),
        title=title,
    ):  # fmt: skip
        print(line)
