"""The `runcap` command line."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from typing import Any

from proxy import admin_http
from proxy.caps import OPERATOR_WHOLE_CAPS
from proxy.config import ConfigError, load_config
from proxy.server.auth import cli_admin_token
from proxy.server.data_dir import PRIVATE_UMASK


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

    p = sub.add_parser(
        "mock-upstream",
        help="serve the scripted OpenAI/Anthropic upstream for offline tests",
        description="A scripted, offline OpenAI/Anthropic upstream (chat, responses, completions, "
        "embeddings, messages; streaming and not) for testing agents without a provider. Example "
        "script: examples/scripts/refund.toml.",
        # The module's docstring for the user: what it speaks and the script format, without the
        # paragraph on what it records for runcap's own tests.
        epilog=_module_doc("proxy.scripted_upstream").split("\nFor tests,")[0].rstrip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Not 9100: the MCP example server (examples/mcp) and the README's [mcp] example use that.
    p.add_argument("--listen", default="127.0.0.1:8790", help="HOST:PORT (default 127.0.0.1:8790)")
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
        "caps",
        help="raise (or lower) a run's caps; `caps suggest`: per-task caps from the p99 of completed runs",
        description="`runcap caps RUN_ID --max-usd 2.00 --max-steps 30`: an operator's top-up of a "
        "run (POST /runs/{id}/caps); a run stopped by a cap that is raised continues with its next "
        'call. `runcap caps suggest [--task T] [--since TIME]`: [tasks."NAME"] tables for '
        "runcap.toml from the p99 of completed runs, with the share of runs each would have stopped.",
    )
    _add_client_args(p)
    p.add_argument("run_id", help="the run, or `suggest`")
    p.add_argument("--max-usd", help="dollar cap (decimal; `none` removes the cap)")
    for cap in OPERATOR_WHOLE_CAPS:  # the run's own caps, and its subtree's (run trees)
        name = cap.replace("_", "-")
        p.add_argument(f"--{name}", help=f"{name.replace('-', ' ')} cap (whole number; `none` removes it)")
    p.add_argument("--deadline", help="new deadline: RFC 3339 or Unix seconds (`none` removes it)")
    p.add_argument("--extend", type=float, metavar="SECONDS", help="move the deadline this much later")
    p.add_argument("--reason", help="why (recorded in the run's span with who and when)")
    p.add_argument("--by", help="who (default: $USER)")
    p.add_argument("--task", help="suggest: only this task")
    p.add_argument("--since", help="suggest: runs updated since (default: 7 days ago)")
    p.add_argument(
        "--min-runs", type=int, metavar="N",
        help="suggest: only for tasks with at least N completed runs (default 5)",
    )  # fmt: skip

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
    _add_approval_commands(sub)
    _add_read_commands(sub)
    return parser


def _add_approval_commands(sub: Any) -> None:
    """Tool calls held for a person (proxy/approval_cli.py)."""
    p = sub.add_parser(
        "approvals", help="tool calls waiting for a person's approval (--all: decided ones too)"
    )
    _add_client_args(p)
    p.add_argument("--run", dest="run_id", help="only this run's")
    p.add_argument("--all", action="store_true", help="every approval: pending, approved, denied, expired")
    for verb, what in (("approve", "let the held tool call execute (once)"), ("deny", "refuse it")):
        p = sub.add_parser(verb, help=f"{what}: approval ID (from `runcap approvals`)")
        _add_client_args(p)
        p.add_argument("approval_id", metavar="ID")
        p.add_argument("--by", help="who decides (default: $USER)")
        p.add_argument("--reason", required=verb == "deny", help="why (the agent is told it on a denial)")


def _module_doc(module: str) -> str:
    """A module's docstring without importing it (the CLI stays quick to start)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _add_wide_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wide", action="store_true",
        help="every column, whole values and full hashes, however wide the terminal (default: fit "
        "the terminal, or COLUMNS, leaving out the least important columns first)",
    )  # fmt: skip


def _add_read_commands(sub: Any) -> None:
    """The read commands (proxy/readcli.py): SQL on the span store, and stored payloads."""
    p = sub.add_parser(
        "query", help="run an on-call query from queries/NAME.sql (no NAME: list them)",
        description="Runs queries/NAME.sql (or a path to a .sql file) on the span store. Parameters "
        "not given with --param take the defaults declared in the file's header.",
    )  # fmt: skip
    _add_client_args(p)
    p.add_argument("name", nargs="?", help="query name, e.g. duplicate_side_effects")
    _add_wide_arg(p)
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="a query parameter (repeatable)")

    p = sub.add_parser("sql", help="run read-only SQL on the span store (runcap.spans, runcap.runs)")
    _add_client_args(p)
    p.add_argument("sql", help='e.g. "SELECT kind, count() FROM runcap.spans GROUP BY kind"')
    _add_wide_arg(p)
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="a {NAME:Type} parameter")

    p = sub.add_parser("runs", help="recent runs: status, steps, cost, the cap that stopped them")
    _add_client_args(p)
    p.add_argument("--since", help="runs updated since (ClickHouse DateTime, UTC; default: 24 hours ago)")
    p.add_argument("--task", help="only this task")
    p.add_argument("--status", help="only this status (completed, budget_exceeded, ...)")
    p.add_argument("--limit", type=int, help="rows (default 50)")
    _add_wide_arg(p)

    p = sub.add_parser("run", help="a run's timeline: one line per span (model calls, tool calls, results)")
    _add_client_args(p)
    _add_wide_arg(p)
    p.add_argument("run_id")
    p.add_argument(
        "--tree", action="store_true",
        help="the run's tree instead (its root, sub-agents, theirs...): per run its own and its subtree's "
        "spend, tokens, steps, status and caps",
    )  # fmt: skip

    p = sub.add_parser("payload", help="print a stored request/response body by its sha256")
    _add_client_args(p)
    p.add_argument(
        "hash", help="the sha256 (request_hash / response_hash), or a unique prefix of it (4+ hex digits)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # What any command creates is private (the data dir's files: server/data_dir.py); a read
    # command that opens the embedded store itself creates files in it too.
    os.umask(PRIVATE_UMASK)
    try:
        return _dispatch(args)
    except ConfigError as e:
        print(f"runcap: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `runcap runs | head`: the reader is gone; say nothing more (and not at exit either).
        sys.stdout = open(os.devnull, "w")
        return 0
    except OSError as e:
        if e.errno != errno.EADDRINUSE or args.command not in ("serve", "mock-upstream"):
            raise
        where = getattr(args, "listen", None) or "the configured listen address"
        print(
            f"runcap {args.command}: {where} is already in use (another runcap?): stop it, or pick "
            "another port with --listen HOST:PORT",
            file=sys.stderr,
        )
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        config = load_config(args.config, listen=args.listen, data_dir=args.data_dir, workers=args.workers)
        try:
            holder = _claim_data_dir(config.data_dir, config.listen)
        except OSError as e:
            print(
                f"runcap serve: cannot use data directory {config.data_dir}: {e.strerror or e}; "
                "give a writable directory with --data-dir DIR (or RUNCAP_DATA_DIR, data_dir in the config)",
                file=sys.stderr,
            )
            return 1
        if holder is not None:
            print(
                f"runcap serve: data directory {config.data_dir} is in use by another runcap serve "
                f"({holder}); stop it, or give this one its own --data-dir (more processes on one "
                "data directory: --workers N)",
                file=sys.stderr,
            )
            return 1
        from proxy.app import serve

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
    if args.command in ("approvals", "approve", "deny"):
        from proxy.approval_cli import approvals

        return approvals(args, load_config(args.config, data_dir=args.data_dir))
    if args.command in ("query", "sql", "runs", "run", "payload"):
        from proxy.readcli import run_read_command

        config = load_config(args.config, data_dir=args.data_dir)
        return run_read_command(args, config)
    if args.command == "caps" and args.run_id == "suggest":
        return _caps_suggest(args)
    if args.command in ("status", "cancel", "caps"):
        config = load_config(args.config, data_dir=args.data_dir)
        base = (args.url or f"http://{config.listen}").rstrip("/")
        token = cli_admin_token(config.admin_token, config.data_dir)
        if args.command == "status":
            offline = args.data_dir is not None and args.url is None
            url = f"{base}/runs/{args.run_id}"
            code, _ = _call_and_print("GET", url, token, args.json, quiet_unreachable=offline)
            return _status_offline(config, args) if code == UNREACHABLE else code
        if args.command == "cancel":
            code, answer = _call_and_print("POST", f"{base}/runs/{args.run_id}/cancel", token, args.json)
            return code if code or answer.get("known", True) else _unknown_run(args.run_id)
        body = _caps_body(args)
        if body is None:
            print("runcap caps: name a cap to change (--max-usd, --max-steps, ...)", file=sys.stderr)
            return 2
        code, answer = _call_and_print("POST", f"{base}/runs/{args.run_id}/caps", token, args.json, body)
        if code == 0 and answer.get("status") == "cancelled":
            print(
                f"runcap caps: run {args.run_id} is cancelled: its caps were changed, but a cancelled "
                "run stays cancelled and refuses every call — start a new run to continue",
                file=sys.stderr,
            )
            return 1
        return code
    raise AssertionError(args.command)


SERVE_LOCK = "serve.lock"
_serve_lock_fd: int | None = None  # held while this process serves; the kernel drops it at exit


def _claim_data_dir(data_dir: Any, listen: str) -> str | None:
    """One `runcap serve` per data directory: its ledger, WAL, shipper and embedded store belong
    to that one server (and its --workers). Takes `data_dir/serve.lock` (flock) for the life of
    this process; when another process holds it, returns who that is ("pid N, listening on ...")."""
    import fcntl
    from pathlib import Path

    global _serve_lock_fd
    path = Path(data_dir) / SERVE_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode("utf-8", "replace").split()
        os.close(fd)
        if len(holder) >= 2:
            return f"pid {holder[0]}, listening on {holder[1]}"
        return f"pid {holder[0]}" if holder else "starting up"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {listen}\n".encode(), 0)
    _serve_lock_fd = fd
    return None


def _caps_body(args: argparse.Namespace) -> dict[str, Any] | None:
    body: dict[str, Any] = {}

    def value(raw: str, whole: bool) -> Any:
        if raw.lower() == "none":
            return None
        if not whole:
            return raw
        try:
            return int(raw)
        except ValueError:
            raise SystemExit(f"runcap caps: {raw!r} is not a whole number") from None

    if args.max_usd is not None:
        body["max_usd"] = value(args.max_usd, False)
    for field in OPERATOR_WHOLE_CAPS:
        raw = getattr(args, field)
        if raw is not None:
            body[field] = value(raw, True)
    if args.deadline is not None:
        deadline = value(args.deadline, False)
        numeric = deadline is not None and deadline.replace(".", "", 1).isdigit()
        body["deadline"] = float(deadline) if numeric else deadline
    if args.extend is not None:
        body["extend_s"] = args.extend
    if not body:
        return None
    body["by"] = args.by or os.environ.get("USER") or "operator"
    if args.reason:
        body["reason"] = args.reason
    return body


def _caps_suggest(args: argparse.Namespace) -> int:
    from proxy.capsuggest import caps_suggest
    from proxy.clierrors import store_error
    from proxy.queryfiles import QueryFileError
    from proxy.readcli import ReadError, open_reader

    config = load_config(args.config, data_dir=args.data_dir)
    try:
        reader = open_reader(config, args.url, args.data_dir is not None)
        try:
            print(caps_suggest(args, reader), end="")
        finally:
            reader.close()
    except (ReadError, QueryFileError) as e:
        print(f"runcap caps suggest: {store_error(str(e))}", file=sys.stderr)
        return 1
    return 0


def _print_http(
    method: str, url: str, token: str | None, as_json: bool, body: dict[str, Any] | None = None
) -> int:
    code, _ = _call_and_print(method, url, token, as_json, body)
    return code


UNREACHABLE = -1  # _call_and_print(quiet_unreachable=True): nothing answered, nothing printed


def _status_offline(config: Any, args: argparse.Namespace) -> int:
    """`runcap status --data-dir DIR` with no server running: the run as the ledger holds it (the
    SQLite file of DIR, or Redis when RUNCAP_REDIS_URL is set), as `GET /runs/{id}` shows it."""
    import asyncio
    import time

    from proxy.app import open_ledger
    from proxy.server.ops import run_json

    async def read() -> Any:
        ledger = open_ledger(config)
        try:
            return await ledger.get_run(args.run_id)
        finally:
            await ledger.close()

    try:
        state = asyncio.run(read())
    except Exception as e:  # the ledger's own failure (Redis down, a locked file): one line
        print(f"runcap status: cannot read the ledger of {config.data_dir}: {e}", file=sys.stderr)
        return 1
    if state is None:
        print(f"runcap status: no run {args.run_id!r} in the ledger of {config.data_dir}", file=sys.stderr)
        return 1
    data = run_json(state, time.time())
    if args.json:
        print(json.dumps([data], indent=2))
    else:
        _print_mapping(data)
    return 0


def _call_and_print(
    method: str, url: str, token: str | None, as_json: bool, body: dict[str, Any] | None = None,
    *, quiet_unreachable: bool = False,
) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """One admin call: print the answer (a table, or JSON); (exit code, answer). Nothing answering
    is `UNREACHABLE`, unprinted, with `quiet_unreachable`."""
    try:
        data = admin_http.call_json(url, token, method=method, body=body)
    except admin_http.Refused as e:
        print(f"runcap {_verb(url)}: {e}", file=sys.stderr)
        return 1, {}
    except admin_http.Unreachable as e:
        if quiet_unreachable:
            return UNREACHABLE, {}
        verb = _verb(url)
        also = ", or --data-dir of its data directory to read the ledger" if verb == "status" else ""
        print(
            f"runcap {verb}: cannot reach runcap at {url}: {e.reason} (is `runcap serve` running? "
            f"use --url{also})",
            file=sys.stderr,
        )
        return 1, {}
    if as_json:
        print(json.dumps([data], indent=2))
    else:
        _print_mapping(data)
    return 0, data


def _verb(url: str) -> str:
    """The command an admin call's URL belongs to, for its messages."""
    last = url.rstrip("/").rsplit("/", 1)[-1]
    return last if last in ("caps", "cancel") else "status"


def _unknown_run(run_id: str) -> int:
    print(
        f"runcap cancel: run {run_id!r} was not known to this runcap (a typo?); it is marked "
        "cancelled anyway, so a first request under that id will be refused",
        file=sys.stderr,
    )
    return 1


def _print_mapping(data: dict, indent: str = "") -> None:  # type: ignore[type-arg]
    width = max((len(k) for k in data), default=0)
    for key, value in data.items():
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print_mapping(value, indent + "  ")
        else:
            print(f"{indent}{key:<{width}}  {_human(value)}")


def _human(value: Any) -> str:
    """A value as a person reads it: money (the API's 9-decimal strings) as $0.00125."""
    if value is None:
        return "-"
    money = isinstance(value, str) and len(value) > 10 and value[-10] == "."
    if money and value.replace(".", "", 1).isdigit():
        whole, frac = value.split(".")
        return f"${whole}.{frac.rstrip('0').ljust(2, '0')}"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
