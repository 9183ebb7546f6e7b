"""How the CLI calls a running runcap (`runcap cancel`, `caps`, `reconcile`, `approvals`, the read
commands with `--url`): one admin call, `call_json`, for all of them.

Those requests carry the admin token, so they never follow a redirect — urllib's default would
resend the `Authorization` header to wherever a `Location` points (a proxy in front of runcap, a
typo'd `--url`). A 3xx is answered like any error status: `Refused`, naming the status. The
server's own outbound calls: proxy/server/outbound.py.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from email.message import Message
from typing import IO, Any

from proxy.clierrors import http_error


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Message, newurl: str
    ) -> None:
        return None  # not followed: urllib raises HTTPError(code) for the 3xx


_OPENER = urllib.request.build_opener(_NoRedirect)  # `urlopen`, never following a redirect


class Refused(Exception):
    """runcap answered with an error status; `str()` is its one-line message (`http_error`)."""


class Unreachable(Exception):
    """Nothing answered; `reason` is what the socket said. Each command words its own hint."""

    def __init__(self, reason: object) -> None:
        super().__init__(str(reason))
        self.reason = reason


def call_json(
    url: str,
    token: str | None,
    *,
    method: str = "GET",
    body: dict[str, Any] | None = None,
    timeout: float = 30.0,
) -> Any:
    """One admin call: `method` on `url` with the bearer token (and `body` as JSON), the answer's
    JSON. `Refused` for an error status (a redirect included), `Unreachable` when nothing answers."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, method=method, data=data)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise Refused(http_error(e.code, e.read().decode("utf-8", "replace"))) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise Unreachable(getattr(e, "reason", e)) from None
