"""Every CLI error is one line saying what to do (issue 25, items 6, 7 and the CLI part of 13).

Each case is a `runcap` process, as the operator runs it: against a real `runcap serve` (HTTP
answers), against the embedded span store of a data directory (ClickHouse's exceptions), and with
configuration mistakes (which name what the user wrote: the TOML key, or the variable).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from proxy.clierrors import store_error
from tests.conftest import REPO, RuncapProcess


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RUNCAP_")}
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args], cwd=cwd or REPO, env={**base, **(env or {})},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def one_line_error(done: subprocess.CompletedProcess[str], *wanted: str) -> str:
    """The command failed with exactly one line on stderr, holding every `wanted` text."""
    assert done.returncode != 0, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "DB::Exception" not in done.stderr, done.stderr
    for text in wanted:
        assert text in lines[0], (text, lines[0])
    return lines[0]


@dataclass
class Served:
    proc: RuncapProcess
    data_dir: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("cli-errors")
    config = tmp / "runcap.toml"
    config.write_text('log_requests = false\n[upstreams.openai]\nurl = "http://127.0.0.1:9"\n')
    proc = RuncapProcess(config, tmp / "data")
    proc.start()
    yield Served(proc, tmp / "data")
    proc.stop()


async def _open_run(served: Served, run_id: str) -> None:
    """A run in the ledger: a call to a model upstream nobody listens for (it is not a step)."""
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{served.proc.url}/v1/chat/completions",
            json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Run-Id": run_id, "X-Run-Max-Steps": "5"},
        ) as r:
            assert r.status == 502, await r.text()


async def test_caps_with_a_bad_value_is_one_line(served: Served) -> None:
    await _open_run(served, "err-caps")
    at = ("--url", served.proc.url, "--data-dir", str(served.data_dir))
    one_line_error(cli("caps", "err-caps", "--max-usd", "abc", *at), "runcap caps: HTTP 400", "max_usd")
    past = one_line_error(
        cli("caps", "err-caps", "--deadline", "2020-01-01T00:00:00Z", *at), "deadline", "in the past"
    )
    assert "--extend" in past


async def test_top_up_of_a_cancelled_run_says_it_does_nothing(served: Served) -> None:
    await _open_run(served, "err-cancelled")
    at = ("--url", served.proc.url, "--data-dir", str(served.data_dir))
    assert cli("cancel", "err-cancelled", *at).returncode == 0
    done = cli("caps", "err-cancelled", "--max-steps", "9", *at)
    one_line_error(done, "cancelled", "start a new run")


def test_url_without_a_token_is_one_line(served: Served, tmp_path: Path) -> None:
    for command in (("runs",), ("status", "anything")):
        one_line_error(
            cli(*command, "--url", served.proc.url, cwd=tmp_path), "HTTP 401", "RUNCAP_ADMIN_TOKEN"
        )


def test_serve_on_a_data_dir_it_cannot_create(tmp_path: Path) -> None:
    one_line_error(
        cli("serve", "--data-dir", "/proc/nope", "--listen", "127.0.0.1:0", cwd=tmp_path),
        "runcap serve: cannot use data directory /proc/nope", "--data-dir",
    )  # fmt: skip


def test_status_reads_the_ledger_when_the_server_is_stopped(tmp_path: Path) -> None:
    config = tmp_path / "runcap.toml"
    config.write_text('log_requests = false\n[upstreams.openai]\nurl = "http://127.0.0.1:9"\n')
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        import asyncio

        asyncio.run(_open_run(Served(proc, tmp_path / "data"), "offline-1"))
    finally:
        proc.stop()
    done = cli("status", "offline-1", "--data-dir", str(tmp_path / "data"), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert '"run_id": "offline-1"' in done.stdout and '"max_steps": 5' in done.stdout
    one_line_error(
        cli("status", "nobody", "--data-dir", str(tmp_path / "data"), cwd=tmp_path), "no run 'nobody'"
    )


# -- the span store's errors, on an embedded store ---------------------------------------------


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from proxy.spans.clickhouse import open_span_store

    data = tmp_path_factory.mktemp("cli-store") / "data"
    open_span_store(None, data).close()
    return data


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (("runs", "--since", "yesterday"), ("runcap runs: --since: 'yesterday'", "2026-01-01")),
        (("caps", "suggest", "--since", "garbage"), ("runcap caps suggest: --since: 'garbage'",)),
        (("query", "top_spend", "--param", "by=nonsense"), ("--param by must be run, task or model",)),
        (("runs", "--status", "nonsense"), ("--status must be", "'nonsense'", "budget_exceeded")),
        (("query", "runs", "--param", "limit=ten"), ("--param limit", "whole number")),
        (("sql", "SELEC 1"), ("runcap sql: ClickHouse: Syntax error", "check the SQL")),
        (("sql", "SELECT nope FROM runcap.spans"), ("Unknown expression identifier", "column names")),
    ],
)
def test_read_command_errors_are_one_line(
    store_dir: Path, args: tuple[str, ...], wanted: tuple[str, ...]
) -> None:
    line = one_line_error(cli(*args, "--data-dir", str(store_dir), cwd=store_dir.parent), *wanted)
    assert "Expected one of" not in line and "In scope" not in line and len(line) <= 320


def test_store_error_keeps_the_message_and_drops_the_dump() -> None:
    dump = (
        "Code: 62. DB::Exception: Syntax error: failed at position 1 (SELEC): SELEC 1. Expected one of: "
        + ", ".join(["token"] * 40)
        + ": In scope SELECT formatQuerySingleLine('SELEC 1'). (SYNTAX_ERROR) (version 25.8.1.1)"
    )
    assert store_error(dump) == (
        "ClickHouse: Syntax error: failed at position 1 (SELEC): SELEC 1 — check the SQL (one SELECT; "
        "the tables are runcap.spans and runcap.runs)"
    )
    thrown = (
        "Code: 395. DB::Exception: top_spend: parameter by must be run, task or model: while executing "
        "'FUNCTION throwIf(...) UInt8 : 3'. (FUNCTION_THROW_IF_VALUE_IS_NON_ZERO)"
    )
    assert store_error(thrown) == "ClickHouse: top_spend: parameter by must be run, task or model"
    assert store_error("no runcap answers at http://x (refused)") == "no runcap answers at http://x (refused)"


# -- configuration: the name the user wrote ----------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "env", "wanted", "not_wanted"),
    [
        ('redis_url = "http://x"\n', {}, "redis_url: expected", "RUNCAP_REDIS_URL"),
        ("", {"RUNCAP_REDIS_URL": "http://x"}, "RUNCAP_REDIS_URL: expected", "redis_url:"),
        ('s3_url = "https://bucket"\n', {}, "s3_url: expected", "RUNCAP_S3_URL"),
        ('clickhouse_url = "clickhouse:9000"\n', {}, "clickhouse_url: expected", "RUNCAP_CLICKHOUSE_URL"),
        (
            'clickhouse_read_url = "http://r:8123"\n',
            {},
            "clickhouse_read_url: needs",
            "RUNCAP_CLICKHOUSE_READ",
        ),
        ("redis_url = 5\n", {}, "redis_url: expected", "Traceback"),
    ],
)
def test_config_errors_name_what_the_user_wrote(
    tmp_path: Path, toml: str, env: dict[str, str], wanted: str, not_wanted: str
) -> None:
    config = tmp_path / "runcap.toml"
    config.write_text(toml)
    line = one_line_error(cli("runs", "--config", str(config), env=env, cwd=tmp_path), wanted)
    assert not_wanted not in line
