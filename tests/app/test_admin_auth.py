"""One auth table for every admin route (DESIGN.md "Trust model"), generated from the app's router.

Every route the app registers is either a proxy/probe route named in `PUBLIC` below or an admin
route — so a route added later is in the table the day it is added, and fails here if it forgot
the guard. Each admin route is sent six wrong `Authorization` values; each is a 401 in runcap's
error shape, and the ledger is unchanged afterwards: the run is not cancelled, its caps not
raised, the unknown side effect not marked `not_done` (which would let it run twice). The right
token, last, gets past the guard on every route (so the table's requests were ones the route acts
on, not ones it refused for another reason).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from proxy.caps import RunCaps
from proxy.errors import Unauthorized
from proxy.ledger.base import UNKNOWN, Settlement, StepRequest, ToolCallRequest
from proxy.server.auth import (
    ADMIN_TOKEN_FILE,
    CLIENT_TOKEN_HEADER,
    AdminGuard,
    ClientAuth,
    cli_admin_token,
    ensure_admin_token,
    read_admin_token,
)

# Routes any loopback client may call: the proxy routes (the agent's) and the probes.
PUBLIC = frozenset(
    {
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/{tail}",
        "/openai/{tail}",
        "/anthropic/{tail}",
        "/u/{name}/{tail}",
        "/r/{run_id}/{tail}",
        "/tools/{name}",
        "/tools/{name}/{tail}",
        "/mcp/{name}",
    }
)
RUN = "victim"
KEY = "unknown-refund"
# What a route would do with the request if its guard let it through (a route not listed gets `{}`).
BODIES: dict[str, dict[str, Any]] = {
    "/runs/{run_id}/caps": {"max_usd": "1000", "max_steps": 1000, "by": "the agent"},
    "/admin/idempotency/{key}/resolve": {"run_id": RUN, "outcome": "not_done"},
    "/admin/sql": {"sql": "SELECT 1"},
    "/approvals/{approval_id}": {"decision": "approve", "by": "the agent"},
}
PATH_PARAMS = {"run_id": RUN, "key": KEY, "approval_id": "0" * 32}


def wrong_authorizations(token: str) -> dict[str, dict[str, str]]:
    """The six ways to not be the admin (header sets, by name)."""
    right = f"Bearer {token}"
    return {
        "no header": {},
        "wrong token": {"Authorization": "Bearer " + "x" * len(token)},
        "right prefix, wrong suffix": {"Authorization": right[:-1] + ("A" if right[-1] != "A" else "B")},
        "token plus extra characters": {"Authorization": right + "x"},
        "bare Bearer": {"Authorization": "Bearer"},
        "another scheme": {"Authorization": f"Basic {token}"},
    }


def admin_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path template) of every route of `app` that is not in `PUBLIC`."""
    routes = set()
    for route in app.router.routes():
        template = route.resource.canonical if route.resource is not None else ""
        if template not in PUBLIC:
            routes.add((route.method, template))
    return sorted(routes)


def concrete(template: str) -> str:
    path = template
    for name, value in PATH_PARAMS.items():
        path = path.replace("{" + name + "}", value)
    assert "{" not in path, f"{template}: add its path parameter to PATH_PARAMS"
    return path


async def ledger_view(ledger: Any) -> tuple[Any, ...]:
    run = await ledger.get_run(RUN)
    records = await ledger.list_tool_calls(run_id=RUN)
    return (
        run.status, run.cancelled, run.caps, run.steps, run.spent_usd_nanos, run.reserved_usd_nanos,
        sorted((r.key, r.state, r.status) for r in records),
    )  # fmt: skip


async def test_every_admin_route_refuses_every_wrong_authorization(runcap) -> None:  # type: ignore[no-untyped-def]
    ledger = runcap.ledger
    now = time.time()
    caps = RunCaps(max_usd_nanos=10**9, max_steps=5)
    step = StepRequest(
        run_id=RUN, task="t", caps=caps, now=now, model="gpt-4o-mini", input_tokens_bound=10,
        client_output_limit=10, model_output_bound=100, min_output_tokens=1,
        input_usd_per_mtok=None, output_usd_per_mtok=None, allow_unpriced=True,
    )  # fmt: skip
    await ledger.settle(await ledger.begin_step(step), Settlement(), now)
    await ledger.begin_tool_call(ToolCallRequest(RUN, "t", caps, now, "refund", KEY, "ah", method="POST"))
    await ledger.mark_unknown(RUN, KEY, now, "cut by a kill")
    before = await ledger_view(ledger)
    assert before[-1] == [(KEY, UNKNOWN, None)]

    routes = admin_routes(runcap.runner.app)
    templates = {template for _, template in routes}
    # The routes DESIGN.md names as admin are all found (the generator sees the real router).
    assert {
        "/runs/{run_id}", "/runs/{run_id}/cancel", "/runs/{run_id}/caps", "/admin/sql",
        "/admin/idempotency", "/admin/idempotency/{key}/resolve",
    } <= templates, templates  # fmt: skip

    token = runcap.runtime.config.admin_token
    assert token and len(token) > 16  # a prefix check would pass "right prefix, wrong suffix"
    failures = []
    async with aiohttp.ClientSession() as s:
        for method, template in routes:
            body = orjson.dumps(BODIES.get(template, {}))
            for label, headers in wrong_authorizations(token).items():
                async with s.request(
                    method, runcap.url + concrete(template), data=body,
                    headers={**headers, "Content-Type": "application/json"},
                ) as r:  # fmt: skip
                    text = await r.text()
                    if r.status != 401:
                        failures.append(f"{method} {template} with {label}: {r.status} {text[:200]}")
                    elif method != "HEAD":
                        err = orjson.loads(text)["error"]
                        if err["type"] != "unauthorized" or "Authorization: Bearer" not in err["message"]:
                            failures.append(f"{method} {template} with {label}: {err}")
        assert not failures, "\n".join(failures)
        assert await ledger_view(ledger) == before

        # The right token gets past the guard on every route (last: these calls act).
        for method, template in routes:
            async with s.request(
                method, runcap.url + concrete(template), data=orjson.dumps(BODIES.get(template, {})),
                headers={**runcap.admin, "Content-Type": "application/json"},
            ) as r:  # fmt: skip
                assert r.status != 401, (method, template, await r.text())
    after = await ledger_view(ledger)
    assert after[1] is True and after[-1] == []  # cancelled, and the unknown record resolved


# -- the parts of proxy/server/auth.py on their own (what the mutation run of issue 28 asked for) --

ADMIN_401 = (
    "admin endpoint: send Authorization: Bearer <admin token> (RUNCAP_ADMIN_TOKEN, or the "
    "token runcap generated in its data directory's admin.token)"
)


def request_with(headers: dict[str, str]) -> web.Request:
    return make_mocked_request("GET", "/runs/r", headers=headers)


def test_the_guard_says_where_the_token_is_and_needs_one() -> None:
    guard = AdminGuard("s3cret-token-0123456789")
    guard.check(request_with({"Authorization": "Bearer s3cret-token-0123456789"}))
    with pytest.raises(Unauthorized) as e:
        guard.check(request_with({}))
    assert e.value.message == ADMIN_401 and e.value.status == 401
    with pytest.raises(ValueError, match=r"^AdminGuard needs a token$"):
        AdminGuard("")


def test_client_tokens_name_their_header_and_say_when_the_token_is_unknown() -> None:
    auth = ClientAuth({"acme-token-0123456789": "acme"})
    assert auth.enabled and not ClientAuth({}).enabled
    assert ClientAuth({}).tenant(request_with({})) is None
    assert auth.tenant(request_with({CLIENT_TOKEN_HEADER: "acme-token-0123456789"})) == "acme"
    shared = (
        f"{CLIENT_TOKEN_HEADER}: this runcap is shared ([auth] client_tokens); send your client token "
        "in this header"
    )
    for headers, message in (
        ({}, shared),
        ({CLIENT_TOKEN_HEADER: "acme-token-012345678"}, shared + " — the one sent is not known"),
    ):
        with pytest.raises(Unauthorized) as e:
            auth.tenant(request_with(headers))
        assert (e.value.message, e.value.param) == (message, CLIENT_TOKEN_HEADER)


def test_the_cli_token_is_the_environments_then_the_configured_then_the_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    generated = ensure_admin_token(tmp_path)
    monkeypatch.setenv("RUNCAP_ADMIN_TOKEN", "from-env")
    assert cli_admin_token("configured", tmp_path) == "from-env"
    monkeypatch.delenv("RUNCAP_ADMIN_TOKEN")
    assert cli_admin_token("configured", tmp_path) == "configured"
    assert cli_admin_token(None, tmp_path) == generated
    assert cli_admin_token(None, tmp_path / "elsewhere") is None


def test_the_generated_token_is_256_bits_kept_0600_and_reused(tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b"  # parents are created
    token = ensure_admin_token(nested)
    assert len(token) == 43 and read_admin_token(nested) == token  # token_urlsafe(32): 256 bits
    assert (nested / ADMIN_TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    assert ensure_admin_token(nested) == token
    existing = tmp_path / "existing"  # a data directory that exists, without a token yet
    existing.mkdir()
    assert len(ensure_admin_token(existing)) == 43
