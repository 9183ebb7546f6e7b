"""Declared settings: each setting is written once, as a field of its section's dataclass.

`setting(default, doc, ...)` puts a `Setting` in the field's metadata: the TOML key (the field's
name unless told), the environment variable that overrides it, its bounds, one line of
documentation. From the dataclass, `read_section` parses and checks a TOML table (messages name
the setting, or the variable or flag the value came from), `known_keys` lists what the table may
hold, and `reference_table` writes the rows of docs/reference.md.

A small table of our own rather than pydantic: runcap's messages ("caps.ceiling_max_steps:
expected a whole number ≥ 0, got -1", the variable named when the value came from it) are pinned
by tests and read by operators, TOML already types its values (so pydantic's coercion, e.g. of
"5" to 5 in lax mode, is what we do not want), and re-wording every pydantic error would be more
code than the checks themselves.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy.money import usd_to_nanos


class ConfigError(Exception):
    """A setting is wrong; the message starts with the setting's name."""


_META = "runcap.setting"


@dataclass(frozen=True, slots=True)
class Setting:
    doc: str  # one line for docs/reference.md
    key: str | None = None  # the TOML key, when it is not the field's name
    env: str | None = None  # the environment variable that overrides the TOML key
    flag: str | None = None  # the `runcap serve` flag that overrides both (documentation only)
    minimum: int | float | None = None  # inclusive (whole numbers default to ≥ 0)
    above: int | float | None = None  # exclusive lower bound of a number
    maximum: int | float | None = None
    unit: str = ""  # named in messages about a number ("seconds")
    why: str = ""  # why the bound, added to its message
    choices: tuple[str, ...] = ()
    schemes: tuple[str, ...] = ()  # a URL of one of these schemes
    usd: bool = False  # dollars in the TOML, nano-dollars in the field
    items: str = "strings"  # what a list or a table holds, for messages ("field names")
    check: Callable[[Any, str], Any] | None = None  # last check or conversion: (value, name) → value
    shown: str | None = None  # the default as the reference shows it (when not the value itself)


def setting(default: Any, doc: str, *, factory: Callable[[], Any] | None = None, **options: Any) -> Any:
    """A dataclass field that is a setting: `default` (or `factory`), then the documentation line."""
    if factory is not None:
        return field(default_factory=factory, metadata={_META: Setting(doc, **options)})
    return field(default=default, metadata={_META: Setting(doc, **options)})


def declared(cls: type) -> list[tuple[Field[Any], Setting, Any]]:
    """The settings of a section dataclass, in declaration order: (field, setting, type)."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata[_META], hints[f.name]) for f in fields(cls) if _META in f.metadata]


def key_of(f: Field[Any], s: Setting) -> str:
    return s.key or f.name


def known_keys(cls: type) -> set[str]:
    return {key_of(f, s) for f, s, _ in declared(cls)}


def join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def check_known(section: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    """Unknown keys are errors: a typo never silently drops a cap."""
    extra = set(section) - allowed
    if extra:
        raise ConfigError(
            f"{join(where, sorted(extra)[0])}: unknown setting (known: {', '.join(sorted(allowed))})"
        )


def read_section(
    cls: type,
    section: Mapping[str, Any],
    where: str,
    env: Mapping[str, str] | None = None,
    *,
    flags: Mapping[str, tuple[str, Any]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The values of `cls`'s settings from one TOML table (`where`: its name, "" = top level),
    by field name: a flag given (`flags`: field → (flag, value or None)) wins over the
    environment variable, which wins over the TOML key, which wins over the default
    (`defaults` replaces the declared one where it depends on other settings)."""
    env = env or {}
    values: dict[str, Any] = {}
    for f, s, hint in declared(cls):
        key = key_of(f, s)
        flag, flag_value = (flags or {}).get(f.name, ("", None))
        if flag_value is not None:
            value, name = flag_value, flag
        elif s.env and env.get(s.env):
            value, name = env[s.env], s.env
        elif key in section and not (s.env and section[key] == ""):
            value, name = section[key], join(where, key)
        else:
            values[f.name] = (defaults or {}).get(f.name, _default(f))
            continue
        values[f.name] = parse_value(s, hint, value, name)
    return values


_ENV_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    assert f.default_factory is not MISSING, f.name
    return f.default_factory()


def parse_value(s: Setting, hint: Any, value: Any, name: str) -> Any:
    kind = _base(hint)
    if s.usd:
        parsed: Any = usd_to_nanos(parse_decimal(s, value, name))
    elif kind is bool:
        if isinstance(value, str) and name == s.env:  # RUNCAP_X=1 / true / 0 / false
            value = _ENV_BOOLS.get(value.strip().lower(), value)
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        parsed = value
    elif kind is int:
        parsed = _whole(s, value, name)
    elif kind is float:
        parsed = float(parse_decimal(s, value, name))
    elif kind in (str, Path):
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        if s.choices and value not in s.choices:
            why = f" ({s.why})" if s.why else ""
            raise ConfigError(f"{name}: expected one of {', '.join(s.choices)}{why}, got {value!r}")
        if s.schemes:
            check_url(value, name, s.schemes)
        parsed = Path(value) if kind is Path else value
    elif kind is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{name}: expected a list of {s.items}")
        parsed = tuple(value)
    elif kind is Mapping:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{name}: expected a table of {s.items}")
        parsed = dict(value)
    else:  # pragma: no cover - a declaration error, caught by tests/unit/test_config_declared.py
        raise TypeError(f"{name}: no parser for settings of type {hint!r}")
    return s.check(parsed, name) if s.check else parsed


def _base(hint: Any) -> Any:
    """`int | None` → int, `tuple[str, ...]` → tuple."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) or hint


def _whole(s: Setting, value: Any, name: str) -> int:
    low = int(s.minimum or 0)
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and value >= low and (s.maximum is None or value <= s.maximum):
        return int(value)
    why = f" ({s.why})" if s.why else ""
    if s.maximum is not None:
        raise ConfigError(f"{name}: expected a whole number from {low} to {s.maximum:g}{why}, got {value!r}")
    raise ConfigError(f"{name}: expected a whole number ≥ {low}{why}, got {value!r}")


def parse_decimal(s: Setting, value: Any, name: str) -> Decimal:
    """A decimal number (TOML int, float or a decimal string such as "2.50")."""
    d: Decimal | None = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            d = Decimal(str(value))
        except InvalidOperation:
            pass
    if d is None or not d.is_finite():
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    # The bounds as written (`0.1`), not as binary floats (0.1000000000000000055...).
    bounds = (s.above, s.minimum, s.maximum)
    above, minimum, maximum = (None if b is None else Decimal(str(b)) for b in bounds)
    low_ok = d > above if above is not None else d >= (minimum or 0)
    if low_ok and (maximum is None or d <= maximum):
        return d
    low = f"> {s.above:g}" if s.above is not None else f"≥ {s.minimum or 0:g}"
    high = f" and ≤ {s.maximum:g}" if s.maximum is not None else ""
    unit = f" of {s.unit}" if s.unit else ""
    why = f" ({s.why})" if s.why else ""
    raise ConfigError(f"{name}: expected a number{unit} {low}{high}{why}, got {value!r}")


def check_url(url: Any, name: str, schemes: tuple[str, ...]) -> None:
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in schemes or not (parts.netloc or parts.scheme == "unix"):
        raise ConfigError(f"{name}: expected a {'/'.join(s + '://' for s in schemes)}... URL, got {url!r}")


# -- docs/reference.md --------------------------------------------------------------------------


REFERENCE_HEAD = ["| key | default | values | meaning |", "|---|---|---|---|"]


def reference_rows(cls: type) -> list[str]:
    """One markdown row per setting: | `key` | default | values | meaning (what overrides it) |."""
    rows = []
    for f, s, hint in declared(cls):
        over = [f"`{o}`" for o in (s.env, s.flag) if o]
        meaning = s.doc + (f" ({', '.join(over)})" if over else "")
        default = s.shown or _shown(_default(f), s)
        rows.append(f"| `{key_of(f, s)}` | {default} | {_values(s, hint)} | {meaning} |")
    return rows


def _values(s: Setting, hint: Any) -> str:
    """What a setting accepts, as its declaration bounds it."""
    if s.choices:
        return ", ".join(f"`{c}`" for c in s.choices)
    if s.schemes:
        return ", ".join(f"`{scheme}://...`" for scheme in s.schemes)
    kind = _base(hint)
    if kind is bool:
        return "`true`, `false`"
    if kind is tuple:
        return f"list of {s.items}"
    if kind is Mapping:
        return f"table of {s.items}"
    if kind is int and not s.usd:
        least = int(s.minimum or 0)
        return f"{least} to {s.maximum:g}" if s.maximum is not None else f"≥ {least}"
    if kind in (int, float):
        low = f"> {s.above:g}" if s.above is not None else f"≥ {s.minimum or 0:g}"
        unit = " s" if s.unit == "seconds" else ""
        high = f", ≤ {s.maximum:g}{unit}" if s.maximum is not None else ""
        return f"{low}{unit}{high}" + (" (USD)" if s.usd else "")
    return "string"


def _shown(value: Any, s: Setting) -> str:
    if value is None or value == () or value == {}:
        return "—"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, (str, Path)):
        return f'`"{value}"`'
    if s.usd:
        return f"{value / 1e9:g}"
    return f"{value:g}" if isinstance(value, float) else str(value)
