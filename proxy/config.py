"""Configuration: one typed, immutable object built once at start-up and passed down.

Sources, lowest to highest precedence: built-in defaults, the TOML file (`runcap.toml` or
`--config`), environment variables (DESIGN.md "Configuration"), CLI flags. Every problem raises
`ConfigError` with the name of the setting at fault; unknown keys are errors too, so a typo never
silently drops a cap.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy.context import POLICIES, ContextSettings
from proxy.money import usd_to_nanos
from proxy.pricing import FEE_SETTINGS, ModelPrice
from proxy.upstream_url import Base


def redact_url(url: str) -> str:
    """A URL fit for logs, spans and error messages: its password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


log = logging.getLogger("runcap.config")


class ConfigError(Exception):
    """A setting is wrong; the message starts with the setting's name."""


FLAVORS = ("openai", "anthropic")
PAYLOAD_MODES = ("off", "errors", "all")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What runcap forwards to — an upstream, a tool service, an MCP server: a name and a URL,
    split once into the base every forwarded path is built on (server/upstream_url.py)."""

    name: str
    url: str  # scheme://host[:port][/base-path], no trailing slash
    base: Base = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", Base.parse(self.url))

    @property
    def display_url(self) -> str:
        return redact_url(self.url)


@dataclass(frozen=True, slots=True)
class UpstreamConfig(Endpoint):
    flavor: str  # wire format family: "openai" (and OpenAI-compatible) or "anthropic"
    api_key: str | None = None  # resolved from api_key_env; replaces the agent's credentials
    # Write `max_tokens` rather than `max_completion_tokens` when runcap sets an output limit the
    # client did not: OpenAI-compatible servers (vLLM, Ollama, ...) know the older field.
    legacy_output_limit: bool = False
    # Endpoints (decoded upstream paths, `*` = one segment) that may be POSTed unmetered while a
    # run has a dollar or token cap: the operator vouches that they cost nothing.
    passthrough_allow: tuple[str, ...] = ()
    # Routes whose model is not in the body (`/openai/deployments/{name}/...`, Azure-style):
    # deployment name -> the model it serves, which the call is priced as.
    deployments: Mapping[str, str] = field(default_factory=dict)
    # The OpenAI service tier a request without `service_tier` is served at (the project's
    # default, "default" unless configured otherwise at the provider).
    service_tier: str = "default"


@dataclass(frozen=True, slots=True)
class ToolConfig(Endpoint):
    side_effects: bool | None = None  # None: by method (POST/PUT/PATCH/DELETE have side effects)
    key_fields: tuple[str, ...] | None = None
    timeout_s: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # Agent headers this tool may receive although they are credentials (lower-case names).
    forward_headers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TaskCaps:
    """`[tasks."NAME"]`: default caps for runs of one task type (`X-Run-Task`); a header may
    lower them, never raise them, and `[caps]` ceilings clamp them."""

    max_usd_nanos: int | None = None
    max_tokens: int | None = None
    max_steps: int | None = None
    max_tool_calls: int | None = None
    timeout_s: float | None = None
    max_context_tokens: int | None = None
    # The context policy runs of this task get when they send no X-Run-Context-Policy
    # (proxy.context.POLICIES); () = none: runcap never changes a message.
    context_policy: tuple[str, ...] = ()


# Upper bound of `caps.max_upstream_failures`: beyond it a provider outage is retried unbounded.
MAX_UPSTREAM_FAILURES = 1000


@dataclass(frozen=True, slots=True)
class CapsConfig:
    """Operator defaults (used when a header is absent) and ceilings (clamp every header value)."""

    default_max_usd_nanos: int | None = None
    ceiling_max_usd_nanos: int | None = None
    default_max_tokens: int | None = None
    ceiling_max_tokens: int | None = None
    default_max_steps: int | None = None
    ceiling_max_steps: int | None = None
    default_max_tool_calls: int | None = None
    ceiling_max_tool_calls: int | None = None
    default_timeout_s: float | None = None
    ceiling_timeout_s: float | None = None
    default_max_context_tokens: int | None = None
    ceiling_max_context_tokens: int | None = None
    # A run with a dollar cap refuses a model without a known price unless this is set.
    allow_unpriced: bool = False
    # A call is refused rather than clamped below this many output tokens: an answer that
    # cannot fit a useful output is not worth paying the input for.
    min_output_tokens: int = 16
    # Output bound for a call that sets no limit on a model whose maximum output is unknown.
    default_output_tokens: int = 16384
    # A caller's X-Run-Deadline / X-Run-Timeout further out than this is a 400, not a cap.
    max_run_seconds: float = 7 * 24 * 3600.0
    # Model calls of a run that got no answer (connect error, 408/409/429/5xx, cut before any
    # output) in a row before its next call is refused (402 max_upstream_failures).
    max_upstream_failures: int = 5
    tasks: Mapping[str, TaskCaps] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Config:
    listen_host: str = "127.0.0.1"
    listen_port: int = 8787
    data_dir: Path = Path("./runcap-data")
    require_run_id: bool = False
    admin_token: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    workers: int = 1
    upstreams: Mapping[str, UpstreamConfig] = field(default_factory=dict)
    tools: Mapping[str, ToolConfig] = field(default_factory=dict)
    caps: CapsConfig = field(default_factory=CapsConfig)
    prices: Mapping[str, ModelPrice] = field(default_factory=dict)
    # Per-model maximum output tokens, extending the built-in table.
    model_max_output: Mapping[str, int] = field(default_factory=dict)
    clickhouse_url: str | None = None
    clickhouse_read_url: str | None = None  # the reader's URL (default: clickhouse_url)
    s3_url: str | None = None
    redis_url: str | None = None
    otlp_endpoint: str | None = None
    payloads: str = "all"
    payload_max_bytes: int = 8 * 1024 * 1024
    log_requests: bool = True
    # Record spans (ClickHouse, OTLP) and payloads. Off: caps are still enforced, nothing is traced.
    tracing: bool = True
    # Idempotency records and idle runs are kept this long (Redis TTL / SQLite sweep).
    ledger_retention_s: float = 7 * 24 * 3600.0
    # A tool answer larger than this is cut off: 502 to the agent, recorded as the outcome.
    tool_max_response_bytes: int = 8 * 1024 * 1024
    # [auth] client_tokens: token → tenant. Empty (the sidecar case): no client token needed.
    client_tokens: Mapping[str, str] = field(default_factory=dict)
    # [auth] client_tokens.TENANT.upstream_keys: tenant → upstream name → the provider key runcap
    # sends for that tenant instead of the upstream's own `api_key_env` (objects it creates at the
    # provider live in the tenant's own account or project).
    tenant_upstream_keys: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Every ledger operation's timeout: past it the call is refused with 503 ledger_unavailable.
    ledger_timeout_s: float = 2.0
    # How often each process sweeps the ledger for reservations of processes that died.
    ledger_sweep_interval_s: float = 30.0
    # Redis ledger: heartbeat period and time to live (a replica whose heartbeat is missing on two
    # sweeps more than a time to live apart is dead).
    redis_heartbeat_s: float = 2.0
    redis_heartbeat_ttl_s: float = 10.0
    # Connections: time to send a request's headers, its body, and idle time between requests.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    # Open connections from one client address (per worker process); 0: no limit.
    max_connections_per_client: int = 256
    # Local payload store (data_dir/payloads): age and total size kept; 0: no limit.
    payload_retention_days: float = 30.0
    payload_store_max_bytes: int = 1 << 30
    # The span path's write-ahead log (data_dir/wal, proxy/spans/wal.py): fsync every
    # wal_fsync_interval_ms ("interval") or every record ("always"); the bound of the whole WAL
    # (bodies are dropped from 3/4 of it on, records at it — counted); segment size.
    wal_fsync: str = "interval"
    wal_fsync_interval_ms: int = 200
    wal_max_bytes: int = 1 << 30
    wal_segment_bytes: int = 16 << 20
    # A step whose record the WAL has no room for (disk full, wal_max_bytes) is held in memory —
    # its answer with it — up to wal_hold_bytes in all and wal_hold_ms each; past them it is
    # dropped (counted, logged with its run) and the call refused: 503 ledger_disk_full.
    wal_hold_bytes: int = 16 << 20
    wal_hold_ms: int = 5000
    # The shipper process's nice value (0-19): under load the request path comes first, the WAL
    # holds what the shipper has not shipped yet.
    shipper_nice: int = 10
    # [mcp.NAME]: MCP servers reached through /mcp/{name} (proxy/mcp/).
    mcp: Mapping[str, MCPServerConfig] = field(default_factory=dict)
    # [context]: thresholds of the context policies and of the growth alert (proxy/context/).
    context: ContextSettings = field(default_factory=ContextSettings)
    # [metrics]: GET /metrics needs the admin token (or `metrics_token`) when required; model
    # labels are "all" names or only "catalog" names (the default with client tokens: what one
    # tenant calls its models is not for the other tenants' eyes).
    metrics_require_token: bool = False
    metrics_token: str | None = None
    metrics_model_labels: str = "all"
    # [local]: who may drive a runcap on this machine (server/local_trust.py): the Host names it
    # answers to (besides the loopback names and the listen address) and the browser Origins it
    # accepts ("*" = any: a deployment behind its own gateway).
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    @property
    def listen(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    def with_overrides(self, **changes: Any) -> Config:
        return replace(self, **changes)


DEFAULT_UPSTREAMS = {
    "openai": UpstreamConfig("openai", "https://api.openai.com", "openai"),
    "anthropic": UpstreamConfig("anthropic", "https://api.anthropic.com", "anthropic"),
}

_TOP_KEYS = {
    "listen", "data_dir", "require_run_id", "admin_token", "max_body_bytes", "workers",
    "upstreams", "tools", "caps", "prices", "models", "clickhouse_url", "clickhouse_read_url",
    "s3_url", "redis_url", "otlp_endpoint", "payloads", "payload_max_bytes", "log_requests", "tracing",
    "ledger_retention_s", "tool_max_response_bytes", "auth", "tasks", "mcp",
    "ledger_timeout_s", "ledger_sweep_interval_s", "redis_heartbeat_s", "redis_heartbeat_ttl_s",
    "header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "max_connections_per_client",
    "payload_retention_days", "payload_store_max_bytes",
    "wal_fsync", "wal_fsync_interval_ms", "wal_max_bytes", "wal_segment_bytes", "shipper_nice", "context",
    "wal_hold_bytes", "wal_hold_ms", "metrics", "local",
}  # fmt: skip


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    listen: str | None = None,
    data_dir: str | None = None,
    workers: int | None = None,
) -> Config:
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
) -> Config:
    env = {} if env is None else env
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown setting (known: {', '.join(sorted(_TOP_KEYS))})")

    listen_value = listen or env.get("RUNCAP_LISTEN") or raw.get("listen") or "127.0.0.1:8787"
    host, port = parse_listen(
        str(listen_value),
        "listen" if not (listen or env.get("RUNCAP_LISTEN")) else ("--listen" if listen else "RUNCAP_LISTEN"),
    )
    data = data_dir or env.get("RUNCAP_DATA_DIR") or raw.get("data_dir") or "./runcap-data"

    upstreams = dict(DEFAULT_UPSTREAMS)
    for name, section in _table(raw, "upstreams").items():
        upstreams[name] = _upstream(name, section, env)

    tools = {name: _tool(name, section) for name, section in _table(raw, "tools").items()}
    mcp = {name: _mcp_server(name, section) for name, section in _table(raw, "mcp").items()}
    caps = _caps(_table(raw, "caps"))
    tasks = {name: _task(name, section, caps) for name, section in _table(raw, "tasks").items()}
    caps = replace(caps, tasks=tasks)
    context = _context(raw.get("context", {}), tasks)
    prices = {model: _price(model, section) for model, section in _table(raw, "prices").items()}
    model_max_output = {}
    for model, section in _table(raw, "models").items():
        _only(section, f"models.{model}", {"max_output_tokens"})
        model_max_output[model] = _int(section, f"models.{model}", "max_output_tokens", minimum=1)

    payloads = _str(raw, "", "payloads", "all")
    if payloads not in PAYLOAD_MODES:
        raise ConfigError(f"payloads: expected one of {', '.join(PAYLOAD_MODES)}, got {payloads!r}")

    # Each message names what the user wrote: the variable when it was set, else the TOML key.
    clickhouse_url, clickhouse_name = _env_or_key(env, raw, "RUNCAP_CLICKHOUSE_URL", "clickhouse_url")
    if clickhouse_url:
        _check_url(clickhouse_url, clickhouse_name, ("http", "https"))
    # The reader `/admin/sql` and the read CLI use (a `runcap_reader` user: docs/admin-sql.md).
    clickhouse_read_url, read_name = _env_or_key(
        env, raw, "RUNCAP_CLICKHOUSE_READ_URL", "clickhouse_read_url"
    )
    if clickhouse_read_url:
        if not clickhouse_url:
            raise ConfigError(
                f"{read_name}: needs RUNCAP_CLICKHOUSE_URL or clickhouse_url (a ClickHouse server)"
            )
        _check_url(clickhouse_read_url, read_name, ("http", "https"))
    s3_url, s3_name = _env_or_key(env, raw, "RUNCAP_S3_URL", "s3_url")
    if s3_url:
        _check_url(s3_url, s3_name, ("s3",))
    redis_url, redis_name = _env_or_key(env, raw, "RUNCAP_REDIS_URL", "redis_url")
    if redis_url:
        _check_url(redis_url, redis_name, ("redis", "rediss", "unix"))

    retention = _number(raw, "", "ledger_retention_s", positive=True)
    if retention is not None and retention < 1:
        raise ConfigError(
            f"ledger_retention_s: expected a number of seconds ≥ 1, got {raw['ledger_retention_s']!r}"
        )

    seconds = {
        key: _seconds(raw, key, default)
        for key, default in (
            ("ledger_timeout_s", 2.0),
            ("ledger_sweep_interval_s", 30.0),
            ("redis_heartbeat_s", 2.0),
            ("redis_heartbeat_ttl_s", 10.0),
            ("header_timeout_s", 10.0),
            ("body_timeout_s", 60.0),
            ("keepalive_timeout_s", 75.0),
        )
    }
    if seconds["redis_heartbeat_ttl_s"] <= seconds["redis_heartbeat_s"]:
        raise ConfigError(
            f"redis_heartbeat_ttl_s: {seconds['redis_heartbeat_ttl_s']:g} s must be longer than "
            f"redis_heartbeat_s = {seconds['redis_heartbeat_s']:g} s (several beats per time to live)"
        )
    retention_days = _number(raw, "", "payload_retention_days")

    n_workers = workers if workers is not None else raw.get("workers", 1)
    if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers < 1:
        raise ConfigError(f"workers: expected a whole number ≥ 1, got {n_workers!r}")
    tracing = _bool(raw, "", "tracing", True)
    # --workers N with embedded chdb is fine: the workers append to the WAL, one shipper owns chdb.
    wal_fsync = _str(raw, "", "wal_fsync", "interval")
    if wal_fsync not in ("interval", "always"):
        raise ConfigError(f'wal_fsync: expected "interval" or "always", got {wal_fsync!r}')
    wal_max_bytes = _int(raw, "", "wal_max_bytes", minimum=1 << 20, default=1 << 30)
    wal_segment_bytes = _int(raw, "", "wal_segment_bytes", minimum=64 << 10, default=16 << 20)
    wal_hold_ms = _int(raw, "", "wal_hold_ms", minimum=0, default=5000)
    if wal_hold_ms > 60_000:
        raise ConfigError(
            f"wal_hold_ms: expected at most 60000 (a held call waits this long for its answer), "
            f"got {wal_hold_ms}"
        )
    shipper_nice = _int(raw, "", "shipper_nice", minimum=0, default=10)
    if shipper_nice > 19:
        raise ConfigError(f"shipper_nice: expected a whole number from 0 to 19, got {shipper_nice}")
    if wal_segment_bytes > wal_max_bytes // 4:
        raise ConfigError(
            f"wal_segment_bytes: {wal_segment_bytes} is more than a quarter of wal_max_bytes = "
            f"{wal_max_bytes} (segments are deleted whole: the bound needs several)"
        )

    client_tokens, tenant_keys = _client_tokens(_table(raw, "auth"), env, upstreams)
    metrics = _metrics(raw.get("metrics", {}), env, tenants=bool(client_tokens))
    allowed_hosts, allowed_origins = _local(raw.get("local", {}))
    admin_token = env.get("RUNCAP_ADMIN_TOKEN") or raw.get("admin_token") or None
    if admin_token is not None:
        setting = "RUNCAP_ADMIN_TOKEN" if env.get("RUNCAP_ADMIN_TOKEN") else "admin_token"
        if not isinstance(admin_token, str) or len(admin_token) < MIN_ADMIN_TOKEN_CHARS:
            raise ConfigError(
                f"{setting}: an admin token needs at least {MIN_ADMIN_TOKEN_CHARS} characters (this one "
                f"has {len(admin_token) if isinstance(admin_token, str) else 0}); generate one with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`, or unset it and runcap "
                "generates one in its data directory"
            )

    return Config(
        listen_host=host,
        listen_port=port,
        data_dir=Path(str(data)),
        require_run_id=_bool(raw, "", "require_run_id", False),
        admin_token=admin_token,
        max_body_bytes=_int(raw, "", "max_body_bytes", minimum=1, default=32 * 1024 * 1024),
        workers=n_workers,
        upstreams=upstreams,
        tools=tools,
        caps=caps,
        prices=prices,
        model_max_output=model_max_output,
        clickhouse_url=clickhouse_url,
        clickhouse_read_url=clickhouse_read_url,
        s3_url=s3_url,
        redis_url=redis_url,
        otlp_endpoint=env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or raw.get("otlp_endpoint") or None,
        payloads=payloads,
        payload_max_bytes=_int(raw, "", "payload_max_bytes", minimum=0, default=8 * 1024 * 1024),
        log_requests=_bool(raw, "", "log_requests", True),
        tracing=tracing,
        ledger_retention_s=float(retention) if retention is not None else 7 * 24 * 3600.0,
        tool_max_response_bytes=_int(raw, "", "tool_max_response_bytes", minimum=1, default=8 * 1024 * 1024),
        client_tokens=client_tokens,
        tenant_upstream_keys=tenant_keys,
        **seconds,
        max_connections_per_client=_int(raw, "", "max_connections_per_client", minimum=0, default=256),
        payload_retention_days=float(retention_days) if retention_days is not None else 30.0,
        payload_store_max_bytes=_int(raw, "", "payload_store_max_bytes", minimum=0, default=1 << 30),
        wal_fsync=wal_fsync,
        wal_fsync_interval_ms=_int(raw, "", "wal_fsync_interval_ms", minimum=1, default=200),
        wal_max_bytes=wal_max_bytes,
        wal_segment_bytes=wal_segment_bytes,
        wal_hold_bytes=_int(raw, "", "wal_hold_bytes", minimum=0, default=16 << 20),
        wal_hold_ms=wal_hold_ms,
        shipper_nice=shipper_nice,
        mcp=mcp,
        context=context,
        **metrics,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
    )


# An admin token opens every run, cancel and top-up: at least as long as a generated one's
# entropy needs (secrets.token_urlsafe(32) is 43 characters).
MIN_ADMIN_TOKEN_CHARS = 32
MODEL_LABEL_MODES = ("all", "catalog")


def _metrics(section: Any, env: Mapping[str, str], *, tenants: bool) -> dict[str, Any]:
    """`[metrics]`: `require_token` (GET /metrics needs the admin token, or `token`), `token`
    (a scrape token of its own, "env:VAR" or the token; setting it requires it), `model_labels`."""
    if not isinstance(section, dict):
        raise ConfigError("metrics: expected a table")
    _only(section, "metrics", {"require_token", "token", "model_labels"})
    token = _str(section, "metrics", "token")
    if token is not None:
        if token.startswith("env:"):
            name = token[4:]
            token = env.get(name, "")
            if not token:
                raise ConfigError(f"metrics.token: environment variable {name} is not set")
        if len(token) < MIN_ADMIN_TOKEN_CHARS:
            raise ConfigError(
                f"metrics.token: a scrape token needs at least {MIN_ADMIN_TOKEN_CHARS} characters"
            )
    require = _bool(section, "metrics", "require_token", token is not None)
    if token is not None and not require:
        raise ConfigError(
            "metrics.require_token: false contradicts metrics.token (a token that is not required)"
        )
    labels = _str(section, "metrics", "model_labels", "catalog" if tenants else "all")
    if labels not in MODEL_LABEL_MODES:
        raise ConfigError(
            f"metrics.model_labels: expected one of {', '.join(MODEL_LABEL_MODES)}, got {labels!r}"
        )
    return {"metrics_require_token": require, "metrics_token": token, "metrics_model_labels": labels}


def _local(section: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`[local]`: `allowed_hosts` (Host names besides loopback and the listen address; "*" = any)
    and `allowed_origins` (browser Origins, "scheme://host[:port]"; "*" = any)."""
    if not isinstance(section, dict):
        raise ConfigError("local: expected a table")
    _only(section, "local", {"allowed_hosts", "allowed_origins"})
    hosts = tuple(h.lower() for h in _str_list(section, "local", "allowed_hosts"))
    for h in hosts:
        if h != "*" and ("/" in h or h.startswith(".") or not h.strip()):
            raise ConfigError(
                f'local.allowed_hosts: {h!r} is not a host name (like "runcap.internal" or "10.0.0.5")'
            )
    origins = tuple(o.lower().rstrip("/") for o in _str_list(section, "local", "allowed_origins"))
    for o in origins:
        parts = urlsplit(o)
        if o != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
            raise ConfigError(
                f'local.allowed_origins: {o!r} is not an origin (scheme://host[:port], like "https://app.example.com")'
            )
    return hosts, origins


def parse_listen(value: str, setting: str) -> tuple[str, int]:
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ConfigError(f"{setting}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port_s)


def _check_url(url: Any, setting: str, schemes: tuple[str, ...]) -> None:
    if not isinstance(url, str):
        raise ConfigError(f"{setting}: expected a {'/'.join(s + '://' for s in schemes)}... URL, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in schemes or not (parts.netloc or parts.scheme == "unix"):
        raise ConfigError(f"{setting}: expected a {'/'.join(s + '://' for s in schemes)}... URL, got {url!r}")


def _table(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table")
    for name, section in value.items():
        if not isinstance(section, dict) and key != "caps":
            raise ConfigError(f"{key}.{name}: expected a table")
    return value


def _only(section: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    extra = set(section) - allowed
    if extra:
        raise ConfigError(
            f"{where}.{sorted(extra)[0]}: unknown setting (known: {', '.join(sorted(allowed))})"
        )


def _str(section: Mapping[str, Any], where: str, key: str, default: str | None = None) -> Any:
    value = section.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{_join(where, key)}: expected a string, got {value!r}")
    return value


def _bool(section: Mapping[str, Any], where: str, key: str, default: bool | None = None) -> Any:
    value = section.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{_join(where, key)}: expected true or false, got {value!r}")
    return value


def _int(
    section: Mapping[str, Any], where: str, key: str, *, minimum: int = 0, default: int | None = None
) -> Any:
    value = section.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{_join(where, key)}: expected a whole number ≥ {minimum}, got {value!r}")
    return value


def _number(section: Mapping[str, Any], where: str, key: str, *, positive: bool = False) -> Decimal | None:
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{_join(where, key)}: expected a number, got {value!r}")
    try:
        d = Decimal(str(value))
    except InvalidOperation:
        raise ConfigError(f"{_join(where, key)}: expected a number, got {value!r}") from None
    if not d.is_finite() or d < 0 or (positive and d == 0):
        raise ConfigError(
            f"{_join(where, key)}: expected a number {'>' if positive else '≥'} 0, got {value!r}"
        )
    return d


def _seconds(section: Mapping[str, Any], key: str, default: float) -> float:
    value = _number(section, "", key, positive=True)
    if value is None:
        return default
    if value > 86400:
        raise ConfigError(f"{key}: expected a number of seconds > 0 and ≤ 86400, got {section[key]!r}")
    return float(value)


def _env_or_key(env: Mapping[str, str], raw: Mapping[str, Any], var: str, key: str) -> tuple[Any, str]:
    """A setting the environment overrides: its value (None: not set) and the name the user wrote
    it under — the variable when it is set, else the TOML key — for messages about it."""
    if env.get(var):
        return env[var], var
    return raw.get(key) or None, key


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


_UPSTREAM_KEYS = {
    "url", "flavor", "api_key_env", "output_limit_field", "passthrough_allow", "deployments", "service_tier",
}  # fmt: skip


def _upstream(name: str, section: Mapping[str, Any], env: Mapping[str, str]) -> UpstreamConfig:
    where = f"upstreams.{name}"
    _only(section, where, _UPSTREAM_KEYS)
    url = _str(section, where, "url")
    if not url:
        if name in DEFAULT_UPSTREAMS:
            url = DEFAULT_UPSTREAMS[name].url
        else:
            raise ConfigError(f"{where}.url: required")
    _check_url(url, f"{where}.url", ("http", "https"))
    if name in DEFAULT_UPSTREAMS and url.rstrip("/").endswith("/v1"):
        # The usual SDK base URL (https://api.openai.com/v1): runcap's /v1/... routes already
        # send /v1, so keeping it would make every call a 404 for /v1/v1/...
        fixed = url.rstrip("/")[: -len("/v1")]
        log.warning(
            "%s.url: %r ends with /v1, which runcap's routes add themselves; using %r", where, url, fixed
        )
        url = fixed
    default_flavor = DEFAULT_UPSTREAMS[name].flavor if name in DEFAULT_UPSTREAMS else "openai"
    flavor = _str(section, where, "flavor", default_flavor)
    if flavor not in FLAVORS:
        raise ConfigError(f"{where}.flavor: expected one of {', '.join(FLAVORS)}, got {flavor!r}")
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
    allow = _str_list(section, where, "passthrough_allow")
    for entry in allow:
        if not entry.startswith("/"):
            raise ConfigError(
                f'{where}.passthrough_allow: {entry!r} must be an upstream path like "/v1/files"'
            )
    deployments = section.get("deployments", {})
    if not isinstance(deployments, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in deployments.items()
    ):
        raise ConfigError(
            f'{where}.deployments: expected a table of deployment name = "model it serves", '
            f'e.g. deployments = {{ "my-o1" = "o1" }}'
        )
    tier = _str(section, where, "service_tier", "default")
    if tier not in ("default", "flex", "priority", "auto"):
        raise ConfigError(
            f"{where}.service_tier: expected default, flex, priority or auto (the tier a request "
            f"without service_tier is served at), got {tier!r}"
        )
    return UpstreamConfig(
        name, url.rstrip("/"), flavor, api_key, field_name == "max_tokens", allow, dict(deployments), tier
    )


def _tool(name: str, section: Mapping[str, Any]) -> ToolConfig:
    where = f"tools.{name}"
    _only(section, where, {"url", "side_effects", "key_fields", "timeout_s", "headers", "forward_headers"})
    url = _str(section, where, "url")
    if not url:
        raise ConfigError(f"{where}.url: required")
    _check_url(url, f"{where}.url", ("http", "https"))
    key_fields = section.get("key_fields")
    if key_fields is not None and (
        not isinstance(key_fields, list) or not all(isinstance(k, str) and k for k in key_fields)
    ):
        raise ConfigError(f"{where}.key_fields: expected a list of field names")
    timeout = _number(section, where, "timeout_s", positive=True)
    headers = section.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ConfigError(f'{where}.headers: expected a table of header = "value"')
    return ToolConfig(
        name=name,
        url=url.rstrip("/"),
        side_effects=_bool(section, where, "side_effects"),
        key_fields=tuple(key_fields) if key_fields is not None else None,
        timeout_s=float(timeout) if timeout is not None else None,
        headers=dict(headers),
        forward_headers=tuple(h.lower() for h in _str_list(section, where, "forward_headers")),
    )


def _str_list(section: Mapping[str, Any], where: str, key: str) -> tuple[str, ...]:
    value = section.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{_join(where, key)}: expected a list of strings")
    return tuple(value)


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
    section: Mapping[str, Any], env: Mapping[str, str], upstreams: Mapping[str, UpstreamConfig]
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """`[auth] client_tokens = { tenant = "token" | "env:VAR" | { token = ..., upstream_keys =
    { upstream = "key" | "env:VAR" } } }` → (token → tenant, tenant → upstream → provider key)."""
    _only(section, "auth", {"client_tokens"})
    table = section.get("client_tokens", {})
    if not isinstance(table, dict):
        raise ConfigError('auth.client_tokens: expected a table of tenant = "token" (or "env:VAR")')
    tokens: dict[str, str] = {}
    keys: dict[str, dict[str, str]] = {}
    for tenant, value in table.items():
        where = f"auth.client_tokens.{tenant}"
        if not 1 <= len(tenant) <= 64 or not set(tenant) <= _TENANT_CHARS:
            raise ConfigError(f"{where}: a tenant name is 1-64 characters of A-Z a-z 0-9 . _ -")
        if isinstance(value, dict):
            _only(value, where, {"token", "upstream_keys"})
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
        else:
            token = _secret(value, where, env, "a token")
        if len(token) < 16:
            raise ConfigError(f"{where}: a client token needs at least 16 characters")
        if token in tokens:
            raise ConfigError(f"{where}: the same token is already given to tenant {tokens[token]!r}")
        tokens[token] = tenant
    return tokens, keys


def _task(name: str, section: Mapping[str, Any], caps: CapsConfig) -> TaskCaps:
    where = f'tasks."{name}"'
    if not name or len(name) > 256 or not name.isprintable():
        raise ConfigError(f"{where}: a task name is 1-256 printable characters (as sent in X-Run-Task)")
    _only(
        section,
        where,
        {
            "max_usd",
            "max_tokens",
            "max_steps",
            "max_tool_calls",
            "timeout_s",
            "max_context_tokens",
            "context_policy",
        },
    )
    usd = _number(section, where, "max_usd")
    timeout = _number(section, where, "timeout_s", positive=True)
    if timeout is not None and timeout > caps.max_run_seconds:
        raise ConfigError(f"{where}.timeout_s: beyond caps.max_run_seconds = {caps.max_run_seconds:g} s")
    return TaskCaps(
        max_usd_nanos=usd_to_nanos(usd) if usd is not None else None,
        max_tokens=_int(section, where, "max_tokens"),
        max_steps=_int(section, where, "max_steps"),
        max_tool_calls=_int(section, where, "max_tool_calls"),
        timeout_s=float(timeout) if timeout is not None else None,
        max_context_tokens=_int(section, where, "max_context_tokens"),
        context_policy=_policies(section, where),
    )


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


def _context(section: Any, tasks: Mapping[str, TaskCaps]) -> ContextSettings:
    """`[context]`: every key named in a message when it is wrong. `summary_model` is required as
    soon as a task's `context_policy` uses summarize (a request asking for it without one is a 400
    naming X-Run-Context-Policy, proxy/server/steps/context.py)."""
    where = "context"
    if not isinstance(section, dict):
        raise ConfigError("context: expected a table")
    _only(section, where, {*_CONTEXT_INTS, "summary_model", "growth_alert"})
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


def _caps(section: Mapping[str, Any]) -> CapsConfig:
    where = "caps"
    allowed = {
        f"{kind}_{cap}"
        for kind in ("default", "ceiling")
        for cap in ("max_usd", "max_tokens", "max_steps", "max_tool_calls", "timeout_s", "max_context_tokens")
    } | {
        "allow_unpriced", "min_output_tokens", "default_output_tokens", "max_run_seconds",
        "max_upstream_failures",
    }  # fmt: skip
    _only(section, where, allowed)
    values: dict[str, Any] = {}
    for kind in ("default", "ceiling"):
        usd = _number(section, where, f"{kind}_max_usd")
        values[f"{kind}_max_usd_nanos"] = usd_to_nanos(usd) if usd is not None else None
        for cap in ("max_tokens", "max_steps", "max_tool_calls", "max_context_tokens"):
            values[f"{kind}_{cap}"] = _int(section, where, f"{kind}_{cap}")
        timeout = _number(section, where, f"{kind}_timeout_s", positive=True)
        values[f"{kind}_timeout_s"] = float(timeout) if timeout is not None else None
    values["allow_unpriced"] = _bool(section, where, "allow_unpriced", False)
    values["min_output_tokens"] = _int(section, where, "min_output_tokens", minimum=1, default=16)
    values["default_output_tokens"] = _int(section, where, "default_output_tokens", minimum=1, default=16384)
    max_run = _number(section, where, "max_run_seconds", positive=True)
    values["max_run_seconds"] = float(max_run) if max_run is not None else 7 * 24 * 3600.0
    failures = _int(section, where, "max_upstream_failures", minimum=1, default=5)
    if failures > MAX_UPSTREAM_FAILURES:
        raise ConfigError(
            f"caps.max_upstream_failures: expected a whole number from 1 to {MAX_UPSTREAM_FAILURES}, "
            f"got {failures!r}"
        )
    values["max_upstream_failures"] = failures
    for kind in ("default", "ceiling"):
        timeout = values[f"{kind}_timeout_s"]
        if timeout is not None and timeout > values["max_run_seconds"]:
            raise ConfigError(
                f"caps.{kind}_timeout_s: {timeout:g} s is beyond caps.max_run_seconds = "
                f"{values['max_run_seconds']:g} s"
            )
    return CapsConfig(**values)


_TOKEN_PRICES = ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok")
_AUDIO_PRICES = ("input_audio_mtok", "output_audio_mtok")


def _price(model: str, section: Mapping[str, Any]) -> ModelPrice:
    """`[prices."MODEL"]`: token prices (USD per million tokens; input_mtok and output_mtok
    together override the model's genai-prices price), and per-use fees of tools the provider
    runs (`web_search_usd`, `file_search_usd`, `code_execution_usd`: USD per use), which may be
    declared alone — for a model genai-prices prices, or for every model with `[prices."*"]`."""
    where = f'prices."{model}"'
    _only(section, where, {*_TOKEN_PRICES, *_AUDIO_PRICES, *FEE_SETTINGS})
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
        raise ConfigError(f'{where}: only tool fees ({", ".join(FEE_SETTINGS)}) apply to every model')
    return ModelPrice(**values, tokens=tokens)  # type: ignore[arg-type]


# -- [mcp.NAME]: MCP servers (DESIGN.md "MCP servers (`/mcp/{name}`)") -------------------------


@dataclass(frozen=True, slots=True)
class MCPToolConfig:
    """`[mcp.NAME.tools.TOOL]`: what the operator says about one tool, over its annotations."""

    name: str
    side_effects: bool | None = None  # None: from tools/list (`readOnlyHint`; absent = side effects)
    key_fields: tuple[str, ...] | None = None
    timeout_s: float | None = None
    max_calls_per_run: int | None = None


@dataclass(frozen=True, slots=True)
class MCPServerConfig(Endpoint):  # url: the server's Streamable HTTP endpoint
    headers: Mapping[str, str] = field(default_factory=dict)  # added to every request
    # Agent headers this server may receive although they are credentials (lower-case names).
    forward_headers: tuple[str, ...] = ()
    timeout_s: float | None = None  # each tools/call's own limit (the run's deadline applies too)
    deny: tuple[str, ...] = ()  # hidden from tools/list, refused on call
    tools: Mapping[str, MCPToolConfig] = field(default_factory=dict)

    def tool(self, name: str) -> MCPToolConfig | None:
        return self.tools.get(name)


def _mcp_server(name: str, section: Mapping[str, Any]) -> MCPServerConfig:
    where = f"mcp.{name}"
    _only(section, where, {"url", "headers", "forward_headers", "timeout_s", "deny", "tools"})
    url = _str(section, where, "url")
    if not url:
        raise ConfigError(f"{where}.url: required (the server's Streamable HTTP endpoint)")
    _check_url(url, f"{where}.url", ("http", "https"))
    headers = section.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ConfigError(f'{where}.headers: expected a table of header = "value"')
    timeout = _number(section, where, "timeout_s", positive=True)
    tools = {}
    table = section.get("tools", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where}.tools: expected a table of [{where}.tools.TOOL] sections")
    for tool, tool_section in table.items():
        if not isinstance(tool_section, dict):
            raise ConfigError(f"{where}.tools.{tool}: expected a table")
        tools[tool] = _mcp_tool(f"{where}.tools.{tool}", tool, tool_section)
    return MCPServerConfig(
        name=name,
        url=url.rstrip("/"),
        headers=dict(headers),
        forward_headers=tuple(h.lower() for h in _str_list(section, where, "forward_headers")),
        timeout_s=float(timeout) if timeout is not None else None,
        deny=_str_list(section, where, "deny"),
        tools=tools,
    )


def _mcp_tool(where: str, name: str, section: Mapping[str, Any]) -> MCPToolConfig:
    _only(section, where, {"side_effects", "key_fields", "timeout_s", "max_calls_per_run"})
    key_fields = section.get("key_fields")
    if key_fields is not None and (
        not isinstance(key_fields, list) or not all(isinstance(k, str) and k for k in key_fields)
    ):
        raise ConfigError(f"{where}.key_fields: expected a list of argument names")
    timeout = _number(section, where, "timeout_s", positive=True)
    return MCPToolConfig(
        name=name,
        side_effects=_bool(section, where, "side_effects"),
        key_fields=tuple(key_fields) if key_fields is not None else None,
        timeout_s=float(timeout) if timeout is not None else None,
        max_calls_per_run=_int(section, where, "max_calls_per_run", minimum=1),
    )
