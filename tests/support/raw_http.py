"""One HTTP request exactly as a test writes it (bytes in, status, headers and bytes out, nothing
retried or validated): the common end of the raw-call helpers of the tool, stub-upstream and
input-bounds tests."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp
from yarl import URL


def json_bytes(body: Any, raw: bytes | None = None) -> bytes | None:
    """`raw` as given, else `body` written with the stdlib json (orjson refuses ints beyond 64
    bits), else no body."""
    if raw is not None:
        return raw
    return json.dumps(body).encode() if body is not None else None


def json_or(raw: bytes, fallback: Any) -> Any:
    """The body parsed as JSON, or `fallback` when it is not JSON."""
    try:
        return json.loads(raw)
    except ValueError:
        return fallback


async def request(
    method: str, url: str | URL, data: bytes | None, headers: Mapping[str, str]
) -> tuple[int, dict[str, str], bytes]:
    """Send one request; its status, headers and body as they came."""
    async with aiohttp.ClientSession() as s, s.request(method, url, data=data, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def post_json(url: str, body: Any, headers: Mapping[str, str]) -> tuple[int, Any]:
    """POST `body` as JSON; the status and the JSON answer (an answer that is not JSON fails)."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()
