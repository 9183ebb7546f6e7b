"""The activities: all the I/O of the agent, each call through runcap.

* `call_model` — one chat completion through runcap's `/v1` with the official `openai` client.
* `call_tool` — one tool call through runcap's `/tools/{name}`, heartbeating while it waits, so a
  dead worker is noticed within the heartbeat timeout and a cancel reaches the call.
* `cancel_run` — `POST /runs/{id}/cancel`: runcap refuses the run's later calls and cuts the ones
  in flight (the tool sees its connection close).

Retries are Temporal's (the SDK's own retries are off: one retry layer, one count of attempts).
A refusal by runcap — cap used up, deadline passed, run cancelled, outcome unknown — is raised as
a non-retryable `ApplicationError` whose `type` is the `proxy.client` exception's name: retrying
the same call cannot succeed. Everything else (a worker killed mid-call, a 5xx, a reset) is
retried, and runcap makes the retry safe: the same tool call in the same run is the same
idempotency key, so a retry gets the recorded outcome (`X-Idempotent-Replay: true`) instead of a
second side effect, and every model call counts against the same run's caps.

A tool call a runcap rule holds for a person in `defer` mode (428 `approval_required`) is the one
refusal worth retrying: the activity fails *retryably* with `next_retry_delay` = runcap's
`Retry-After`, so the workflow parks on Temporal's retry timer (no worker slot held) until the
call is approved — then the retry executes it, once — or denied, when runcap's 403 is the tool's
answer the model reads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import aiohttp
import openai
from temporalio import activity
from temporalio.exceptions import ApplicationError

from proxy.client import RuncapRejection, RunHeaders, rejection_from_error, rejection_from_response

T = TypeVar("T")


@dataclass
class ModelRequest:
    run: RunHeaders
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    max_output_tokens: int | None = None
    # Extra request headers, e.g. X-Mock-Script to pick the scripted upstream's script.
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelTurn:
    message: dict[str, Any]  # the assistant message, as the next request sends it back
    finish_reason: str
    final_step: bool  # runcap enforced an answer-only step (X-Run-Final-Step)
    remaining_usd: str | None


@dataclass
class ToolRequest:
    run: RunHeaders
    name: str
    arguments: str  # the JSON text the model wrote
    call_id: str


@dataclass
class ToolResult:
    call_id: str
    status: int
    content: str
    replayed: bool  # runcap answered with the recorded outcome of an earlier attempt
    idempotency_key: str | None


def non_retryable(rejection: RuncapRejection) -> ApplicationError:
    return ApplicationError(
        str(rejection), rejection.as_details(), type=type(rejection).__name__, non_retryable=True
    )


def waiting_for_approval(tool: str, body: bytes, headers: dict[str, str]) -> ApplicationError:
    """runcap's 428 `approval_required`: retried after its `Retry-After` (see the module's doc)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        error = {}
    retry_after = headers.get("retry-after", "")
    delay = timedelta(seconds=int(retry_after)) if retry_after.isdigit() else timedelta(seconds=30)
    return ApplicationError(
        f"tool {tool!r} waits for a person's approval {error.get('approval_id')}: {error.get('message')}",
        {"approval_id": error.get("approval_id")},
        type="ApprovalRequired",
        next_retry_delay=delay,
    )


class AgentActivities:
    """Holds the connections to runcap; the worker registers its bound methods."""

    def __init__(
        self,
        runcap_url: str,
        *,
        api_key: str = "unused-by-the-scripted-model",
        admin_token: str | None = None,
        heartbeat_every_s: float = 0.5,
    ) -> None:
        base = runcap_url.rstrip("/")
        # max_retries=0: Temporal retries the activity; the client must not retry inside it.
        self.openai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=120)
        self.base = base
        self._http: aiohttp.ClientSession | None = None
        self.admin_headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.heartbeat_every_s = heartbeat_every_s

    @property
    def http(self) -> aiohttp.ClientSession:
        # Made on first use, inside the worker's event loop. No total timeout: runcap bounds every
        # call by the run's deadline, and the heartbeat timeout notices a dead worker.
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self._http

    async def aclose(self) -> None:
        await self.openai.close()
        if self._http is not None:
            await self._http.close()

    @activity.defn(name="call_model")
    async def call_model(self, req: ModelRequest) -> ModelTurn:
        kwargs: dict[str, Any] = {}
        if req.tools:
            kwargs["tools"] = req.tools
        if req.max_output_tokens is not None:
            kwargs["max_tokens"] = req.max_output_tokens
        try:
            raw = await self.openai.chat.completions.with_raw_response.create(
                model=req.model,
                messages=req.messages,  # type: ignore[arg-type]
                extra_headers={**req.run.as_dict(), **req.headers},
                **kwargs,
            )
        except openai.APIStatusError as e:
            rejection = rejection_from_error(e)
            if rejection is not None:
                raise non_retryable(rejection) from None
            raise  # the provider's own error: Temporal's retry policy decides
        completion = raw.parse()
        choice = completion.choices[0]
        message: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
        if choice.message.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in choice.message.tool_calls
            ]  # fmt: skip
        return ModelTurn(
            message=message,
            finish_reason=choice.finish_reason or "",
            final_step=raw.headers.get("x-run-final-step") == "true",
            remaining_usd=raw.headers.get("x-run-remaining-usd"),
        )

    @activity.defn(name="call_tool")
    async def call_tool(self, req: ToolRequest) -> ToolResult:
        headers = {**req.run.as_dict(), "Content-Type": "application/json"}
        status, response_headers, body = await self._heartbeating(
            self._post(f"/tools/{req.name}", req.arguments.encode(), headers)
        )
        if status == 428:
            raise waiting_for_approval(req.name, body, response_headers)
        rejection = rejection_from_response(status, body, response_headers)
        if rejection is not None:
            raise non_retryable(rejection)
        text = body.decode("utf-8", "replace")
        if status == 502 and "upstream_unavailable" in text:
            # The tool could not be reached (or reset the connection): worth a retry.
            raise ApplicationError(f"tool {req.name!r} unavailable: {text[:300]}", type="ToolUnavailable")
        # Any other answer, error statuses included, is the tool's outcome: the model reads it.
        return ToolResult(
            call_id=req.call_id,
            status=status,
            content=text,
            replayed=response_headers.get("x-idempotent-replay") == "true",
            idempotency_key=response_headers.get("idempotency-key"),
        )

    @activity.defn(name="cancel_run")
    async def cancel_run(self, run_id: str) -> dict[str, Any]:
        status, _, body = await self._post(f"/runs/{run_id}/cancel", b"", self.admin_headers)
        if status != 200:
            raise ApplicationError(f"runcap refused to cancel run {run_id}: {status} {body[:300]!r}")
        state = json.loads(body)
        return {"status": state.get("status"), "aborted_in_flight": state.get("aborted_in_flight")}

    async def _post(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        async with self.http.post(self.base + path, data=body, headers=headers) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()

    async def _heartbeating(self, call: Awaitable[T]) -> T:
        """Await `call`, heartbeating meanwhile. When the activity is cancelled, the call is cut,
        which closes the connection to runcap."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.heartbeat_every_s)
                if done:
                    return task.result()
                activity.heartbeat()
        finally:
            if not task.done():
                task.cancel()
