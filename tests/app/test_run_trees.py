"""Run trees through the proxy (issue 22), with the official OpenAI client against the scripted
upstream: one parent's dollar cap bounds its children's concurrent calls, the named 4xx of a bad
parent, depth and fan-out, the path form, and a cancel of the parent cutting its children's calls
in flight on two replicas sharing one Redis (a single redis-server, and the session's Redis Cluster)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from decimal import Decimal
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.redis_server import wait_subscribed
from tests.support.tool_agent import wait_for

USER = [{"role": "user", "content": "hi"}]
FULL = "fills-its-limit"  # every answer uses all the output tokens the call may
HANG = "hangs"


def agent(base_url: str, headers: dict[str, str]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0, default_headers=headers)


def error_of(e: openai.APIStatusError) -> dict[str, Any]:
    body = e.response.json()
    assert isinstance(body, dict)
    return body["error"]


@pytest.fixture(params=["sqlite", "redis"])
def ledger_config(request) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        return {"tracing": False}
    return {"tracing": False, "redis_url": request.getfixturevalue("redis_server").url}


@pytest.mark.parametrize("child_cap", [None, "0.20"])
async def test_six_children_with_eight_clients_each_stay_under_the_parents_cap(  # type: ignore[no-untyped-def]
    runcap_factory, upstream, ledger_config, child_cap
):
    upstream.scripts[FULL] = [{"text_tokens": 10**6}]
    rc = await runcap_factory(ledger_config)
    p = f"plan-{secrets.token_hex(3)}"
    parent = agent(rc.openai_url, {"X-Run-Id": p, "X-Run-Max-Usd": "0.50", "X-Mock-Script": FULL})
    await parent.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=5)
    refusals: list[dict[str, Any]] = []

    async def client(child: str) -> None:
        headers = {"X-Run-Id": child, "X-Run-Parent": p, "X-Mock-Script": FULL}
        if child_cap is not None:
            headers["X-Run-Max-Usd"] = child_cap
        c = agent(rc.openai_url, headers)
        while True:  # ~$0.005 a call (500 output tokens of gpt-4o)
            try:
                await c.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=500)
            except openai.APIStatusError as e:
                assert e.status_code == 402, e
                refusals.append(error_of(e))
                return

    children = [f"{p}.c{i}" for i in range(6)]
    await asyncio.gather(*(client(child) for child in children for _ in range(8)))
    tree = await rc.run(p)
    assert tree["children_count"] == 6 and sorted(tree["children"]) == sorted(children)
    spent = Decimal(tree["subtree"]["cost_usd"])
    assert Decimal("0.475") <= spent <= Decimal("0.50"), spent
    assert Decimal(tree["subtree"]["reserved_usd"]) == 0
    kids = [await rc.run(child) for child in children]
    assert sum(Decimal(k["cost_usd"]) for k in kids) + Decimal(tree["cost_usd"]) == spent  # books close
    assert all(k["parent"] == p and k["root"] == p for k in kids)
    if child_cap is not None:
        assert all(Decimal(k["cost_usd"]) <= Decimal(child_cap) for k in kids)
    # Refusals by the parent's cap name the parent.
    by_parent = [r for r in refusals if r.get("run") == p]
    assert by_parent and all(r["code"] == "max_usd" and p in r["message"] for r in by_parent)


async def test_a_bad_parent_depth_and_fan_out_are_named_refusals(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"tracing": False})
    tag = secrets.token_hex(3)

    async def ask(headers: dict[str, str], base: str | None = None) -> tuple[int, dict[str, Any]]:
        c = agent(base or rc.openai_url, headers)
        try:
            await c.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=5)
        except openai.APIStatusError as e:
            return e.status_code, error_of(e)
        return 200, {}

    status, error = await ask({"X-Run-Id": f"{tag}-c", "X-Run-Parent": f"{tag}-nobody"})
    assert (status, error["code"], error["param"]) == (400, "parent_unknown", "X-Run-Parent")
    status, error = await ask({"X-Run-Id": f"{tag}-c", "X-Run-Parent": f"{tag}-c"})
    assert (status, error["code"]) == (400, "parent_cycle")
    status, error = await ask({"X-Run-Id": f"{tag}-c", "X-Run-Parent": "not a run id"})
    assert (status, error["param"]) == (400, "X-Run-Parent")
    status, error = await ask({"X-Run-Id": f"{tag}-c", "X-Run-Max-Depth": "-1"})
    assert (status, error["param"]) == (400, "X-Run-Max-Depth")

    root = f"{tag}-root"
    assert (await ask({"X-Run-Id": root, "X-Run-Max-Depth": "1", "X-Run-Max-Children": "1"}))[0] == 200
    # The path form: /r/{run}/p/{parent}/v1 is the run with X-Run-Parent.
    kid = f"{tag}-kid"
    assert (await ask({}, f"{rc.url}/r/{kid}/p/{root}/v1"))[0] == 200
    assert (await rc.run(kid))["parent"] == root and (await rc.run(root))["children"] == [kid]
    status, error = await ask({"X-Run-Id": f"{tag}-kid2", "X-Run-Parent": root})
    assert (status, error["code"], error["run"]) == (402, "max_children", root)
    status, error = await ask({}, f"{rc.url}/r/{tag}-grandkid/p/{kid}/v1")
    assert (status, error["code"], error["run"]) == (402, "max_depth", root)
    # The parent is fixed: the same child naming another parent is refused, without it is itself.
    status, error = await ask({"X-Run-Id": kid, "X-Run-Parent": f"{tag}-c"})
    assert (status, error["code"]) == (400, "parent_changed")
    assert (await ask({"X-Run-Id": kid}))[0] == 200
    status, error = await ask({"X-Run-Parent": f"{tag}-other"}, f"{rc.url}/r/{kid}/p/{root}/v1")
    assert (status, error["param"]) == (400, "X-Run-Parent")  # the header disagrees with the path
    # X-Run-Max-Depth: 0 is "no sub-runs", not "no cap" (it was once stored as no cap at all).
    leaf_only = f"{tag}-leafonly"
    assert (await ask({"X-Run-Id": leaf_only, "X-Run-Max-Depth": "0"}))[0] == 200
    status, error = await ask({"X-Run-Id": f"{tag}-sub", "X-Run-Parent": leaf_only})
    assert (status, error["code"], error["run"]) == (402, "max_depth", leaf_only)


async def test_a_tenant_cannot_name_another_tenants_run_as_parent(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    tokens = {"acme": "acme-token-0123456789", "globex": "globex-token-0123456789"}
    rc = await runcap_factory({"tracing": False, "auth": {"client_tokens": tokens}})
    acme = agent(rc.openai_url, {"X-Run-Client-Token": tokens["acme"], "X-Run-Id": "plan"})
    await acme.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=5)
    globex = agent(
        rc.openai_url, {"X-Run-Client-Token": tokens["globex"], "X-Run-Id": "kid", "X-Run-Parent": "plan"}
    )
    with pytest.raises(openai.APIStatusError) as e:
        await globex.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=5)
    assert e.value.status_code == 400 and error_of(e.value)["code"] == "parent_unknown"
    own = agent(
        rc.openai_url, {"X-Run-Client-Token": tokens["acme"], "X-Run-Id": "kid", "X-Run-Parent": "plan"}
    )
    await own.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=5)
    kid = await rc.ledger.get_run("acme:kid")
    assert kid is not None and kid.parent_run_id == "acme:plan"  # the child is in its parent's tenant
    assert await rc.ledger.get_run("globex:kid") is None


HOLD_S = 20  # the upstream's hold of a call: an answer before it is a cut, after it a 200


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_cancel_of_the_parent_cuts_its_childrens_calls_on_every_replica(  # type: ignore[no-untyped-def]
    runcap_factory, upstream, tmp_path, caplog, request, backend
):
    """Three children's calls held by the upstream, on two replicas; the parent cancelled through
    one: every call is answered 410 while the upstream still holds it (an uncut call would be
    answered 200 after `HOLD_S`), the other replica's by the pub/sub push (sharded on the
    cluster) — at once, not by the 1 s poll that backs the push up — and later calls of any
    descendant are refused, naming the cancelled ancestor."""
    upstream.scripts[HANG] = [{"text": "too late", "delay_s": HOLD_S}]
    cluster = backend == "redis-cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    config = {"tracing": False, "redis_url": server.url, "redis_cluster": cluster}
    a = await runcap_factory(config, data_dir=tmp_path / "a")
    b = await runcap_factory(config, data_dir=tmp_path / "b")
    await wait_subscribed(server.url, b.ledger.backend.cancel_channel, 2, sharded=cluster)  # both listen
    p = f"plan-{secrets.token_hex(3)}"
    await agent(a.openai_url, {"X-Run-Id": p}).chat.completions.create(model="gpt-4o-mini", messages=USER)
    kids = [(f"{p}.a", a), (f"{p}.b1", b), (f"{p}.b2", b)]

    async def hung(child: str, rc: Any) -> int:
        c = agent(rc.openai_url, {"X-Run-Id": child, "X-Run-Parent": p, "X-Mock-Script": HANG})
        try:
            await c.chat.completions.create(model="gpt-4o-mini", messages=USER)
        except openai.APIStatusError as e:
            return e.status_code
        return 200

    calls = [asyncio.create_task(hung(child, rc)) for child, rc in kids]
    await wait_for(lambda: upstream.in_flight == 3, 30)  # every child's call is at the upstream
    with caplog.at_level(logging.INFO, logger="runcap.cancel"):
        async with aiohttp.ClientSession() as s, s.post(f"{a.url}/runs/{p}/cancel", headers=a.admin) as r:
            assert r.status == 200, await r.text()
        # Every call in flight is cut, on both replicas, before the upstream's hold ends.
        assert await asyncio.gather(*calls) == [410, 410, 410]
    via = [m.getMessage() for m in caplog.records if m.name == "runcap.cancel" and p in m.getMessage()]
    assert via and all('"via": "pubsub"' in m for m in via), via  # b learnt it by the push
    await wait_for(lambda: upstream.in_flight == 0, 30)  # the upstream saw each disconnect
    # Later calls of any descendant are refused, naming the cancelled ancestor.
    for child, rc in [*kids, (f"{p}.b1", a)]:
        with pytest.raises(openai.APIStatusError) as e:
            await agent(rc.openai_url, {"X-Run-Id": child}).chat.completions.create(
                model="gpt-4o-mini", messages=USER
            )
        assert e.value.status_code == 410 and error_of(e.value)["type"] == "run_cancelled"
        assert f"ancestor {p}" in error_of(e.value)["message"]


async def test_caps_defaults_and_ceilings_bound_the_tree(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    caps = {"default_max_depth": 1, "ceiling_max_fan_out": 1, "ceiling_max_tree_steps": 2}
    rc = await runcap_factory({"tracing": False, "caps": caps})
    tag = secrets.token_hex(3)

    async def ask(headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        try:
            await agent(rc.openai_url, headers).chat.completions.create(
                model="gpt-4o-mini", messages=USER, max_tokens=5
            )
        except openai.APIStatusError as e:
            return e.status_code, error_of(e)
        return 200, {}

    # Asks for 5 children and 10 tree steps: the ceilings clamp both; the depth is the default.
    root = {"X-Run-Id": f"{tag}-r", "X-Run-Max-Children": "5", "X-Run-Max-Tree-Steps": "10"}
    assert (await ask(root))[0] == 200
    tree_caps = (await rc.run(f"{tag}-r"))["tree_caps"]
    assert tree_caps == {"max_depth": 1, "max_children": 1, "max_tree_steps": 2, "max_tree_tool_calls": None}
    assert (await ask({"X-Run-Id": f"{tag}-a", "X-Run-Parent": f"{tag}-r"}))[0] == 200
    status, error = await ask({"X-Run-Id": f"{tag}-b", "X-Run-Parent": f"{tag}-r"})
    assert (status, error["code"]) == (402, "max_children")
    status, error = await ask({"X-Run-Id": f"{tag}-a"})  # the tree's third step
    assert (status, error["code"], error["run"]) == (402, "max_tree_steps", f"{tag}-r")
    status, error = await ask({"X-Run-Id": f"{tag}-g", "X-Run-Parent": f"{tag}-a"})
    assert (status, error["code"], error["run"]) == (402, "max_depth", f"{tag}-r")


async def test_a_childs_remaining_headers_show_its_ancestors_tighter_caps(  # type: ignore[no-untyped-def]
    runcap_factory, ledger_config
):
    """`X-Run-Remaining-Usd` / `-Tokens` of a child's call: what the tightest cap of the child
    and its ancestors leaves, not the child's own cap alone — an agent that plans on the header
    must not see $2 left when its parent has $0.49 (or tokens left when only the parent counts
    them)."""
    rc = await runcap_factory(ledger_config)
    p = f"plan-{secrets.token_hex(3)}"
    parent = agent(rc.openai_url, {"X-Run-Id": p, "X-Run-Max-Usd": "0.50", "X-Run-Max-Tokens": "100000"})
    await parent.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=50)

    async def call(run_id: str, **caps: str) -> dict[str, str]:
        c = agent(rc.openai_url, {"X-Run-Id": run_id, "X-Run-Parent": p, **caps})
        raw = await c.chat.completions.with_raw_response.create(model="gpt-4o", messages=USER, max_tokens=50)
        return dict(raw.headers)

    async def left() -> tuple[Decimal, int]:
        tree = await rc.run(p)
        assert Decimal(tree["subtree"]["reserved_usd"]) == 0
        return Decimal("0.50") - Decimal(tree["subtree"]["cost_usd"]), 100000 - tree["subtree"]["tokens"]

    loose = await call(f"{p}.loose", **{"X-Run-Max-Usd": "2.00"})  # its own cap is looser
    usd, tokens = await left()
    assert Decimal(loose["x-run-remaining-usd"]) == usd < Decimal("0.50")
    assert int(loose["x-run-remaining-tokens"]) == tokens < 100000  # the parent's cap alone
    tight = await call(f"{p}.tight", **{"X-Run-Max-Usd": "0.01"})  # its own cap is tighter
    child = await rc.run(f"{p}.tight")
    assert Decimal(tight["x-run-remaining-usd"]) == Decimal("0.01") - Decimal(child["cost_usd"])
    assert int(tight["x-run-remaining-tokens"]) == (await left())[1]


async def test_a_parents_deadline_cuts_its_childs_call_and_an_extension_lets_it_go_on(  # type: ignore[no-untyped-def]
    runcap_factory, upstream, ledger_config
):
    """A child's call is bound by its parent's deadline as it stands when the call starts: its
    `X-Run-Remaining-Ms` counts down to it, a call in flight is cut at it (504, the child then
    `ancestor_deadline_exceeded`, not terminal), and an operator's extension of the parent's
    deadline (`POST /runs/{parent}/caps {"extend_s": ...}`) lets the child go on — a deadline
    copied into the child when it was created would still stop it."""
    upstream.scripts[HANG] = [{"text": "too late", "delay_s": HOLD_S}]
    rc = await runcap_factory(ledger_config)
    p = f"plan-{secrets.token_hex(3)}"
    await agent(rc.openai_url, {"X-Run-Id": p, "X-Run-Timeout": "3"}).chat.completions.create(
        model="gpt-4o-mini", messages=USER
    )
    kid = agent(rc.openai_url, {"X-Run-Id": f"{p}.c", "X-Run-Parent": p, "X-Run-Timeout": "3600"})
    raw = await kid.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert 0 < int(raw.headers["x-run-remaining-ms"]) <= 3000  # the parent's, not its own hour
    with pytest.raises(openai.APIStatusError) as e:
        hang = {"X-Mock-Script": HANG}
        await kid.chat.completions.create(model="gpt-4o-mini", messages=USER, extra_headers=hang)
    assert e.value.status_code == 504 and error_of(e.value)["type"] == "run_deadline_exceeded"
    child = await rc.run(f"{p}.c")
    assert child["status"] == "ancestor_deadline_exceeded"
    with pytest.raises(openai.APIStatusError) as e:  # later calls too, naming the parent
        await kid.chat.completions.create(model="gpt-4o-mini", messages=USER)
    assert e.value.status_code == 504 and f"ancestor {p}" in error_of(e.value)["message"]
    async with aiohttp.ClientSession() as s, s.post(
        f"{rc.url}/runs/{p}/caps", json={"extend_s": 600}, headers=rc.admin
    ) as r:
        assert r.status == 200, await r.text()
    raw = await kid.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert 3000 < int(raw.headers["x-run-remaining-ms"]) <= 603_000
    assert (await rc.run(f"{p}.c"))["status"] == "completed"  # answered: the run went on
