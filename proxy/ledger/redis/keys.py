"""The Redis ledger's key layout: every key name the backend reads or writes is built here.

Redis Cluster runs a script only when all its keys share one hash slot, and a run tree's
reservation writes its own run and every ancestor's in one script. So everything a run tree owns
carries the hash tag of the tree's root run id (`{<root>}` below is a literal hash tag; `<x>` is a
placeholder): the runs, their idempotency records, and the per-owner and per-tree indexes the
scripts touch with them. One layout for a single Redis and a cluster (a single Redis has one slot
space too). Keys (all under `prefix`, default `runcap:`; every key of a tree expires after
`retention_s` without writes):

  run:{<root>}:<run>        hash  v = version token, s = RunState JSON. A root run's state is at
                                  `run:{<run>}:<run>`; a child's at its root's tag, and
                                  `run:{<run>}:<run>` holds p = <root> instead (a pointer written
                                  once, single-key): a caller that knows only a run id reads
                                  `run:{<run>}:<run>` and finds the state (a root: no extra round
                                  trip) or the root to read it under (a child: one more)
  call:{<root>}:<n>:<run>:<key>  hash  st = state, m = record JSON (without the body), b = body;
                                  n = len(run), so no two (run, key) pairs share a key
  res:{<root>}:<owner>      hash  reservation id → JSON (run, usd, tokens) — a live process's
  swept:{<root>}:<owner>    hash  the same, for reservations a sweep charged at their reserved
                                  amount (kept so a live owner swept by mistake can take them back)
  inflight:{<root>}:<owner> set   members [run, key] (JSON) of the owner's in-flight calls
  unknown:{<root>}          zset  [run, key] of the tree's unknown records, by time
  tcs:{<root>}              zset  every record of the tree, by creation time (listing)
  kids:{<root>}:<run>       zset  the run's children, by creation time (`get_run`'s ids): added
                                  once per child with its pointer, apart from the run's state
                                  that every call of its subtree writes

Indexes written outside the scripts (single-key commands, each before the first script that
writes under a tag), read by recovery, sweeps and listings:

  tags:<owner>              set   the roots under which `owner` may hold reservations or
                                  in-flight calls (recovery of a dead owner walks them, and
                                  prunes the empty ones); expires a retention after the
                                  owner's last heartbeat
  tags                      zset  every root with records or reservations, by when a process
                                  last indexed it (listings walk them; trimmed after retention)
  owners                    set   every ledger instance that may own reservations or calls
  owner:<owner>             str   heartbeat, with a TTL; refreshed every `heartbeat_s`
  record-keys               str   "2" once runcap 0.1's `tc:<run>:<key>` records were moved
  layout                    str   "3" (this layout) once keys of layout 2 were moved
  objects:<n>:<account>     hash  provider object id → tenant (n = len(account))
  probe:<owner>             str   readiness's write, expires after a minute
  cancel                    channel  [run, origin owner] of every cancel (pub/sub, not a key;
                                  sharded pub/sub on a cluster: cancels.py)

Layout 2 (before run trees): `run:<run>`, `call:<n>:<run>:<key>`, `res:<owner>`,
`swept:<owner>`, `inflight:<owner>`, `unknown`, `tcs`, all without a hash tag; recovery moves
them once (recovery.py). It only ever ran on a single Redis (its scripts were cross-slot).
Layout 1 (runcap 0.1): records under `tc:<run>:<key>`, where run `a` + key `b:c` and run `a:b` +
key `c` collided; moved the same way.

Every script's key list is built in store.py from the methods here: a tree's keys all take its
root (`root=None`: the run is its own root).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson

# The version `record-keys` holds once runcap 0.1's records were moved.
RECORD_KEYS_VERSION = b"2"
# The version `layout` holds once layout 2's keys were moved to their tree's hash tag.
LAYOUT_VERSION = b"3"


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names under one `prefix` (one ledger's namespace on a Redis server or cluster)."""

    prefix: str = "runcap:"

    def __post_init__(self) -> None:
        # A brace in the prefix would become (part of) every key's hash tag.
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"redis ledger prefix {self.prefix!r}: no '{{' or '}}' (the ledger's hash tags)")

    @staticmethod
    def tag(root: str) -> str:
        """The hash tag of a tree (run ids hold no braces: caps.py's charset)."""
        return "{" + root + "}"

    def chain(self, runs: Sequence[tuple[str, str]]) -> list[str]:
        """The keys of a run and its ancestors, as (run id, root) pairs, written together by one
        script: all under the root's tag (one slot on a cluster)."""
        return [self.run(run_id, root) for run_id, root in runs]

    def run(self, run_id: str, root: str | None = None) -> str:
        return f"{self.prefix}run:{{{root or run_id}}}:{run_id}"

    def call(self, run_id: str, key: str, root: str | None = None) -> str:
        # Length-prefixed: the run id's end is known, so `a` + `b:c` and `a:b` + `c` differ.
        return f"{self.prefix}call:{{{root or run_id}}}:{len(run_id)}:{run_id}:{key}"

    def no_call(self, root: str) -> str:
        """The record key of a call without one (never written; real ones have `n:`), in the
        tree's slot like the other keys of its script."""
        return f"{self.prefix}call:{{{root}}}:-"

    def reservations(self, owner: str, root: str) -> str:
        return f"{self.prefix}res:{{{root}}}:{owner}"

    def swept(self, owner: str, root: str) -> str:
        return f"{self.prefix}swept:{{{root}}}:{owner}"

    def inflight(self, owner: str, root: str) -> str:
        return f"{self.prefix}inflight:{{{root}}}:{owner}"

    def unknown(self, root: str) -> str:
        return f"{self.prefix}unknown:{{{root}}}"

    def calls(self, root: str) -> str:
        """The index of a tree's records, by creation time (`tcs`)."""
        return f"{self.prefix}tcs:{{{root}}}"

    def children(self, run_id: str, root: str) -> str:
        return f"{self.prefix}kids:{{{root}}}:{run_id}"

    def owner_tags(self, owner: str) -> str:
        return f"{self.prefix}tags:{owner}"

    @property
    def tags(self) -> str:
        return f"{self.prefix}tags"

    def heartbeat(self, owner: str) -> str:
        return f"{self.prefix}owner:{owner}"

    @property
    def owners(self) -> str:
        return f"{self.prefix}owners"

    @property
    def record_keys(self) -> str:
        return f"{self.prefix}record-keys"

    @property
    def layout(self) -> str:
        return f"{self.prefix}layout"

    def objects(self, account: str) -> str:
        # One hash per provider account: object id → tenant (one key, so one slot on a cluster).
        return f"{self.prefix}objects:{len(account)}:{account}"

    def probe(self, owner: str) -> str:
        return f"{self.prefix}probe:{owner}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}cancel"

    # -- older layouts (recovery.py moves them) --------------------------------------------------

    @property
    def legacy_call_pattern(self) -> str:
        """A SCAN MATCH pattern for the records runcap 0.1 wrote (`tc:<run>:<key>`)."""
        return f"{glob_escape(self.prefix)}tc:*"

    def v2_pattern(self, kind: str) -> str:
        """A SCAN MATCH pattern for layout 2's `<kind>:<...>` keys (no hash tag after the kind)."""
        return f"{glob_escape(self.prefix)}{kind}:[^{{]*"

    def v2_run(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}"

    def v2_owner_key(self, kind: str, owner: str) -> str:
        """Layout 2's `res:<owner>`, `swept:<owner>`, `inflight:<owner>`."""
        return f"{self.prefix}{kind}:{owner}"

    def v2_index(self, kind: str) -> str:
        """Layout 2's global `unknown` and `tcs` zsets."""
        return f"{self.prefix}{kind}"


def member(run_id: str, key: str) -> bytes:
    """A call's member of `inflight:`, `unknown:` and `tcs:`. A JSON array: unambiguous whatever
    the strings hold (unlike joining them with a separator)."""
    return orjson.dumps([run_id, key])


def glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
