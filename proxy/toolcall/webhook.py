"""`approval_webhook_url` (`[approvals]`): each new pending approval announced to a URL the
operator chose — a chat bot, a ticket queue — so a person learns that a call waits for them.

`POST {"id", "run_id", "tool", "args_hash", "rule", "rule_reason", "tenant", "requested_at",
"expires_at"}` (JSON). Never on the request path: the announcement runs in a task of its own, each
attempt bounded by `approval_webhook_timeout_s`, 3 attempts (0.5 s, then 2 s apart) until a 2xx;
a failure is logged (`approval_webhook_failed`) and counted (`failures`), and the call waits on
regardless — the approval is in the ledger and in `runcap approvals` whatever the webhook does.
The arguments are not sent: only their hash (the payload store has them, for who may read it).

Every attempt carries the Standard Webhooks headers (standardwebhooks.com): `webhook-id` (the
approval's id: the same on a retry, so a receiver can drop a repeat), `webhook-timestamp` (the
attempt's, in Unix seconds) and, with `approval_webhook_secret`, `webhook-signature: v1,<base64
HMAC-SHA256 of "{id}.{timestamp}.{body}">` — any Standard Webhooks library verifies it, so a
receiver can refuse an announcement that runcap did not send, or one replayed later.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from proxy.ledger.base import Approval

log = logging.getLogger("runcap.approvals")

ATTEMPTS = 3
PAUSES_S = (0.5, 2.0)


class ApprovalWebhook:
    def __init__(
        self, url: str | None, timeout_s: float, on_failure: Callable[[], None] | None = None,
        *, secret: str | None = None,
    ) -> None:  # fmt: skip
        self.url = url
        # The key: `whsec_` + base64, checked at config load (config/sections.py).
        self._key = base64.b64decode(secret.removeprefix("whsec_") + "==") if secret else None
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
        data = json.dumps(body, separators=(",", ":")).encode()
        error = ""
        for attempt in range(ATTEMPTS):
            try:
                async with self._session.post(
                    self.url, data=data, headers=self.headers(approval.id, data), allow_redirects=False,
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

    def headers(self, message_id: str, data: bytes, now: float | None = None) -> dict[str, str]:
        """One attempt's headers: the body's type, its id and timestamp, and its signature."""
        stamp = str(int(time.time() if now is None else now))
        headers = {"Content-Type": "application/json", "webhook-id": message_id, "webhook-timestamp": stamp}
        if self._key is not None:
            mac = hmac.new(self._key, f"{message_id}.{stamp}.".encode() + data, hashlib.sha256).digest()
            headers["webhook-signature"] = "v1," + base64.b64encode(mac).decode()
        return headers

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
