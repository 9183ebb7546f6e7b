"""`runcap serve` writes the access log itself (server/steps/accesslog.py, issue 24): the lines of
one event-loop turn in one write, the same text logging's `%(message)s` handler would have
written; and only where logging would have done nothing else with them."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
from collections.abc import Iterator

import pytest

from proxy.server.steps import accesslog
from proxy.server.steps.accesslog import AccessLogWriter, log_tool_call, write_lines_directly


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


@pytest.fixture
def plain_root() -> Iterator[logging.StreamHandler[io.TextIOWrapper]]:
    """A root handler as `runcap serve` installs it: `%(message)s` on stderr (see `only`)."""
    root = logging.getLogger()
    saved = (root.level, accesslog._writer)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.level, accesslog._writer = saved


@contextlib.contextmanager
def only(*handlers: logging.Handler) -> Iterator[None]:
    """`handlers` the root's only ones (pytest adds its capturing handlers around each test)."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers[:] = list(handlers)
    try:
        yield
    finally:
        root.handlers[:] = saved


async def test_the_lines_of_one_turn_are_one_write_in_order() -> None:
    stream = CountingStream()
    writer = AccessLogWriter(stream)
    for i in range(5):
        writer.write(f'{{"n":{i}}}')
    assert stream.writes == 0  # not before the turn ends
    await asyncio.sleep(0)
    assert stream.getvalue() == "".join(f'{{"n":{i}}}\n' for i in range(5))
    assert stream.writes == 1
    writer.write('{"n":5}')
    writer.flush()  # at shutdown: at once
    assert stream.getvalue().endswith('{"n":4}\n{"n":5}\n')


def test_without_a_loop_a_line_is_written_at_once() -> None:
    stream = CountingStream()
    AccessLogWriter(stream).write('{"a":1}')
    assert stream.getvalue() == '{"a":1}\n'


async def test_the_line_is_the_text_logging_would_have_written(
    plain_root: logging.StreamHandler[io.TextIOWrapper],
) -> None:
    fields = {
        "run_id": "r-1", "step": 2, "method": "POST", "path": "/tools/refund", "tool": "refund",
        "status": 200, "outcome": "ok", "duration_ms": 1.23456, "idempotency_key": "k",
        "error": "", "mcp_server": "crm",
    }  # fmt: skip
    via_logging = io.StringIO()
    plain_root.setStream(via_logging)  # type: ignore[arg-type]
    with only(plain_root):
        log_tool_call(**fields)  # type: ignore[arg-type]
    direct = io.StringIO()
    plain_root.setStream(sys.stderr)
    with only(plain_root):
        writer = write_lines_directly()
    assert writer is not None
    writer.stream = direct
    log_tool_call(**fields)  # type: ignore[arg-type]
    writer.flush()
    assert direct.getvalue() == via_logging.getvalue()
    assert via_logging.getvalue().startswith('{"run_id":"r-1","step":2,')


@pytest.mark.parametrize("change", ["own handler", "propagate off", "other format", "other stream", "level"])
def test_logging_stays_when_it_would_do_more_than_write_the_line(
    plain_root: logging.StreamHandler[io.TextIOWrapper], change: str
) -> None:
    access = logging.getLogger("runcap.access")
    saved = (access.handlers[:], access.propagate, access.level)
    try:
        if change == "own handler":
            access.addHandler(logging.NullHandler())
        elif change == "propagate off":
            access.propagate = False
        elif change == "other format":
            plain_root.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        elif change == "other stream":
            plain_root.setStream(io.StringIO())  # type: ignore[arg-type]
        else:
            access.setLevel(logging.WARNING)
        with only(plain_root):
            assert write_lines_directly() is None
        assert accesslog._writer is None
    finally:
        access.handlers[:], access.propagate, level = saved
        access.setLevel(level)


def test_the_plain_configuration_writes_directly(plain_root: logging.StreamHandler[io.TextIOWrapper]) -> None:
    with only(plain_root):
        assert write_lines_directly() is not None
    with only(plain_root, logging.NullHandler()):  # a second handler on the root: logging
        assert write_lines_directly() is None
