"""Approvals across a restart, with the operator's CLI: a `defer` rule answers 428 with the
approval's id; `runcap approvals` lists it with the call's arguments from the payload store;
runcap is killed (-9) and started again on the same data directory; `runcap approve` releases the
call, which then executes exactly once (the tool counts); another call of the same tool with other
arguments is a new approval, and `runcap deny --reason` refuses it with the reason."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

from tests.conftest import REPO, RuncapProcess
from tests.support.tool_agent import call
from tests.support.tool_service import ToolService


def cli(proc: RuncapProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args, "--url", proc.url, "--data-dir", str(proc.data_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def pending(proc: RuncapProcess, run: str) -> list[dict[str, Any]]:
    done = cli(proc, "approvals", "--run", run, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_defer_survives_a_restart_and_executes_once(tool: ToolService, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "runcap.toml"
    config.write_text(
        f"""log_requests = false
payloads = "all"
[tools.refund]
url = "{tool.url}/refund"
side_effects = true
key_fields = ["order_id", "amount"]
[[tools.refund.rules]]
name = "large"
when = "args.amount > 100"
effect = "approve"
mode = "defer"
reason = "refunds over 100 need a person"
"""
    )
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    url, run = f"{proc.url}/tools/refund", "ticket-4711"
    big = {"order_id": "o-1", "amount": 500}
    try:
        status, headers, body = await call(url, run, big)
        assert status == 428 and headers["Retry-After"] == "30", body
        approval_id = body["error"]["approval_id"]
        assert body["error"]["type"] == "approval_required" and len(approval_id) == 32
        assert tool.executions == 0
        # the operator sees it, with its arguments once the shipper has stored the body
        for _ in range(200):
            [row] = pending(proc, run)
            if row["args"] is not None:
                break
            await asyncio.sleep(0.05)
        assert (row["id"], row["tool"], row["rule"], row["args"]) == (approval_id, "refund", "large", big)
        table = cli(proc, "approvals", "--run", run)
        assert approval_id in table.stdout and '"amount": 500' in table.stdout, table.stdout

        proc.kill9()
        proc.start()  # same data directory: the approval is in the ledger file

        approved = cli(proc, "approve", approval_id, "--by", "alice", "--reason", "order checked")
        assert approved.returncode == 0, approved.stderr
        assert f"approval {approval_id}" in approved.stdout and "approved by alice" in approved.stdout
        status, headers, body = await call(url, run, big)
        assert status == 200 and body["execution"] == 1
        status, headers, body = await call(url, run, big)  # the retried call: replayed, not run again
        assert status == 200 and headers.get("X-Idempotent-Replay") == "true"
        assert tool.executions == 1
        again = cli(proc, "approve", approval_id)
        assert again.returncode == 1 and "approved" in again.stderr

        other = {"order_id": "o-2", "amount": 900}
        status, _, body = await call(url, run, other)  # the same tool, other arguments: asks anew
        assert status == 428 and body["error"]["approval_id"] != approval_id
        no_reason = cli(proc, "deny", body["error"]["approval_id"])
        assert no_reason.returncode == 2
        denied = cli(proc, "deny", body["error"]["approval_id"], "--reason", "duplicate of o-1")
        assert denied.returncode == 0, denied.stderr
        status, _, body = await call(url, run, other)
        assert status == 403 and body["error"]["type"] == "tool_call_denied"
        assert "duplicate of o-1" in body["error"]["message"]
        assert tool.executions == 1
        assert pending(proc, run) == []
    finally:
        proc.stop()
