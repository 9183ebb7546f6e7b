"""The configuration's sections, one frozen dataclass each, and `Config` that holds them.

Sections follow the TOML: `Config`'s own settings are the server's top-level keys; the ledger's,
the span path's and the client connections' settings are top-level keys too, but each part gets
only its section (`config.ledger`, `config.spans`, `config.connections`); `[caps]`, `[local]`,
`[metrics]` are tables. A field made with `setting(...)` is a setting, declared once here: its key,
type, default, environment variable, bounds and documentation line (proxy/config/declare.py).
The named tables — `[upstreams.*]`, `[tools.*]`, `[mcp.*]`, `[prices.*]`, `[auth]`, `[context]` —
are read by their own parsers (proxy/config/build.py): their keys depend on each other and on the
entry's name more than on a type.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from proxy.config.declare import ConfigError, setting
from proxy.config.rules import ToolRule
from proxy.context import ContextSettings
from proxy.pricing import ModelPrice
from proxy.upstream_url import Base


def redact_url(url: str) -> str:
    """A URL fit for logs, spans and error messages: its password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


def parse_listen(value: str, setting: str) -> tuple[str, int]:
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ConfigError(f"{setting}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port_s)


def _listen(value: str, name: str) -> str:
    host, port = parse_listen(value, name)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# An admin token opens every run, cancel and top-up: at least as long as a generated one's
# entropy needs (secrets.token_urlsafe(32) is 43 characters).
MIN_ADMIN_TOKEN_CHARS = 32


def _admin_token(token: str, name: str) -> str:
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise ConfigError(
            f"{name}: an admin token needs at least {MIN_ADMIN_TOKEN_CHARS} characters (this one "
            f"has {len(token)}); generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`, or unset it and runcap "
            "generates one in its data directory"
        )
    return token


# Standard Webhooks (standardwebhooks.com): a signing secret is `whsec_` + base64 of 24-64 bytes.
WEBHOOK_SECRET_BYTES = (24, 64)


def _webhook_secret(secret: str, name: str) -> str:
    """The secret is checked, never echoed: the message names the setting and what is wrong."""
    raw = secret.removeprefix("whsec_")
    how = (
        "generate one with `python -c 'import base64, secrets; "
        'print("whsec_" + base64.b64encode(secrets.token_bytes(32)).decode())\''
    )
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except binascii.Error:
        raise ConfigError(f"{name}: not base64 (expected `whsec_` + base64 of random bytes); {how}") from None
    low, high = WEBHOOK_SECRET_BYTES
    if not low <= len(key) <= high:
        raise ConfigError(f"{name}: {len(key)} bytes of key, expected {low} to {high}; {how}")
    return secret


_DAY_S = 86400  # the bound of every connection and ledger timeout
WEEK_S = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """Client connections (server/connections.py); top-level keys."""

    TABLE: ClassVar[str] = ""
    header_timeout_s: float = setting(
        10.0, "time a client has to send a request's headers", above=0, maximum=_DAY_S, unit="seconds"
    )
    body_timeout_s: float = setting(
        60.0, "time a client has to send a request's body", above=0, maximum=_DAY_S, unit="seconds"
    )
    keepalive_timeout_s: float = setting(
        75.0, "idle keep-alive between requests", above=0, maximum=_DAY_S, unit="seconds"
    )
    max_connections_per_client: int = setting(
        256, "open connections per client address and worker (0: no limit)"
    )


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    """The run ledger (proxy/ledger/): SQLite in data_dir, or Redis; top-level keys."""

    TABLE: ClassVar[str] = ""
    redis_url: str | None = setting(
        None, "the Redis ledger (absent: SQLite in `data_dir`)", env="RUNCAP_REDIS_URL",
        schemes=("redis", "rediss", "unix"),
    )  # fmt: skip
    ledger_retention_s: float = setting(
        WEEK_S, "idempotency records and idle runs kept this long", minimum=1, unit="seconds"
    )
    ledger_timeout_s: float = setting(
        2.0, "each ledger operation; past it 503 `ledger_unavailable`", above=0, maximum=_DAY_S,
        unit="seconds",
    )  # fmt: skip
    ledger_sweep_interval_s: float = setting(
        30.0, "sweep for reservations of processes that died", above=0, maximum=_DAY_S, unit="seconds"
    )
    redis_heartbeat_s: float = setting(
        2.0, "Redis ledger: each replica's heartbeat period", above=0, maximum=_DAY_S, unit="seconds"
    )
    redis_heartbeat_ttl_s: float = setting(
        10.0, "Redis ledger: a heartbeat's time to live (longer than `redis_heartbeat_s`)", above=0,
        maximum=_DAY_S, unit="seconds",
    )  # fmt: skip
    redis_cluster: bool = setting(
        False, "Redis ledger: `redis_url` names a node of a Redis Cluster (README: Redis Cluster)",
        env="RUNCAP_REDIS_CLUSTER",
    )  # fmt: skip
    redis_wait_replicas: int = setting(
        0, "Redis ledger: a reservation or settlement is acknowledged only once this many replicas "
        "have it (`WAIT`); fewer within half of `ledger_timeout_s`: 503 `ledger_unavailable`",
        maximum=64,
    )  # fmt: skip


PAYLOAD_MODES = ("off", "errors", "all")


@dataclass(frozen=True, slots=True)
class SpanSettings:
    """The span path (proxy/spans/): WAL, shipper, sinks, payloads; top-level keys."""

    TABLE: ClassVar[str] = ""
    tracing: bool = setting(True, "spans and payloads; `false`: caps only")
    clickhouse_url: str | None = setting(
        None, "ClickHouse server, `http(s)://user:pass@host:8123/db` (absent: embedded chdb)",
        env="RUNCAP_CLICKHOUSE_URL", schemes=("http", "https"),
    )  # fmt: skip
    clickhouse_read_url: str | None = setting(
        None, "the read-only user `/admin/sql` and the CLI use (default: `clickhouse_url`)",
        env="RUNCAP_CLICKHOUSE_READ_URL", schemes=("http", "https"),
    )  # fmt: skip
    s3_url: str | None = setting(
        None, "payload store `s3://bucket/prefix`, with the standard `AWS_*` variables "
        "(absent: `data_dir/payloads`)", env="RUNCAP_S3_URL", schemes=("s3",),
    )  # fmt: skip
    otlp_endpoint: str | None = setting(
        None, "OTLP export of the spans (absent: none)", env="OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    payloads: str = setting("all", "bodies stored: `all`, `errors`, `off`", choices=PAYLOAD_MODES)
    payload_max_bytes: int = setting(8 * 1024 * 1024, "larger bodies are not stored")
    payload_retention_days: float = setting(30.0, "local payload store: age kept (0: no limit)")
    payload_store_max_bytes: int = setting(1 << 30, "local payload store: size kept (0: no limit)")
    wal_fsync: str = setting(
        "interval", 'span WAL: fsync every `wal_fsync_interval_ms`, or `"always"` (every record)',
        choices=("interval", "always"),
    )  # fmt: skip
    wal_fsync_interval_ms: int = setting(200, "milliseconds between two fsyncs of the WAL", minimum=1)
    wal_max_bytes: int = setting(
        1 << 30, "WAL bound: bodies dropped from 3/4 of it, records held then dropped at it (counted)",
        minimum=1 << 20,
    )  # fmt: skip
    wal_segment_bytes: int = setting(16 << 20, "at most a quarter of `wal_max_bytes`", minimum=64 << 10)
    wal_hold_bytes: int = setting(
        16 << 20, "a step's record the WAL has no room for (disk full, `wal_max_bytes`) is held in "
        "memory, its answer waiting with it, up to this many bytes in all; beyond, it is dropped and "
        "the call refused (503 `ledger_disk_full`); 0: no hold",
    )  # fmt: skip
    wal_hold_ms: int = setting(
        5000, "how long one held record (and its call) waits for room before it is dropped and the "
        "call refused", maximum=60_000, why="a held call waits this long for its answer",
    )  # fmt: skip
    shipper_nice: int = setting(
        10, "the shipper process's nice value: under load the request path gets the CPU first, the "
        "WAL holds the backlog (0: same priority as the proxy)", maximum=19,
    )  # fmt: skip


def _hosts(hosts: tuple[str, ...], name: str) -> tuple[str, ...]:
    hosts = tuple(h.lower() for h in hosts)
    for h in hosts:
        if h != "*" and ("/" in h or h.startswith(".") or not h.strip()):
            raise ConfigError(f'{name}: {h!r} is not a host name (like "runcap.internal" or "10.0.0.5")')
    return hosts


def _origins(origins: tuple[str, ...], name: str) -> tuple[str, ...]:
    origins = tuple(o.lower().rstrip("/") for o in origins)
    for o in origins:
        parts = urlsplit(o)
        if o != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
            raise ConfigError(
                f'{name}: {o!r} is not an origin (scheme://host[:port], like "https://app.example.com")'
            )
    return origins


@dataclass(frozen=True, slots=True)
class LocalSettings:
    """`[local]`: who may drive a runcap on this machine (server/local_trust.py), against DNS
    rebinding."""

    TABLE: ClassVar[str] = "local"
    allowed_hosts: tuple[str, ...] = setting(
        (), "Host names it answers to besides the loopback names and the listen address "
        '(`["*"]`: any, a deployment behind its own gateway)', check=_hosts,
    )  # fmt: skip
    allowed_origins: tuple[str, ...] = setting(
        (), 'browser Origins it accepts, `scheme://host[:port]` (`["*"]`: any)', check=_origins
    )


MODEL_LABEL_MODES = ("all", "catalog")


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """`[metrics]`: who may read GET /metrics, and which model names its labels show."""

    TABLE: ClassVar[str] = "metrics"
    require_token: bool = setting(
        False, "`GET /metrics` needs the admin token (or `token`)", shown="`false` (`true` with `token`)"
    )
    token: str | None = setting(
        None, f'a scrape token of its own, `"env:VAR"` or the token (≥ {MIN_ADMIN_TOKEN_CHARS} '
        "characters); implies `require_token`",
    )  # fmt: skip
    model_labels: str = setting(
        "all", '`"all"`, or `"catalog"`: price-catalog names only, the rest `other` (what one '
        "tenant calls its models is not for the other tenants' eyes)", choices=MODEL_LABEL_MODES,
        shown='`"all"` (`"catalog"` with `[auth] client_tokens`)',
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ApprovalSettings:
    """`[approvals]`: how long a tool call waits for a person (DESIGN.md "Tool policies and
    approvals"), and who is told that one waits."""

    TABLE: ClassVar[str] = "approvals"
    approval_ttl_s: float = setting(
        3600.0, "a pending approval expires after this long (or at its run's deadline, if earlier)",
        above=0, unit="seconds",
    )  # fmt: skip
    approval_retry_after_s: int = setting(
        30, "`defer` mode: the `Retry-After` of a 428 `approval_required`", minimum=1, unit="seconds"
    )
    approval_webhook_url: str | None = setting(
        None, "POSTed `{id, run_id, tool, args_hash, rule, requested_at}` for each new pending approval "
        "(in the background: a failure is logged and counted, never the agent's)",
        schemes=("http", "https"),
    )  # fmt: skip
    approval_webhook_timeout_s: float = setting(
        5.0, "each webhook attempt's timeout (3 attempts)", above=0, unit="seconds"
    )
    approval_webhook_secret: str | None = setting(
        None, "signs each announcement the Standard Webhooks way (`webhook-id`, `webhook-timestamp`, "
        "`webhook-signature: v1,<HMAC-SHA256>`): `whsec_` + base64 of 24-64 random bytes",
        env="RUNCAP_APPROVAL_WEBHOOK_SECRET", check=_webhook_secret, shown="none (unsigned)",
    )  # fmt: skip
    approval_keepalive_s: float = setting(
        15.0, "`wait` mode over MCP: between two keep-alives on the SSE stream of a held `tools/call` "
        "(below the agent's read timeout)", minimum=0.1, maximum=3600.0, unit="seconds",
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TaskCaps:
    """`[tasks."NAME"]`: default caps for runs of one task type (`X-Run-Task`); a header may
    lower them, never raise them, and `[caps]` ceilings clamp them."""

    TABLE: ClassVar[str] = 'tasks."NAME"'
    max_usd_nanos: int | None = setting(None, "dollar cap of the task's runs", key="max_usd", usd=True)
    max_tokens: int | None = setting(None, "token cap")
    max_steps: int | None = setting(None, "model-call cap")
    max_tool_calls: int | None = setting(None, "tool-call cap")
    timeout_s: float | None = setting(
        None, "deadline after the run's first request (≤ `caps.max_run_seconds`)", above=0
    )
    max_context_tokens: int | None = setting(None, "cap on one step's input tokens")
    # The context policy runs of this task get when they send no X-Run-Context-Policy
    # (proxy.context.POLICIES); () = none: runcap never changes a message.
    context_policy: tuple[str, ...] = setting(
        (), "the context policy (`offload`, `summarize`; a name or a list) of its runs that send no "
        "`X-Run-Context-Policy`",
    )  # fmt: skip


# Upper bound of `caps.max_upstream_failures`: beyond it a provider outage is retried unbounded.
MAX_UPSTREAM_FAILURES = 1000


@dataclass(frozen=True, slots=True)
class CapsConfig:
    """`[caps]`: operator defaults (used when a header is absent) and ceilings (clamp every header
    value)."""

    TABLE: ClassVar[str] = "caps"
    default_max_usd_nanos: int | None = setting(None, "dollar cap of a run", key="default_max_usd", usd=True)
    ceiling_max_usd_nanos: int | None = setting(
        None, "the highest dollar cap a header may ask for", key="ceiling_max_usd", usd=True
    )
    default_max_tokens: int | None = setting(None, "token cap of a run")
    ceiling_max_tokens: int | None = setting(None, "the highest token cap")
    default_max_steps: int | None = setting(None, "model-call cap of a run")
    ceiling_max_steps: int | None = setting(None, "the highest model-call cap")
    default_max_tool_calls: int | None = setting(None, "tool-call cap of a run")
    ceiling_max_tool_calls: int | None = setting(None, "the highest tool-call cap")
    default_timeout_s: float | None = setting(
        None, "a run's deadline after its first request, seconds (≤ `max_run_seconds`)", above=0
    )
    ceiling_timeout_s: float | None = setting(None, "the furthest deadline, seconds", above=0)
    default_max_context_tokens: int | None = setting(None, "cap on one step's input tokens")
    ceiling_max_context_tokens: int | None = setting(None, "the highest cap on one step's input tokens")
    # Run trees (issue 22): caps on the shape and the totals of a run's subtree.
    default_max_depth: int | None = setting(None, "how many levels of sub-runs a run may have below it")
    ceiling_max_depth: int | None = setting(None, "the deepest run tree a header may ask for")
    # (`X-Run-Max-Children`)
    default_max_fan_out: int | None = setting(None, "how many direct sub-runs a run may start")
    ceiling_max_fan_out: int | None = setting(None, "the highest fan-out a header may ask for")
    default_max_tree_steps: int | None = setting(None, "model-call cap of a run and its sub-runs together")
    ceiling_max_tree_steps: int | None = setting(None, "the highest model-call cap of a run tree")
    default_max_tree_tool_calls: int | None = setting(
        None, "tool-call cap of a run and its sub-runs together"
    )
    ceiling_max_tree_tool_calls: int | None = setting(None, "the highest tool-call cap of a run tree")
    allow_unpriced: bool = setting(False, "a run with a dollar cap may call a model without a known price")
    min_output_tokens: int = setting(
        16, "a call is refused rather than clamped below this many output tokens", minimum=1
    )
    default_output_tokens: int = setting(
        16384, "output bound of a call that sets none, on a model whose maximum output is unknown",
        minimum=1,
    )  # fmt: skip
    max_run_seconds: float = setting(
        WEEK_S, "a caller's `X-Run-Deadline` / `X-Run-Timeout` further out than this is a 400", above=0
    )
    max_upstream_failures: int = setting(
        5, "model calls in a row without an answer (connect error, 408/409/429/5xx, cut before any "
        "output) before the run's next call is a 402 `max_upstream_failures`", minimum=1,
        maximum=MAX_UPSTREAM_FAILURES,
    )  # fmt: skip
    default_max_repeats: int | None = setting(
        None, "times a run's model may ask for the same tool call (or send the same request) "
        "before runcap makes it answer (`X-Run-Max-Repeats`)", minimum=1,
    )  # fmt: skip
    ceiling_max_repeats: int | None = setting(None, "the highest repeat cap", minimum=1)
    tasks: Mapping[str, TaskCaps] = field(default_factory=dict)  # [tasks."NAME"]


FLAVORS = ("openai", "anthropic")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What runcap forwards to — an upstream, a tool service, an MCP server: a name and a URL,
    split once into the base every forwarded path is built on (proxy/upstream_url.py)."""

    name: str
    url: str  # scheme://host[:port][/base-path], no trailing slash
    base: Base = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", Base.parse(self.url))

    @property
    def display_url(self) -> str:
        return redact_url(self.url)


def _paths(paths: tuple[str, ...], name: str) -> tuple[str, ...]:
    for entry in paths:
        if not entry.startswith("/"):
            raise ConfigError(f'{name}: {entry!r} must be an upstream path like "/v1/files"')
    return paths


_DEPLOYMENTS = 'deployment name = "model it serves", e.g. deployments = { "my-o1" = "o1" }'


def _deployments(table: Mapping[str, str], name: str) -> Mapping[str, str]:
    if not all(k and v for k, v in table.items()):
        raise ConfigError(f"{name}: expected a table of {_DEPLOYMENTS}")
    return table


@dataclass(frozen=True, slots=True)
class UpstreamConfig(Endpoint):
    """`[upstreams.NAME]`: a model provider (`openai`, `anthropic` built in; others at /u/NAME/)."""

    TABLE: ClassVar[str] = "upstreams.NAME"
    flavor: str = setting(
        "openai", "wire format family: OpenAI (and OpenAI-compatible servers) or Anthropic", choices=FLAVORS,
        shown="`anthropic` on `anthropic`, else `openai`",
    )  # fmt: skip
    api_key: str | None = None  # resolved from api_key_env; replaces the agent's credentials
    # Write `max_tokens` rather than `max_completion_tokens` when runcap sets an output limit the
    # client did not: OpenAI-compatible servers (vLLM, Ollama, ...) know the older field.
    legacy_output_limit: bool = False
    passthrough_allow: tuple[str, ...] = setting(
        (), "endpoints (decoded upstream paths, `*` = one segment) that may be POSTed unmetered while a "
        "run has a dollar or token cap: the operator vouches that they cost nothing",
        items="upstream paths", check=_paths,
    )  # fmt: skip
    deployments: Mapping[str, str] = setting(
        None, "for Azure-style `/openai/deployments/{name}/...` routes, whose model is not in the body: "
        "each deployment's model, which its calls are priced as (an undeclared deployment is refused "
        "under a dollar cap)", factory=dict, items=_DEPLOYMENTS, check=_deployments,
    )  # fmt: skip
    service_tier: str = setting(
        "default", "the OpenAI tier a request without `service_tier` is served at — your project's "
        "default; `auto` reserves at the dearest", choices=("default", "flex", "priority", "auto"),
        why="the tier a request without service_tier is served at",
    )  # fmt: skip


def _lower(names: tuple[str, ...], _name: str) -> tuple[str, ...]:
    return tuple(n.lower() for n in names)


@dataclass(frozen=True, slots=True)
class ToolConfig(Endpoint):
    """`[tools.NAME]`: a tool service at /tools/NAME (`url` is required)."""

    TABLE: ClassVar[str] = "tools.NAME"
    side_effects: bool | None = setting(
        None, "calls have side effects (idempotency protection)", shown="by method: POST, PUT, PATCH, DELETE"
    )
    key_fields: tuple[str, ...] | None = setting(
        None,
        "the body fields the idempotency key is derived from",
        items="field names",
        shown="the whole body",
    )
    timeout_s: float | None = setting(None, "each call's own limit (the run's deadline applies too)", above=0)
    headers: Mapping[str, str] = setting(
        None, "added to every request to the tool", factory=dict, items='header = "value"'
    )
    forward_headers: tuple[str, ...] = setting(
        (), "agent headers the tool may receive although they are credentials", check=_lower
    )
    rules: tuple[ToolRule, ...] = ()  # [[tools.NAME.rules]], compiled (config/rules.py)


@dataclass(frozen=True, slots=True)
class MCPToolConfig:
    """`[mcp.NAME.tools.TOOL]`: what the operator says about one tool, over its annotations."""

    TABLE: ClassVar[str] = "mcp.NAME.tools.TOOL"
    name: str
    side_effects: bool | None = setting(
        None, "calls have side effects", shown="from tools/list: unless `readOnlyHint: true`"
    )
    key_fields: tuple[str, ...] | None = setting(
        None, "the arguments the idempotency key is derived from", items="argument names",
        shown="all arguments",
    )  # fmt: skip
    timeout_s: float | None = setting(None, "each call's own limit (the run's deadline applies too)", above=0)
    max_calls_per_run: int | None = setting(None, "calls of this tool one run may make", minimum=1)
    rules: tuple[ToolRule, ...] = ()  # [[mcp.NAME.tools.TOOL.rules]], compiled (config/rules.py)


@dataclass(frozen=True, slots=True)
class MCPServerConfig(Endpoint):
    """`[mcp.NAME]`: an MCP server at /mcp/NAME (`url`, its Streamable HTTP endpoint, is required)."""

    TABLE: ClassVar[str] = "mcp.NAME"
    headers: Mapping[str, str] = setting(
        None, "added to every request to the server", factory=dict, items='header = "value"'
    )
    forward_headers: tuple[str, ...] = setting(
        (), "agent headers the server may receive although they are credentials", check=_lower
    )
    timeout_s: float | None = setting(
        None, "each `tools/call`'s own limit (the run's deadline applies too)", above=0
    )
    deny: tuple[str, ...] = setting((), "tools hidden from `tools/list` and refused on call")
    tools: Mapping[str, MCPToolConfig] = field(default_factory=dict)  # [mcp.NAME.tools.TOOL]

    def tool(self, name: str) -> MCPToolConfig | None:
        return self.tools.get(name)


@dataclass(frozen=True, slots=True)
class Config:
    """The whole configuration. Its own settings are the server's top-level keys; each part of
    runcap takes the section it reads."""

    TABLE: ClassVar[str] = ""
    listen: str = setting("127.0.0.1:8787", "HOST:PORT", env="RUNCAP_LISTEN", flag="--listen", check=_listen)
    data_dir: Path = setting(  # noqa: RUF009 (a Path is immutable)
        Path("./runcap-data"), "SQLite ledger, WAL, local payloads, admin token; made 0700, everything "
        "in it created 0600 / 0700", env="RUNCAP_DATA_DIR", flag="--data-dir",
        shown='`"./runcap-data"`',
    )  # fmt: skip
    require_run_id: bool = setting(
        False, "a proxy request without `X-Run-Id` (or `/r/{run_id}/...`) is a 400"
    )
    admin_token: str | None = setting(
        None, f"at least {MIN_ADMIN_TOKEN_CHARS} characters; absent: `data_dir/admin.token` (a "
        "pre-existing one must be private: no group/other bits)", env="RUNCAP_ADMIN_TOKEN",
        check=_admin_token, shown="generated",
    )  # fmt: skip
    max_body_bytes: int = setting(32 * 1024 * 1024, "larger request bodies: 413", minimum=1)
    max_answer_bytes: int = setting(
        128 * 1024 * 1024, "a larger buffered (non-stream) model answer is cut: 502 `answer_too_large`, "
        "charged at its reservation; bounds runcap's memory whatever an upstream sends",
        minimum=1,
    )  # fmt: skip
    workers: int = setting(
        1, "processes sharing the port (SO_REUSEPORT) and the ledger", minimum=1, flag="--workers"
    )
    log_requests: bool = setting(
        True, "one JSON line per request on stderr (`runcap.access`): per model call, and per tool "
        "call through `/tools` or MCP `tools/call`; a request refused for a bad header names its run "
        "when its `X-Run-Id` was valid",
    )  # fmt: skip
    tool_max_response_bytes: int = setting(
        8 * 1024 * 1024, "a larger tool answer: 502, recorded as the outcome", minimum=1
    )
    # Sections of top-level keys.
    connections: ConnectionSettings = field(default_factory=ConnectionSettings)
    ledger: LedgerSettings = field(default_factory=LedgerSettings)
    spans: SpanSettings = field(default_factory=SpanSettings)
    # Tables.
    caps: CapsConfig = field(default_factory=CapsConfig)
    local: LocalSettings = field(default_factory=LocalSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    approvals: ApprovalSettings = field(default_factory=ApprovalSettings)
    upstreams: Mapping[str, UpstreamConfig] = field(default_factory=dict)
    tools: Mapping[str, ToolConfig] = field(default_factory=dict)
    mcp: Mapping[str, MCPServerConfig] = field(default_factory=dict)  # /mcp/{name} (proxy/mcp/)
    prices: Mapping[str, ModelPrice] = field(default_factory=dict)
    # [models."MODEL"] max_output_tokens: per-model maximum output tokens, over the built-in table.
    model_max_output: Mapping[str, int] = field(default_factory=dict)
    # [context]: thresholds of the context policies and of the growth alert (proxy/context/).
    context: ContextSettings = field(default_factory=ContextSettings)
    # [auth] client_tokens: token → tenant. Empty (the sidecar case): no client token needed.
    client_tokens: Mapping[str, str] = field(default_factory=dict)
    # [auth] client_tokens.TENANT.upstream_keys: tenant → upstream name → the provider key runcap
    # sends for that tenant instead of the upstream's own `api_key_env` (objects it creates at the
    # provider live in the tenant's own account or project).
    tenant_upstream_keys: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # [auth] client_tokens.TENANT.approver_token: approver token → tenant. It decides the tenant's
    # approvals (`POST /approvals/{id}`); a client token only lists them — the agent holds it.
    approver_tokens: Mapping[str, str] = field(default_factory=dict)

    @property
    def listen_host(self) -> str:
        return parse_listen(self.listen, "listen")[0]

    @property
    def listen_port(self) -> int:
        return parse_listen(self.listen, "listen")[1]

    def with_overrides(self, **changes: Any) -> Config:
        return replace(self, **changes)


# Sections whose keys sit at the top level of the TOML, besides Config's own.
TOP_LEVEL_SECTIONS = (ConnectionSettings, LedgerSettings, SpanSettings)
