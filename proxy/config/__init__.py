"""Configuration: one typed, immutable object built once at start-up and passed down, in
sections — each part of runcap takes the section it reads.

* `declare.py`: how a setting is declared, once (key, type, default, variable, bounds, doc),
  and what is derived from it: parsing, unknown-key errors, overrides, the reference table.
* `sections.py`: the sections and `Config`.
* `build.py`: `load_config` / `build_config`: the TOML, the environment and the flags, checks
  across settings, the named tables (`[upstreams.*]`, `[tools.*]`, `[mcp.*]`, ...).
* `reference.py`: the configuration part of docs/reference.md, generated.
"""

from proxy.config.build import DEFAULT_UPSTREAMS, build_config, load_config
from proxy.config.declare import ConfigError
from proxy.config.sections import (
    FLAVORS,
    MAX_UPSTREAM_FAILURES,
    MIN_ADMIN_TOKEN_CHARS,
    MODEL_LABEL_MODES,
    PAYLOAD_MODES,
    ApprovalSettings,
    CapsConfig,
    Config,
    ConnectionSettings,
    Endpoint,
    LedgerSettings,
    LocalSettings,
    MCPServerConfig,
    MCPToolConfig,
    MetricsSettings,
    SpanSettings,
    TaskCaps,
    ToolConfig,
    UpstreamConfig,
    parse_listen,
    redact_url,
)

__all__ = [
    "DEFAULT_UPSTREAMS",
    "FLAVORS",
    "MAX_UPSTREAM_FAILURES",
    "MIN_ADMIN_TOKEN_CHARS",
    "MODEL_LABEL_MODES",
    "PAYLOAD_MODES",
    "ApprovalSettings",
    "CapsConfig",
    "Config",
    "ConfigError",
    "ConnectionSettings",
    "Endpoint",
    "LedgerSettings",
    "LocalSettings",
    "MCPServerConfig",
    "MCPToolConfig",
    "MetricsSettings",
    "SpanSettings",
    "TaskCaps",
    "ToolConfig",
    "UpstreamConfig",
    "build_config",
    "load_config",
    "parse_listen",
    "redact_url",
]
