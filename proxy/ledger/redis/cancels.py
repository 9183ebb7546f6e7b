"""Cancels across replicas: each cancel is published on `{prefix}cancel` as [run_id, origin owner];
every replica's subscriber yields the run ids cancelled elsewhere, and aborts its in-flight calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import orjson
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("runcap.ledger")


async def publish_cancel(r: aioredis.Redis, channel: str, run_id: str, owner: str) -> None:
    await r.publish(channel, orjson.dumps([run_id, owner]))


async def cancel_events(r: aioredis.Redis, channel: str, owner: str) -> AsyncIterator[str]:
    """Run ids cancelled through other ledger instances than `owner`, as they are published
    (reconnects with backoff; a cancel missed while disconnected is caught by the caller's slow
    poll)."""
    backoff = 0.1
    while True:
        pubsub = r.pubsub()
        try:
            await pubsub.subscribe(channel)
            backoff = 0.1
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is None or msg.get("type") != "message":
                    continue
                try:
                    run_id, origin = orjson.loads(msg["data"])
                except (orjson.JSONDecodeError, TypeError, ValueError):
                    log.warning("ignored a malformed message on %s: %r", channel, msg["data"][:200])
                    continue
                if origin != owner:
                    yield run_id
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            log.warning("redis cancel subscription lost (%s); reconnecting", e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
