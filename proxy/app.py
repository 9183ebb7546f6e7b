"""Wiring: build the aiohttp application from a `Config`, and serve it (one or N processes).

Routes (DESIGN.md): `/v1/...` (OpenAI; `/v1/messages...` Anthropic), `/openai/...`,
`/anthropic/...`, `/u/{name}/...`, plus the operational routes in `ops.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy.config import Config, ConfigError
from proxy.errors import InvalidRequest, LedgerUnavailable, NotFound
from proxy.ledger.base import Ledger
from proxy.ledger.guarded import GuardedLedger, guarded
from proxy.ledger.sqlite import SQLiteLedger
from proxy.mcp.gateway import MCPGateway
from proxy.pricing import PriceBook
from proxy.server.auth import AdminGuard, ClientAuth, ensure_admin_token
from proxy.server.cancel import CancelPropagation
from proxy.server.connections import ConnectionGuard
from proxy.server.connections import run_app as run_guarded
from proxy.server.data_dir import make_private
from proxy.server.flow import Flights, Flow, Pipeline
from proxy.server.forward import Forwarder
from proxy.server.inner import InnerCalls
from proxy.server.local_trust import LocalTrust
from proxy.server.metrics import OVERFLOW_LABEL, Metrics, MetricsStep
from proxy.server.ops import OpsRoutes
from proxy.server.outbound import OutboundClient
from proxy.server.reconcile import IdempotencyAdmin
from proxy.server.run_path import run_path_request
from proxy.server.steps.accesslog import AccessLogStep, write_lines_directly
from proxy.server.steps.budget import BudgetStep, pricing_provider
from proxy.server.steps.context import ContextStep
from proxy.server.steps.tenant_objects import TenantObjects
from proxy.server.steps.trace import TraceStep
from proxy.server.topup import RunCapsAdmin
from proxy.server.worker_metrics import WorkerSiblings
from proxy.spans.recorder import SpanRecorder
from proxy.spans.setup import SpanSystem, open_span_system
from proxy.spans.supervisor import ShipperSupervisor, die_with_parent
from proxy.toolcall.approval_routes import ApprovalRoutes
from proxy.toolcall.approvals import ApprovalDesk
from proxy.toolcall.route import ToolClient
from proxy.tools.gateway import ToolGateway
from proxy.upstream_url import UnsafePath, decode_segment, remaining_segments

log = logging.getLogger("runcap.server")


@dataclass
class Runtime:
    """What one runcap process owns; reachable from the app as `app[RUNTIME]`."""

    config: Config
    ledger: Ledger
    prices: PriceBook
    metrics: Metrics
    flights: Flights
    spans: SpanSystem
    forwarder: Forwarder | None = None
    client: OutboundClient | None = None  # to the model upstreams
    approvals: ApprovalDesk | None = None  # tool calls held for a person (toolcall/approvals.py)

    @property
    def recorder(self) -> SpanRecorder:
        return self.spans.recorder


RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)


def open_ledger(config: Config) -> GuardedLedger:
    """The configured backend, guarded: each operation bounded by `ledger_timeout_s`, and an
    unavailable backend a 503 `ledger_unavailable` (proxy/ledger/guarded.py)."""
    backend: Ledger
    settings = config.ledger
    if settings.redis_url:
        from proxy.ledger.redis import RedisLedger

        backend = RedisLedger(
            settings.redis_url,
            retention_s=settings.ledger_retention_s,
            heartbeat_s=settings.redis_heartbeat_s,
            heartbeat_ttl_s=settings.redis_heartbeat_ttl_s,
            op_timeout_s=settings.ledger_timeout_s,
            cluster=settings.redis_cluster,
            wait_replicas=settings.redis_wait_replicas,
        )
    else:
        backend = SQLiteLedger(
            config.data_dir / "ledger.sqlite3",
            retention_s=settings.ledger_retention_s,
            busy_timeout_s=settings.ledger_timeout_s,
        )
    return GuardedLedger(backend, timeout_s=settings.ledger_timeout_s)


def build_app(
    config: Config, ledger: Ledger | None = None, span_options: dict[str, Any] | None = None
) -> web.Application:
    """`span_options` tune the span path (proxy/spans/setup.py): by default the shipper runs in
    this process on threads of its own (tests flush faster with `flush_interval_s`); `runcap serve`
    passes `shipper="external"` and runs it as a supervised process."""
    make_private(config.data_dir)  # 0700, and a umask of 0077 for everything created in it
    if not config.admin_token:
        # Admin routes always need a token: without a configured one, generate and keep one.
        config = config.with_overrides(admin_token=ensure_admin_token(config.data_dir))
    assert config.admin_token is not None
    ledger = guarded(ledger, config.ledger.ledger_timeout_s) if ledger is not None else open_ledger(config)
    prices = PriceBook(dict(config.prices))
    metrics = Metrics(
        model_label=_catalog_label(prices) if config.metrics.model_labels == "catalog" else None
    )
    spans = open_span_system(config.spans, config.data_dir, **(span_options or {}))
    metrics.watch_spans(spans)
    rt = Runtime(config, ledger, prices, metrics, Flights(), spans)
    app = web.Application(
        client_max_size=config.max_body_bytes,
        handler_args={"max_field_size": 65536},
        # Host / Origin against DNS rebinding, before any route (server/local_trust.py)
        middlewares=[LocalTrust(config.local, config.listen_host).middleware, json_not_found],
    )
    app[RUNTIME] = rt

    guard = AdminGuard(config.admin_token)
    clients = ClientAuth(config.client_tokens, config.tenant_upstream_keys, config.approver_tokens)
    metrics_guard = (
        AdminGuard(
            config.admin_token, config.metrics.token or "", what="GET /metrics ([metrics] require_token)"
        )
        if config.metrics.require_token
        else None
    )
    # Tool calls a rule holds for a person, and GET/POST /approvals (toolcall/approval_routes.py).
    rt.approvals = ApprovalDesk(
        ledger, config.approvals, rt.recorder, tenants=clients.enabled, metrics=metrics
    )
    OpsRoutes(
        ledger, metrics, rt.flights, guard, spans.client, rt.recorder, metrics_guard,
        on_cancel=rt.approvals.run_cancelled,  # a cancel denies the run's pending approvals
    ).add_to(app)  # fmt: skip
    ApprovalRoutes(
        rt.approvals, guard, clients, data_dir=config.data_dir, s3_url=config.spans.s3_url
    ).add_to(app)
    # /tools/{name}, the reconcile admin routes, and cancels made on other processes/replicas.
    tool_client = ToolClient()
    # Where a tool call a rule sends to a person waits (toolcall/approvals.py, the ledger's approvals).
    gate = rt.approvals
    tools = ToolGateway(config, ledger, rt.flights, metrics, tool_client, rt.recorder, clients, gate)
    tools.add_to(app)
    # /mcp/{name}
    MCPGateway(config, ledger, rt.flights, metrics, tool_client, rt.recorder, clients, gate).add_to(app)
    tool_client.add_to(app)  # after the gateways: closed after their clean-up
    IdempotencyAdmin(ledger, guard).add_to(app)
    RunCapsAdmin(ledger, guard, config.caps, rt.recorder).add_to(app)
    CancelPropagation(ledger, rt.flights).add_to(app)
    upstreams = config.upstreams

    def known() -> str:
        return ", ".join(sorted(upstreams))

    # Each route names how many leading path segments are its own (`u`, `{name}`...); the rest of
    # the path, as received, is what the upstream gets after its base path.
    async def openai_v1(request: web.Request) -> web.StreamResponse:
        return await _fwd(request, None, 0)

    async def prefixed(request: web.Request) -> web.StreamResponse:
        return await _fwd(request, request.path.split("/", 2)[1], 1)

    async def named(request: web.Request) -> web.StreamResponse:
        return await _fwd(request, request.match_info["name"], 2)

    async def run_in_path(request: web.Request) -> web.StreamResponse:
        """`/r/{run_id}[/t/{task}]/<route>` is `<route>` with the run (and task) as headers, for
        agents that can set a base URL but no headers."""
        try:
            inner = run_path_request(request)
        except InvalidRequest as rej:
            metrics.rejections.labels(rej.code or rej.type).inc()
            return rej.response("openai")
        match = await app.router.resolve(inner)
        match.add_app(app)
        match.freeze()
        inner._match_info = match  # what aiohttp's own dispatch does (web_app._handle)
        if match.http_exception is not None:
            raise match.http_exception
        return await match.handler(inner)

    async def _fwd(request: web.Request, name: str | None, consumed: int) -> web.StreamResponse:
        try:
            segments, query = remaining_segments(request.raw_path, consumed)
        except UnsafePath as rej:
            metrics.rejections.labels("unsafe_path").inc()
            return rej.response("anthropic" if name == "anthropic" else "openai")
        if name is None:  # /v1/...: Anthropic's messages, else OpenAI (decided on the checked path)
            messages = len(segments) > 1 and decode_segment(segments[1]) == "messages"
            name = "anthropic" if messages else "openai"
        upstream = upstreams.get(name)
        if upstream is None:
            return NotFound(
                f"no upstream named {name!r}; configured upstreams: {known()} "
                f"(add [upstreams.{name}] to runcap.toml)",
                param="upstream",
            ).response("openai")
        assert rt.forwarder is not None
        return await rt.forwarder.handle(request, upstream, upstream.base.target(segments, query), clients)

    app.router.add_route("*", "/v1/{tail:.*}", openai_v1)
    app.router.add_route("*", "/openai/{tail:.*}", prefixed)
    app.router.add_route("*", "/anthropic/{tail:.*}", prefixed)
    app.router.add_route("*", "/u/{name}/{tail:.*}", named)
    app.router.add_route("*", "/r/{run_id}/{tail:.*}", run_in_path)

    async def on_startup(app: web.Application) -> None:
        rt.client = OutboundClient(keepalive_timeout_s=60, connect_timeout_s=30, dns_cache_s=300)
        await rt.client.start()
        budget = BudgetStep(config, ledger, rt.prices, metrics)
        # The context step first: a policy's rewrite and the context cap come before any reservation.
        # runcap's own calls within a run: fetch continuations, summaries.
        inner = InnerCalls(rt.client, config.max_answer_bytes)
        context = ContextStep(config.context, config.caps, budget.history, metrics, inner)
        # Tenants sharing a provider key see only their own provider objects; first, so a refused
        # read reserves and counts nothing.
        steps = Pipeline([TenantObjects(ledger), context, budget, MetricsStep(metrics)])
        if config.spans.tracing:
            # A call the model requests that a tool's rules would deny is on its tool_call span.
            judge = tools.policy.judge_requested if tools.policy.policies else None
            steps.append(TraceStep(spans.recorder, judge))
        if config.log_requests:
            steps.append(AccessLogStep())
        rt.forwarder = Forwarder(config, rt.client, steps, rt.flights, metrics)
        await ledger.recover()
        metrics.watch_ledger(ledger)
        ledger.start()  # writes the ledger could not take (settlements...) are retried from now on
        spans.start()
        app[_RECOVERY] = asyncio.create_task(_recovery_loop(ledger, config.ledger.ledger_sweep_interval_s))

    async def on_cleanup(app: web.Application) -> None:
        app[_RECOVERY].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await app[_RECOVERY]
        if rt.client is not None:
            await rt.client.close()
        # The WAL fsync'd (and an in-process shipper drained) before exiting.
        await spans.aclose()
        await ledger.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _catalog_label(prices: PriceBook) -> Callable[[Flow, str], str]:
    """Metric labels without what only a tenant knows: a model counted under its public catalog
    name, any other (a fine-tune, a private deployment's name) under "other"."""

    def label(flow: Flow, model: str) -> str:
        return prices.catalog_name(pricing_provider(flow), model) or OVERFLOW_LABEL

    return label


_RECOVERY: web.AppKey[asyncio.Task[None]] = web.AppKey("recovery", asyncio.Task)


async def _recovery_loop(ledger: Ledger, interval_s: float) -> None:
    """Settle reservations of sibling workers (replicas) that died while this process lives on."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await ledger.recover()
        except LedgerUnavailable as e:
            log.warning("ledger sweep skipped: %s", e.message)  # the next one tries again
        except Exception:
            log.exception("ledger recovery failed")


# -- serving -----------------------------------------------------------------------------------


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


# What a request to no route is told, in runcap's error shape (aiohttp's own is plain text).
_ROUTES_HINT = (
    "runcap serves /v1/... and /openai/... (OpenAI), /anthropic/... (Anthropic), /u/{upstream}/..., "
    "/tools/{name}, /mcp/{name}, /r/{run_id}/..., /runs/{id}, /healthz, /readyz, /metrics, /admin/sql"
)


@web.middleware
async def json_not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown route (or `/`) is a JSON 404 that says which routes there are."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return NotFound(f"no route {request.path[:200]!r}; {_ROUTES_HINT}", param="path").response("openai")


def serve(config: Config) -> None:
    """Serve until SIGINT/SIGTERM, in `config.workers` processes sharing the port; with tracing,
    a supervised shipper process drains their write-ahead log into the stores."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_private(config.data_dir)  # before the shipper starts: it inherits the umask
    if not config.admin_token:  # checked (and generated) once, before any worker starts
        config = config.with_overrides(admin_token=ensure_admin_token(config.data_dir))
    shipper = _start_shipper(config)
    try:
        _serve_workers(config)
    finally:
        if shipper is not None:
            shipper.stop()  # the workers have stopped appending: drain, then stop


def _start_shipper(config: Config) -> ShipperSupervisor | None:
    if not config.spans.tracing:
        return None
    if not config.spans.clickhouse_url and importlib.util.find_spec("chdb") is None:
        raise ConfigError(
            "tracing: the embedded span store needs chdb: install the runcap[embedded] extra "
            "(pip install 'runcap[embedded]'), set RUNCAP_CLICKHOUSE_URL to a ClickHouse server, "
            "or set tracing = false"
        )
    supervisor = ShipperSupervisor(config.spans, config.data_dir)
    supervisor.start()
    return supervisor


def _serve_workers(config: Config) -> None:
    if config.workers == 1:
        _serve_one(config, reuse_port=False, worker=None)
        return
    procs = [
        multiprocessing.get_context("spawn").Process(
            target=_serve_one, args=(config, True, i, os.getpid()), daemon=False
        )
        for i in range(config.workers)
    ]
    for p in procs:
        p.start()

    def stop(signum: int, _frame: object) -> None:
        for p in procs:
            if p.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for p in procs:
        p.join()


def _serve_one(config: Config, reuse_port: bool, worker: int | None, parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        # A worker drains and exits when `serve` dies, even by `kill -9`: no orphan keeps the port.
        die_with_parent(parent_pid, signal.SIGTERM)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _install_uvloop()
    # Each worker appends to WAL segments of its own; the shipper `serve` supervises ships them.
    app = build_app(config, span_options={"shipper": "external"})
    if worker is not None:  # a scrape reaching any worker answers for all of them
        WorkerSiblings(app[RUNTIME].metrics, config.data_dir, worker, config.workers).add_to(app)
    # The request path allocates many short-lived objects; the heap also holds large long-lived
    # tables (prices). Freeze what start-up built so collections never rescan it, and
    # collect the young generation less often: ~4% of a request's CPU went to the collector.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    sock = socket.socket(socket.AF_INET6 if ":" in config.listen_host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.listen_host, config.listen_port))
    log.info(
        '{"event": "listening", "listen": "%s", "pid": %d, "data_dir": "%s", "ledger": "%s"}',
        config.listen, os.getpid(), config.data_dir, app[RUNTIME].ledger.name,
    )  # fmt: skip
    # Header and body deadlines, idle keep-alive, connections per client (server/connections.py).
    guard = ConnectionGuard(config.connections)
    app[RUNTIME].metrics.watch_connections(guard)

    async def draining(app: web.Application) -> None:
        # A SIGTERM or Ctrl-C: the one line that says shutdown began (the shipper's "shipper
        # drained" line says when it is done, and what is left in the WAL).
        rt = app[RUNTIME]
        log.info(
            '{"event": "draining", "pid": %d, "in_flight_runs": %d, "then": "%s"}',
            os.getpid(), len(rt.flights.run_ids()),
            "the span shipper drains the WAL" if config.spans.tracing else "exit",
        )  # fmt: skip

    app.on_shutdown.append(draining)
    access_log = write_lines_directly() if config.log_requests else None
    if access_log is not None:  # the lines of the last loop turn, before the "stopped" lines

        async def flush_access_log(app: web.Application) -> None:
            access_log.flush()

        app.on_cleanup.append(flush_access_log)
    run_guarded(
        app, sock, guard, keepalive_timeout_s=config.connections.keepalive_timeout_s, shutdown_timeout_s=10
    )
