"""The read CLI end to end: `python -m proxy.cli query | sql | runs | run | payload` as
subprocesses — against a running runcap (through its /admin/sql, with the admin token), directly
on the data directory once no server holds it, and on a ClickHouse server via
RUNCAP_CLICKHOUSE_URL — with table and --json output."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from proxy.hashing import canonical_json
from proxy.pricing import PriceBook
from proxy.readcli import AdminSqlReader, ReadError
from tests.conftest import REPO, RuncapProcess, free_port
from tests.support.oncall_scenarios import REFUND, Agent, Facts, Services, play, wait_for_spans

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOKEN = "cli-read-token-at-least-32-characters"
REFUND_HASH = hashlib.sha256(canonical_json(REFUND)).hexdigest()
PRICES = PriceBook()


@dataclass
class Served:
    svc: Services
    proc: RuncapProcess
    config: Path
    data_dir: Path
    facts: Facts


def cli(*args: str, env: dict[str, str] | None = None, ok: bool = True) -> subprocess.CompletedProcess[str]:
    # no COLUMNS: a pipe gets the whole table, whatever the terminal pytest runs in
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNCAP_") and k != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args], cwd=REPO, env={**clean, **(env or {})},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def as_json(*args: str, **kw: Any) -> list[dict[str, Any]]:
    return json.loads(cli(*args, "--json", **kw).stdout)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("cli-read")
    svc = Services()
    proc = None
    try:
        data_dir = tmp / "data"
        data_dir.mkdir()
        config = tmp / "runcap.toml"
        proc = RuncapProcess(config, data_dir)
        tools = "\n".join(
            f'[tools.{name}]\nurl = "{t["url"]}"\nside_effects = {str(t["side_effects"]).lower()}\n'
            + (f"key_fields = {json.dumps(t['key_fields'])}\n" if "key_fields" in t else "")
            + (f"timeout_s = {t['timeout_s']}\n" if "timeout_s" in t else "")
            + "".join(
                f"[[tools.{name}.rules]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in rule.items())
                for rule in t.get("rules", [])
            )
            for name, t in svc.config_raw()["tools"].items()
        )
        config.write_text(
            f'listen = "127.0.0.1:{proc.port}"\ndata_dir = "{data_dir}"\nadmin_token = "{TOKEN}"\n'
            f'log_requests = false\n\n[upstreams.openai]\nurl = "{svc.upstream_url}"\n\n{tools}'
        )
        proc.start()
        facts = play(proc.url, "cli", TOKEN)
        # A run that only calls tools, cancelled: its row says so (not `active` forever).
        agent = Agent(proc.url, facts, TOKEN)
        agent.tool("cli-tools-cancelled", "search", {"q": "refund policy"})
        agent.cancel("cli-tools-cancelled")
        agent.close()
        total = facts.model_spans + facts.tool_spans + facts.tool_call_spans + facts.tool_result_spans
        reader = starting_shipper(AdminSqlReader(proc.url, TOKEN))
        wait_for_spans(reader, total, timeout=60)
        cancelled = (
            "SELECT count() FROM runcap.runs WHERE run_id = 'cli-tools-cancelled' AND status = 'cancelled'"
        )
        wait_for_spans(lambda _: reader(cancelled), 1)  # the cancel's row: the last record written
        yield Served(svc, proc, config, data_dir, facts)
    finally:
        if proc is not None:
            proc.stop()
        svc.close()


def starting_shipper(reader: AdminSqlReader) -> Any:
    """`reader.query` for `wait_for_spans`, counting nothing while the span shipper (a process of
    its own, slow to start on a busy machine) does not answer yet."""

    def rows(sql: str) -> Any:
        try:
            return reader.query(sql)[1]
        except ReadError as e:
            if "HTTP 503" not in str(e):
                raise
            return [[-1]]

    return rows


def test_through_a_running_runcap(served: Served) -> None:
    cfg = ("--config", str(served.config))
    runs = as_json("runs", *cfg)  # the configured listen address, the configured admin token
    statuses = {r["run_id"]: r["status"] for r in runs}
    assert set(statuses) == served.facts.all_run_ids()
    assert statuses["cli-usd"] == "budget_exceeded" and statuses["cli-dup"] == "completed"
    assert {r["run_id"]: r["cap_hit"] for r in runs}["cli-steps"] == "X-Run-Max-Steps"
    assert Decimal(next(r for r in runs if r["run_id"] == "cli-dup")["cost_usd"]) == served.facts.runs[
        "dup"
    ].cost(PRICES)
    assert [r["run_id"] for r in as_json("runs", *cfg, "--status", "cancelled", "--limit", "5")] == [
        "cli-tools-cancelled", "cli-cancel"
    ]  # fmt: skip
    # A run that only calls tools never completes (no model answer ends it): active until a cap,
    # its deadline or a cancel stops it.
    assert statuses["cli-storm"] == "active" and statuses["cli-tools-cancelled"] == "cancelled"

    timeline = as_json("run", "cli-dup", *cfg)
    assert [(r["step"], r["kind"], r["outcome"]) for r in timeline] == [
        (1, "model", "ok"), (1, "tool_call", "ok"), (1, "tool", "ok"), (1, "tool_result", "ok"),
        (2, "model", "ok"), (2, "tool_call", "ok"), (2, "tool", "replayed"), (2, "tool_result", "ok"),
        (3, "model", "ok"),
    ]  # fmt: skip
    assert Decimal(timeline[-1]["cumulative_usd"]) == served.facts.runs["dup"].cost(PRICES)
    # A result sent back carries the status of the call that carried it, as a requested call does.
    assert {r["kind"]: r["status_code"] for r in timeline} == {
        "model": 200, "tool_call": 200, "tool": 200, "tool_result": 200
    }  # fmt: skip

    table = cli("run", "cli-dup", *cfg).stdout
    lines = table.splitlines()
    assert lines[0].strip().startswith("run cli-dup: 9 spans, $0.0000")
    assert REFUND_HASH[:12] in table and REFUND_HASH not in table  # short hashes on a terminal
    assert sum("replayed" in line for line in lines) == 1
    assert any("tool_result" in line for line in lines)

    dups = as_json("query", "duplicate_side_effects", *cfg, "--param", "run_id=cli-dup")
    assert [(r["seen_as"], r["times"], r["replays"]) for r in dups] == [
        ("requested", 2, None),
        ("executed", 2, 1),
    ]
    table = cli("query", "duplicate_side_effects", *cfg).stdout
    assert "cli-dup-model" in table and "requested" in table

    counted = as_json(
        "sql", "SELECT count() AS n FROM runcap.spans WHERE run_id = {r:String}", "--param", "r=cli-dup", *cfg
    )
    assert counted == [{"n": 9}]

    # --data-dir names the directory the server holds: chdb refuses a second process, so the
    # configured runcap answers instead.
    assert len(as_json("runs", *cfg, "--data-dir", str(served.data_dir))) == len(runs)


def test_admin_token_and_errors(served: Served) -> None:
    url = ("--url", served.proc.url)
    refused = cli("runs", *url, ok=False)
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr and "RUNCAP_ADMIN_TOKEN" in refused.stderr
    assert len(as_json("runs", *url, env={"RUNCAP_ADMIN_TOKEN": TOKEN})) == len(served.facts.all_run_ids())

    nobody = cli("runs", "--url", f"http://127.0.0.1:{free_port()}", ok=False)
    assert nobody.returncode == 1 and "no runcap answers at http://127.0.0.1:" in nobody.stderr

    bad = cli("sql", "SELEC 1", "--config", str(served.config), ok=False)
    assert bad.returncode == 1 and "Syntax error" in bad.stderr

    unknown = cli("query", "no_such_query", "--config", str(served.config), ok=False)
    assert (
        unknown.returncode == 1
        and "no query named 'no_such_query'" in unknown.stderr
        and "run_cost" in unknown.stderr
    )


def test_query_list_and_payload(served: Served) -> None:
    listing = cli("query").stdout
    assert "duplicate_side_effects: Why did this run call refund twice?" in listing
    assert "--param since=" in listing
    names = {q["name"] for q in as_json("query")}
    assert {"run_cost", "cap_hits", "unknown_outcomes"} <= names

    timeline = as_json("run", "cli-dup", "--config", str(served.config))
    first = timeline[0]
    # The request as runcap sent it upstream: the body the scripted model received.
    first_message = [{"role": "user", "content": "please handle dup"}]
    (sent,) = [
        r.body for r in served.svc.upstream.requests
        if isinstance(r.body, dict) and r.body.get("messages") == first_message
    ]  # fmt: skip
    body = cli("payload", first["request_hash"], "--data-dir", str(served.data_dir)).stdout
    assert json.loads(body) == sent
    by_prefix = cli("payload", first["request_hash"][:12], "--data-dir", str(served.data_dir)).stdout
    assert by_prefix == body
    (wrapped,) = as_json("payload", first["response_hash"], "--data-dir", str(served.data_dir))
    assert wrapped["sha256"] == first["response_hash"]
    assert json.loads(wrapped["body"])["object"] == "chat.completion"
    missing = cli("payload", "ab" * 32, "--data-dir", str(served.data_dir), ok=False)
    assert missing.returncode == 1 and "no payload" in missing.stderr


def main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`runcap ARGS` in this process (no interpreter start-up): exit code, stdout, stderr."""
    from proxy.cli import main as runcap

    code = runcap(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_payload_prefixes(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix that matches nothing says so, one that matches several lists them; an argument that
    is no hash at all says what a hash looks like."""
    for name in [k for k in os.environ if k.startswith("RUNCAP_")]:
        monkeypatch.delenv(name)
    at = ("--data-dir", str(served.data_dir))
    assert main(capsys, "payload", "deadbeef", *at) == (
        1, "", f"runcap payload: no payload matches deadbeef in {served.data_dir / 'payloads'}\n"
    )  # fmt: skip
    code, _, err = main(capsys, "payload", "cli-dup", *at)
    assert code == 1 and "'cli-dup' is not a sha256 hash or a prefix of one" in err

    from proxy.spans.payloads import LocalPayloadStore

    prefix_lookups(capsys, LocalPayloadStore(tmp_path / "payloads"), ("--data-dir", str(tmp_path)),
                   str(tmp_path / "payloads"))  # fmt: skip


def test_payload_prefixes_on_s3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    from proxy.spans.payloads import open_payload_store
    from tests.support.s3 import CREDENTIALS, S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    s3 = S3Server().start()
    try:
        s3.create_bucket("cli-payloads")
        for name in [k for k in os.environ if k.startswith(("RUNCAP_", "AWS_"))]:
            monkeypatch.delenv(name)
        for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3.endpoint_url}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("RUNCAP_S3_URL", "s3://cli-payloads/runcap")
        store = open_payload_store("s3://cli-payloads/runcap", tmp_path)
        prefix_lookups(capsys, store, ("--data-dir", str(tmp_path)), "s3://cli-payloads/runcap")
    finally:
        s3.stop()


def prefix_lookups(capsys: pytest.CaptureFixture[str], store: Any, at: tuple[str, ...], where: str) -> None:
    """Two bodies whose hashes share their first 4 hex digits, in `store`: `runcap payload` lists
    both for that prefix, prints one for a longer prefix, and says when nothing matches."""
    from proxy.spans.model import Payload

    seen: dict[str, bytes] = {}
    for n in range(5000):
        body = b'{"n": %d}' % n
        other = seen.setdefault(hashlib.sha256(body).hexdigest()[:4], body)
        if other != body:
            break
    for b in (other, body):
        store.put(Payload(hashlib.sha256(b).hexdigest(), b))
    store.close()
    both = sorted(hashlib.sha256(b).hexdigest() for b in (other, body))
    code, _, err = main(capsys, "payload", both[0][:4], *at)
    assert (code, err) == (
        1, f"runcap payload: {both[0][:4]} matches several payloads in {where}; give more digits: "
        f"{both[0]}, {both[1]}\n",
    )  # fmt: skip
    code, out, _ = main(capsys, "payload", both[1][:20], *at)
    assert code == 0 and hashlib.sha256(out.encode()).hexdigest() == both[1]
    unknown = "0" * 6 if both[0][:6] != "0" * 6 else "f" * 6
    assert main(capsys, "payload", unknown, *at) == (
        1, "", f"runcap payload: no payload matches {unknown} in {where}\n"
    )  # fmt: skip


def test_tables_fit_the_terminal(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """COLUMNS=80: no line wider, one line per row, and the hashes shown are what `runcap payload`
    takes; --wide shows every column and full hashes."""
    for name in [k for k in os.environ if k.startswith("RUNCAP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "80")
    cfg = ("--config", str(served.config))
    timeline = json.loads(main(capsys, "run", "cli-dup", *cfg, "--json")[1])
    code, out, _ = main(capsys, "run", "cli-dup", *cfg)
    lines = out.splitlines()
    assert code == 0 and all(len(line) <= 80 for line in lines), lines
    assert lines[0] == f"run cli-dup: {len(timeline)} spans, ${timeline[-1]['cumulative_usd']}"
    assert {"step", "kind", "outcome", "status", "request"} <= set(lines[2].split())
    rows = lines[4 : 4 + len(timeline)]
    assert [r.split()[1] for r in rows] == [t["kind"] for t in timeline]
    assert lines[-1].startswith("(--wide shows ") and len(lines) == 5 + len(timeline)
    request = timeline[0]["request_hash"]
    assert request[:12] in rows[0] and request not in out
    code, body, _ = main(capsys, "payload", request[:12], "--data-dir", str(served.data_dir))
    assert code == 0 and hashlib.sha256(body.encode()).hexdigest() == request

    code, out, _ = main(capsys, "run", "cli-dup", *cfg, "--wide")
    assert len(out.splitlines()) == 4 + len(timeline) and timeline[0]["response_hash"] in out
    for command in (("runs",), ("query", "unknown_outcomes"), ("query", "duplicate_side_effects")):
        code, out, _ = main(capsys, *command, *cfg)
        lines = out.splitlines()
        assert code == 0 and lines and all(len(line) <= 80 for line in lines), lines
        rows = json.loads(main(capsys, *command, *cfg, "--json")[1])
        assert len(lines) == 2 + len(rows) + lines[-1].startswith("(--wide shows ")


def test_without_a_server_reads_the_data_directory(served: Served, tmp_path: Path) -> None:
    served.proc.stop()  # last test of the module: the data directory is free now
    cfg = ("--config", str(served.config))
    # Nothing listens at the configured address: the configured data directory, directly.
    runs = as_json("runs", *cfg)
    assert {r["run_id"] for r in runs} == served.facts.all_run_ids()
    cost = as_json("query", "run_cost", "--data-dir", str(served.data_dir), "--param", "run_id=cli-dup")
    assert [r["row"] for r in cost] == ["step", "step", "step", "model", "run"]
    assert Decimal(cost[-1]["cost_usd"]) == served.facts.runs["dup"].cost(PRICES)
    table = cli("runs", "--data-dir", str(served.data_dir)).stdout
    assert "cli-usd" in table and "budget_exceeded" in table

    empty = tmp_path / "empty"
    empty.mkdir()
    neither = cli("runs", "--data-dir", str(empty), "--config", str(served.config), ok=False)
    assert neither.returncode == 1
    assert "no embedded span store in" in neither.stderr and "no runcap answers at" in neither.stderr


def test_runcap_clickhouse_url_reads_the_server(tmp_path: Path) -> None:
    from tests.support.clickhouse import ClickHouseProcess

    ch = ClickHouseProcess(tmp_path / "ch")
    ch.start()
    svc = Services()
    try:
        url, rt = svc.start_runcap(tmp_path / "data", clickhouse_url=ch.url)
        facts = Facts("chsrv")
        agent = Agent(url, facts, rt.config.admin_token)
        agent.run("dup", "refunds", "double-refund", via_tools=True)
        agent.close()
        reader = AdminSqlReader(url, rt.config.admin_token)
        total = facts.model_spans + facts.tool_spans + facts.tool_call_spans + facts.tool_result_spans
        wait_for_spans(lambda sql: reader.query(sql)[1], total)
        env = {"RUNCAP_CLICKHOUSE_URL": ch.url}
        # --url points nowhere: with RUNCAP_CLICKHOUSE_URL the server is read directly
        dead = ("--url", f"http://127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "nothing"))
        assert [r["run_id"] for r in as_json("runs", *dead, env=env)] == ["chsrv-dup"]
        dups = as_json("query", "duplicate_side_effects", *dead, env=env)
        assert [(r["run_id"], r["seen_as"], r["times"]) for r in dups] == [
            ("chsrv-dup", "requested", 2), ("chsrv-dup", "executed", 2),
        ]  # fmt: skip
    finally:
        svc.close()
        ch.stop()
