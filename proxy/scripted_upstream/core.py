"""The scripted upstream's server: scripts, request recording, step picking, and the routing of
each request to the wire format that speaks it (`FORMATS`, one file each). See the package
docstring for what it plays.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

import orjson
from aiohttp import web

from proxy.scripted_upstream.anthropic_messages import AnthropicMessages
from proxy.scripted_upstream.openai_basic import OpenAIBasic
from proxy.scripted_upstream.openai_chat import OpenAIChat
from proxy.scripted_upstream.openai_common import openai_error_body
from proxy.scripted_upstream.openai_responses import OpenAIResponses
from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.script import (
    DEFAULT_SCRIPT,
    DEFAULT_STEP,
    SCRIPT_HEADER,
    Script,
    Step,
    load_scripts,
    parse_scripts,
    with_fetches,
)
from proxy.scripted_upstream.tokens import BYTES_4, InputTokenizer
from proxy.scripted_upstream.wire import JSON, BadRequest
from proxy.scripted_upstream.wire_format import WireFormat


class ScriptedUpstream:
    """A fake OpenAI/Anthropic upstream that plays scripts. See the package docstring.

    Typical async fixture::

        upstream = ScriptedUpstream({"refund": [{"tool_calls": [...]}, {"text": "Done."}]})
        url = await upstream.start()
        yield upstream            # OpenAI base_url = f"{url}/v1"; Anthropic base_url = url
        await upstream.stop()

    `scripts` may be changed while running (`upstream.scripts["x"] = [{...}, ...]`; dict steps are
    validated when played). `record=False` turns off request recording (for long benchmarks).
    `chunk_chars` is the size of streamed text/argument pieces.
    """

    # The wire formats served, in the order their routes are added.
    FORMATS: tuple[type[WireFormat], ...] = (OpenAIChat, OpenAIResponses, OpenAIBasic, AnthropicMessages)

    def __init__(
        self,
        scripts: Mapping[str, Iterable[Step | Mapping[str, Any]]] | None = None,
        *,
        record: bool = True,
        chunk_chars: int = 16,
        tokenizer: InputTokenizer = BYTES_4,
    ) -> None:
        self.tokenizer = tokenizer  # may be changed while running
        self.scripts: dict[str, Script] = {DEFAULT_SCRIPT: [DEFAULT_STEP]}
        self.scripts.update(parse_scripts(scripts or {}))
        self.requests: list[RecordedRequest] = []
        self.record = record
        self.chunk_chars = max(1, chunk_chars)
        self.in_flight = 0
        self.max_in_flight = 0
        # Azure-style deployments (`/openai/deployments/{name}/chat/completions`): name -> the
        # model it serves, whatever the body says (an unknown name serves the body's model).
        self.deployments: dict[str, str] = {}
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._id_prefix = secrets.token_hex(6)
        self._seq = itertools.count(1)
        self.formats = [fmt(self) for fmt in self.FORMATS]

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0 = any free port); return the base URL `http://host:port`."""
        # A short shutdown timeout: stop() must not wait for stalled streams to play out.
        runner = web.AppRunner(
            make_app(self), handler_cancellation=True, access_log=None, shutdown_timeout=0.1
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        bound_host, bound_port = runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScriptedUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def clear(self) -> None:
        """Forget recorded requests (scripts are kept)."""
        self.requests.clear()
        self.max_in_flight = self.in_flight

    # ------------------------------------------------------------------ observability helpers

    def hits(self, path: str | None = None) -> int:
        """How many requests arrived (for `path` only, when given)."""
        if path is None:
            return len(self.requests)
        return sum(1 for r in self.requests if r.path == path)

    @property
    def last(self) -> RecordedRequest:
        return self.requests[-1]

    # ------------------------------------------------------------------ what the formats share

    def new_id(self, prefix: str) -> str:
        """A fresh provider-style id (`chatcmpl-…`, `msg_…`): unique per server, in order."""
        return f"{prefix}{self._id_prefix}{next(self._seq):010d}"

    def _step(self, script: str, index: int) -> Step:
        steps = self.scripts[script]
        if not steps:
            return DEFAULT_STEP
        index = min(index, len(steps) - 1)
        step = steps[index]
        if isinstance(step, Step):
            return step
        try:
            return Step.from_dict(step)
        except ValueError as e:
            raise BadRequest(f"{SCRIPT_HEADER}: script {script!r} step {index}: {e}") from None

    async def begin(self, request: web.Request) -> tuple[RecordedRequest, Any]:
        """Read, parse and record a request; refuse a body that is not a JSON object."""
        raw = await request.read()
        body: Any = None
        parse_error = False
        if raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parse_error = True
        rec = RecordedRequest(
            method=request.method,
            path=request.path,
            query=request.query_string,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=body,
            script=request.headers.get(SCRIPT_HEADER, DEFAULT_SCRIPT),
            raw=raw,
        )
        if self.record:
            self.requests.append(rec)
        if parse_error or (request.method == "POST" and not isinstance(body, dict)):
            raise BadRequest(
                "We could not parse the JSON body of your request. The body must be a JSON object."
            )
        return rec, body

    def pick_step(self, rec: RecordedRequest, turns: int) -> Step:
        """The step of `rec`'s script after `turns` assistant turns (the last one past the end)."""
        if rec.script not in self.scripts:
            raise BadRequest(
                f"{SCRIPT_HEADER}: unknown script {rec.script!r}; known: {sorted(self.scripts)}",
                SCRIPT_HEADER,
            )
        rec.step = turns
        return with_fetches(self._step(rec.script, turns), rec.body)

    async def track(self, rec: RecordedRequest, coro: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """Track in-flight requests and client disconnects around one handler body."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await coro
        except (TypeError, AttributeError, KeyError, ValueError) as e:
            # A field of a type the provider would refuse (`"instructions": 1`): a 400 as the
            # provider answers it, not a crash of the test upstream (a 500 runcap would relay).
            raise BadRequest(f"Invalid request body: {type(e).__name__}: {e}") from None
        except asyncio.CancelledError:
            # With handler cancellation on, a client that goes away cancels the handler.
            if not rec.dropped:
                rec.disconnected = True
            raise
        finally:
            self.in_flight -= 1

    # ------------------------------------------------------------------ fallbacks

    async def handle_not_found(self, request: web.Request) -> web.StreamResponse:
        if self.record:
            with contextlib.suppress(Exception):
                await self.begin(request)
            if self.requests:
                self.requests[-1].status = 404
                self.requests[-1].completed = True
        for fmt in self.formats:
            answer = fmt.not_found(request)
            if answer is not None:
                return answer
        body = openai_error_body(404, f"Invalid URL ({request.method} {request.path})", None)
        return web.Response(status=404, body=body, content_type=JSON)


def make_app(upstream: ScriptedUpstream) -> web.Application:
    """The aiohttp application serving `upstream` (routes only; no middleware on the hot path)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    for fmt in upstream.formats:
        app.router.add_routes(fmt.routes())
    app.router.add_route("*", "/{tail:.*}", upstream.handle_not_found)
    return app


def run(host: str = "127.0.0.1", port: int = 8000, script_path: str | None = None) -> None:
    """Serve until interrupted (`runcap mock-upstream --listen H:P --script FILE`).

    Requests are not recorded here: nothing in-process reads them, and a long benchmark would
    otherwise grow memory without bound.
    """
    scripts = load_scripts(script_path) if script_path else None
    upstream = ScriptedUpstream(scripts, record=False)

    async def serve() -> None:
        url = await upstream.start(host, port)
        print(f"scripted upstream listening on {url} (scripts: {', '.join(sorted(upstream.scripts))})")
        try:
            await asyncio.Event().wait()
        finally:
            await upstream.stop()

    try:
        import uvloop  # type: ignore[import-not-found]

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve())
