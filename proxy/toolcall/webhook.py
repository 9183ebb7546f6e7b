"""`approval_webhook_url` (`[approvals]`): each new pending approval announced to a URL the
operator chose — a chat bot, a ticket queue — so a person learns that a call waits for them.

`POST {"id", "run_id", "tool", "args_hash", "rule", "rule_reason", "tenant", "requested_at",
"expires_at"}` (JSON). Never on the request path: the announcement runs in a task of its own, each
attempt bounded by `approval_webhook_timeout_s`, 3 attempts (0.5 s, then 2 s apart) until a 2xx;
a failure is logged (`approval_webhook_failed`) and counted (`failures`), and the call waits on
regardless — the approval is in the ledger and in `runcap approvals` whatever the webhook does.
The arguments are not sent: only their hash (the payload store has them, for who may read it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from proxy.ledger.base import Approval

log = logging.getLogger("runcap.approvals")

ATTEMPTS = 3
PAUSES_S = (0.5, 2.0)


class ApprovalWebhook:
    def __init__(
        self, url: str | None, timeout_s: float, on_failure: Callable[[], None] | None = None
    ) -> None:
        self.url = url
        self.on_failure = on_failure  # counts it (runcap_approval_webhook_failures_total)
        self.timeout_s = timeout_s
        self.failures = 0  # announcements that reached nobody after every attempt
        self.sent = 0
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def announce(self, approval: Approval) -> None:
        if self.url is None:
            return
        task = asyncio.get_running_loop().create_task(self._send(approval))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, approval: Approval) -> None:
        assert self.url is not None
        if self._session is None:
            # No cookies and no redirects: the announcement goes to the configured URL only.
            self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        body = {
            "id": approval.id, "run_id": approval.run_id, "tool": approval.tool,
            "args_hash": approval.args_hash, "rule": approval.rule, "rule_reason": approval.rule_reason,
            "tenant": approval.tenant, "requested_at": approval.requested_at,
            "expires_at": approval.expires_at,
        }  # fmt: skip
        error = ""
        for attempt in range(ATTEMPTS):
            try:
                async with self._session.post(
                    self.url, json=body, allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                ) as answer:  # fmt: skip
                    if 200 <= answer.status < 300:
                        self.sent += 1
                        return
                    error = f"HTTP {answer.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                error = f"{type(e).__name__}: {e}"
            if attempt < len(PAUSES_S):
                await asyncio.sleep(PAUSES_S[attempt])
        self.failures += 1
        if self.on_failure is not None:
            self.on_failure()
        log.warning(
            '{"event": "approval_webhook_failed", "approval_id": "%s", "run_id": "%s", "attempts": %d, '
            '"error": "%s"}', approval.id, approval.run_id, ATTEMPTS, error.replace('"', "'"),
        )  # fmt: skip

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
