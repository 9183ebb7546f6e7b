"""The agent's side of the MCP tests: the SDK's ClientSession through runcap, and every kind of MCP
server (tests/support/mcp_server.py) started once per module."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import free_port
from tests.support.mcp_server import MCPServerProcess

FLAGS = {
    "stateful-sse": (),
    "stateless-json": ("--stateless", "--json"),
    "stateful-json": ("--json",),
    "stateless-sse": ("--stateless",),
    "resumable": ("--event-store",),
}


@pytest.fixture(scope="module")
def servers() -> Iterator[Callable[[str], MCPServerProcess]]:
    """Every kind of server, started together (their start-ups overlap), each ready on first use."""
    started = {kind: MCPServerProcess(free_port(), *flags).start() for kind, flags in FLAGS.items()}

    def get(kind: str) -> MCPServerProcess:
        return started[kind].wait_ready()

    yield get
    for server in started.values():
        server.stop()


def rid(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def mcp_config(server: MCPServerProcess, **extra: Any) -> dict[str, Any]:
    tools = extra.pop("tools", {})
    return {
        "mcp": {
            "crm": {
                "url": server.url,
                "headers": {"X-Server-Key": "server-secret"},
                "deny": ["drop_database"],
                "tools": {"slow_read": {"timeout_s": 0.5}, **tools},
            }
        },
        **extra,
    }


@asynccontextmanager
async def session(
    url: str, run_id: str | None, *, read_timeout_s: float = 60, **kwargs: Any
) -> AsyncIterator[ClientSession]:
    """The agent: the SDK's ClientSession over its Streamable HTTP client, the run's headers on
    the transport (and a credential of its own, which runcap must not pass on). `read_timeout_s`
    is the HTTP client's read timeout: the longest silence it takes on an answer's stream."""
    headers = {"Authorization": "Bearer agent-own-secret", **kwargs.pop("headers", {})}
    if run_id is not None:
        headers["X-Run-Id"] = run_id
    timeout = httpx2.Timeout(30, read=read_timeout_s)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write, **kwargs) as s,
    ):
        await s.initialize()
        yield s
