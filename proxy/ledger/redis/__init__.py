"""The Redis ledger backend (`RUNCAP_REDIS_URL`): see ledger.py for the picture, keys.py for the
key layout."""

from proxy.ledger.redis.ledger import RedisLedger

__all__ = ["RedisLedger"]
