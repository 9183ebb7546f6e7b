"""The script model of the scripted upstream: what the "model" answers, step by step.

A script is a named list of `Step`s (dicts in script files, validated by `Step.from_dict`), chosen
per request by the `X-Mock-Script` header; `load_scripts` reads them from JSON or TOML. A step's
`fetch` entries become calls of runcap's `runcap_fetch` tool on the handles the request shows
(`with_fetches`). Nothing here knows a wire format.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

SCRIPT_HEADER = "X-Mock-Script"
DEFAULT_SCRIPT = "default"
DEFAULT_TEXT = "Hello! This is a scripted answer from runcap's mock upstream."
# The answer given when a step asks for tool calls the request does not allow.
FALLBACK_TEXT = "I cannot call tools now, so here is my final answer."


@dataclass(frozen=True, slots=True)
class ScriptedToolCall:
    name: str
    arguments: str  # the JSON text the "model" produces (may deliberately not parse)
    input: dict[str, Any]  # the same as an object, for Anthropic's tool_use.input


@dataclass(frozen=True, slots=True)
class Step:
    """One scripted model turn. Build from a dict with `Step.from_dict`."""

    text: str | None = None
    text_tokens: int | None = None
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    status: int | None = None
    error: str | None = None
    error_type: str | None = None
    error_code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    delay_s: float = 0.0
    stall_s: float = 0.0
    chunk_delay_s: float = 0.0
    drop_after_events: int | None = None
    end_after_events: int | None = None
    end_mid_event: bool = False
    error_after_events: int | None = None
    oversized_event_bytes: int = 0
    omit_usage: bool = False
    input_tokens: int | None = None
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    service_tier: str | None = None
    audio_tokens: int = 0
    hosted_uses: int = 0
    use_input_tokens: int = 1000
    reference_tokens: int = 0
    # `runcap_fetch` calls to make: (handle index or literal, offset, length)
    fetch: tuple[tuple[int | str, int | None, int | None], ...] = ()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Step:
        unknown = set(raw) - _STEP_KEYS
        if unknown:
            raise ValueError(f"unknown step key(s) {sorted(unknown)}; known: {sorted(_STEP_KEYS)}")
        calls = []
        for call in raw.get("tool_calls") or ():
            if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
                raise ValueError(f"tool_calls entry needs a string 'name': {call!r}")
            args = call.get("arguments", {})
            if isinstance(args, str):
                try:
                    obj = orjson.loads(args)
                except orjson.JSONDecodeError:
                    obj = {}
                calls.append(ScriptedToolCall(call["name"], args, obj if isinstance(obj, dict) else {}))
            elif isinstance(args, Mapping):
                calls.append(ScriptedToolCall(call["name"], orjson.dumps(args).decode(), dict(args)))
            else:
                raise ValueError(f"tool_calls[].arguments must be an object or a JSON string: {args!r}")
        status = raw.get("status")
        if status is not None and not (isinstance(status, int) and 400 <= status <= 599):
            raise ValueError(f"step 'status' must be an HTTP error status 400-599: {status!r}")
        for key in (
            "drop_after_events",
            "error_after_events",
            "oversized_event_bytes",
            "text_tokens",
            "input_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "reasoning_tokens",
            "audio_tokens",
            "hosted_uses",
            "use_input_tokens",
            "reference_tokens",
        ):
            value = raw.get(key)
            if value is not None and not (isinstance(value, int) and value >= 0):
                raise ValueError(f"step {key!r} must be a non-negative integer: {value!r}")
        end = raw.get("end_after_events")
        if end is not None and (isinstance(end, bool) or not isinstance(end, int)):
            raise ValueError(f"step 'end_after_events' must be an integer: {end!r}")
        fetches = raw.get("fetch") or ()
        if isinstance(fetches, Mapping):
            fetches = (fetches,)
        fetch = []
        for spec in fetches:
            handle = spec.get("handle", 0) if isinstance(spec, Mapping) else None
            if not isinstance(handle, int | str) or isinstance(handle, bool):
                raise ValueError(f"step 'fetch' needs a handle index or string: {spec!r}")
            fetch.append((handle, spec.get("offset"), spec.get("length")))
        return cls(
            text=raw.get("text"),
            text_tokens=raw.get("text_tokens"),
            tool_calls=tuple(calls),
            status=status,
            error=raw.get("error"),
            error_type=raw.get("error_type"),
            error_code=raw.get("error_code"),
            headers=tuple((str(k), str(v)) for k, v in (raw.get("headers") or {}).items()),
            delay_s=float(raw.get("delay_s", 0.0)),
            stall_s=float(raw.get("stall_s", 0.0)),
            chunk_delay_s=float(raw.get("chunk_delay_s", 0.0)),
            drop_after_events=raw.get("drop_after_events"),
            end_after_events=end,
            end_mid_event=bool(raw.get("end_mid_event", False)),
            error_after_events=raw.get("error_after_events"),
            oversized_event_bytes=raw.get("oversized_event_bytes") or 0,
            omit_usage=bool(raw.get("omit_usage", False)),
            input_tokens=raw.get("input_tokens"),
            cache_read_tokens=raw.get("cache_read_tokens", 0),
            cache_write_tokens=raw.get("cache_write_tokens", 0),
            reasoning_tokens=raw.get("reasoning_tokens", 0),
            service_tier=raw.get("service_tier"),
            audio_tokens=raw.get("audio_tokens", 0),
            hosted_uses=raw.get("hosted_uses", 0),
            use_input_tokens=raw.get("use_input_tokens", 1000),
            reference_tokens=raw.get("reference_tokens", 0),
            fetch=tuple(fetch),
        )


_STEP_KEYS = frozenset(
    {
        "text",
        "text_tokens",
        "tool_calls",
        "status",
        "error",
        "error_type",
        "error_code",
        "headers",
        "delay_s",
        "stall_s",
        "chunk_delay_s",
        "drop_after_events",
        "end_after_events",
        "end_mid_event",
        "error_after_events",
        "oversized_event_bytes",
        "omit_usage",
        "input_tokens",
        "cache_read_tokens",
        "cache_write_tokens",
        "reasoning_tokens",
        "service_tier",
        "audio_tokens",
        "hosted_uses",
        "use_input_tokens",
        "reference_tokens",
        "fetch",
    }
)

DEFAULT_STEP = Step(text=DEFAULT_TEXT)

# A script as `ScriptedUpstream.scripts` holds it: dict steps (set while running) are validated
# when played.
Script = list[Step | Mapping[str, Any]]


def parse_scripts(scripts: Mapping[str, Iterable[Step | Mapping[str, Any]]]) -> dict[str, Script]:
    """`scripts` with every step validated into a `Step` (a `ValueError` names the bad one)."""
    parsed: dict[str, Script] = {}
    for name, steps in scripts.items():
        out: Script = []
        for i, step in enumerate(steps):
            if isinstance(step, Step):
                out.append(step)
                continue
            if not isinstance(step, Mapping):
                raise ValueError(f"script {name!r} step {i}: a step is a table/object, got {step!r}")
            try:
                out.append(Step.from_dict(step))
            except ValueError as e:
                raise ValueError(f"script {name!r} step {i}: {e}") from None
        parsed[name] = out
    return parsed


def load_scripts(path: str) -> dict[str, list[dict[str, Any]]]:
    """Read scripts from a JSON or TOML file (by suffix; `.toml` is TOML, anything else JSON).

    The file maps script names to lists of steps, optionally under a top-level `scripts` key.
    In TOML a script is an array of tables: `[[refund]]` then `tool_calls = [...]`.
    Steps are validated here, so a typo fails with a message naming the script and step.
    """
    data = Path(path).read_bytes()
    raw = tomllib.loads(data.decode()) if path.endswith(".toml") else orjson.loads(data)
    if isinstance(raw, dict) and isinstance(raw.get("scripts"), dict):
        raw = raw["scripts"]
    if not isinstance(raw, dict) or not all(isinstance(v, list) for v in raw.values()):
        raise ValueError(f"{path}: expected a table of scripts, each a list of steps")
    parse_scripts(raw)
    return raw


# --------------------------------------------------------------------------- runcap_fetch calls

FETCH_TOOL = "runcap_fetch"
_HANDLE = re.compile(rb"runcap:sha256/[0-9a-f]{64}")
_UNKNOWN_HANDLE = "runcap:sha256/" + "0" * 64


def handles_in(body: Any) -> list[str]:
    """The distinct `runcap:sha256/<hex>` handles a request's text shows, in order."""
    seen: dict[str, None] = {}
    for match in _HANDLE.findall(orjson.dumps(body)):
        seen.setdefault(match.decode(), None)
    return list(seen)


def with_fetches(step: Step, body: Any) -> Step:
    """`step` with its `fetch` entries turned into `runcap_fetch` calls on handles of `body`."""
    if not step.fetch:
        return step
    handles = handles_in(body)
    calls = []
    for ref, offset, length in step.fetch:
        if isinstance(ref, int):
            handle = handles[ref] if -len(handles) <= ref < len(handles) else _UNKNOWN_HANDLE
        else:
            handle = ref
        args: dict[str, Any] = {"handle": handle}
        if offset is not None:
            args["offset"] = offset
        if length is not None:
            args["length"] = length
        calls.append(ScriptedToolCall(FETCH_TOOL, orjson.dumps(args).decode(), args))
    return dataclasses.replace(step, tool_calls=(*calls, *step.tool_calls))
