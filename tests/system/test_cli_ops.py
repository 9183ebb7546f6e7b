"""The operator CLI as a new user meets it: admin calls find the generated token, money reads as
money, a cancel of an unknown run says so, a busy port is one line, a closed pipe is no
traceback."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import urllib.request

import openai

from tests.conftest import REPO, RuncapProcess, free_port


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


async def test_status_and_cancel(runcap_factory, upstream, tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "data"
    rc = await runcap_factory(data_dir=data)
    c = openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0)
    h = {"X-Run-Id": "st-1", "X-Run-Max-Usd": "0.05"}
    messages = [{"role": "user", "content": "x"}]
    await c.chat.completions.create(model="gpt-4o-mini", messages=messages, extra_headers=h)
    at = ("--url", rc.url, "--data-dir", str(data))
    loop = asyncio.get_running_loop()
    status = await loop.run_in_executor(None, lambda: cli("status", "st-1", *at))
    assert status.returncode == 0, status.stderr
    assert "$0.05" in status.stdout and "0.050000000" not in status.stdout  # money as money
    # Without the data dir (no token) the operator is told to send one.
    denied = await loop.run_in_executor(None, lambda: cli("status", "st-1", "--url", rc.url))
    assert denied.returncode == 1 and "401" in denied.stderr
    done = await loop.run_in_executor(None, lambda: cli("cancel", "st-1", *at))
    assert done.returncode == 0 and "cancelled" in done.stdout
    typo = await loop.run_in_executor(None, lambda: cli("cancel", "st-l", *at))
    assert typo.returncode == 1 and "was not known" in typo.stderr


def test_busy_port_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for argv in (
            ("mock-upstream", "--listen", f"127.0.0.1:{port}"),
            ("serve", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "d")),
        ):
            out = cli(*argv, timeout=60)
            assert out.returncode == 1, out.stderr
            lines = [line for line in out.stderr.splitlines() if "already in use" in line]
            assert lines and "Traceback" not in out.stderr, out.stderr


def test_a_second_serve_on_the_same_data_dir_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two `runcap serve` on one data directory would share its ledger, WAL and embedded store: the
    second stops at once and says which process holds it; the first serves on."""
    data = tmp_path / "data"
    config = tmp_path / "runcap.toml"
    config.write_text("log_requests = false\ntracing = false\n")  # the lock comes first: no shipper needed
    first = RuncapProcess(config, data)
    first.start()
    try:
        assert first.proc is not None
        second = cli("serve", "--listen", f"127.0.0.1:{free_port()}", "--data-dir", str(data))
        assert second.returncode == 1
        assert second.stderr.splitlines() == [
            f"runcap serve: data directory {data} is in use by another runcap serve (pid {first.proc.pid}, "
            f"listening on 127.0.0.1:{first.port}); stop it, or give this one its own --data-dir (more "
            "processes on one data directory: --workers N)"
        ]
        with urllib.request.urlopen(f"{first.url}/healthz", timeout=10) as r:
            assert r.status == 200
    finally:
        first.stop()


def test_closed_pipe_is_quiet(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """`runcap query | head`: the reader goes away mid-output; runcap stops without a traceback."""
    from proxy.cli import main

    class ClosedPipe:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["query"]) == 0  # lists the query files: writes, and the pipe is closed


def test_an_empty_result_reads_as_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    from proxy.readcli import render_table

    for columns in ([], ["a"], ["run_id", "status"]):
        render_table(columns, [])
        out = capsys.readouterr().out
        assert "(no rows)" in out.splitlines(), out
