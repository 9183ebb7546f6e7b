"""A request without run headers: its own run, with a generated id of the documented shape,
unique across the workers `runcap serve --workers N` forks (each child draws its own sequence,
not a copy of its parent's), under exactly the caps the operator's defaults give any run."""

from __future__ import annotations

import os
import re

import pytest

from proxy.caps import parse_run_headers
from proxy.config import CapsConfig
from proxy.errors import InvalidRequest


def generated() -> str:
    run = parse_run_headers({}, CapsConfig())
    assert run.generated
    return run.run_id


def test_a_generated_run_id_has_its_shape_and_does_not_repeat() -> None:
    ids = [generated() for _ in range(10_000)]
    assert all(re.fullmatch(r"run_[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == len(ids)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_generates_other_ids_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write, " ".join(generated() for _ in range(100)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = set(f.read().split())
    os.waitpid(pid, 0)
    parent = {generated() for _ in range(100)}
    assert len(child) == 100 and not child & parent


@pytest.mark.parametrize(
    "config",
    [
        CapsConfig(),
        CapsConfig(default_max_usd_nanos=2 * 10**9, ceiling_max_usd_nanos=10**9, default_timeout_s=60.0,
                   ceiling_timeout_s=30.0, default_max_steps=5, default_max_depth=0, default_max_fan_out=3,
                   default_max_tree_steps=40, default_max_repeats=2, default_max_context_tokens=1000),
    ],
)  # fmt: skip
def test_no_run_headers_get_the_defaults_a_named_run_gets(config: CapsConfig) -> None:
    plain = parse_run_headers({"Content-Type": "application/json"}, config)
    named = parse_run_headers({"X-Run-Id": "r"}, config)
    assert plain.caps == named.caps and plain.generated and not named.generated
    again = parse_run_headers({}, config)
    assert again.caps == plain.caps and again.run_id != plain.run_id
    assert parse_run_headers({}, config, tenant="acme").run_id.startswith("acme:run_")
    with pytest.raises(InvalidRequest) as e:
        parse_run_headers({}, config, require_run_id=True)
    assert e.value.param == "X-Run-Id"
