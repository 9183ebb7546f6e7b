"""Every bad input gets a clear error naming what is wrong; upstream failures are named too."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.config import ConfigError, build_config
from tests.conftest import free_port

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}


async def post(url: str, *, json=None, data=None, headers=None):  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s, s.post(url, json=json, data=data, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("X-Run-Id", "has spaces"),
        ("X-Run-Id", "x" * 129),
        ("X-Run-Max-Usd", "five"),
        ("X-Run-Max-Usd", "-1"),
        ("X-Run-Max-Usd", "NaN"),
        ("X-Run-Max-Tokens", "1.5"),
        ("X-Run-Max-Steps", "-3"),
        ("X-Run-Max-Tool-Calls", "lots"),
        ("X-Run-Deadline", "tomorrow"),
        ("X-Run-Deadline", "2026-01-01T00:00:00"),  # no zone
        ("X-Run-Timeout", "0"),
        ("X-Run-Timeout", "inf"),
    ],
)
async def test_malformed_run_header_is_400_naming_it(runcap, upstream, header, value):  # type: ignore[no-untyped-def]
    status, headers, body = await post(
        f"{runcap.openai_url}/chat/completions", json=CHAT, headers={header: value}
    )
    assert status == 400
    assert body["error"]["type"] == "invalid_request" and body["error"]["param"] == header
    assert header in body["error"]["message"]
    assert headers["x-should-retry"] == "false"
    assert upstream.hits() == 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"messages": []}', "model"),
        (b'{"model": "gpt-4o-mini", "messages": "hi"}', "messages"),
        (b'{"model": "gpt-4o-mini", "messages": [], "max_tokens": -5}', "max_tokens"),
        (b'{"model": "gpt-4o-mini", "messages": [], "stream": "yes"}', "stream"),
        # within the JSON parser's 1,024 levels, past what a recursive reader can walk (was a 500)
        (b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": [{"type": "text", '
         b'"text": "hi", "x": ' + b'{"c": ' * 1000 + b"1" + b"}" * 1000 + b"}]}]}", "nested deeper"),
    ],
)
async def test_unparseable_body_is_400(runcap, upstream, body, needle):  # type: ignore[no-untyped-def]
    status, _, err = await post(
        f"{runcap.openai_url}/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    assert status == 400 and err["error"]["type"] == "invalid_request"
    assert needle in err["error"]["message"]
    assert upstream.hits() == 0


async def test_require_run_id(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"require_run_id": True})
    status, _, err = await post(f"{rc.openai_url}/chat/completions", json=CHAT)
    assert status == 400 and err["error"]["param"] == "X-Run-Id"


async def test_oversized_body_is_413(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"max_body_bytes": 2000})
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    status, _, err = await post(f"{rc.openai_url}/chat/completions", json=big)
    assert status == 413 and "max_body_bytes" in err["error"]["message"]
    assert upstream.hits() == 0


async def test_unknown_upstream_lists_configured(runcap, upstream):  # type: ignore[no-untyped-def]
    status, _, err = await post(f"{runcap.url}/u/nope/v1/chat/completions", json=CHAT)
    assert status == 404
    assert "'nope'" in err["error"]["message"] and "anthropic, local, openai" in err["error"]["message"]


async def test_upstream_unreachable_is_502_naming_it(runcap_factory, upstream):  # type: ignore[no-untyped-def]
    dead = f"http://127.0.0.1:{free_port()}"
    rc = await runcap_factory({"upstreams": {"local": {"url": dead}}})
    status, _, err = await post(f"{rc.url}/u/local/v1/chat/completions", json=CHAT,
                                      headers={"X-Run-Id": "dead", "X-Run-Max-Usd": "1"})  # fmt: skip
    assert status == 502 and "'local'" in err["error"]["message"] and dead in err["error"]["message"]
    run = await rc.run("dead")
    assert run["cost_usd"] == "0.000000000" and run["reserved_usd"] == "0.000000000"


async def test_upstream_error_passed_through_and_settled(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["boom"] = [{"status": 429, "error": "slow down", "headers": {"retry-after": "1"}}]
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{upstream.url}/v1/chat/completions", json=CHAT, headers={"X-Mock-Script": "boom"}
        ) as r:
            direct = await r.json()
        h = {"X-Run-Id": "e429", "X-Run-Max-Usd": "1", "X-Mock-Script": "boom"}
        async with s.post(f"{runcap.openai_url}/chat/completions", json=CHAT, headers=h) as r:
            assert r.status == 429 and r.headers["retry-after"] == "1"
            assert "x-should-retry" not in r.headers  # the upstream's error, the agent's retry policy
            assert await r.json() == direct
    run = await runcap.run("e429")
    assert run["cost_usd"] == "0.000000000" and run["reserved_usd"] == "0.000000000"
    # A 429 got no answer: not a step (issue 25 item 1; it was counted as one), but a failure.
    assert run["steps"] == 0 and run["upstream_failures"] == 1


async def test_client_disconnect_mid_stream_closes_upstream_and_settles(runcap, upstream):  # type: ignore[no-untyped-def]
    upstream.scripts["slow"] = [{"text": "word " * 40, "chunk_delay_s": 0.05}]
    body = {**CHAT, "stream": True, "max_tokens": 500}
    h = {"X-Run-Id": "gone", "X-Run-Max-Usd": "1", "X-Mock-Script": "slow"}
    async with aiohttp.ClientSession() as s:
        r = await s.post(f"{runcap.openai_url}/chat/completions", json=body, headers=h)
        await r.content.readany()
        r.close()  # the agent goes away
    for _ in range(100):
        run = await runcap.run("gone")
        if run["reserved_usd"] == "0.000000000" and upstream.last.disconnected:
            break
        await asyncio.sleep(0.05)
    assert upstream.last.disconnected and not upstream.last.completed
    assert run["reserved_usd"] == "0.000000000"
    assert run["output_tokens"] == 500  # usage unknown at the cut: settled at the reserved limit


def test_config_errors_name_the_setting(tmp_path):  # type: ignore[no-untyped-def]
    cases = [
        ({"caps": {"default_max_usd": "lots"}}, "caps.default_max_usd"),
        ({"caps": {"ceiling_max_steps": -1}}, "caps.ceiling_max_steps"),
        ({"caps": {"max_usd": 1}}, "caps.max_usd"),
        ({"upstreams": {"local": {}}}, "upstreams.local.url"),
        ({"upstreams": {"local": {"url": "ftp://x"}}}, "upstreams.local.url"),
        ({"upstreams": {"local": {"url": "http://x", "flavor": "gemini"}}}, "upstreams.local.flavor"),
        ({"upstreams": {"local": {"url": "http://x", "api_key_env": "NOPE_NOT_SET"}}}, "NOPE_NOT_SET"),
        ({"tools": {"refund": {"url": "http://x", "key_fields": "order_id"}}}, "tools.refund.key_fields"),
        ({"prices": {"m": {"input_mtok": 1}}}, 'prices."m"'),
        ({"listen": "nohost"}, "listen"),
        ({"payloads": "some"}, "payloads"),
        ({"lisen": "127.0.0.1:1"}, "lisen"),
        ({"shipper_nice": 20}, "shipper_nice"),
        ({"shipper_nice": -1}, "shipper_nice"),
    ]
    for raw, name in cases:
        with pytest.raises(ConfigError) as e:
            build_config(raw, {})
        assert name in str(e.value), (raw, str(e.value))
    with pytest.raises(ConfigError, match="RUNCAP_CLICKHOUSE_URL"):
        build_config({}, {"RUNCAP_CLICKHOUSE_URL": "clickhouse:9000"})
    with pytest.raises(ConfigError, match="RUNCAP_LISTEN"):
        build_config({}, {"RUNCAP_LISTEN": "x"})


def test_json_nested_past_the_recursion_limit_hashes_as_bytes() -> None:
    """A tool body or MCP arguments nested deeper than a recursive walk can go (a 500 before):
    the hash is of the raw bytes, as for anything that is not JSON runcap can read."""
    import hashlib

    import orjson

    from proxy.hashing import args_hash, canonical_json

    raw = b'{"c": ' * 1000 + b"1" + b"}" * 1000
    assert args_hash(raw) == hashlib.sha256(raw).hexdigest()
    with pytest.raises(ValueError, match="nested too deep"):
        canonical_json(orjson.loads(raw))
