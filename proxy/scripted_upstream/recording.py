"""What the scripted upstream records of each request, for tests to assert on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from proxy.providers.base import Usage
from proxy.scripted_upstream.script import DEFAULT_SCRIPT


@dataclass(slots=True)
class RecordedRequest:
    """One request the server received. Header names are lower-cased."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or None
    script: str = DEFAULT_SCRIPT
    step: int | None = None  # index of the step played (None when no step was played)
    stream: bool = False
    status: int = 200
    completed: bool = False  # the whole response was sent
    disconnected: bool = False  # the client went away before the end
    dropped: bool = False  # the server dropped the connection (a `drop_after_events` step)
    # The server ended the stream before its end (an `end_after_events` / `error_after_events` step).
    ended_early: bool = False
    # The usage the answer carries, normalised like runcap's own `Usage` (input includes cache
    # reads/writes). Set even when the stream was cut before the usage was sent; None for errors.
    usage: Usage | None = None
    received_at: float = field(default_factory=time.time)
    raw: bytes = b""  # the body's bytes as received

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())
