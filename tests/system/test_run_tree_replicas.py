"""A run tree across two runcap processes sharing one Redis, one killed -9 mid-run (issue 22): the
parent's $0.50 cap bounds its six children's calls on both replicas — in the ledger and in what the
upstream actually billed — the dead replica's reservations are settled by the live one's sweep,
and the books close (the parent's subtree totals are its children's spend).

Run on a single redis-server and on the session's 3-master Redis Cluster (`redis_cluster = true`:
the tree's state and both replicas' reservations share one slot, the sweep finds the dead
replica's trees through its per-owner tag index)."""

from __future__ import annotations

import asyncio
import secrets
from decimal import Decimal
from pathlib import Path

import aiohttp
import pytest

from proxy.config import build_config
from proxy.money import usd_to_nanos
from proxy.pricing import PriceBook
from proxy.scripted_upstream import ScriptedUpstream
from tests.conftest import RuncapProcess
from tests.support.redis_server import RedisClusterServers, RedisServer
from tests.system.test_ledger_faults import CLIENT_TIMEOUT, get_json, wait_until

MODEL = "tree-model"
PRICES = {"prices": {MODEL: {"input_mtok": 1.0, "output_mtok": 20.0}}}
CAP = Decimal("0.50")


def replica_config(tmp: Path, server: RedisServer | RedisClusterServers, upstream: ScriptedUpstream) -> Path:
    path = tmp / "runcap.toml"
    path.write_text(
        "log_requests = false\ntracing = false\n"
        f'redis_url = "{server.url}"\n'
        f"redis_cluster = {'true' if isinstance(server, RedisClusterServers) else 'false'}\n"
        "redis_heartbeat_s = 0.5\nredis_heartbeat_ttl_s = 2.0\nledger_sweep_interval_s = 1.0\n"
        f'[upstreams.openai]\nurl = "{upstream.url}"\n'
        f'[prices."{MODEL}"]\ninput_mtok = 1.0\noutput_mtok = 20.0\n'
    )
    return path


def billed(upstream: ScriptedUpstream, tree: str) -> Decimal:
    """What the upstream billed the tree's calls: the usage it answered, at the configured price."""
    prices = PriceBook(dict(build_config(PRICES).prices))
    nanos = sum(
        usd_to_nanos(prices.cost("openai", MODEL, r.usage).usd)
        for r in upstream.requests
        if r.header("x-test-run") == tree and r.usage is not None
    )
    return Decimal(nanos) / 10**9


@pytest.fixture(params=["redis", "redis-cluster"])
def shared_redis(request) -> RedisServer | RedisClusterServers:  # type: ignore[no-untyped-def]
    """The session's redis-server, or its Redis Cluster (no node is killed here: shared)."""
    return request.getfixturevalue("redis_cluster" if request.param == "redis-cluster" else "redis_server")


async def test_a_tree_across_two_replicas_one_killed_never_overshoots(  # type: ignore[no-untyped-def]
    upstream, shared_redis, tmp_path
):
    # ~$0.002 a call (100 output tokens): the cap lasts several rounds of the 48 clients' calls,
    # each slow enough that B has calls in flight when it dies.
    upstream.scripts["tree"] = [{"text_tokens": 10**6, "delay_s": 0.3}]
    procs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        procs.append(
            RuncapProcess(replica_config(tmp_path / name, shared_redis, upstream), tmp_path / name / "data")
        )
    a, b = procs
    p = f"plan-{secrets.token_hex(3)}"
    session = aiohttp.ClientSession(timeout=CLIENT_TIMEOUT)

    async def call(url: str, headers: dict[str, str]) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 100}
        headers = {**headers, "X-Mock-Script": "tree", "X-Test-Run": p}
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status

    async def client(url: str, child: str) -> None:
        while True:
            try:
                status = await call(url, {"X-Run-Id": child, "X-Run-Parent": p})
            except aiohttp.ClientError:
                return  # its replica was killed
            if status != 200:
                assert status == 402, status
                return

    async def subtree() -> dict[str, str]:
        status, state, _ = await get_json(f"{a.url}/runs/{p}", a.admin)
        assert status == 200, state
        return state["subtree"]

    try:
        await asyncio.to_thread(a.start)
        await asyncio.to_thread(b.start)
        assert await call(a.url, {"X-Run-Id": p, "X-Run-Max-Usd": str(CAP)}) == 200
        children = [f"{p}.c{i}" for i in range(6)]
        clients = [
            asyncio.create_task(client((a, b)[j % 2].url, child)) for child in children for j in range(8)
        ]

        async def a_fifth_spent() -> bool:
            return Decimal((await subtree())["cost_usd"]) >= CAP / 5

        await wait_until(a_fifth_spent, 60, "a fifth of the parent's cap spent")
        await asyncio.to_thread(b.kill9)  # with calls of every child in flight on it
        await asyncio.wait_for(asyncio.gather(*clients), 120)

        async def settled() -> bool:
            return Decimal((await subtree())["reserved_usd"]) == 0

        await wait_until(settled, 30, "the killed replica's reservations settled by the live one")
        tree = await subtree()
        spent = Decimal(tree["cost_usd"])
        assert spent <= CAP, spent
        assert billed(upstream, p) <= spent  # the sweep charged B's cut calls at their worst case
        kids = [(await get_json(f"{a.url}/runs/{child}", a.admin))[1] for child in children]
        _, parent, _ = await get_json(f"{a.url}/runs/{p}", a.admin)
        assert Decimal(parent["cost_usd"]) + sum(Decimal(k["cost_usd"]) for k in kids) == spent
        assert all(Decimal(k["reserved_usd"]) == 0 for k in kids)
    finally:
        await session.close()
        for proc in procs:
            await asyncio.to_thread(proc.stop)
    assert "died at its reserved amount" in (tmp_path / "a" / "runcap.log").read_text()
