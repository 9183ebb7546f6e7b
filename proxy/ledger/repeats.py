"""Loops that stop themselves (`X-Run-Max-Repeats`): what a run remembers of the tool calls its
model asked for and of the model requests it sent, and the rule that says the run is spinning.

With `max_repeats = N`:

* **a repeat**: the model asks for the same tool with the same canonical arguments (tool name +
  `args_hash`, as on `tool_call` spans) more than N times in the run;
* **a cycle**: the model's requested calls, in order, end in a block of 2-4 calls (not all the
  same call) repeated max(N, 2) times back to back: `A B A B` at N = 2. Every call of a cycle is
  also a repeat, so a cycle repeated *more* than N times has already hit the repeat rule; the
  cycle rule sees the alternation itself, one round earlier;
* either one makes the run's next model step answer-only (tools stripped, as at the step cap:
  `RunState.final_reason = "max_repeats"`), and `Repeats.stopped` says why;
* **a repeated request**: the same model request body, byte for byte, answered N times already:
  the next copy is refused (402 `max_repeats`).

Bounded, so a run's state stays small whatever it does (it lives in the ledger's run row, shared
by replicas, written atomically with the step's settlement): the counts of the last
`CALLS_KEPT` = 64 distinct calls requested (a call not among them starts counting again), the
last `max(PERIODS)` = 4 calls with one run length per period, and the counts of the last
`REQUESTS_KEPT` = 16 distinct request bodies. A run without the cap keeps nothing here
(`Repeats()` is empty and stored as '').
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson

CALLS_KEPT = 64
REQUESTS_KEPT = 16
PERIODS = (2, 3, 4)
_NAME_KEPT = 64  # characters of a tool name kept in a fingerprint


def call_fingerprint(tool: str, args_hash: str) -> str:
    """One requested call as the window holds it: `{tool} {first 16 hex of args_hash}` — readable
    by `runcap run`, and bounded (64 characters of the name)."""
    return f"{tool[:_NAME_KEPT]} {args_hash[:16]}"


def request_fingerprint(body: bytes) -> str:
    """A model request body as the window holds it (sha256, first 32 hex)."""
    return hashlib.sha256(body).hexdigest()[:32]


@dataclass(slots=True)
class Repeats:
    """A run's memory of what it repeated. `calls`/`requests` are in least-recently-seen order."""

    calls: dict[str, int] = field(default_factory=dict)
    last: list[str] = field(default_factory=list)  # the last max(PERIODS) calls, oldest first
    # For each period p of PERIODS: how many calls in a row were the call p before them.
    periodic: list[int] = field(default_factory=lambda: [0] * len(PERIODS))
    requests: dict[str, int] = field(default_factory=dict)
    stopped: str = ""  # why the run was made to answer ('' while it was not)
    stopped_step: int = 0  # the step whose answer showed it

    def __bool__(self) -> bool:
        return bool(self.calls or self.requests or self.stopped)

    def to_json(self) -> str:
        """'' for an empty window (a run without the cap stores nothing)."""
        if not self:
            return ""
        return orjson.dumps(
            [list(self.calls.items()), self.last, self.periodic, list(self.requests.items()),
             self.stopped, self.stopped_step]
        ).decode()  # fmt: skip

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> Repeats:
        if not raw:
            return cls()
        calls, last, periodic, requests, stopped, step = orjson.loads(raw)
        return cls(dict(calls), list(last), list(periodic), dict(requests), stopped, step)

    def copy(self) -> Repeats:
        return Repeats(dict(self.calls), list(self.last), list(self.periodic), dict(self.requests),
                       self.stopped, self.stopped_step)  # fmt: skip


def _count(counts: dict[str, int], key: str, kept: int) -> int:
    """One more of `key`, moved to the most recent end; the least recent beyond `kept` go."""
    n = counts.pop(key, 0) + 1
    counts[key] = n
    while len(counts) > kept:
        del counts[next(iter(counts))]
    return n


def note_calls(repeats: Repeats, calls: Iterable[str], limit: int, step: int) -> str:
    """Count the calls one answer requested (fingerprints, in order); returns why the run is
    spinning ('' when it is not). Once a reason is found the rest are still counted, and the
    first reason is kept in `repeats.stopped`."""
    why = ""
    rounds = max(limit, 2)
    keep_last = max(PERIODS)
    for fp in calls:
        n = _count(repeats.calls, fp, CALLS_KEPT)
        last = repeats.last
        for i, p in enumerate(PERIODS):
            repeats.periodic[i] = repeats.periodic[i] + 1 if len(last) >= p and last[-p] == fp else 0
        last.append(fp)
        del last[:-keep_last]
        if why:
            continue
        if n > limit:
            why = f"repeat: {fp} requested {n} times (X-Run-Max-Repeats {limit})"
            continue
        for i, p in enumerate(PERIODS):
            block = last[-p:]
            if repeats.periodic[i] >= (rounds - 1) * p and len(set(block)) > 1:
                why = f"cycle: {', '.join(block)} repeated {rounds} times (X-Run-Max-Repeats {limit})"
                break
    if why and not repeats.stopped:
        repeats.stopped = why
        repeats.stopped_step = step
    return why


def note_request(repeats: Repeats, fingerprint: str) -> int:
    """One more answered copy of the request body `fingerprint`; returns how many there were."""
    return _count(repeats.requests, fingerprint, REQUESTS_KEPT)


def request_copies(repeats: Repeats, fingerprint: str) -> int:
    """How many copies of the request body `fingerprint` were answered."""
    return repeats.requests.get(fingerprint, 0)
