"""Bounded inputs (issue 19, hole 5 and 6; issue 25 item 8): every number and name runcap reads
is bounded, a value out of bounds is a 400 naming the field and the bound — never a 500 — and
the access log records the status the agent got. Run headers are ASCII, sent once, and known.

Against a real runcap: in-process (`runcap_factory`) with the scripted upstream, and as a
process where what is checked is the process's own output (its access log)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from proxy.bounds import MAX_CAP, MAX_CHOICES, MAX_MODEL_NAME, MAX_OUTPUT_TOKENS
from proxy.caps import RUN_HEADERS, parse_run_headers
from proxy.config import CapsConfig
from proxy.errors import InvalidRequest
from proxy.server.metrics import MAX_LABEL_CHARS
from tests.conftest import REPO, RuncapProcess
from tests.support.raw_http import json_bytes, json_or, request

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
BIG = 2**63
U64_MAX = 2**64 - 1


async def send(
    method: str, url: str, body: Any = None, headers: Any = None, raw: bytes | None = None
) -> tuple[int, dict[str, Any] | None, str]:
    """One request; `body` is written with the stdlib json (orjson refuses ints beyond 64 bits)."""
    data = json_bytes(body, raw)
    hdrs = CIMultiDict(headers or {})
    if data is not None and "Content-Type" not in hdrs:
        hdrs["Content-Type"] = "application/json"
    status, _, answer = await request(method, url, data, hdrs)
    return status, json_or(answer, None), answer.decode()


def error_of(body: dict[str, Any] | None) -> dict[str, Any]:
    assert body is not None
    return body["error"]


# -- hole 5: model request fields, per adapter -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field", "bound"),
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": BIG}, "max_tokens", MAX_OUTPUT_TOKENS),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": BIG}, "max_completion_tokens",
         MAX_OUTPUT_TOKENS),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10, "n": BIG}, "n", MAX_CHOICES),
        ("/v1/completions", {"model": "gpt-3.5-turbo-instruct", "prompt": "x", "max_tokens": 5,
                             "best_of": BIG}, "best_of", MAX_CHOICES),
        ("/v1/completions", {"model": "gpt-3.5-turbo-instruct", "prompt": "x", "max_tokens": 5,
                             "n": U64_MAX}, "n", MAX_CHOICES),
        ("/v1/responses", {"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": BIG},
         "max_output_tokens", MAX_OUTPUT_TOKENS),
        ("/anthropic/v1/messages", {"model": "claude-sonnet-4-5", "messages": CHAT["messages"],
                                    "max_tokens": BIG}, "max_tokens", MAX_OUTPUT_TOKENS),
    ],
)  # fmt: skip
async def test_huge_request_integers_are_a_400_naming_the_field_and_bound(
    runcap, upstream, path: str, body: dict[str, Any], field: str, bound: int
) -> None:  # type: ignore[no-untyped-def]
    # A ledgered run without a dollar or token cap: the reservation of 2**63 tokens overflowed
    # SQLite's integers (a bare 500).
    status, answer, _ = await send(
        "POST", runcap.url + path, body, {"X-Run-Id": "huge-1", "X-Run-Max-Steps": "5"}
    )
    assert status == 400, answer
    anthropic = path.startswith("/anthropic")
    err = answer["error"] if anthropic else error_of(answer)  # type: ignore[index]
    assert field in err["message"] and str(bound) in err["message"], err
    if not anthropic:
        assert err["param"] == field
    assert upstream.hits() == 0


async def test_model_names_are_bounded(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    status, answer, _ = await send(
        "POST", runcap.openai_url + "/chat/completions", {**CHAT, "model": "m" * (MAX_MODEL_NAME + 1)}
    )
    assert status == 400
    err = error_of(answer)
    assert err["param"] == "model" and str(MAX_MODEL_NAME) in err["message"]
    status, answer, _ = await send(
        "POST", runcap.openai_url + "/chat/completions", {**CHAT, "model": "m" * (1 << 20)}
    )
    assert status == 400 and error_of(answer)["param"] == "model"
    assert upstream.hits() == 0


async def test_metric_labels_are_bounded_in_length(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    """Model names within the request bound but longer than a label may be are counted under one
    `other` label: /metrics stays small however many such names arrive."""
    for i in range(20):
        model = f"{i:03d}-" + "x" * 240
        status, _, text = await send(
            "POST", runcap.openai_url + "/chat/completions", {**CHAT, "model": model}
        )
        assert status == 200, text
    async with aiohttp.ClientSession() as s, s.get(runcap.url + "/metrics") as r:
        metrics = await r.text()
    labels = re.findall(r'model="([^"]*)"', metrics)
    assert labels and all(len(v) <= MAX_LABEL_CHARS for v in labels), max(map(len, labels))
    assert 'model="other"' in metrics
    assert len(metrics) < 200_000


# -- hole 5: top-up, cancel, admin SQL parameters, MCP params ----------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": BIG}, "max_tokens"),
        ({"max_steps": U64_MAX}, "max_steps"),
        ({"max_tool_calls": MAX_CAP + 1}, "max_tool_calls"),
        ({"max_usd": "1e3"}, "max_usd"),
        ({"max_usd": "1_0"}, "max_usd"),
        ({"max_usd": "10000000000"}, "max_usd"),
        ({"extend_s": 1e300}, "extend_s"),
    ],
)
async def test_top_up_values_out_of_bounds_are_a_400(
    runcap, upstream, change: dict[str, Any], field: str
) -> None:  # type: ignore[no-untyped-def]
    status, _, text = await send(
        "POST", runcap.openai_url + "/chat/completions", CHAT, {"X-Run-Id": "topped", "X-Run-Max-Steps": "3"}
    )
    assert status == 200, text
    status, answer, _ = await send("POST", f"{runcap.url}/runs/topped/caps", change, runcap.admin)
    assert status == 400, answer
    assert error_of(answer)["param"] == field
    run = await runcap.run("topped")
    assert run["caps"]["max_steps"] == 3  # nothing changed


async def test_admin_run_ids_are_matched_in_full(runcap) -> None:  # type: ignore[no-untyped-def]
    for path in ("/runs/abc%0A/cancel", "/runs/abc%0A/caps", "/runs/abc%0A"):
        method = "GET" if path == "/runs/abc%0A" else "POST"
        status, answer, _ = await send(method, runcap.url + path, {"max_steps": 1}, runcap.admin)
        assert status == 400, (path, answer)
    assert await runcap.ledger.get_run("abc\n") is None


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"x": "y" * (64 * 1024 + 1)}, "params.x"),
        ({"x": [1] * 10_001}, "params.x"),
        ({"x": {"nested": 1}}, "params.x"),
        ({"bad name": 1}, "params"),
        ({f"p{i}": i for i in range(65)}, "params"),
        ({"x": [{"a": 1}]}, "params.x"),
    ],
)
async def test_admin_sql_params_are_bounded(runcap, params: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]
    status, answer, _ = await send(
        "POST", runcap.url + "/admin/sql", {"sql": "SELECT 1", "params": params}, runcap.admin
    )
    assert status == 400, answer
    assert error_of(answer)["param"] == param


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"jsonrpc": "2.0", "id": "i" * 2000, "method": "tools/list"}, "id"),
        ({"jsonrpc": "2.0", "id": 2**64, "method": "tools/list"}, "id"),
        ({"jsonrpc": "2.0", "id": 1.5, "method": "tools/list"}, "id"),
        ({"jsonrpc": "2.0", "id": 1, "method": "m" * 300}, "method"),
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t" * 300}}, "params.name"),
    ],
)
async def test_mcp_message_fields_are_bounded(runcap_factory, message: dict[str, Any], field: str) -> None:  # type: ignore[no-untyped-def]
    # The server is never reached: refused while reading the message (its URL has nobody listening).
    rc = await runcap_factory({"mcp": {"crm": {"url": "http://127.0.0.1:9/mcp"}}})
    status, answer, _ = await send(
        "POST", rc.url + "/mcp/crm", message, {"Accept": "application/json, text/event-stream"}
    )
    assert status == 400, answer
    assert answer is not None and answer["error"]["message"].split(": ", 2)[1].startswith(field), answer


# -- the access log records what the agent got --------------------------------------------------


def test_access_log_records_the_status_the_agent_got(upstream_process, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "data"
    config = tmp_path / "runcap.toml"
    config.write_text(
        f'tracing = false\nlog_requests = true\n[upstreams.openai]\nurl = "{upstream_process}"\n'
        f'[upstreams.anthropic]\nurl = "{upstream_process}"\n'
    )
    proc = RuncapProcess(config, data)
    proc.start()
    try:
        statuses = []
        for body in ({**CHAT, "max_tokens": BIG}, {**CHAT, "n": BIG}, CHAT):
            status, _, _ = asyncio.run(
                send(
                    "POST",
                    proc.openai_url + "/chat/completions",
                    body,
                    {"X-Run-Id": "logged", "X-Run-Max-Steps": "9"},
                )
            )
            statuses.append(status)
    finally:
        proc.stop()
    assert statuses == [400, 400, 200]
    lines = [
        json.loads(line) for line in (tmp_path / "runcap.log").read_text().splitlines() if '"method"' in line
    ]
    assert [line["status"] for line in lines] == statuses, lines
    assert [line["outcome"] for line in lines] == ["error", "error", "ok"]


@pytest.fixture
def upstream_process(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The scripted upstream as a process (`runcap mock-upstream`), for tests whose runcap is one."""
    import socket
    import subprocess
    import sys
    import time

    from tests.conftest import free_port
    from tests.support.processes import stop_process

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "mock-upstream", "--listen", f"127.0.0.1:{port}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "upstream.log", "ab"),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    stop_process(proc, grace_s=5)


# -- run headers: ASCII, once, known ----------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("X-Run-Max-Usd", "1_0"),
        ("X-Run-Max-Usd", "1e3"),
        ("X-Run-Max-Usd", "+1"),
        ("X-Run-Max-Usd", "Infinity"),
        ("X-Run-Max-Steps", "1_0"),
        ("X-Run-Max-Steps", "+3"),
        ("X-Run-Max-Tokens", "99999999999999999999"),
        ("X-Run-Max-Tool-Calls", "1000000000000001"),
        ("X-Run-Timeout", "1e3"),
        ("X-Run-Timeout", "1_0"),
        ("X-Run-Timeout", "nan"),
        ("X-Run-Deadline", "1_700_000_000"),
    ],
)
async def test_caps_are_ascii_decimals(runcap, upstream, header: str, value: str) -> None:  # type: ignore[no-untyped-def]
    status, answer, _ = await send("POST", runcap.openai_url + "/chat/completions", CHAT, {header: value})
    assert status == 400, answer
    assert error_of(answer)["param"] == header
    assert upstream.hits() == 0


@pytest.mark.parametrize(
    ("header", "value"),
    [("X-Run-Max-Steps", "\u0663"), ("X-Run-Max-Steps", "\uff11"), ("X-Run-Max-Tokens", "\u00b2"),
     ("X-Run-Timeout", "\u0663"), ("X-Run-Max-Usd", "\u0663"), ("X-Run-Deadline", "\uff11" * 10)],
)  # fmt: skip
async def test_non_ascii_digits_are_a_400(runcap, upstream, header: str, value: str) -> None:  # type: ignore[no-untyped-def]
    """Sent as raw UTF-8 bytes (as a client that does not check would): `\\d` read them as digits."""
    port = int(runcap.url.rsplit(":", 1)[1])
    body = json.dumps(CHAT).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{header}: {value}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status = int(answer.split(b" ", 2)[1])
    assert status == 400, answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["param"] == header
    assert upstream.hits() == 0


@pytest.mark.parametrize(
    "header", ["X-Run-Max-Usd", "X-Run-Id", "X-Run-Max-Steps", "X-Run-Task", "Idempotency-Key"]
)
async def test_a_repeated_run_header_is_a_400_naming_it(runcap, upstream, header: str) -> None:  # type: ignore[no-untyped-def]
    values = {"X-Run-Max-Usd": ("5.00", "0.01"), "X-Run-Id": ("a", "b"), "X-Run-Max-Steps": ("9", "1"),
              "X-Run-Task": ("t", "u"), "Idempotency-Key": ("k1", "k2")}[header]  # fmt: skip
    headers = CIMultiDict([(header, values[0]), (header, values[1])])
    status, answer, _ = await send("POST", runcap.openai_url + "/chat/completions", CHAT, headers)
    assert status == 400, answer
    err = error_of(answer)
    assert err["param"] == header and "2 times" in err["message"]
    # also in the path form: the path's id and a header copy (or two) must not be merged silently
    status, answer, _ = await send(
        "POST",
        runcap.url + "/r/pathrun/v1/chat/completions",
        CHAT,
        CIMultiDict([("X-Run-Id", "pathrun")] * 2),
    )
    assert status == 400 and error_of(answer)["param"] == "X-Run-Id"
    assert upstream.hits() == 0


@pytest.mark.parametrize(
    ("header", "closest"),
    [("X-Run-Max-Dollars", "X-Run-Max-Usd"), ("X-Run-Max-Step", "X-Run-Max-Steps"),
     ("X-Run-Deadlines", "X-Run-Deadline"), ("x-run-max-toolcalls", "X-Run-Max-Tool-Calls")],
)  # fmt: skip
async def test_unknown_run_header_is_a_400_naming_the_closest(
    runcap, upstream, header: str, closest: str
) -> None:  # type: ignore[no-untyped-def]
    status, answer, _ = await send("POST", runcap.openai_url + "/chat/completions", CHAT, {header: "0.01"})
    assert status == 400, answer
    err = error_of(answer)
    assert err["param"].lower() == header.lower()
    assert f"did you mean {closest}?" in err["message"], err["message"]
    assert upstream.hits() == 0


async def test_unknown_run_header_is_refused_on_tools_and_mcp_too(runcap_factory) -> None:  # type: ignore[no-untyped-def]
    rc = await runcap_factory(
        {"tools": {"t": {"url": "http://127.0.0.1:9/t"}}, "mcp": {"crm": {"url": "http://127.0.0.1:9/mcp"}}}
    )
    for path in ("/tools/t", "/mcp/crm"):
        status, _, text = await send("POST", rc.url + path, {"a": 1}, {"X-Run-Max-Dollars": "1"})
        assert status == 400, (path, text)
        assert "X-Run-Max-Usd" in text


def test_every_header_runcap_reads_is_a_known_run_header() -> None:
    """The list unknown headers are checked against is the list of headers parse_run_headers
    and the steps read: each of them is accepted alone."""
    for name in RUN_HEADERS:
        value = {"X-Run-Id": "r", "X-Run-Deadline": str(int(time.time()) + 60), "X-Run-Timeout": "5",
                 "X-Run-Max-Usd": "1.5", "X-Run-Context-Policy": "offload"}.get(name, "7")  # fmt: skip
        parse_run_headers({name: value}, CapsConfig())
    with pytest.raises(InvalidRequest) as e:
        parse_run_headers({"X-Run-Nonsense": "1"}, CapsConfig())
    assert e.value.param == "X-Run-Nonsense"
