"""docker-compose.yml as Compose reads it: the file, the sample environment, and ${VAR} interpolation."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.conftest import REPO

COMPOSE_FILE = REPO / "docker-compose.yml"


ENV_EXAMPLE = REPO / "deploy" / "compose.env.example"


def sample_env() -> dict[str, str]:
    """deploy/compose.env.example with every empty secret filled in (as a user would)."""
    env: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip() or f"{key.strip().lower()}-0123abcd0123abcd0123abcd"
    return env


_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
    ${VAR?error}, $VAR; `$$` is a literal `$` (left for the container's shell)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3)
        present = name in env and (env[name] != "" or op in (None, "-", "?"))
        if op in (":?", "?") and not present:
            raise KeyError(f"{name}: {arg}")
        if op in (":-", "-") and not present:
            return arg
        return env.get(name, "")

    return _VAR.sub(sub, value)


def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())
