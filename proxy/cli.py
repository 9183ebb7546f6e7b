"""The `runcap` command line."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from proxy.config import ConfigError, load_config
from proxy.server.auth import cli_admin_token


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file (default: ./runcap.toml if present)")
    p.add_argument("--data-dir", help="data directory (default: ./runcap-data, or RUNCAP_DATA_DIR)")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument(
        "--url", help="a running runcap, http://host:port (default: the configured listen address)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runcap", description="Per-run caps, at-most-once tools and step traces for LLM agents."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the proxy")
    _add_config_args(p)
    p.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:8787, or RUNCAP_LISTEN)")
    p.add_argument("--workers", type=int, help="processes sharing the port (default 1)")

    p = sub.add_parser("demo", help="run runcap and a scripted model offline and show what it enforces")
    p.add_argument("--data-dir", help="data directory (default: a fresh temporary one)")

    p = sub.add_parser("mock-upstream", help="serve the scripted OpenAI/Anthropic upstream for offline tests")
    p.add_argument("--listen", default="127.0.0.1:9100", help="HOST:PORT (default 127.0.0.1:9100)")
    p.add_argument(
        "--script", help="JSON or TOML file of named scripts (chosen per request by X-Mock-Script)"
    )

    p = sub.add_parser("status", help="a run's caps, spend and what is left (GET /runs/{id})")
    _add_client_args(p)
    p.add_argument("run_id")

    p = sub.add_parser("cancel", help="cancel a run: refuse its next calls and abort those in flight")
    _add_client_args(p)
    p.add_argument("run_id")

    p = sub.add_parser(
        "reconcile",
        help="list side-effecting tool calls whose outcome is unknown; resolve one as done or not done",
        description="Without KEY: list idempotency records (default: the unknown ones). With KEY: "
        "resolve it — --done records the outcome to replay (--status, --body/--body-file), --not-done "
        "deletes the record so the next attempt executes. Talks to a running runcap (--url), or, "
        "with --data-dir, opens the ledger directly (no server needed).",
    )
    _add_client_args(p)
    p.add_argument("key", nargs="?", help="the idempotency key to resolve")
    p.add_argument("--run", dest="run_id", help="the key's run (needed when a key exists in several runs)")
    verdict = p.add_mutually_exclusive_group()
    verdict.add_argument("--done", action="store_true", help="the call took effect: replay --status/--body")
    verdict.add_argument("--not-done", action="store_true", help="it did not: the next attempt executes")
    p.add_argument("--status", type=int, default=200, help="HTTP status to replay (default 200)")
    p.add_argument("--body", help="response body to replay")
    p.add_argument("--body-file", help="file holding the response body to replay")
    p.add_argument("--content-type", help="content type of the body (default: JSON when it looks like JSON)")
    p.add_argument(
        "--state", default="unknown", choices=["unknown", "in_flight", "completed", "all"],
        help="records to list (default unknown)",
    )  # fmt: skip
    _add_read_commands(sub)
    return parser


def _add_read_commands(sub: Any) -> None:
    """The read commands (proxy/readcli.py): SQL on the span store, and stored payloads."""
    p = sub.add_parser(
        "query", help="run an on-call query from queries/NAME.sql (no NAME: list them)",
        description="Runs queries/NAME.sql (or a path to a .sql file) on the span store. Parameters "
        "not given with --param take the defaults declared in the file's header.",
    )  # fmt: skip
    _add_client_args(p)
    p.add_argument("name", nargs="?", help="query name, e.g. duplicate_side_effects")
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="a query parameter (repeatable)")

    p = sub.add_parser("sql", help="run read-only SQL on the span store (runcap.spans, runcap.runs)")
    _add_client_args(p)
    p.add_argument("sql", help='e.g. "SELECT kind, count() FROM runcap.spans GROUP BY kind"')
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="a {NAME:Type} parameter")

    p = sub.add_parser("runs", help="recent runs: status, steps, cost, the cap that stopped them")
    _add_client_args(p)
    p.add_argument("--since", help="runs updated since (ClickHouse DateTime, UTC; default: 24 hours ago)")
    p.add_argument("--task", help="only this task")
    p.add_argument("--status", help="only this status (completed, budget_exceeded, ...)")
    p.add_argument("--limit", type=int, help="rows (default 50)")

    p = sub.add_parser("run", help="a run's timeline: one line per span (model calls, tool calls, results)")
    _add_client_args(p)
    p.add_argument("run_id")

    p = sub.add_parser("payload", help="print a stored request/response body by its sha256")
    _add_client_args(p)
    p.add_argument("hash", help="the sha256 (request_hash / response_hash); a unique prefix on local storage")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as e:
        print(f"runcap: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from proxy.server.app import serve

        config = load_config(args.config, listen=args.listen, data_dir=args.data_dir, workers=args.workers)
        serve(config)
        return 0
    if args.command == "demo":
        from proxy.demo import main as demo_main

        return demo_main(args.data_dir)
    if args.command == "mock-upstream":
        from proxy.config import parse_listen
        from proxy.scripted_upstream import run

        host, port = parse_listen(args.listen, "--listen")
        run(host, port, args.script)
        return 0
    if args.command == "reconcile":
        from proxy.reconcile_cli import reconcile

        config = load_config(args.config, data_dir=args.data_dir)
        return reconcile(args, config)
    if args.command in ("query", "sql", "runs", "run", "payload"):
        from proxy.readcli import run_read_command

        config = load_config(args.config, data_dir=args.data_dir)
        return run_read_command(args, config)
    if args.command in ("status", "cancel"):
        config = load_config(args.config, data_dir=args.data_dir)
        base = (args.url or f"http://{config.listen}").rstrip("/")
        if args.command == "status":
            return _print_http("GET", f"{base}/runs/{args.run_id}", None, args.json)
        token = cli_admin_token(config.admin_token, config.data_dir)
        return _print_http("POST", f"{base}/runs/{args.run_id}/cancel", token, args.json)
    raise AssertionError(args.command)


def _print_http(method: str, url: str, token: str | None, as_json: bool) -> int:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", "replace")
        print(f"runcap: {method} {url}: HTTP {e.code}: {body}", file=sys.stderr)
        return 1
    except urllib.error.URLError as e:
        print(
            f"runcap: cannot reach runcap at {url}: {e.reason} (is `runcap serve` running? use --url)",
            file=sys.stderr,
        )
        return 1
    if as_json:
        print(json.dumps([data], indent=2))
    else:
        _print_mapping(data)
    return 0


def _print_mapping(data: dict, indent: str = "") -> None:  # type: ignore[type-arg]
    width = max((len(k) for k in data), default=0)
    for key, value in data.items():
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print_mapping(value, indent + "  ")
        else:
            print(f"{indent}{key:<{width}}  {'-' if value is None else value}")


if __name__ == "__main__":
    raise SystemExit(main())
