"""A local runcap no web page can drive, and that keeps what it holds to its user (issue 19,
"surprises"): Host/Origin checks against DNS rebinding (and the MCP server's view of them),
admin tokens long enough and private, a private data directory, request bodies forwarded as
they were metered, /metrics behind a token on request and without tenants' model names.

Against a real runcap: in-process (`runcap_factory`), and as a process (`runcap serve`) where
what is checked belongs to the served process (its start-up, its files, its connection handler)."""

from __future__ import annotations

import base64
import gzip
import json
import os
import stat
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config import ConfigError, build_config
from tests.conftest import REPO, RuncapProcess, free_port
from tests.support.mcp_server import MCPServerProcess

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
TOKEN = "a-metrics-scrape-token-of-32-chars!"


async def post(url: str, body: Any = None, headers: dict[str, str] | None = None, data: bytes | None = None):  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body if data is None else None, data=data, headers=headers) as r:
            text = await r.text()
            return r.status, text, r.headers


async def get(url: str, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, await r.text()


# -- Host / Origin ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/chat/completions", "openai"), ("/anthropic/v1/messages", "anthropic"), ("/runs/x", "openai")],
)
async def test_a_rebound_host_is_a_403(runcap, upstream, path: str, shape: str) -> None:  # type: ignore[no-untyped-def]
    status, text, headers = await post(runcap.url + path, CHAT, {"Host": "evil.example:8787"})
    assert status == 403, text
    body = json.loads(text)
    err = body["error"]
    assert "Host" in err["message"] and "allowed_hosts" in err["message"]
    if shape == "anthropic":
        assert body["type"] == "error"
    else:
        assert err["param"] == "Host"
    assert headers["x-should-retry"] == "false"
    assert upstream.hits() == 0


@pytest.mark.parametrize(
    "host", ["127.0.0.1:8787", "localhost", "LOCALHOST:1", "[::1]:8787", "agent.localhost:9", "127.1.2.3"]
)
async def test_loopback_hosts_pass(runcap, upstream, host: str) -> None:  # type: ignore[no-untyped-def]
    status, text, _ = await post(runcap.openai_url + "/chat/completions", CHAT, {"Host": host})
    assert status == 200, text


async def test_browser_origins_are_refused_unless_allowed(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory()
    for origin in ("https://evil.example", "null", "http://localhost:3000"):
        status, text, _ = await post(rc.openai_url + "/chat/completions", CHAT, {"Origin": origin})
        assert status == 403, (origin, text)
        assert json.loads(text)["error"]["param"] == "Origin"
    assert upstream.hits() == 0
    allowed = await runcap_factory(
        {"local": {"allowed_origins": ["https://agent-ui.example.com"], "allowed_hosts": ["runcap.internal"]}}
    )
    ok = {"Origin": "https://agent-ui.example.com", "Host": "runcap.internal:8787"}
    status, text, _ = await post(allowed.openai_url + "/chat/completions", CHAT, ok)
    assert status == 200, text
    status, text, _ = await post(
        allowed.openai_url + "/chat/completions", CHAT, {"Origin": "https://other.example"}
    )
    assert status == 403


async def test_every_host_when_configured(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory({"local": {"allowed_hosts": ["*"]}})
    status, text, _ = await post(rc.openai_url + "/chat/completions", CHAT, {"Host": "anything.example"})
    assert status == 200, text


@pytest.mark.parametrize(
    ("local", "needle"),
    [
        ({"allowed_origins": ["evil.example"]}, "local.allowed_origins"),
        ({"allowed_origins": ["https://x.example/path"]}, "local.allowed_origins"),
        ({"allowed_hosts": ["http://x.example/"]}, "local.allowed_hosts"),
        ({"allowed_hosts": "x"}, "local.allowed_hosts"),
        ({"allowed_host": ["x"]}, "local.allowed_host"),
    ],
)
def test_local_configuration_errors_name_the_setting(local: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        build_config({"local": local})


@pytest.fixture(scope="module")
def mcp_server():  # type: ignore[no-untyped-def]
    server = MCPServerProcess(free_port(), "--stateless", "--json").start().wait_ready()
    yield server
    server.stop()


async def test_mcp_refusal_is_json_rpc_and_the_server_sees_the_agents_host_and_origin(
    runcap_factory, mcp_server
) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory(
        {"mcp": {"crm": {"url": mcp_server.url}}, "local": {"allowed_origins": ["http://127.0.0.1:5173"]}}
    )
    init = {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "1"}},
    }  # fmt: skip
    accept = {"Accept": "application/json, text/event-stream", "X-Run-Id": "mcp-host"}
    # A rebound Host: refused by runcap, as the MCP transport spec asks (403, JSON-RPC error, no id).
    status, text, _ = await post(rc.url + "/mcp/crm", init, {**accept, "Host": "evil.example"})
    assert status == 403, text
    answer = json.loads(text)
    assert answer["jsonrpc"] == "2.0" and answer["id"] is None and "Host" in answer["error"]["message"]
    before = len(mcp_server.stats()["messages"])
    # An allowed browser origin: the server gets Host = its own address (routing), the agent's
    # Host as X-Forwarded-Host, and the agent's Origin unchanged — its own check decides.
    status, text, _ = await post(rc.url + "/mcp/crm", init, {**accept, "Origin": "http://127.0.0.1:5173"})
    assert status == 200, text
    messages = mcp_server.stats()["messages"][before:]
    seen = messages[-1]["headers"]
    assert seen["x-forwarded-host"] == rc.url.split("//", 1)[1]
    assert seen["origin"] == "http://127.0.0.1:5173"
    assert seen["host"] == mcp_server.url.split("//", 1)[1].split("/", 1)[0]


# -- admin tokens -------------------------------------------------------------------------------


def test_a_short_admin_token_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match=r"RUNCAP_ADMIN_TOKEN: .*at least 32 characters.*secrets"):
        build_config({}, {"RUNCAP_ADMIN_TOKEN": "short-token"})
    with pytest.raises(ConfigError, match=r"^admin_token: .*at least 32"):
        build_config({"admin_token": "x" * 31})
    assert build_config({}, {"RUNCAP_ADMIN_TOKEN": "x" * 32}).admin_token == "x" * 32


def test_a_bad_webhook_secret_is_a_configuration_error_that_does_not_show_it() -> None:
    """`approval_webhook_secret`: `whsec_` + base64 of 24-64 bytes (Standard Webhooks); the error
    names the setting and says how to make one, and never prints the secret."""
    short = "whsec_" + base64.b64encode(b"k" * 23).decode()
    expected = r"^approvals.approval_webhook_secret: 23 bytes of key, expected 24 to 64; generate"
    with pytest.raises(ConfigError, match=expected) as e:
        build_config({"approvals": {"approval_webhook_secret": short}})
    assert short[6:] not in str(e.value)
    with pytest.raises(ConfigError, match=r"^RUNCAP_APPROVAL_WEBHOOK_SECRET: not base64") as e:
        build_config({}, {"RUNCAP_APPROVAL_WEBHOOK_SECRET": "whsec_not*base64*at-all"})
    assert "not*base64" not in str(e.value)
    good = "whsec_" + base64.b64encode(b"k" * 32).decode()
    from_env = build_config({}, {"RUNCAP_APPROVAL_WEBHOOK_SECRET": good}).approvals
    assert from_env.approval_webhook_secret == good
    bare = good.removeprefix("whsec_")  # the prefix is optional, as in the reference libraries
    assert build_config({"approvals": {"approval_webhook_secret": bare}}).approvals.approval_webhook_secret


def _serve(tmp_path: Path, data: Path, extra: str = "") -> subprocess.CompletedProcess[str]:
    """`runcap serve` expected to refuse to start: its exit and its message."""
    config = tmp_path / "runcap.toml"
    config.write_text("tracing = false\n" + extra)
    env = {k: v for k, v in os.environ.items() if k != "RUNCAP_ADMIN_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config), "--listen",
         f"127.0.0.1:{free_port()}", "--data-dir", str(data)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("token", "mode", "needle"),
    [("x" * 43, 0o644, "chmod 600"), ("x" * 43, 0o640, "chmod 600"), ("short", 0o600, "fewer than the 32")],
)
def test_a_preexisting_token_file_must_be_private_and_long(
    tmp_path: Path, token: str, mode: int, needle: str
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    path = data / "admin.token"
    path.write_text(token + "\n")
    path.chmod(mode)
    done = _serve(tmp_path, data)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "admin token file" in done.stderr and needle in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


# -- the data directory is private --------------------------------------------------------------


def test_everything_under_the_data_dir_is_private(tmp_path: Path) -> None:
    """A served runcap with tracing (chdb, the WAL, the shipper's socket), payloads and the SQLite
    ledger: every file it wrote is 0600 (or stricter), every directory 0700, from a umask of 022."""
    import asyncio

    from proxy.scripted_upstream import ScriptedUpstream

    async def scenario() -> None:
        async with ScriptedUpstream() as up:
            config = tmp_path / "runcap.toml"
            config.write_text(f'payloads = "all"\n[upstreams.openai]\nurl = "{up.url}"\n')
            proc = RuncapProcess(config, tmp_path / "data")
            old = os.umask(0o022)
            try:
                proc.start()
            finally:
                os.umask(old)
            try:
                for i in range(3):
                    status, text, _ = await post(
                        proc.openai_url + "/chat/completions", CHAT, {"X-Run-Id": f"p{i}"}
                    )
                    assert status == 200, text
                await asyncio.sleep(1.5)  # the shipper ships the WAL to chdb and the payload store
            finally:
                proc.stop()

    asyncio.run(scenario())
    data = tmp_path / "data"
    seen = {"ledger.sqlite3": False, "payloads": False, "wal": False}
    loose = []
    for root, dirs, files in os.walk(data):
        for name in dirs + files:
            path = Path(root) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            top = path.relative_to(data).parts[0]
            seen[top] = True
            if stat.S_IMODE(st.st_mode) & 0o077:
                loose.append(f"{path.relative_to(data)} {stat.S_IMODE(st.st_mode):04o}")
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert not loose, loose
    assert all(seen.values()), seen


# -- Content-Encoding ---------------------------------------------------------------------------


@pytest.mark.parametrize(("coding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_a_compressed_body_is_forwarded_as_metered(runcap, upstream, coding, compress) -> None:  # type: ignore[no-untyped-def]
    raw = json.dumps({**CHAT, "max_tokens": 7}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": coding, "X-Run-Id": f"enc-{coding}"}
    status, text, _ = await post(runcap.openai_url + "/chat/completions", data=compress(raw), headers=headers)
    assert status == 200, text
    sent = upstream.last
    assert sent.header("content-encoding") is None  # the bytes it got are the decoded ones
    assert sent.body["max_tokens"] == 7 and int(sent.header("content-length")) == len(sent.raw)


@pytest.mark.parametrize("coding", ["x-foo", "compress", "gzip, deflate"])
async def test_an_unknown_coding_is_a_415_in_runcaps_shape(runcap, upstream, coding: str) -> None:  # type: ignore[no-untyped-def]
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    for path in ("/v1/chat/completions", "/anthropic/v1/messages"):
        status, text, _ = await post(runcap.url + path, data=b"{}", headers=headers)
        assert status == 415, text
        body = json.loads(text)
        assert "Content-Encoding" in body["error"]["message"]
        assert (body.get("type") == "error") == path.startswith("/anthropic")
    assert upstream.hits() == 0


async def test_a_body_that_does_not_decode_is_a_400(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    status, text, _ = await post(
        runcap.openai_url + "/chat/completions", data=b"not gzip at all", headers=headers
    )
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == "Content-Encoding"


def test_brotli_refused_by_the_parser_gets_runcaps_shape(tmp_path: Path) -> None:
    """aiohttp refuses `br` (no Brotli installed) before any route runs: the served runcap's
    connection handler answers it in runcap's error shape, not aiohttp's plain text."""
    from aiohttp.compression_utils import HAS_BROTLI

    if HAS_BROTLI:
        pytest.skip("Brotli is installed: br is decoded like gzip")
    import asyncio

    config = tmp_path / "runcap.toml"
    config.write_text("tracing = false\n")
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        headers = {"Content-Type": "application/json", "Content-Encoding": "br"}
        status, text, _ = asyncio.run(
            post(proc.openai_url + "/chat/completions", data=b"\x0b\x01\x80{}\x03", headers=headers)
        )
    finally:
        proc.stop()
    assert status == 415, text
    body = json.loads(text)
    assert body["error"]["param"] == "Content-Encoding" and "br" in body["error"]["message"]


# -- /metrics -----------------------------------------------------------------------------------


async def test_metrics_can_require_the_admin_or_a_scrape_token(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    open_rc = await runcap_factory()
    assert (await get(open_rc.url + "/metrics"))[0] == 200
    rc = await runcap_factory({"metrics": {"token": "env:SCRAPE"}}, env={"SCRAPE": TOKEN})
    status, text = await get(rc.url + "/metrics")
    assert status == 401 and "metrics" in text
    assert (await get(rc.url + "/metrics", {"Authorization": f"Bearer {TOKEN}"}))[0] == 200
    assert (await get(rc.url + "/metrics", rc.admin))[0] == 200
    assert (await get(rc.url + "/metrics", {"Authorization": "Bearer wrong"}))[0] == 401
    admin_only = await runcap_factory({"metrics": {"require_token": True}})
    assert (await get(admin_only.url + "/metrics"))[0] == 401
    assert (await get(admin_only.url + "/metrics", admin_only.admin))[0] == 200


@pytest.mark.parametrize(
    ("metrics", "needle"),
    [({"token": "short"}, "metrics.token"),
     ({"token": TOKEN, "require_token": False}, "metrics.require_token"),
     ({"model_labels": "some"}, "metrics.model_labels"), ({"token": "env:NOPE"}, "NOPE")],
)  # fmt: skip
def test_metrics_configuration_errors_name_the_setting(metrics: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_config({"metrics": metrics})


async def test_with_tenants_model_labels_are_catalog_names_only(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    tokens = {"acme": "acme-client-token-0001", "beta": "beta-client-token-0001"}
    rc = await runcap_factory({"auth": {"client_tokens": tokens}})
    for tenant, model in (
        ("acme", "ft:gpt-4o-mini:acme-secret-project:x"),
        ("beta", "gpt-4o-mini-2024-07-18"),
    ):
        headers = {"X-Run-Client-Token": tokens[tenant], "X-Run-Id": f"{tenant}-1"}
        status, text, _ = await post(rc.openai_url + "/chat/completions", {**CHAT, "model": model}, headers)
        assert status == 200, text
    status, metrics = await get(rc.url + "/metrics")
    assert status == 200
    assert "acme-secret-project" not in metrics
    assert 'model="other"' in metrics and 'model="gpt-4o-mini"' in metrics
    # without tenants (a sidecar) the names are the operator's own: kept as they are
    single = await runcap_factory()
    await post(single.openai_url + "/chat/completions", {**CHAT, "model": "ft:gpt-4o-mini:mine:x"})
    assert 'model="ft:gpt-4o-mini:mine:x"' in (await get(single.url + "/metrics"))[1]
