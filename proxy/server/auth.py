"""Who may call what (DESIGN.md "Trust model"): the admin token, and client tokens → tenants.

* Admin routes (`/admin/*`, `GET /runs/{id}`, cancel, reconcile) always need
  `Authorization: Bearer <admin token>`. There is no loopback exception: in a sidecar the agent
  *is* a loopback client. With no `RUNCAP_ADMIN_TOKEN` configured, the server generates one and
  keeps it in `data_dir/admin.token` (mode 0600), where the CLI finds it.
* With `[auth] client_tokens` (a shared gateway), every proxy request carries
  `X-Run-Client-Token`; its tenant namespaces the run ids (`{tenant}:{run id}`), and may have
  provider keys of its own (`upstream_keys`), sent instead of an upstream's shared one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

from proxy.config import MIN_ADMIN_TOKEN_CHARS, ConfigError
from proxy.errors import Unauthorized

ADMIN_TOKEN_FILE = "admin.token"
CLIENT_TOKEN_HEADER = "X-Run-Client-Token"


def read_admin_token(data_dir: Path) -> str | None:
    """The generated admin token of the runcap using `data_dir`, if there is one."""
    try:
        token = (data_dir / ADMIN_TOKEN_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    return token or None


def cli_admin_token(admin_token: str | None, data_dir: Path) -> str | None:
    """The token a CLI command sends: RUNCAP_ADMIN_TOKEN, the configured one, else the one the
    server generated in the data directory (`--data-dir`)."""
    return os.environ.get("RUNCAP_ADMIN_TOKEN") or admin_token or read_admin_token(data_dir)


def ensure_admin_token(data_dir: Path) -> str:
    """The admin token in `data_dir/admin.token`, generated (mode 0600) when absent. Safe when
    several workers start at once: the first to create the file wins, the others read it. A file
    that is there already must be private (no group/other bits) and hold a token of at least
    `MIN_ADMIN_TOKEN_CHARS`: anything else is a `ConfigError` saying how to fix it."""
    token = read_admin_token(data_dir)
    if token:
        return check_token_file(data_dir / ADMIN_TOKEN_FILE, token)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = data_dir / ADMIN_TOKEN_FILE
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        existing = read_admin_token(data_dir)
        if existing:
            return check_token_file(path, existing)
        raise
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def check_token_file(path: Path, token: str) -> str:
    """`token`, read from `path`, if the file is private and the token long enough."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"admin token file {path}: mode {mode:04o} lets other users read it; run `chmod 600 {path}` "
            "(and rotate the token if others could read it: delete the file and runcap generates a new one)"
        )
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise ConfigError(
            f"admin token file {path}: the token has {len(token)} characters, fewer than the "
            f"{MIN_ADMIN_TOKEN_CHARS} runcap requires; delete the file (runcap generates a new one) or "
            "write a longer token into it"
        )
    return token


class AdminGuard:
    """`Authorization: Bearer <admin token>` on every admin route."""

    def __init__(self, token: str, *also: str, what: str = "admin endpoint") -> None:
        """`also`: other tokens this guard lets in (the metrics scrape token)."""
        if not token:
            raise ValueError("AdminGuard needs a token")
        self._expected = [f"Bearer {t}".encode() for t in (token, *also) if t]
        self._what = what

    def check(self, request: web.Request) -> None:
        given = request.headers.get("Authorization", "").encode()
        # Every token compared (no early exit), each in constant time.
        if not sum(hmac.compare_digest(given, expected) for expected in self._expected):
            raise Unauthorized(
                f"{self._what}: send Authorization: Bearer <admin token> (RUNCAP_ADMIN_TOKEN, or the "
                "token runcap generated in its data directory's admin.token)"
                + (" or the [metrics] token" if len(self._expected) > 1 else "")
            )


class ClientAuth:
    """Client token → tenant; with no tokens configured every request is its own tenant-less
    client (the sidecar case)."""

    def __init__(
        self, tokens: Mapping[str, str], upstream_keys: Mapping[str, Mapping[str, str]] | None = None,
        approvers: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        # Looked up by digest, so the comparison does not leak a token's prefix through timing.
        self._by_digest = {hashlib.sha256(t.encode()).digest(): tenant for t, tenant in tokens.items()}
        self._upstream_keys = upstream_keys or {}
        # `Authorization: Bearer <approver token>` → the tenant whose approvals it decides.
        self._approvers = {
            hashlib.sha256(f"Bearer {t}".encode()).digest(): tenant for t, tenant in (approvers or {}).items()
        }

    def approver(self, request: web.Request) -> str | None:
        """The tenant whose approver token the request's `Authorization` carries, else None."""
        given = request.headers.get("Authorization")
        return self._approvers.get(hashlib.sha256(given.encode()).digest()) if given else None

    def upstream_key(self, tenant: str | None, upstream: str) -> str | None:
        """The provider key configured for `tenant` on `upstream` (`[auth] client_tokens.TENANT.
        upstream_keys`), sent instead of the upstream's own; None: the tenant has none there."""
        if tenant is None:
            return None
        return self._upstream_keys.get(tenant, {}).get(upstream)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def tenant(self, request: web.Request) -> str | None:
        """The request's tenant (None when client tokens are off). Raises `Unauthorized`."""
        if not self._by_digest:
            return None
        given = request.headers.get(CLIENT_TOKEN_HEADER)
        tenant = self._by_digest.get(hashlib.sha256(given.encode()).digest()) if given else None
        if tenant is None:
            raise Unauthorized(
                f"{CLIENT_TOKEN_HEADER}: this runcap is shared ([auth] client_tokens); send your client "
                "token in this header" + (" — the one sent is not known" if given else ""),
                param=CLIENT_TOKEN_HEADER,
            )
        return tenant
