"""The shape of one wire format the scripted upstream speaks (OpenAI chat, Responses, the basic
OpenAI endpoints, Anthropic messages): its routes, how it refuses a request, and the serving of a
request around its handler. Adding a provider's wire format is one `WireFormat` subclass in its
own file, listed in `ScriptedUpstream.FORMATS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.scripted_upstream.answer import Answer, HostedUse, compose_answer
from proxy.scripted_upstream.recording import RecordedRequest
from proxy.scripted_upstream.script import Step
from proxy.scripted_upstream.wire import BadRequest

if TYPE_CHECKING:
    from proxy.scripted_upstream.core import ScriptedUpstream

# A format's answer to one parsed request (its recording and its JSON body).
Play = Callable[[web.Request, RecordedRequest, dict[str, Any]], Awaitable[web.StreamResponse]]

# Bounds the memory of Responses ids kept for `previous_response_id` (and of Anthropic threads)
# in long benchmarks.
MAX_REMEMBERED_RESPONSES = 100_000


class WireFormat(ABC):
    """One provider wire format, served by `upstream` (its scripts, ids, recording)."""

    call_prefix = "call_"  # of the ids this server gives the tool calls it answers with

    def __init__(self, upstream: ScriptedUpstream) -> None:
        self.upstream = upstream

    @abstractmethod
    def routes(self) -> list[web.RouteDef]:
        """The routes the format serves (`web.post(path, handler)`...)."""

    @abstractmethod
    def fail(self, rec: RecordedRequest | None, e: BadRequest) -> web.Response:
        """The provider's 400 for a refused request (`rec` is None when nothing was recorded)."""

    def not_found(self, request: web.Request) -> web.Response | None:
        """The format's 404 for an unknown path it owns (None: not one of its paths)."""
        return None

    async def serve(self, request: web.Request, play: Play) -> web.StreamResponse:
        """Read and record `request`, play it (tracked in flight), and refuse what `play` refuses."""
        rec: RecordedRequest | None = None
        try:
            rec, body = await self.upstream.begin(request)
            return await self.upstream.track(rec, play(request, rec, body))
        except BadRequest as e:
            return self.fail(rec, e)

    def answer(
        self,
        rec: RecordedRequest,
        step: Step,
        input_tokens: int,
        limit: int | None,
        tools_allowed: bool,
        *,
        hosted: tuple[HostedUse, ...] = (),
        audio: bool = False,
        input_audio: int = 0,
    ) -> Answer:
        """`compose_answer` with the tool calls named `{call_prefix}…` by this server."""
        return compose_answer(
            rec,
            step,
            input_tokens,
            limit,
            tools_allowed,
            lambda: self.upstream.new_id(self.call_prefix),
            hosted=hosted,
            audio=audio,
            input_audio=input_audio,
        )
