"""Cancels across replicas: each cancel is published on `{prefix}cancel` as [run_id, origin owner];
every replica's subscriber yields the run ids cancelled elsewhere, and aborts its in-flight calls.

On a Redis Cluster the channel is a sharded one (`SPUBLISH` / `SSUBSCRIBE`, Redis >= 7): it lives
on the master that owns its slot (and that master's replicas), each replica subscribes there, and
after a failover or a slot move the subscription is made again on the new owner, from a fresh map
of the slots: a lost connection, the old owner's `sunsubscribe` (a master turned replica drops its
sharded subscribers; redis-py's cluster pub/sub stayed on it, deaf, before), or no node left
holding the subscription (redis-py then answers at once: the listener would spin without yielding
and starve the event loop) all re-subscribe. A single Redis keeps classic pub/sub, which works on
any version. A cancel missed while a subscriber reconnects is caught by the caller's slow poll of
the cancel flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("runcap.ledger")


async def publish_cancel(
    r: aioredis.Redis | RedisCluster, channel: str, run_id: str, owner: str, *, sharded: bool = False
) -> None:
    message = orjson.dumps([run_id, owner])
    if sharded:
        await r.spublish(channel, message)
    else:
        await r.publish(channel, message)


async def cancel_events(
    r: aioredis.Redis | RedisCluster, channel: str, owner: str, *, sharded: bool = False
) -> AsyncIterator[str]:
    """Run ids cancelled through other ledger instances than `owner`, as they are published
    (reconnects with backoff; a cancel missed while disconnected is caught by the caller's slow
    poll)."""
    backoff, lost = 0.1, False
    while True:
        pubsub: Any = None
        try:
            if isinstance(r, RedisCluster):
                # The map of slots (the channel's owner): read afresh after a lost subscription.
                await (r.nodes_manager.initialize() if lost else r.initialize())
            pubsub = r.pubsub()
            if sharded:
                await pubsub.ssubscribe(channel)
            else:
                await pubsub.subscribe(channel)
            backoff = 0.1
            while True:
                if sharded:
                    msg = await pubsub.get_sharded_message(timeout=1.0)
                else:
                    msg = await pubsub.get_message(timeout=1.0)
                if msg is None and sharded and not pubsub.node_pubsub_mapping:
                    # No node holds the subscription (dropped, see below): redis-py then answers
                    # None at once, and this loop would spin without yielding.
                    raise RedisConnectionError(f"the sharded subscription to {channel} is gone")
                if msg is not None and msg.get("type") in ("unsubscribe", "sunsubscribe"):
                    # The server dropped it: in a failover the old owner of the channel's slot
                    # unsubscribes its sharded subscribers. Subscribe again on the new owner.
                    raise RedisConnectionError(f"the subscription to {channel} was dropped by the server")
                if msg is None or msg.get("type") not in ("message", "smessage"):
                    continue
                try:
                    run_id, origin = orjson.loads(msg["data"])
                except (orjson.JSONDecodeError, TypeError, ValueError):
                    log.warning("ignored a malformed message on %s: %r", channel, msg["data"][:200])
                    continue
                if origin != owner:
                    yield run_id
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError) as e:
            log.warning("redis cancel subscription lost (%s); reconnecting", e)
            lost = True
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
