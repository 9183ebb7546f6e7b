"""A property of run trees on both ledger backends: random trees (depth ≤ 3), random caps and
random concurrent calls of random cost — no node's settled + reserved dollars or tokens (its own
and its descendants') ever exceeds its cap, seen at any moment by a concurrent observer, and the
books close (every ancestor's subtree totals are the sum of its descendants')."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.caps import RunCaps
from proxy.errors import BudgetExceeded
from proxy.ledger.base import Ledger, RunState, Settlement
from proxy.ledger.redis import RedisLedger
from proxy.ledger.sqlite import SQLiteLedger
from tests.support.ledgers import step

CENT = 10_000_000  # nano-dollars
EXAMPLES = 30
MIN_BINDING = 10  # examples where a cap refused or clamped a call: the property was exercised


@dataclass(frozen=True)
class Node:
    parent: int  # index of the parent node, -1 for the root
    usd: int | None
    tokens: int | None


@st.composite
def trees(draw: st.DrawFn) -> tuple[list[Node], list[tuple[int, int, int, float]]]:
    n = draw(st.integers(2, 7))
    nodes = [Node(-1, draw(st.sampled_from([None, 3, 5, 8])), draw(st.sampled_from([None, 20_000, 60_000])))]
    depth = [0]
    for _ in range(1, n):
        parent = draw(st.sampled_from([i for i in range(len(nodes)) if depth[i] < 3]))
        nodes.append(
            Node(
                parent,
                draw(st.sampled_from([None, None, 1, 2, 4])),
                draw(st.sampled_from([None, 10_000, 30_000])),
            )
        )
        depth.append(depth[parent] + 1)
    calls = draw(
        st.lists(
            st.tuples(
                st.integers(0, n - 1),  # the node calling
                st.integers(100, 5_000),  # input tokens
                st.integers(16, 20_000),  # output tokens asked for
                st.floats(0, 1),  # the share of its worst case the call used
            ),
            min_size=4,
            max_size=40,
        )
    )
    return nodes, calls


async def _scenario(led: Ledger, nodes: list[Node], calls: list[tuple[int, int, int, float]]) -> bool:
    tag = secrets.token_hex(3)
    ids = [f"{tag}-n{i}" for i in range(len(nodes))]
    caps = [
        RunCaps(max_usd_nanos=None if n.usd is None else n.usd * CENT, max_tokens=n.tokens) for n in nodes
    ]
    for i, node in enumerate(nodes):  # each node's first call creates it under its parent
        parent = ids[node.parent] if node.parent >= 0 else ""
        res = await led.begin_step(step(ids[i], caps[i], parent_run_id=parent, input_tokens=10, output=16))
        await led.settle(
            res, Settlement(input_tokens=10, output_tokens=16, cost_usd_nanos=res.usd_nanos), time.time()
        )
    binding = False
    violations: list[str] = []
    done = asyncio.Event()

    def check(state: RunState) -> None:
        c = state.caps
        if c.max_usd_nanos is not None and state.tree_usd_nanos > c.max_usd_nanos:
            violations.append(f"{state.run_id}: ${state.tree_usd_nanos} > ${c.max_usd_nanos}")
        if c.max_tokens is not None and state.tree_tokens > c.max_tokens:
            violations.append(f"{state.run_id}: {state.tree_tokens} tokens > {c.max_tokens}")

    async def observe() -> None:
        while not done.is_set():
            for rid in ids:
                state = await led.get_run(rid)
                assert state is not None
                check(state)
            await asyncio.sleep(0)

    async def one(i: int, tin: int, tout: int, share: float) -> None:
        nonlocal binding
        try:
            res = await led.begin_step(step(ids[i], RunCaps(), input_tokens=tin, output=tout))
        except BudgetExceeded:
            binding = True
            return
        binding = binding or res.clamped
        check(res.state)
        await asyncio.sleep(0)
        used_in, used_out = res.input_tokens, int(res.output_tokens * share)
        cost = (used_in * 1 + used_out * 2) * 1000  # $1 / $2 per million tokens, in nano-dollars
        check(
            await led.settle(
                res,
                Settlement(input_tokens=used_in, output_tokens=used_out, cost_usd_nanos=cost),
                time.time(),
            )
        )

    watcher = asyncio.create_task(observe())
    await asyncio.gather(*(one(*c) for c in calls))
    done.set()
    await watcher
    assert not violations, violations
    # The books close: each node's subtree totals are its descendants' own, nothing left reserved.
    states = [await led.get_run(rid) for rid in ids]
    for i, state in enumerate(states):
        assert state is not None
        below = [s for s in states if s is not None and ids[i] in s.ancestors]
        assert state.sub_spent_usd_nanos == sum(s.spent_usd_nanos for s in below)
        assert state.sub_tokens == sum(s.tokens_used for s in below)
        assert state.sub_reserved_usd_nanos == 0 and state.reserved_usd_nanos == 0
        check(state)
    return binding


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_no_node_of_a_random_tree_ever_exceeds_its_cap(backend: str, request, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url = request.getfixturevalue("redis_server").url if backend == "redis" else ""
    exercised: list[bool] = []

    @given(trees())
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    def example(tree: tuple[list[Node], list[tuple[int, int, int, float]]]) -> None:
        async def go() -> bool:
            led: Ledger = (
                SQLiteLedger(tmp_path / f"{secrets.token_hex(4)}.sqlite3")
                if backend == "sqlite"
                else RedisLedger(url, prefix=f"p{secrets.token_hex(4)}:")
            )
            try:
                return await _scenario(led, *tree)
            finally:
                await led.close()

        exercised.append(asyncio.run(go()))

    example()
    assert sum(exercised) >= MIN_BINDING, f"only {sum(exercised)} of {len(exercised)} examples hit a cap"
