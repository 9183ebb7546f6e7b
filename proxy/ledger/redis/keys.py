"""The Redis ledger's key layout: every key name the backend reads or writes is built here.

Keys (all under `prefix`, default `runcap:`; every key of a run, its records and its reservations
expires after `retention_s` without writes):

  run:{run_id}            hash  v = version token, s = RunState JSON
  res:{owner}             hash  reservation id → JSON (run, usd, tokens) — a live process's
  swept:{owner}           hash  the same, for reservations a sweep charged at their reserved
                                amount (kept so a live owner swept by mistake can take them back)
  owners                  set   every ledger instance that may own reservations or in-flight calls
  owner:{owner}           str   heartbeat, with a TTL; refreshed every `heartbeat_s`
  call:{n}:{run_id}:{key} hash  st = state, m = record JSON (without the body), b = body;
                                n = len(run_id), so no two (run, key) pairs share a key
  inflight:{owner}        set   members [run_id, key] (JSON) of the owner's in-flight calls
  unknown                 zset  [run_id, key] of unknown records, by time (reconcile's list)
  tcs                     zset  every record, by creation time (listing)
  record-keys             str   "2" (this key layout) once records under the old keys were moved
  objects:{n}:{account}   hash  provider object id → tenant (n = len(account))
  probe:{owner}           str   readiness's write, expires after a minute
  cancel                  channel  [run_id, origin owner] of every cancel (pub/sub, not a key)

Upgrade: runcap 0.1 kept records under `tc:{run_id}:{key}` (`legacy_call_pattern`), where run `a`
+ key `b:c` and run `a:b` + key `c` collided; recovery moves them (recovery.py).

Redis Cluster: a script runs there only when all its keys share one hash slot, so a layout for
a cluster (a run and its sub-runs updated atomically) is a change of the key names here — a
`{hash tag}` on everything a run tree owns, e.g. `run:{<root run id>}:<run id>` and the same tag
on its records — plus of the per-owner and global keys the scripts touch in the same call
(`res:`, `swept:`, `inflight:`, `unknown`, `tcs`): they would become one per tag, with recovery
and listing finding them through an index written outside the scripts. Every script's key list
is built in one place (store.py), so this module and that one are what the change touches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson

# The layout version `record-keys` holds once the legacy records were moved.
RECORD_KEYS_VERSION = b"2"


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names under one `prefix` (one ledger's namespace on a Redis server)."""

    prefix: str = "runcap:"

    def run(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}"

    def chain(self, run_ids: Sequence[str]) -> list[str]:
        """The keys of a run and its ancestors, written together by one script (a run tree:
        on a cluster they must share a slot — a tag on the root run id)."""
        return [self.run(run_id) for run_id in run_ids]

    def reservations(self, owner: str) -> str:
        return f"{self.prefix}res:{owner}"

    def swept(self, owner: str) -> str:
        return f"{self.prefix}swept:{owner}"

    def heartbeat(self, owner: str) -> str:
        return f"{self.prefix}owner:{owner}"

    def call(self, run_id: str, key: str) -> str:
        # Length-prefixed: the run id's end is known, so `a` + `b:c` and `a:b` + `c` differ.
        return f"{self.prefix}call:{len(run_id)}:{run_id}:{key}"

    @property
    def no_call(self) -> str:
        """The record key of a call without one (never written; real ones have `n:`)."""
        return f"{self.prefix}call:-"

    def inflight(self, owner: str) -> str:
        return f"{self.prefix}inflight:{owner}"

    @property
    def owners(self) -> str:
        return f"{self.prefix}owners"

    @property
    def unknown(self) -> str:
        return f"{self.prefix}unknown"

    @property
    def calls(self) -> str:
        """The index of every record, by creation time (`tcs`)."""
        return f"{self.prefix}tcs"

    @property
    def record_keys(self) -> str:
        return f"{self.prefix}record-keys"

    @property
    def legacy_call_pattern(self) -> str:
        """A SCAN MATCH pattern for the records runcap 0.1 wrote (`tc:{run_id}:{key}`)."""
        return f"{glob_escape(self.prefix)}tc:*"

    def objects(self, account: str) -> str:
        # One hash per provider account: object id → tenant (one key, so one slot on a cluster).
        return f"{self.prefix}objects:{len(account)}:{account}"

    def probe(self, owner: str) -> str:
        return f"{self.prefix}probe:{owner}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}cancel"


def member(run_id: str, key: str) -> bytes:
    """A call's member of `inflight:`, `unknown` and `tcs`. A JSON array: unambiguous whatever the
    strings hold (unlike joining them with a separator)."""
    return orjson.dumps([run_id, key])


def glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
