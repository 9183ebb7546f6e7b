"""Each setting is declared once (proxy/config/sections.py), and what is derived from the
declaration holds: the reference page, unknown-key errors, overrides, bounds, defaults."""

from __future__ import annotations

import dataclasses
import re

import pytest

from proxy.config import (
    ApprovalSettings,
    CapsConfig,
    Config,
    ConfigError,
    ConnectionSettings,
    LedgerSettings,
    LocalSettings,
    MCPServerConfig,
    MCPToolConfig,
    MetricsSettings,
    SpanSettings,
    TaskCaps,
    ToolConfig,
    build_config,
)
from proxy.config.declare import declared, key_of
from proxy.config.reference import DOC, generate, render

SECTIONS = (
    *(Config, ConnectionSettings, LedgerSettings, SpanSettings, CapsConfig, TaskCaps, LocalSettings),
    *(MetricsSettings, ApprovalSettings, ToolConfig, MCPServerConfig, MCPToolConfig),
)
TOP_LEVEL = (Config, ConnectionSettings, LedgerSettings, SpanSettings)


def test_the_committed_reference_is_the_generated_one() -> None:
    page = DOC.read_text()
    assert render(page) == page, "docs/reference.md is stale: run `python -m proxy.config.reference`"
    for cls in SECTIONS:
        for f, s, _ in declared(cls):
            assert s.doc.strip(), f"{cls.__name__}.{f.name}: a setting needs its line of documentation"
            assert f"| `{key_of(f, s)}` |" in generate(), (cls.__name__, f.name)


def test_each_top_level_key_is_declared_in_one_section_only() -> None:
    keys = [key_of(f, s) for cls in TOP_LEVEL for f, s, _ in declared(cls)]
    assert len(keys) == len(set(keys))
    config = build_config({}, {})
    assert config.spans.wal_segment_bytes == 16 << 20 and not hasattr(config, "wal_segment_bytes")
    assert config.ledger.ledger_timeout_s == 2.0 and not hasattr(config, "ledger_timeout_s")


def _toml(value: object) -> object:
    """A declared default as a TOML file would write it."""
    if isinstance(value, tuple):
        return list(value)
    return str(value) if not isinstance(value, (bool, int, float)) else value


def test_writing_every_default_into_the_file_changes_nothing() -> None:
    """The declared default is what parsing the key gives: a default and its parser agree."""
    raw: dict[str, object] = {}
    for cls in TOP_LEVEL:
        for f, s, _ in declared(cls):
            if f.default is not None and s.shown is None:
                raw[key_of(f, s)] = _toml(f.default)
    raw["data_dir"] = "./runcap-data"
    caps = {key_of(f, s): _toml(f.default) for f, s, _ in declared(CapsConfig) if f.default is not None}
    raw["caps"] = caps
    assert build_config(raw, {}) == build_config({}, {})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"wal_segmnt_bytes": 1}, "wal_segmnt_bytes: unknown setting (known: "),
        (
            {"caps": {"max_usd": 1}},
            "caps.max_usd: unknown setting (known: allow_unpriced, ceiling_max_context",
        ),
        ({"local": {"hosts": []}}, "local.hosts: unknown setting (known: allowed_hosts, allowed_origins)"),
        (
            {"metrics": {"tokn": "x"}},
            "metrics.tokn: unknown setting (known: model_labels, require_token, token)",
        ),
        (
            {"tools": {"t": {"url": "http://t", "keyfields": []}}},
            "tools.t.keyfields: unknown setting (known: ",
        ),
        (
            {"mcp": {"m": {"url": "http://m", "tools": {"t": {"deny": []}}}}},
            "mcp.m.tools.t.deny: unknown setting",
        ),
        (
            {"tasks": {"t": {"max_usd_nanos": 1}}},
            'tasks."t".max_usd_nanos: unknown setting (known: context_policy',
        ),
    ],
)
def test_unknown_keys_name_the_key_and_what_is_known(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        build_config(raw, {})


def test_the_top_level_known_keys_are_every_declared_key_and_every_table() -> None:
    with pytest.raises(ConfigError) as e:
        build_config({"nope": 1}, {})
    known = set(str(e.value).split("(known: ")[1].rstrip(")").split(", "))
    declared_keys = {key_of(f, s) for cls in TOP_LEVEL for f, s, _ in declared(cls)}
    assert declared_keys < known
    assert known - declared_keys == {"upstreams", "tools", "mcp", "caps", "tasks", "prices", "models"} | {
        "auth",
        "context",
        "metrics",
        "local",
        "approvals",
    }


def test_a_message_names_where_the_value_came_from() -> None:
    """Flag over variable over key; the message names the one that was used."""
    with pytest.raises(ConfigError, match=r"^RUNCAP_REDIS_URL: expected a redis://"):
        build_config({"redis_url": "redis://ok:6379"}, {"RUNCAP_REDIS_URL": "http://x"})
    with pytest.raises(ConfigError, match=r"^redis_url: expected a redis://"):
        build_config({"redis_url": "http://x"}, {})
    assert build_config({"redis_url": "http://x"}, {"RUNCAP_REDIS_URL": "redis://h:1"}).ledger.redis_url == (
        "redis://h:1"
    )
    with pytest.raises(ConfigError, match=r"^--workers: expected a whole number ≥ 1, got 0"):
        build_config({"workers": 2}, {}, workers=0)
    assert build_config({"workers": 0}, {}, workers=3).workers == 3
    with pytest.raises(ConfigError, match=r"^--listen: expected HOST:PORT"):
        build_config({}, {"RUNCAP_LISTEN": "127.0.0.1:1"}, listen="nope")
    config = build_config({"listen": "127.0.0.1:1"}, {"RUNCAP_LISTEN": "0.0.0.0:2"})
    assert (config.listen_host, config.listen_port) == ("0.0.0.0", 2)


def test_a_bound_is_the_number_as_written() -> None:
    """A fractional bound (`≥ 0.1`) admits exactly that number: compared as the decimal written,
    not as the binary float just above it."""
    config = build_config({"approvals": {"approval_keepalive_s": 0.1}}, {})
    assert config.approvals.approval_keepalive_s == 0.1
    assert build_config({}, {}).approvals.approval_keepalive_s == 15.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"wal_hold_ms": 60_001}, "wal_hold_ms: expected a whole number from 0 to 60000 (a held call waits"),
        ({"shipper_nice": 20}, "shipper_nice: expected a whole number from 0 to 19, got 20"),
        ({"wal_max_bytes": 1}, "wal_max_bytes: expected a whole number ≥ 1048576, got 1"),
        ({"ledger_timeout_s": 0}, "ledger_timeout_s: expected a number of seconds > 0 and ≤ 86400, got 0"),
        ({"header_timeout_s": 86401}, "header_timeout_s: expected a number of seconds > 0 and ≤ 86400"),
        ({"ledger_retention_s": 0.5}, "ledger_retention_s: expected a number of seconds ≥ 1, got 0.5"),
        ({"tracing": "yes"}, "tracing: expected true or false, got 'yes'"),
        (
            {"approvals": {"approval_keepalive_s": 0.09}},
            "approvals.approval_keepalive_s: expected a number of seconds ≥ 0.1 and ≤ 3600, got 0.09",
        ),
        (
            {"approvals": {"approval_keepalive_s": 3601}},
            "approvals.approval_keepalive_s: expected a number of seconds ≥ 0.1 and ≤ 3600, got 3601",
        ),
        ({"wal_fsync": "never"}, "wal_fsync: expected one of interval, always, got 'never'"),
        (
            {"caps": {"max_upstream_failures": 1001}},
            "caps.max_upstream_failures: expected a whole number from 1",
        ),
        ({"caps": {"default_max_usd": "lots"}}, "caps.default_max_usd: expected a number, got 'lots'"),
        ({"local": {"allowed_hosts": ["a/b"]}}, "local.allowed_hosts: 'a/b' is not a host name"),
        (
            {"tools": {"t": {"url": "http://t", "key_fields": "id"}}},
            "tools.t.key_fields: expected a list of field names",
        ),
        (
            {"mcp": {"m": {"url": "http://m", "headers": {"a": 1}}}},
            'mcp.m.headers: expected a table of header = "value"',
        ),
        (
            {"upstreams": {"u": {"url": "http://u", "service_tier": "fast"}}},
            "upstreams.u.service_tier: expected one of default, flex, priority, auto (the tier a request",
        ),
        (
            {"upstreams": {"u": {"url": "http://u", "passthrough_allow": ["v1"]}}},
            "upstreams.u.passthrough_allow: 'v1' must be an upstream path",
        ),
        (
            {"upstreams": {"u": {"url": "http://u", "deployments": {"a": ""}}}},
            'upstreams.u.deployments: expected a table of deployment name = "model it serves"',
        ),
    ],
)
def test_bounds_come_from_the_declaration(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        build_config(raw, {})


def test_values_in_bounds_land_in_their_section() -> None:
    config = build_config(
        {
            "wal_hold_ms": 60_000,
            "shipper_nice": 0,
            "header_timeout_s": 86400,
            "max_connections_per_client": 0,
            "caps": {"default_max_usd": "2.50", "max_upstream_failures": 1000},
            "tasks": {"t": {"max_usd": 1, "context_policy": "offload"}},
            "metrics": {"token": "m" * 32},
            "local": {"allowed_hosts": ["Runcap.Internal"]},
        },
        {},
    )
    assert (config.spans.wal_hold_ms, config.spans.shipper_nice) == (60_000, 0)
    assert config.connections == dataclasses.replace(
        ConnectionSettings(), header_timeout_s=86400.0, max_connections_per_client=0
    )
    assert config.caps.default_max_usd_nanos == 2_500_000_000 and config.caps.max_upstream_failures == 1000
    assert config.caps.tasks["t"] == TaskCaps(max_usd_nanos=1_000_000_000, context_policy=("offload",))
    assert config.metrics == MetricsSettings(require_token=True, token="m" * 32, model_labels="all")
    assert config.local.allowed_hosts == ("runcap.internal",)


def test_an_upstream_s_declared_defaults_follow_its_name() -> None:
    config = build_config({"upstreams": {"anthropic": {}, "local": {"url": "http://127.0.0.1:8000"}}}, {})
    assert (
        config.upstreams["anthropic"].flavor == "anthropic" and config.upstreams["local"].flavor == "openai"
    )
    assert config.upstreams["local"].service_tier == "default" and config.upstreams["local"].deployments == {}


def test_tools_and_mcp_servers_are_read_by_their_declarations() -> None:
    config = build_config(
        {
            "tools": {"t": {"url": "http://t/", "forward_headers": ["Authorization"], "timeout_s": 3}},
            "mcp": {"m": {"url": "http://m", "deny": ["drop"], "tools": {"x": {"side_effects": False}}}},
        },
        {},
    )
    assert config.tools["t"] == ToolConfig("t", "http://t", forward_headers=("authorization",), timeout_s=3.0)
    assert config.mcp["m"] == MCPServerConfig(
        "m", "http://m", deny=("drop",), tools={"x": MCPToolConfig("x", side_effects=False)}
    )
