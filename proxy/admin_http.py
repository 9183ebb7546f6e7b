"""How the CLI calls a running runcap (`runcap cancel`, `caps`, `reconcile`, the read commands
with `--url`): those requests carry the admin token, so they never follow a redirect — urllib's
default would resend the `Authorization` header to wherever a `Location` points (a proxy in front
of runcap, a typo'd `--url`). A 3xx comes back as an `urllib.error.HTTPError` naming the status,
which every caller already reports. The server's own outbound calls: proxy/server/outbound.py.
"""

from __future__ import annotations

import urllib.request
from email.message import Message
from typing import IO, Any


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Message, newurl: str
    ) -> None:
        return None  # not followed: urllib raises HTTPError(code) for the 3xx


_OPENER = urllib.request.build_opener(_NoRedirect)


def urlopen(req: urllib.request.Request, timeout: float) -> Any:
    """`urllib.request.urlopen`, never following a redirect."""
    return _OPENER.open(req, timeout=timeout)
