"""Tool policies as configured: `[[tools.NAME.rules]]` and `[[mcp.SERVER.tools.TOOL.rules]]`
(README "Tool policies"), read and compiled once at start-up.

Each rule is a CEL condition (`when`) and an effect. CEL is compiled here, with the type checker
of cel-cpp (the `cel-expr-python` binding), against the variables a rule may read — so a rule
that does not parse, names a variable or a field of `run` / `tool` that does not exist, compares
a double with an int, or is not a condition, stops start-up with a `ConfigError` naming the tool
and the rule. What only the arguments can tell (a missing argument, an argument of another type)
fails when the rule is evaluated: toolcall/policy.py denies the call then (fail closed).

Variables: `args` (the call's JSON arguments, a map), `tool.name`, `tool.server` (the MCP server,
`""` on /tools), `run.id`, `run.task`, `run.tenant`, `run.spent_usd` (double, dollars settled),
`run.steps` (= `run.step`, model calls so far), `run.tool_calls`; on /tools also `method` and
`path` (the sub-path after /tools/NAME). `run` and `tool` are declared field by field (`run.id`
is one variable to the checker), which is what lets an unknown field be a config error.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.config.declare import ConfigError

EFFECTS = ("allow", "deny", "approve", "cap")
MODES = ("wait", "defer")
RULE_KEYS = frozenset({"name", "when", "effect", "mode", "reason", "max_calls"})
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")

# What a rule reads without asking the ledger (known from the request itself) ... (CEL types by
# their `cel.Type` name; "MAP" is a map of string to dyn)
REQUEST_VARIABLES: Mapping[str, str] = {
    "args": "MAP",
    "tool.name": "STRING",
    "tool.server": "STRING",
    "run.id": "STRING",
    "run.task": "STRING",
    "run.tenant": "STRING",
}
# ... and what needs the run's state from the ledger (one read, only for a tool whose rules use it).
STATE_VARIABLES: Mapping[str, str] = {
    "run.spent_usd": "DOUBLE",
    "run.steps": "INT",
    "run.step": "INT",
    "run.tool_calls": "INT",
}
HTTP_VARIABLES: Mapping[str, str] = {"method": "STRING", "path": "STRING"}


@functools.cache
def _cel() -> Any:
    """cel-expr-python, imported when the first environment is built: a runcap with no tool rules
    never loads cel-cpp and protobuf (~10 MB of RSS in the serving process, bench/README.md)."""
    import cel_expr_python.cel as cel

    return cel


def _type(cel: Any, name: str) -> Any:
    return cel.Type.Map(cel.Type.STRING, cel.Type.DYN) if name == "MAP" else getattr(cel.Type, name)


def variable_names(*, http: bool) -> tuple[str, ...]:
    """Every variable a rule of that kind of tool may read (the environment's declarations)."""
    tables = (REQUEST_VARIABLES, *([HTTP_VARIABLES] if http else []), STATE_VARIABLES)
    return tuple(name for table in tables for name in table)


@functools.cache
def environment(*, http: bool, state: bool = True) -> Any:
    """The CEL environment rules are compiled in (`Env.Activation` builds a call's variables): one
    per kind of tool, built once, with and without the run's state (a rule that compiles without
    it never needs the ledger read)."""
    cel = _cel()
    tables = (REQUEST_VARIABLES, *([HTTP_VARIABLES] if http else []), *([STATE_VARIABLES] if state else []))
    return cel.NewEnv(variables={name: _type(cel, t) for table in tables for name, t in table.items()})


@dataclass(frozen=True, slots=True)
class ToolRule:
    """One rule of a tool's policy, compiled: the first rule whose `when` holds decides."""

    name: str
    when: str
    effect: str  # allow | deny | approve | cap
    reason: str = ""
    mode: str = "wait"  # approve: wait | defer
    max_calls: int | None = None  # cap: calls matching the rule per run
    needs_state: bool = False  # reads run.spent_usd / steps / step / tool_calls
    program: Any = field(default=None, compare=False, repr=False)  # cel Expression


def read_rules(value: Any, where: str, what: str, *, http: bool) -> tuple[ToolRule, ...]:
    """`where` = the rules' TOML name (`tools.refund.rules`), `what` = the tool in words."""
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise ConfigError(f"{where}: expected an array of tables ([[{where}]] sections)")
    rules: list[ToolRule] = []
    seen: set[str] = set()
    for index, table in enumerate(value):
        rule = _rule(table, where, index, what, http=http)
        if rule.name in seen:
            raise ConfigError(
                f'{where}[{index}] (rule "{rule.name}" of {what}).name: used by another rule of this tool'
            )
        seen.add(rule.name)
        rules.append(rule)
    return tuple(rules)


def _rule(table: Mapping[str, Any], where: str, index: int, what: str, *, http: bool) -> ToolRule:
    name = table.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"{where}[{index}] (of {what}).name: required, 1-64 characters of A-Z a-z 0-9 . _ - "
            f"(got {name!r})"
        )
    at = f'{where}[{index}] (rule "{name}" of {what})'
    extra = sorted(set(table) - RULE_KEYS)
    if extra:
        raise ConfigError(f"{at}.{extra[0]}: unknown setting (known: {', '.join(sorted(RULE_KEYS))})")
    effect = table.get("effect")
    if effect not in EFFECTS:
        raise ConfigError(f"{at}.effect: expected one of {', '.join(EFFECTS)}, got {effect!r}")
    mode = table.get("mode")
    if mode is not None and effect != "approve":
        raise ConfigError(f"{at}.mode: only an approve rule has a mode (this one's effect is {effect})")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"{at}.mode: expected wait or defer, got {mode!r}")
    max_calls = table.get("max_calls")
    if effect == "cap":
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ConfigError(
                f"{at}.max_calls: a cap rule needs max_calls, a whole number ≥ 1 (got {max_calls!r})"
            )
    elif max_calls is not None:
        raise ConfigError(f"{at}.max_calls: only a cap rule has max_calls (this one's effect is {effect})")
    reason = table.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 1000:
        raise ConfigError(f"{at}.reason: expected a string of at most 1000 characters")
    when = table.get("when")
    if not isinstance(when, str) or not when.strip():
        raise ConfigError(f'{at}.when: required, a CEL condition such as "args.amount > 100"')
    program = _compile(environment(http=http), when, f"{at}.when")
    try:
        environment(http=http, state=False).compile(when)
        needs_state = False
    except RuntimeError:
        needs_state = True  # compiles only with run.spent_usd / steps / tool_calls declared
    return ToolRule(
        name=name, when=when, effect=effect, reason=reason, mode=mode or "wait",
        max_calls=max_calls if effect == "cap" else None, needs_state=needs_state, program=program,
    )  # fmt: skip


def _compile(env: Any, when: str, name: str) -> Any:
    try:
        program = env.compile(when)
    except RuntimeError as e:
        raise ConfigError(f"{name}: {_cel_message(str(e))}") from None
    returns = program.return_type()
    if returns not in (_cel().Type.BOOL, _cel().Type.DYN):
        raise ConfigError(f"{name}: {when!r} is a {returns.name().lower()}, not a condition (true or false)")
    return program


def _cel_message(text: str) -> str:
    """cel-cpp's status text without its status code: the error's first line, with its position.
    (A double is not compared with an int in CEL's type checker: `run.spent_usd > 2.0`.)"""
    first = text.replace(" [INVALID_ARGUMENT]", "").strip().splitlines()[0] if text.strip() else text
    return first.removeprefix("INVALID_ARGUMENT: ").removeprefix("ERROR: ").replace("<input>:", "at ")
