"""Build the `Config` from its sources, lowest to highest precedence: built-in defaults, the TOML
file (`runcap.toml` or `--config`), environment variables (DESIGN.md "Configuration"), CLI flags.
Every problem raises `ConfigError` with the name of the setting at fault (the variable or flag
when the value came from one); unknown keys are errors too, so a typo never silently drops a cap.

The declared sections (proxy/config/sections.py) are read by `read_section`; what is left here
is what a declaration cannot say: checks across settings, and the named tables.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from proxy.config import sections
from proxy.config.declare import (
    ConfigError,
    Setting,
    check_known,
    check_url,
    join,
    known_keys,
    parse_decimal,
    parse_value,
    read_section,
)
from proxy.config.rules import ToolRule, read_rules
from proxy.context import POLICIES, ContextSettings
from proxy.pricing import FEE_SETTINGS, ModelPrice

log = logging.getLogger("runcap.config")

DEFAULT_UPSTREAMS = {
    "openai": sections.UpstreamConfig("openai", "https://api.openai.com", "openai"),
    "anthropic": sections.UpstreamConfig("anthropic", "https://api.anthropic.com", "anthropic"),
}

# Tables, each read by its own parser below.
TABLES = (
    "upstreams",
    "tools",
    "mcp",
    "caps",
    "tasks",
    "prices",
    "models",
    "auth",
    "context",
    "metrics",
    "local",
    "approvals",
)
TOP_KEYS = known_keys(sections.Config).union(*map(known_keys, sections.TOP_LEVEL_SECTIONS), TABLES)


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    listen: str | None = None,
    data_dir: str | None = None,
    workers: int | None = None,
) -> sections.Config:
    """Build the configuration. `path=None` reads `./runcap.toml` when it exists."""
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: no such file: {p}")
        raw = _read_toml(p)
    elif Path("runcap.toml").is_file():
        raw = _read_toml(Path("runcap.toml"))
    return build_config(raw, env, listen=listen, data_dir=data_dir, workers=workers)


def _read_toml(p: Path) -> dict[str, Any]:
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None


def build_config(
    raw: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    *,
    listen: str | None = None,
    data_dir: str | None = None,
    workers: int | None = None,
) -> sections.Config:
    env = {} if env is None else env
    check_known(raw, "", TOP_KEYS)
    flags = {
        "listen": ("--listen", listen),
        "data_dir": ("--data-dir", data_dir),
        "workers": ("--workers", workers),
    }
    server = read_section(sections.Config, raw, "", env, flags=flags)

    upstreams = dict(DEFAULT_UPSTREAMS)
    for name, section in _table(raw, "upstreams").items():
        upstreams[name] = _upstream(name, section, env)
    tools = {name: _tool(name, section) for name, section in _table(raw, "tools").items()}
    mcp = {name: _mcp_server(name, section) for name, section in _table(raw, "mcp").items()}
    caps = _caps(_table(raw, "caps"))
    tasks = {name: _task(name, section, caps) for name, section in _table(raw, "tasks").items()}
    caps = replace(caps, tasks=tasks)
    model_max_output = {}
    for model, section in _table(raw, "models").items():
        check_known(section, f"models.{model}", {"max_output_tokens"})
        model_max_output[model] = _int(section, f"models.{model}", "max_output_tokens", minimum=1)
    client_tokens, tenant_keys, approver_tokens = _client_tokens(_table(raw, "auth"), env, upstreams)

    return sections.Config(
        **server,
        connections=sections.ConnectionSettings(**read_section(sections.ConnectionSettings, raw, "", env)),
        ledger=_ledger(raw, env),
        spans=_spans(raw, env),
        caps=caps,
        local=sections.LocalSettings(**read_section(sections.LocalSettings, _section(raw, "local"), "local")),
        metrics=_metrics(_section(raw, "metrics"), env, tenants=bool(client_tokens)),
        approvals=sections.ApprovalSettings(
            **read_section(sections.ApprovalSettings, _section(raw, "approvals"), "approvals", env)
        ),
        upstreams=upstreams,
        tools=tools,
        mcp=mcp,
        prices={model: _price(model, section) for model, section in _table(raw, "prices").items()},
        model_max_output=model_max_output,
        context=_context(raw.get("context", {}), tasks),
        client_tokens=client_tokens,
        tenant_upstream_keys=tenant_keys,
        approver_tokens=approver_tokens,
    )


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """A table of settings (`[local]`, `[metrics]`), its unknown keys refused."""
    section = raw.get(key, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{key}: expected a table")
    cls = {
        "local": sections.LocalSettings,
        "metrics": sections.MetricsSettings,
        "approvals": sections.ApprovalSettings,
    }[key]
    check_known(section, key, known_keys(cls))
    return section


def _ledger(raw: Mapping[str, Any], env: Mapping[str, str]) -> sections.LedgerSettings:
    ledger = sections.LedgerSettings(**read_section(sections.LedgerSettings, raw, "", env))
    if ledger.redis_heartbeat_ttl_s <= ledger.redis_heartbeat_s:
        raise ConfigError(
            f"redis_heartbeat_ttl_s: {ledger.redis_heartbeat_ttl_s:g} s must be longer than "
            f"redis_heartbeat_s = {ledger.redis_heartbeat_s:g} s (several beats per time to live)"
        )
    if not ledger.redis_url:
        for name, value in (
            ("redis_cluster", ledger.redis_cluster),
            ("redis_wait_replicas", ledger.redis_wait_replicas),
        ):
            if value:
                raise ConfigError(
                    f"{name}: set for the Redis ledger, but `redis_url` is not set (SQLite in data_dir)"
                )
    elif ledger.redis_cluster and ledger.redis_url.startswith("unix:"):
        raise ConfigError(
            "redis_cluster: a Redis Cluster is reached over TCP; `redis_url` must be redis:// or rediss:// "
            "(any node of the cluster)"
        )
    return ledger


def _spans(raw: Mapping[str, Any], env: Mapping[str, str]) -> sections.SpanSettings:
    # --workers N with embedded chdb is fine: the workers append to the WAL, one shipper owns chdb.
    spans = sections.SpanSettings(**read_section(sections.SpanSettings, raw, "", env))
    if spans.clickhouse_read_url and not spans.clickhouse_url:
        name = (
            "RUNCAP_CLICKHOUSE_READ_URL" if env.get("RUNCAP_CLICKHOUSE_READ_URL") else "clickhouse_read_url"
        )
        raise ConfigError(f"{name}: needs RUNCAP_CLICKHOUSE_URL or clickhouse_url (a ClickHouse server)")
    if spans.wal_segment_bytes > spans.wal_max_bytes // 4:
        raise ConfigError(
            f"wal_segment_bytes: {spans.wal_segment_bytes} is more than a quarter of wal_max_bytes = "
            f"{spans.wal_max_bytes} (segments are deleted whole: the bound needs several)"
        )
    return spans


def _caps(section: Mapping[str, Any]) -> sections.CapsConfig:
    check_known(section, "caps", known_keys(sections.CapsConfig))
    caps = sections.CapsConfig(**read_section(sections.CapsConfig, section, "caps"))
    for kind in ("default", "ceiling"):
        timeout = getattr(caps, f"{kind}_timeout_s")
        if timeout is not None and timeout > caps.max_run_seconds:
            raise ConfigError(
                f"caps.{kind}_timeout_s: {timeout:g} s is beyond caps.max_run_seconds = "
                f"{caps.max_run_seconds:g} s"
            )
    return caps


def _task(name: str, section: Mapping[str, Any], caps: sections.CapsConfig) -> sections.TaskCaps:
    where = f'tasks."{name}"'
    if not name or len(name) > 256 or not name.isprintable():
        raise ConfigError(f"{where}: a task name is 1-256 printable characters (as sent in X-Run-Task)")
    check_known(section, where, known_keys(sections.TaskCaps))
    values = read_section(
        sections.TaskCaps, {k: v for k, v in section.items() if k != "context_policy"}, where
    )
    timeout = values["timeout_s"]
    if timeout is not None and timeout > caps.max_run_seconds:
        raise ConfigError(f"{where}.timeout_s: beyond caps.max_run_seconds = {caps.max_run_seconds:g} s")
    return sections.TaskCaps(**{**values, "context_policy": _policies(section, where)})


def _metrics(
    section: Mapping[str, Any], env: Mapping[str, str], *, tenants: bool
) -> sections.MetricsSettings:
    """`[metrics]`: `token` may be "env:VAR"; setting it requires it; the model labels default to
    "catalog" names with client tokens."""
    values = read_section(
        sections.MetricsSettings,
        section,
        "metrics",
        defaults={"model_labels": "catalog" if tenants else "all"},
    )
    token = values["token"]
    if token is not None:
        if token.startswith("env:"):
            name = token[4:]
            token = env.get(name, "")
            if not token:
                raise ConfigError(f"metrics.token: environment variable {name} is not set")
        if len(token) < sections.MIN_ADMIN_TOKEN_CHARS:
            raise ConfigError(
                f"metrics.token: a scrape token needs at least {sections.MIN_ADMIN_TOKEN_CHARS} characters"
            )
        if section.get("require_token") is False:
            raise ConfigError(
                "metrics.require_token: false contradicts metrics.token (a token that is not required)"
            )
        values.update(token=token, require_token=True)
    return sections.MetricsSettings(**values)


def _table(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table")
    for name, section in value.items():
        if not isinstance(section, dict) and key != "caps":
            raise ConfigError(f"{key}.{name}: expected a table")
    return value


# The named tables' parsers check one value at a time with the declared settings' checks.


def _str(section: Mapping[str, Any], where: str, key: str, default: str | None = None) -> Any:
    value = section.get(key)
    return default if value is None else parse_value(Setting(""), str, value, join(where, key))


def _int(
    section: Mapping[str, Any], where: str, key: str, *, minimum: int = 0, default: int | None = None
) -> Any:
    value = section.get(key)
    if value is None:
        return default
    return parse_value(Setting("", minimum=minimum), int, value, join(where, key))


def _number(section: Mapping[str, Any], where: str, key: str, *, positive: bool = False) -> Decimal | None:
    value = section.get(key)
    if value is None:
        return None
    return parse_decimal(Setting("", above=0) if positive else Setting(""), value, join(where, key))


def _upstream(name: str, section: Mapping[str, Any], env: Mapping[str, str]) -> sections.UpstreamConfig:
    where = f"upstreams.{name}"
    check_known(
        section, where, {"url", "api_key_env", "output_limit_field"} | known_keys(sections.UpstreamConfig)
    )
    builtin = DEFAULT_UPSTREAMS.get(name)
    url = _str(section, where, "url")
    if not url:
        if builtin is None:
            raise ConfigError(f"{where}.url: required")
        url = builtin.url
    check_url(url, f"{where}.url", ("http", "https"))
    if builtin is not None and url.rstrip("/").endswith("/v1"):
        # The usual SDK base URL (https://api.openai.com/v1): runcap's /v1/... routes already
        # send /v1, so keeping it would make every call a 404 for /v1/v1/...
        fixed = url.rstrip("/")[: -len("/v1")]
        log.warning(
            "%s.url: %r ends with /v1, which runcap's routes add themselves; using %r", where, url, fixed
        )
        url = fixed
    settings = read_section(
        sections.UpstreamConfig, section, where, defaults={"flavor": builtin.flavor} if builtin else None
    )
    api_key = None
    key_env = _str(section, where, "api_key_env")
    if key_env:
        api_key = env.get(key_env)
        if not api_key:
            raise ConfigError(f"{where}.api_key_env: environment variable {key_env} is not set")
    field_name = _str(
        section, where, "output_limit_field", "max_completion_tokens" if name == "openai" else "max_tokens"
    )
    if field_name not in ("max_tokens", "max_completion_tokens"):
        raise ConfigError(
            f"{where}.output_limit_field: expected max_tokens or max_completion_tokens, got {field_name!r}"
        )
    return sections.UpstreamConfig(
        name=name,
        url=url.rstrip("/"),
        api_key=api_key,
        legacy_output_limit=field_name == "max_tokens",
        **settings,
    )


def _tool(name: str, section: Mapping[str, Any]) -> sections.ToolConfig:
    where = f"tools.{name}"
    check_known(section, where, {"url", "rules"} | known_keys(sections.ToolConfig))
    url = _str(section, where, "url")
    if not url:
        if "rules" in section:
            raise ConfigError(
                f"{where}.rules: rules for tool {name!r}, which is not configured ({where}.url is missing)"
            )
        raise ConfigError(f"{where}.url: required")
    check_url(url, f"{where}.url", ("http", "https"))
    rules = (
        read_rules(section["rules"], f"{where}.rules", f"tool {name!r}", http=True)
        if "rules" in section
        else ()
    )
    return sections.ToolConfig(
        name=name, url=url.rstrip("/"), rules=rules, **read_section(sections.ToolConfig, section, where)
    )


_TENANT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def _secret(value: Any, where: str, env: Mapping[str, str], what: str) -> str:
    """A configured secret: the string itself, or `env:VAR` for the environment variable's value."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f'{where}: expected {what} string or "env:VAR"')
    if not value.startswith("env:"):
        return value
    secret = env.get(value[4:], "")
    if not secret:
        raise ConfigError(f"{where}: environment variable {value[4:]} is not set")
    return secret


def _client_tokens(
    section: Mapping[str, Any], env: Mapping[str, str], upstreams: Mapping[str, sections.UpstreamConfig]
) -> tuple[dict[str, str], dict[str, dict[str, str]], dict[str, str]]:
    """`[auth] client_tokens = { tenant = "token" | "env:VAR" | { token = ..., upstream_keys =
    { upstream = "key" | "env:VAR" }, approver_token = ... } }` → (token → tenant, tenant →
    upstream → provider key, approver token → tenant)."""
    check_known(section, "auth", {"client_tokens"})
    table = section.get("client_tokens", {})
    if not isinstance(table, dict):
        raise ConfigError('auth.client_tokens: expected a table of tenant = "token" (or "env:VAR")')
    tokens: dict[str, str] = {}
    keys: dict[str, dict[str, str]] = {}
    approvers: dict[str, str] = {}
    for tenant, value in table.items():
        where = f"auth.client_tokens.{tenant}"
        if not 1 <= len(tenant) <= 64 or not set(tenant) <= _TENANT_CHARS:
            raise ConfigError(f"{where}: a tenant name is 1-64 characters of A-Z a-z 0-9 . _ -")
        if isinstance(value, dict):
            check_known(value, where, {"token", "upstream_keys", "approver_token"})
            own = value.get("upstream_keys", {})
            if not isinstance(own, dict):
                raise ConfigError(
                    f'{where}.upstream_keys: expected a table of upstream = "key" (or "env:VAR")'
                )
            for upstream, key in own.items():
                if upstream not in upstreams:
                    known = ", ".join(sorted(upstreams))
                    raise ConfigError(
                        f"{where}.upstream_keys.{upstream}: no such upstream (configured: {known})"
                    )
                keys.setdefault(tenant, {})[upstream] = _secret(
                    key, f"{where}.upstream_keys.{upstream}", env, "a provider key"
                )
            if "token" not in value:
                raise ConfigError(f"{where}.token: required (the tenant's client token)")
            token = _secret(value["token"], f"{where}.token", env, "a token")
            if "approver_token" in value:
                approver = _secret(value["approver_token"], f"{where}.approver_token", env, "a token")
                if len(approver) < sections.MIN_ADMIN_TOKEN_CHARS:
                    raise ConfigError(
                        f"{where}.approver_token: an approver token needs at least "
                        f"{sections.MIN_ADMIN_TOKEN_CHARS} characters (it releases held side effects)"
                    )
                if approver in approvers:  # a client token, its own included: checked below
                    raise ConfigError(
                        f"{where}.approver_token: must differ from every other approver token (it "
                        f"is tenant {approvers[approver]!r}'s)"
                    )
                approvers[approver] = tenant
        else:
            token = _secret(value, where, env, "a token")
        if len(token) < 16:
            raise ConfigError(f"{where}: a client token needs at least 16 characters")
        if token in tokens:
            raise ConfigError(f"{where}: the same token is already given to tenant {tokens[token]!r}")
        tokens[token] = tenant
    for approver, tenant in approvers.items():
        if approver in tokens:
            raise ConfigError(
                f"auth.client_tokens.{tenant}.approver_token: must differ from every client token "
                f"(it is tenant {tokens[approver]!r}'s client token; the agent holds its client "
                "token, and an approver token it also held would let it approve its own calls)"
            )
    return tokens, keys, approvers


def _policies(section: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """`context_policy`: a policy name or a list of them, each one of proxy.context.POLICIES."""
    value = section.get("context_policy", [])
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}.context_policy: expected a list of policy names ({', '.join(POLICIES)})")
    for name in names:
        if name not in POLICIES:
            raise ConfigError(
                f"{where}.context_policy: {name!r} is not a context policy (known: {', '.join(POLICIES)})"
            )
    return tuple(dict.fromkeys(names))


_CONTEXT_INTS = {
    "keep_last_steps": 0,
    "offload_min_bytes": 1,
    "head_bytes": 0,
    "tail_bytes": 0,
    "max_fetch_calls": 0,
    "summarize_above_tokens": 1,
    "summary_keep_first": 0,
    "summary_keep_last": 1,
    "summary_max_tokens": 1,
}


def _context(section: Any, tasks: Mapping[str, sections.TaskCaps]) -> ContextSettings:
    """`[context]`: every key named in a message when it is wrong. `summary_model` is required as
    soon as a task's `context_policy` uses summarize (a request asking for it without one is a 400
    naming X-Run-Context-Policy, proxy/server/steps/context.py)."""
    where = "context"
    if not isinstance(section, dict):
        raise ConfigError("context: expected a table")
    check_known(section, where, {*_CONTEXT_INTS, "summary_model", "growth_alert"})
    values: dict[str, Any] = {
        key: _int(section, where, key, minimum=minimum)
        for key, minimum in _CONTEXT_INTS.items()
        if key in section
    }
    model = _str(section, where, "summary_model")
    if model is not None:
        values["summary_model"] = model.strip()
    alert = _number(section, where, "growth_alert", positive=True)
    if alert is not None:
        if alert < 1:
            raise ConfigError(
                "context.growth_alert: expected a factor ≥ 1 (4 = four times the first step), "
                f"got {section['growth_alert']!r}"
            )
        values["growth_alert"] = float(alert)
    settings = ContextSettings(**values)
    if not settings.summary_model:
        for name, task in tasks.items():
            if "summarize" in task.context_policy:
                raise ConfigError(
                    f'context.summary_model: required, since [tasks."{name}"] context_policy uses summarize '
                    "(the model that writes the summaries)"
                )
    return settings


_TOKEN_PRICES = ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok")
_AUDIO_PRICES = ("input_audio_mtok", "output_audio_mtok")


def _price(model: str, section: Mapping[str, Any]) -> ModelPrice:
    """`[prices."MODEL"]`: token prices (USD per million tokens; input_mtok and output_mtok
    together override the model's genai-prices price), and per-use fees of tools the provider
    runs (`web_search_usd`, `file_search_usd`, `code_execution_usd`: USD per use), which may be
    declared alone — for a model genai-prices prices, or for every model with `[prices."*"]`."""
    where = f'prices."{model}"'
    check_known(section, where, {*_TOKEN_PRICES, *_AUDIO_PRICES, *FEE_SETTINGS})
    values = {key: _number(section, where, key) for key in (*_TOKEN_PRICES, *_AUDIO_PRICES, *FEE_SETTINGS)}
    tokens = any(values[key] is not None for key in (*_TOKEN_PRICES, *_AUDIO_PRICES))
    if tokens and (values["input_mtok"] is None or values["output_mtok"] is None):
        raise ConfigError(f"{where}: input_mtok and output_mtok are required (USD per million tokens)")
    if not tokens and not any(values[key] is not None for key in FEE_SETTINGS):
        raise ConfigError(
            f"{where}: set input_mtok and output_mtok (USD per million tokens), or a tool fee "
            f"({', '.join(FEE_SETTINGS)}: USD per use)"
        )
    if tokens and model == "*":
        raise ConfigError(f"{where}: only tool fees ({', '.join(FEE_SETTINGS)}) apply to every model")
    return ModelPrice(**values, tokens=tokens)  # type: ignore[arg-type]


# -- [mcp.NAME]: MCP servers (DESIGN.md "MCP servers (`/mcp/{name}`)") -------------------------


def _mcp_server(name: str, section: Mapping[str, Any]) -> sections.MCPServerConfig:
    where = f"mcp.{name}"
    check_known(section, where, {"url", "tools"} | known_keys(sections.MCPServerConfig))
    url = _str(section, where, "url")
    if not url:
        tables = section.get("tools")
        ruled = (
            [t for t, v in tables.items() if isinstance(v, dict) and "rules" in v]
            if isinstance(tables, dict)
            else []
        )
        if ruled:
            raise ConfigError(
                f"{where}.tools.{ruled[0]}.rules: rules for tool {ruled[0]!r} of MCP server {name!r}, "
                f"which is not configured ({where}.url is missing)"
            )
        raise ConfigError(f"{where}.url: required (the server's Streamable HTTP endpoint)")
    check_url(url, f"{where}.url", ("http", "https"))
    settings = read_section(sections.MCPServerConfig, section, where)
    tools = {}
    table = section.get("tools", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where}.tools: expected a table of [{where}.tools.TOOL] sections")
    for tool, tool_section in table.items():
        if not isinstance(tool_section, dict):
            raise ConfigError(f"{where}.tools.{tool}: expected a table")
        tools[tool] = _mcp_tool(f"{where}.tools.{tool}", name, tool, tool_section)
        if tools[tool].rules and tool in settings.get("deny", ()):
            raise ConfigError(
                f"{where}.tools.{tool}.rules: tool {tool!r} of MCP server {name!r} is denied ({where}.deny), "
                "so its rules would never apply: remove one or the other"
            )
    return sections.MCPServerConfig(name=name, url=url.rstrip("/"), **settings, tools=tools)


def _mcp_tool(where: str, server: str, name: str, section: Mapping[str, Any]) -> sections.MCPToolConfig:
    check_known(section, where, {"rules"} | known_keys(sections.MCPToolConfig))
    rules: tuple[ToolRule, ...] = ()
    if "rules" in section:
        rules = read_rules(
            section["rules"], f"{where}.rules", f"tool {name!r} of MCP server {server!r}", http=False
        )
    return sections.MCPToolConfig(
        name=name, rules=rules, **read_section(sections.MCPToolConfig, section, where)
    )
