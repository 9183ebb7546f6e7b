"""Tenants sharing one provider key do not share the provider's objects
(proxy/server/steps/tenant_objects.py), and a tenant with a key of its own sends that one
(`client_tokens.TENANT.upstream_keys`)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from proxy.ledger.sqlite import SQLiteLedger
from tests.support.provider_objects import ProviderObjects

ACME = "acme-token-0123456789"
BETA = "beta-token-0123456789"
TOKENS = {"acme": ACME, "beta": BETA}
ENV = {"SHARED_KEY": "sk-shared", "ACME_KEY": "sk-acme-own"}


@pytest.fixture
async def provider() -> AsyncIterator[ProviderObjects]:
    server = await ProviderObjects().start()
    yield server
    await server.stop()


def client(base: str, token: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="agent-own", max_retries=0,
        default_headers={"X-Run-Client-Token": token},
    )  # fmt: skip


def shared(provider: ProviderObjects, **extra: Any) -> dict[str, Any]:
    return {
        "upstreams": {"openai": {"url": provider.url, "api_key_env": "SHARED_KEY"}},
        "auth": {"client_tokens": TOKENS},
        **extra,
    }


async def test_a_tenant_sees_only_the_files_and_batches_it_created(runcap_factory, provider) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory(shared(provider), env=ENV)
    acme, beta = client(rc.url, ACME), client(rc.url, BETA)
    mine = await acme.files.create(file=("a.jsonl", b'{"custom_id": "1"}\n'), purpose="batch")
    theirs = await beta.files.create(file=("b.jsonl", b"beta's\n"), purpose="batch")
    # An object of the shared account runcap never saw created (the key owner's, or older).
    unseen = provider.seed("sk-shared", "operator.jsonl")
    assert set(provider.files["sk-shared"]) == {mine.id, theirs.id, unseen}

    # Lists: each tenant its own.
    assert [f.id for f in (await acme.files.list()).data] == [mine.id]
    assert [f.id for f in (await beta.files.list()).data] == [theirs.id]
    # Reads, content, deletes, and a create that uses another tenant's file: as if it did not exist.
    before = len(provider.hits_on(mine.id))
    for oid in (mine.id, unseen):
        with pytest.raises(openai.NotFoundError):
            await beta.files.retrieve(oid)
        with pytest.raises(openai.NotFoundError):
            await beta.files.content(oid)
        with pytest.raises(openai.NotFoundError):
            await beta.files.delete(oid)
        with pytest.raises(openai.NotFoundError):
            await beta.batches.create(
                input_file_id=oid, endpoint="/v1/chat/completions", completion_window="24h"
            )
    assert len(provider.hits_on(mine.id)) == before  # none of it reached the provider
    assert mine.id in provider.files["sk-shared"]
    # The creator still has everything.
    assert (await acme.files.retrieve(mine.id)).filename == "a.jsonl"
    assert (await acme.files.content(mine.id)).read() == b'{"custom_id": "1"}\n'
    batch = await acme.batches.create(
        input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert (await acme.batches.retrieve(batch.id)).input_file_id == mine.id
    assert [b.id for b in (await beta.batches.list()).data] == []
    with pytest.raises(openai.NotFoundError):
        await beta.batches.retrieve(batch.id)
    assert (await acme.files.delete(mine.id)).deleted


async def test_a_tenant_with_its_own_key_uses_it(runcap_factory, provider) -> None:  # type: ignore[no-untyped-def]
    tokens = {"acme": {"token": ACME, "upstream_keys": {"openai": "env:ACME_KEY"}}, "beta": BETA}
    rc = await runcap_factory(shared(provider, auth={"client_tokens": tokens}), env=ENV)
    acme, beta = client(rc.url, ACME), client(rc.url, BETA)
    mine = await acme.files.create(file=("a.jsonl", b"acme\n"), purpose="batch")
    theirs = await beta.files.create(file=("b.jsonl", b"beta\n"), purpose="batch")
    # acme's objects are in acme's own account; the agent's own credential went nowhere.
    assert list(provider.files["sk-acme-own"]) == [mine.id] and list(provider.files["sk-shared"]) == [
        theirs.id
    ]
    assert {h.key for h in provider.hits} == {"sk-acme-own", "sk-shared"}
    # With its own account, all of it is acme's (the provider keeps the accounts apart).
    unseen = provider.seed("sk-acme-own", "earlier.jsonl")
    assert {f.id for f in (await acme.files.list()).data} == {mine.id, unseen}
    assert (await acme.files.retrieve(unseen)).filename == "earlier.jsonl"
    with pytest.raises(openai.NotFoundError):
        await beta.files.retrieve(mine.id)


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_replicas_agree_on_whose_stored_response_it_is(  # type: ignore[no-untyped-def]
    backend, runcap_factory, upstream, request, tmp_path: Path
) -> None:
    """A stored response (Responses API) created on one replica is the creator's on the other:
    another tenant cannot continue it (`previous_response_id`) or read it."""
    extra: dict[str, Any] = {
        "upstreams": {"openai": {"url": upstream.url, "api_key_env": "SHARED_KEY"}},
        "auth": {"client_tokens": TOKENS},
    }
    if backend == "redis":
        extra["redis_url"] = request.getfixturevalue("redis_server").url
        a = await runcap_factory(extra, data_dir=tmp_path / "a", env=ENV)
        b = await runcap_factory(extra, data_dir=tmp_path / "b", env=ENV)
    else:  # two processes' worth of runcap on one SQLite file
        a = await runcap_factory(extra, data_dir=tmp_path / "one", env=ENV)
        b = await runcap_factory(extra, data_dir=tmp_path / "one", env=ENV)
    assert a.ledger.name == backend
    run = {"X-Run-Id": f"stored-{secrets.token_hex(4)}"}
    first = await client(a.url, ACME).responses.create(model="gpt-4o", input="remember 42", extra_headers=run)
    with pytest.raises(openai.NotFoundError):
        await client(b.url, BETA).responses.create(
            model="gpt-4o", input="what was it?", previous_response_id=first.id, extra_headers=run
        )
    with pytest.raises(openai.NotFoundError):
        await client(b.url, BETA).responses.retrieve(first.id)
    again = await client(b.url, ACME).responses.create(
        model="gpt-4o", input="what was it?", previous_response_id=first.id, extra_headers=run
    )
    assert again.id != first.id
    # A streamed create is recorded too (its id comes at the end of the stream).
    stream = await client(a.url, ACME).responses.create(
        model="gpt-4o", input="hi", stream=True, extra_headers=run
    )
    streamed = [e async for e in stream][-1].response.id
    owners = await b.ledger.object_owners("openai", [first.id, again.id, streamed])
    assert owners == {first.id: "acme", again.id: "acme", streamed: "acme"}


async def test_ownership_records_in_the_sqlite_ledger(tmp_path: Path) -> None:
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite3")
    try:
        await ledger.claim_objects("openai", ["file-1", "file-2"], "acme", 1.0)
        await ledger.claim_objects("openai", ["file-2", "file-3"], "beta", 2.0)  # the first claim wins
        await ledger.claim_objects("other", ["file-1"], "beta", 2.0)  # another account: another id
        ids = [f"file-{i}" for i in range(1, 1200)]
        assert await ledger.object_owners("openai", ids) == {
            "file-1": "acme",
            "file-2": "acme",
            "file-3": "beta",
        }
        assert await ledger.object_owners("other", ["file-1"]) == {"file-1": "beta"}
    finally:
        await ledger.close()


async def test_a_reference_however_it_is_written_is_found(runcap_factory, provider) -> None:  # type: ignore[no-untyped-def]
    """The provider reads an escaped key, leading whitespace and deep nesting as the same
    reference: so does runcap."""
    rc = await runcap_factory(shared(provider), env=ENV)
    mine = await client(rc.url, ACME).files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    deep: Any = {"file_id": mine.id}
    for _ in range(120):  # 240 levels: deeper than a recursive walk would go
        deep = {"metadata": [deep]}
    bodies = [
        b' \n{"\\u0069nput_file_id": "%s", "endpoint": "/v1/chat/completions", "completion_window": "24h"}'
        % mine.id.encode(),
        orjson.dumps(
            {
                "input_file_id": "x",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "extra": deep,
            }
        ),
    ]
    headers = {"X-Run-Client-Token": BETA, "Content-Type": "application/json"}
    before = len(provider.hits)
    async with aiohttp.ClientSession() as http:
        for body in bodies:
            async with http.post(f"{rc.url}/v1/batches", data=body, headers=headers) as r:
                assert r.status == 404, await r.text()
    assert len(provider.hits) == before  # none reached the provider


def test_upstream_key_configuration_errors_name_the_setting() -> None:
    from proxy.config import ConfigError, build_config

    for tokens, setting in [
        (
            {"acme": {"token": ACME, "upstream_keys": {"nope": "k"}}},
            "auth.client_tokens.acme.upstream_keys.nope",
        ),
        ({"acme": {"upstream_keys": {"openai": "k"}}}, "auth.client_tokens.acme.token"),
        (
            {"acme": {"token": ACME, "upstream_keys": {"openai": "env:MISSING"}}},
            "auth.client_tokens.acme.upstream_keys.openai",
        ),
        ({"acme": {"token": ACME, "upstream_keys": ["k"]}}, "auth.client_tokens.acme.upstream_keys"),
        ({"acme": {"token": ACME, "keys": {}}}, "auth.client_tokens.acme"),
        ({"acme": {"token": "short"}}, "auth.client_tokens.acme"),
    ]:
        with pytest.raises(ConfigError) as err:
            build_config({"auth": {"client_tokens": tokens}}, {})
        assert str(err.value).startswith(setting), err.value


async def test_an_anthropic_thread_is_continued_only_by_its_tenant(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    """A message thread the provider keeps (`thread.previous_message_id`) is the creating tenant's."""
    from proxy.scripted_upstream import MESSAGE_THREADS_BETA

    rc = await runcap_factory(
        {"upstreams": {"anthropic": {"url": upstream.url, "api_key_env": "SHARED_KEY"}},
         "auth": {"client_tokens": TOKENS}},
        env=ENV,
    )  # fmt: skip
    beta_header = {"anthropic-beta": MESSAGE_THREADS_BETA, "anthropic-version": "2023-06-01"}
    body = {"model": "claude-sonnet-4-5", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}

    async def post(token: str, payload: dict[str, Any]) -> tuple[int, Any]:
        headers = {**beta_header, "X-Run-Client-Token": token, "X-Run-Id": "thread-run"}
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{rc.url}/anthropic/v1/messages", json=payload, headers=headers) as r,
        ):
            return r.status, await r.json()

    status, first = await post(ACME, {**body, "thread": {"type": "create"}})
    assert status == 200, first
    then = {**body, "thread": {"type": "continue", "previous_message_id": first["id"]}}
    hits = upstream.hits()
    status, refused = await post(BETA, then)
    assert status == 404 and refused["type"] == "error", refused
    assert upstream.hits() == hits  # not forwarded
    status, second = await post(ACME, then)
    assert status == 200, second
    # ...and so on down the thread: the continuation's id is acme's too.
    status, third = await post(
        ACME, {**then, "thread": {"type": "continue", "previous_message_id": second["id"]}}
    )
    assert status == 200, third
