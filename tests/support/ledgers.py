"""Every ledger backend behind one fixture (make_ledger: SQLite, Redis on the session's redis-
server, and Redis on the session's 3-master Redis Cluster), and the step / tool-call requests the
tests send them. A test that holds for some backends only says which with `@backends(...)`: the
others are not generated (never a skip that looks like a missing part)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from proxy.caps import RunCaps
from proxy.ledger.base import (
    Ledger,
    StepRequest,
    ToolCallRequest,
)
from proxy.ledger.redis import RedisLedger
from proxy.ledger.sqlite import SQLiteLedger

USD = 1_000_000_000


def step(
    run_id: str, caps: RunCaps, *, input_tokens: int = 100, output: int | None = 100, **kw: Any
) -> StepRequest:
    return StepRequest(
        run_id=run_id, task="t", caps=caps, now=kw.pop("now", time.time()), model="m",
        input_tokens_bound=input_tokens, client_output_limit=output, model_output_bound=4096,
        min_output_tokens=16, input_usd_per_mtok=Decimal(1), output_usd_per_mtok=Decimal(2), **kw,
    )  # fmt: skip


def tool(
    run_id: str, key: str | None, caps: RunCaps | None = None, now: float | None = None, **op: str
) -> ToolCallRequest:
    """A call of `POST /tools/refund`; `op` overrides name, method, path, args_hash, op_hash."""
    return ToolCallRequest(
        run_id, "t", caps or RunCaps(), now or time.time(), op.get("name", "refund"), key,
        op.get("args_hash", "ah"), method=op.get("method", "POST"), path=op.get("path", ""),
        op_hash=op.get("op_hash", "op"),
    )  # fmt: skip


async def die(ledger: Ledger) -> None:
    """Simulate kill -9 of the process owning `ledger`: its liveness signal disappears."""
    if isinstance(ledger, SQLiteLedger):
        ledger._owner_file.close()  # the flock goes with the process
    else:
        assert isinstance(ledger, RedisLedger)
        assert ledger._heartbeat_task is not None
        ledger._heartbeat_task.cancel()
        await ledger._r.delete(ledger._k_owner(ledger.owner))  # as if its TTL ran out


BACKENDS = ("sqlite", "redis", "redis-cluster")


def backends(*names: str) -> pytest.MarkDecorator:
    """The test runs make_ledger on these backends only (e.g. `@backends("sqlite")` for SQLite's
    own purge): the cases of the others do not exist."""
    unknown = set(names) - set(BACKENDS)
    if unknown or not names:
        raise ValueError(f"backends({', '.join(names)}): each must be one of {', '.join(BACKENDS)}")
    return pytest.mark.parametrize("make_ledger", names, indirect=True)


@pytest.fixture(params=BACKENDS)
async def make_ledger(request, tmp_path: Path) -> AsyncIterator[Callable[..., Ledger]]:  # type: ignore[no-untyped-def]
    """make_ledger(**opts) → a ledger instance; every instance of one test shares one store."""
    opened: list[Ledger] = []
    prefix = f"t{secrets.token_hex(4)}:"

    def make(retention_s: float = 3600.0) -> Ledger:
        if request.param == "sqlite":
            ledger: Ledger = SQLiteLedger(tmp_path / "ledger.sqlite3", retention_s=retention_s)
        else:
            cluster = request.param == "redis-cluster"
            server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
            # confirm_dead_s=0: the tests fake a death by deleting the heartbeat key; the two-sweep
            # rule is tested with real replicas in test_ledger_faults.py.
            ledger = RedisLedger(
                server.url, prefix=prefix, retention_s=retention_s, heartbeat_ttl_s=5, confirm_dead_s=0,
                cluster=cluster,
            )  # fmt: skip
        opened.append(ledger)
        return ledger

    make.backend = request.param  # type: ignore[attr-defined]
    yield make
    for ledger in opened:
        try:
            await ledger.close()
        except Exception:
            pass
