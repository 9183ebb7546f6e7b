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
from proxy.readcli import AdminSqlReader
from tests.conftest import REPO, RuncapProcess, free_port
from tests.support.oncall_scenarios import REFUND, Agent, Facts, Services, play, wait_for_spans

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOKEN = "cli-read-token"
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
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNCAP_")}
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
            for name, t in svc.config_raw()["tools"].items()
        )
        config.write_text(
            f'listen = "127.0.0.1:{proc.port}"\ndata_dir = "{data_dir}"\nadmin_token = "{TOKEN}"\n'
            f'log_requests = false\n\n[upstreams.openai]\nurl = "{svc.upstream_url}"\n\n{tools}'
        )
        proc.start()
        facts = play(proc.url, "cli", TOKEN)
        reader = AdminSqlReader(proc.url, TOKEN)
        total = facts.model_spans + facts.tool_spans + facts.tool_call_spans + facts.tool_result_spans
        wait_for_spans(lambda sql: reader.query(sql)[1], total)
        yield Served(svc, proc, config, data_dir, facts)
    finally:
        if proc is not None:
            proc.stop()
        svc.close()


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
        "cli-cancel"
    ]

    timeline = as_json("run", "cli-dup", *cfg)
    assert [(r["step"], r["kind"], r["outcome"]) for r in timeline] == [
        (1, "model", "ok"), (1, "tool_call", "ok"), (1, "tool", "ok"), (1, "tool_result", "ok"),
        (2, "model", "ok"), (2, "tool_call", "ok"), (2, "tool", "replayed"), (2, "tool_result", "ok"),
        (3, "model", "ok"),
    ]  # fmt: skip
    assert Decimal(timeline[-1]["cumulative_usd"]) == served.facts.runs["dup"].cost(PRICES)

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
    from tests.test_spans import ClickHouseProcess

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
