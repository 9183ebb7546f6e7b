"""The Redis ledger's Lua scripts: each one compare-and-sets a run (and what the decision changed
with it) in one round trip, and writes nothing when the run's version moved since it was read.

The scripts only compare strings and move values: no arithmetic happens in Lua, whose numbers are
doubles — nano-dollar amounts travel as JSON integers decoded by Python, so they never lose
precision. Each script that writes a run first checks whether the run already has the version it
is about to write — its own write, sent again — and then answers as if it had just done it: so
the client may resend a command whose connection broke without a reservation written twice or a
refund applied twice. The keys each script takes are built by store.py from keys.py, all under
one tree's hash tag (one slot on a cluster).
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

# KEYS: run  ARGV: expected version, state, ttl ms, new version
_SAVE_RUN = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: run, res:{<root>}:<owner>  ARGV: expected version, state, ttl ms, new version, reservation id, JSON
_BEGIN_STEP = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[5], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""

# KEYS: run, res:{<root>}:<owner>, swept:{<root>}:<owner>  ARGV: expected version, state, ttl ms, new version,
#       reservation id
# -1: the reservation is gone (already settled) — never charge twice; -2: a sweep charged it at its
# reserved amount (its owner was thought dead): settle it out of swept:{owner} with `_MOVE_RES`.
_SETTLE = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if redis.call('HEXISTS', KEYS[2], ARGV[5]) == 0 then
  if redis.call('HEXISTS', KEYS[3], ARGV[5]) == 1 then return -2 end
  return -1
end
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[5])
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# Move one reservation between `from` and `to` (reservation hashes of one owner) with the run
# written — a sweep (res → swept), a settlement of a swept one (swept → nowhere: JSON ''), or a
# live owner taking one back (swept → res).
# KEYS: run, from, to  ARGV: expected version, state, ttl ms, new version, reservation id, JSON
# -1: the reservation is not in `from` (any more); 0: the run changed since it was read.
_MOVE_RES = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if redis.call('HEXISTS', KEYS[2], ARGV[5]) == 0 then return -1 end
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[5])
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[5], ARGV[6])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: run, tc, inflight:{<root>}:<record owner>, unknown:{<root>}, tcs:{<root>} (one tree's slot)
# ARGV: expected version, state, ttl ms, new version, expected tc state, new tc state ('' = leave),
#       record JSON, member, now
_BEGIN_TOOL = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[4] then return 1 end  -- done: a retried send
if (redis.call('HGET', KEYS[1], 'v') or '') ~= ARGV[1] then return 0 end
if (redis.call('HGET', KEYS[2], 'st') or '') ~= ARGV[5] then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 's', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[6] == 'in_flight' then
  redis.call('HSET', KEYS[2], 'st', 'in_flight', 'm', ARGV[7], 'b', '')
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('SADD', KEYS[3], ARGV[8])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  redis.call('ZADD', KEYS[5], ARGV[9], ARGV[8])
  redis.call('PEXPIRE', KEYS[5], ARGV[3])
elseif ARGV[6] == 'unknown' then
  redis.call('HSET', KEYS[2], 'st', 'unknown', 'm', ARGV[7])
  redis.call('SREM', KEYS[3], ARGV[8])
  redis.call('ZADD', KEYS[4], ARGV[9], ARGV[8])
  redis.call('PEXPIRE', KEYS[4], ARGV[3])
end
return 1
"""

# KEYS: tc, inflight:{<root>}:<record owner>, unknown:{<root>}, tcs:{<root>}
# ARGV: expected state, new state ('' = delete), record JSON, body, ttl ms, member, now
_SET_TOOL = """
if (redis.call('HGET', KEYS[1], 'st') or '') ~= ARGV[1] then return 0 end
redis.call('SREM', KEYS[2], ARGV[6])
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[3], ARGV[6])
  redis.call('ZREM', KEYS[4], ARGV[6])
  return 1
end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'm', ARGV[3], 'b', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[4], ARGV[5])  -- the tree's index lives as long as its records
if ARGV[2] == 'unknown' then
  redis.call('ZADD', KEYS[3], ARGV[7], ARGV[6])
  redis.call('PEXPIRE', KEYS[3], ARGV[5])
else
  redis.call('ZREM', KEYS[3], ARGV[6])
end
return 1
"""

# KEYS: an older layout's record key, its current key (one slot: the migration runs on a single
# Redis, the only place an older layout ran)  ARGV: the record JSON as read
# 1: moved; 2: the current key already holds the record (written since the upgrade; the older copy
# is dropped); 0: the legacy key changed or went since it was read (left alone).
_MOVE_LEGACY = """
if redis.call('HGET', KEYS[1], 'm') ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[1])
  return 2
end
redis.call('RENAME', KEYS[1], KEYS[2])
return 1
"""

# KEYS: a layout-2 key, its current name  1: moved; 2: the current name was written since the
# upgrade (the newer: the old one is dropped); 0: the old key went meanwhile.
_MOVE_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[1])
  return 2
end
redis.call('RENAME', KEYS[1], KEYS[2])
return 1
"""


# A run tree (issue 22): the same compare-and-sets over a run and its ancestors at once — every
# state of the chain written only if none moved since it was read, with what the mode writes
# besides (the mode's keys and arguments are those of the single-run script of the same name).
# KEYS: the n runs (the run first, then its ancestors), then the mode's keys
# ARGV: mode, n, ttl ms, then per run (expected version, state, new version), then the mode's
# arguments. Every key under the tree's tag (the root's): one slot on a cluster. Modes: save
# (nothing more) · begin (res:{<root>}:<owner>; reservation id, JSON) · settle (res:, swept:;
# reservation id) · move (from, to; reservation id, JSON or '') · tool (tc, inflight:{<root>}:
# <owner>, unknown:{<root>}, tcs:{<root>}; expected tc state, new tc state, record JSON, member,
# now). Answers as the single-run scripts do (1, 0, and -1 / -2 for settle and move).
_CHAIN = """
local mode, n, ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local a = 3 + 3 * n
if redis.call('HGET', KEYS[1], 'v') == ARGV[6] then return 1 end  -- done: a retried send
if mode == 'settle' and redis.call('HEXISTS', KEYS[n + 1], ARGV[a + 1]) == 0 then
  if redis.call('HEXISTS', KEYS[n + 2], ARGV[a + 1]) == 1 then return -2 end
  return -1
end
if mode == 'move' and redis.call('HEXISTS', KEYS[n + 1], ARGV[a + 1]) == 0 then return -1 end
for i = 1, n do
  if (redis.call('HGET', KEYS[i], 'v') or '') ~= ARGV[3 * i + 1] then return 0 end
end
if mode == 'tool' and (redis.call('HGET', KEYS[n + 1], 'st') or '') ~= ARGV[a + 1] then return 0 end
for i = 1, n do
  redis.call('HSET', KEYS[i], 'v', ARGV[3 * i + 3], 's', ARGV[3 * i + 2])
  redis.call('PEXPIRE', KEYS[i], ttl)
end
if mode == 'begin' then
  redis.call('HSET', KEYS[n + 1], ARGV[a + 1], ARGV[a + 2])
  redis.call('PEXPIRE', KEYS[n + 1], ttl)
elseif mode == 'settle' then
  redis.call('HDEL', KEYS[n + 1], ARGV[a + 1])
elseif mode == 'move' then
  redis.call('HDEL', KEYS[n + 1], ARGV[a + 1])
  if ARGV[a + 2] ~= '' then
    redis.call('HSET', KEYS[n + 2], ARGV[a + 1], ARGV[a + 2])
    redis.call('PEXPIRE', KEYS[n + 2], ttl)
  end
elseif mode == 'tool' then
  if ARGV[a + 2] == 'in_flight' then
    redis.call('HSET', KEYS[n + 1], 'st', 'in_flight', 'm', ARGV[a + 3], 'b', '')
    redis.call('PEXPIRE', KEYS[n + 1], ttl)
    redis.call('SADD', KEYS[n + 2], ARGV[a + 4])
    redis.call('PEXPIRE', KEYS[n + 2], ttl)
    redis.call('ZADD', KEYS[n + 4], ARGV[a + 5], ARGV[a + 4])
    redis.call('PEXPIRE', KEYS[n + 4], ttl)
  elseif ARGV[a + 2] == 'unknown' then
    redis.call('HSET', KEYS[n + 1], 'st', 'unknown', 'm', ARGV[a + 3])
    redis.call('SREM', KEYS[n + 2], ARGV[a + 4])
    redis.call('ZADD', KEYS[n + 3], ARGV[a + 5], ARGV[a + 4])
    redis.call('PEXPIRE', KEYS[n + 3], ttl)
  end
end
return 1
"""


class Scripts:
    """The scripts registered on one client (EVALSHA, loaded on first use)."""

    def __init__(self, r: Redis | RedisCluster) -> None:
        self.save_run = r.register_script(_SAVE_RUN)
        self.begin_step = r.register_script(_BEGIN_STEP)
        self.settle = r.register_script(_SETTLE)
        self.move_res = r.register_script(_MOVE_RES)
        self.begin_tool = r.register_script(_BEGIN_TOOL)
        self.set_tool = r.register_script(_SET_TOOL)
        self.move_legacy = r.register_script(_MOVE_LEGACY)
        # A layout-2 key moved to its tree's tag (RENAME: a single Redis only, as keys.py says).
        self.move_key = r.register_script(_MOVE_KEY)
        self.chain = r.register_script(_CHAIN)
