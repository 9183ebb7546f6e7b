"""The common rules of a tool policy evaluated in Python, exactly as cel-cpp would, without calling
into cel-cpp (toolcall/policy.py).

Why: inside a busy `runcap serve` a ten-rule decision through cel-cpp took ~130 µs per call, not
the ~12 µs of a hot loop (bench/policy_bench.py, "admit in situ"): cel-cpp's working set — the
program, its type registry, protobuf's descriptors, the activation's arena — is evicted from the
CPU's caches between two tool calls by everything else the process does (reading 4 MB between two
decisions in a hot loop reproduces it: 13 → 107 µs). A rule of the usual kind (a comparison of an
argument with a literal, a string test, a membership, `&&` / `||`) evaluated here touches a few
Python objects instead.

Exactness is by construction, not by imitation: this module evaluates only what it models — the
happy path of each operator on the types it names — and raises `Unsupported` for everything else
(an error CEL would report, a type pair or a value it does not model: a missing key, a string
compared with an int, an integer beyond int64, an overflow, a division by zero, a list compared
with a list...). The caller then evaluates that rule with cel-cpp, which gives the exact value or
error. An expression outside the subset (`matches`, macros other than `has`, unsigned or hex
literals, raw strings, timestamps...) is not compiled here at all (`compile_rule` returns None).
tests/unit/toolcall/test_fastcel.py checks the two against each other on generated rules and
arguments (hypothesis): same value, or `Unsupported` here.

The subset (CEL syntax, cel-spec's precedence):

    cond ? a : b    a || b    a && b    < <= > >= == != in    + -    * / %    ! -x
    x.field  x[i]  x.startsWith(s)  x.endsWith(s)  x.contains(s)  x.size()  size(x)  has(x.f)
    literals: 12  1.5  2e3  'text'  "text" (escapes \\ \' \" \n \r \t)  true false null  [a, b]
    variables: args, and the dotted names the environment declares (run.task, tool.name, ...)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

INT_MIN, INT_MAX = -(2**63), 2**63 - 1

Fn = Callable[[Mapping[str, Any]], Any]


class Unsupported(Exception):
    """Not modelled here: evaluate this rule with cel-cpp."""


def convertible(value: Any, depth: int = 0) -> bool:
    """Whether cel-cpp takes `value` (a call's arguments) as it is: JSON's types, integers below
    2**64, strings that are UTF-8 (no lone surrogate, which `json.loads` lets through), not too
    deep. cel-cpp converts all the arguments at its first evaluation, so one value it cannot take
    is an error of every rule, whichever it reads."""
    t = type(value)
    if t is str:
        if value.isascii():
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if t is int:
        return INT_MIN <= value < 2**64
    if t is float or t is bool or value is None:
        return True
    if depth > 32:
        return False
    if t is dict:
        return all(type(k) is str and convertible(k) and convertible(v, depth + 1) for k, v in value.items())
    if t is list:
        return all(convertible(v, depth + 1) for v in value)
    return False


_TOKEN = re.compile(
    r"""\s*(?:
      (?P<num>\d+\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\d+)(?![\w.])
    | (?P<str>'(?:[^'\\\n]|\\[\\'"nrt])*'|"(?:[^"\\\n]|\\[\\'"nrt])*")
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op>\|\||&&|<=|>=|==|!=|[<>!?:.,()\[\]+\-*/%])
    )""",
    re.X,
)
_ESCAPES = {"\\\\": "\\", "\\'": "'", '\\"': '"', "\\n": "\n", "\\r": "\r", "\\t": "\t"}
_RESERVED = frozenset(
    "as break const continue else for function if import let loop package namespace return var void while "
    "in".split()
)


class _Cannot(Exception):
    """The expression is outside the subset: cel-cpp evaluates the whole rule."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(text):
        if text[at:].strip() == "":
            break
        m = _TOKEN.match(text, at)
        if m is None or m.end() == at:
            raise _Cannot
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        at = m.end()
    out.append(("end", ""))
    return out


class _Parser:
    """Recursive descent over the subset, emitting one Python expression per rule (`compile_rule`
    compiles it into a lambda): literals inline, a map's field read inline, one helper call per
    operator — fewer calls, and fewer objects to fetch into a cold cache, than a tree of closures.
    `&&`, `||` and `?:` evaluate their right side only when CEL's result needs it (`has(args.x) &&
    args.x > 1` never reads a missing key), through walrus temporaries `_t0`, `_t1`..."""

    def __init__(self, text: str, variables: frozenset[str]) -> None:
        self.toks = _tokens(text)
        self.at = 0
        self.variables = variables
        self.consts: dict[str, Any] = {}
        self.temps = 0

    def temp(self) -> str:
        self.temps += 1
        return f"_t{self.temps}"

    def const(self, value: Any) -> str:
        name = f"_c{len(self.consts)}"
        self.consts[name] = value
        return name

    def peek(self) -> tuple[str, str]:
        return self.toks[self.at]

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.toks[self.at]
        if value is not None and tok[1] != value:
            raise _Cannot
        self.at += 1
        return tok

    def is_op(self, *values: str) -> bool:
        kind, value = self.toks[self.at]
        return kind == "op" and value in values

    def parse(self) -> str:
        code = self.ternary()
        if self.peek()[0] != "end":
            raise _Cannot
        return code

    def ternary(self) -> str:
        cond = self.or_()
        if not self.is_op("?"):
            return cond
        self.take("?")
        yes = self.or_()
        self.take(":")
        no = self.ternary()
        t = self.temp()
        return f"(({yes}) if ({t} := {cond}) is True else (({no}) if {t} is False else _u()))"

    def or_(self) -> str:
        return self.logic("||", self.and_, "True", "_or")

    def and_(self) -> str:
        return self.logic("&&", self.relation, "False", "_and")

    def logic(self, op: str, operand: Callable[[], str], decides: str, helper: str) -> str:
        """`a || b` / `a && b`, left to right: the left side alone decides when it is `decides`
        (True for ||, False for &&); else `helper` gives CEL's value of both."""
        left = operand()
        while self.is_op(op):
            self.take()
            t = self.temp()
            left = f"({decides} if ({t} := {left}) is {decides} else {helper}({t}, {operand()}))"
        return left

    def relation(self) -> str:
        left = self.addition()
        kind, value = self.peek()
        if (kind == "op" and value in _COMPARE) or (kind == "ident" and value == "in"):
            self.take()
            right = self.addition()
            if self.is_op(*_COMPARE) or self.peek() == ("ident", "in"):
                raise _Cannot  # CEL's relations do not chain (a < b < c is a parse error)
            return f"{_COMPARE[value] if value != 'in' else '_in'}({left}, {right})"
        return left

    def addition(self) -> str:
        left = self.product()
        while self.is_op("+", "-"):
            op = self.take()[1]
            left = f"{'_add' if op == '+' else '_sub'}({left}, {self.product()})"
        return left

    def product(self) -> str:
        left = self.unary()
        while self.is_op("*", "/", "%"):
            op = self.take()[1]
            left = f"{ {'*': '_mul', '/': '_div', '%': '_mod'}[op] }({left}, {self.unary()})"
        return left

    def unary(self) -> str:
        if self.is_op("!"):
            self.take()
            return f"_not({self.unary()})"
        if self.is_op("-"):
            self.take()
            if self.peek()[0] == "num":  # a negative literal (INT_MIN is one)
                return self.member(self.number(negative=True))
            return f"_neg({self.unary()})"
        return self.member(self.primary())

    def number(self, *, negative: bool = False) -> str:
        text = self.take()[1]
        if any(c in text for c in ".eE"):
            value: Any = float(text)
            if math.isinf(value):
                raise _Cannot
            value = -value if negative else value
        else:
            if len(text) > 1 and text[0] == "0":
                raise _Cannot  # leading zeros: not CEL's decimal literal
            value = -int(text) if negative else int(text)
            if not INT_MIN <= value <= INT_MAX:
                raise _Cannot
        return repr(value)

    def primary(self) -> str:
        kind, value = self.peek()
        if kind == "num":
            return self.number()
        if kind == "str":
            self.take()
            text = re.sub(r"\\.", lambda m: _ESCAPES[m.group()], value[1:-1])
            return self.const(text)
        if kind == "op" and value == "(":
            self.take()
            inner = self.ternary()
            self.take(")")
            return f"({inner})"
        if kind == "op" and value == "[":
            self.take()
            items: list[str] = []
            while not self.is_op("]"):
                items.append(self.ternary())
                if not self.is_op("]"):
                    self.take(",")
            self.take("]")
            return f"[{', '.join(items)}]"
        if kind != "ident":
            raise _Cannot
        self.take()
        if value in ("true", "false", "null"):
            return {"true": "True", "false": "False", "null": "None"}[value]
        if value in ("size", "has") and self.is_op("("):
            self.take("(")
            if value == "has":
                code = self.has()
            else:
                code = f"_size({self.ternary()})"
            self.take(")")
            return code
        if value in _RESERVED:
            raise _Cannot
        return self.variable(value)

    def variable(self, name: str) -> str:
        # A dotted name the environment declares is one variable (`run.task`): take the longest.
        parts, at = [name], self.at
        while self.toks[at] == ("op", ".") and self.toks[at + 1][0] == "ident":
            parts.append(self.toks[at + 1][1])
            at += 2
        for n in range(len(parts), 0, -1):
            dotted = ".".join(parts[:n])
            if dotted in self.variables:
                self.at += 2 * (n - 1)
                return f"v[{dotted!r}]"  # (a variable the call lacks: KeyError, NOT_MODELLED)
        raise _Cannot  # unknown (the checker refused it already), or a namespace

    def has(self) -> str:
        # has(x.f): x a member expression, its last step a field selection.
        kind, value = self.peek()
        if kind != "ident":
            raise _Cannot
        self.take()
        code = self.variable(value)
        last = None
        while self.is_op(".", "["):
            if last is not None:
                code = self.field(code, last)
                last = None
            if self.take()[1] == ".":
                last = self.field_name()
            else:
                code = f"_index({code}, {self.ternary()})"
                self.take("]")
        if last is None:
            raise _Cannot
        return f"_has({code}, {last!r})"

    def field_name(self) -> str:
        kind, value = self.take()
        if kind != "ident" or value in _RESERVED or value in ("true", "false", "null"):
            raise _Cannot
        return value

    def field(self, code: str, name: str) -> str:
        t = self.temp()
        return f"({t}[{name!r}] if type({t} := {code}) is dict and {name!r} in {t} else _u())"

    def member(self, code: str) -> str:
        while self.is_op(".", "["):
            if self.take()[1] == "[":
                index = self.ternary()
                self.take("]")
                code = f"_index({code}, {index})"
                continue
            name = self.field_name()
            if not self.is_op("("):
                code = self.field(code, name)
                continue
            self.take("(")
            args: list[str] = []
            while not self.is_op(")"):
                args.append(self.ternary())
                if not self.is_op(")"):
                    self.take(",")
            self.take(")")
            if name == "size" and not args:
                code = f"_size({code})"
            elif name in _STRING_METHODS and len(args) == 1:
                code = f"{_STRING_METHODS[name]}({code}, {args[0]})"
            else:
                raise _Cannot
        return code


# -- the operators, on the types they are modelled for (else `Unsupported`) --------------------


def _u() -> Any:
    raise Unsupported


def _kind(x: Any) -> str:
    t = type(x)
    if t is bool:
        return "bool"
    if t is int:
        if not INT_MIN <= x <= INT_MAX:
            raise Unsupported  # a uint to CEL, or beyond what it holds
        return "num"
    if t is float:
        return "num"
    if t is str:
        return "str"
    if x is None:
        return "null"
    raise Unsupported  # lists, maps: compared element by element in CEL, not modelled


# a == b of two values of one of these types is CEL's (two integers: int64 or uint to CEL, they
# compare as numbers either way; above 2**64 the arguments are not `convertible`).
_SAME = (str, float, bool, int, type(None))


def _eq(a: Any, b: Any) -> bool:
    t = type(a)
    if t is type(b) and t in _SAME:
        return bool(a == b)
    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        return False  # CEL's heterogeneous equality: another kind is not equal
    if ka == "num" and type(a) is not type(b) and max(abs(a), abs(b)) > 2**53:
        raise Unsupported  # an int and a double beyond the doubles' exact integers
    return bool(a == b)


def _ne(a: Any, b: Any) -> bool:
    return not _eq(a, b)


def _ordered(a: Any, b: Any) -> None:
    t = type(a)
    if t is type(b) and (t is str or t is float):
        return
    ka, kb = _kind(a), _kind(b)
    if ka != kb or ka == "null":
        raise Unsupported  # CEL: no matching overload
    if ka == "num" and type(a) is not type(b) and max(abs(a), abs(b)) > 2**53:
        raise Unsupported


def _lt(a: Any, b: Any) -> bool:
    _ordered(a, b)
    return bool(a < b)


def _le(a: Any, b: Any) -> bool:
    _ordered(a, b)
    return bool(a <= b)


def _gt(a: Any, b: Any) -> bool:
    _ordered(a, b)
    return bool(a > b)


def _ge(a: Any, b: Any) -> bool:
    _ordered(a, b)
    return bool(a >= b)


def _in(a: Any, b: Any) -> bool:
    if type(b) is list:
        return any(_eq(a, item) for item in b)
    if type(b) is dict and type(a) is str:
        return a in b
    raise Unsupported


_COMPARE = {"<": "_lt", "<=": "_le", ">": "_gt", ">=": "_ge", "==": "_eq", "!=": "_ne"}


def _ints(a: Any, b: Any) -> bool:
    """Both int64 (True), both doubles (False), else not modelled."""
    ta, tb = type(a), type(b)
    if ta is int and tb is int:
        if not (INT_MIN <= a <= INT_MAX and INT_MIN <= b <= INT_MAX):
            raise Unsupported
        return True
    if ta is float and tb is float:
        return False
    raise Unsupported


def _int_result(x: int) -> int:
    if not INT_MIN <= x <= INT_MAX:
        raise Unsupported  # CEL: integer overflow
    return x


def _add(a: Any, b: Any) -> Any:
    if type(a) is str and type(b) is str:
        return a + b
    return _int_result(a + b) if _ints(a, b) else a + b


def _sub(a: Any, b: Any) -> Any:
    return _int_result(a - b) if _ints(a, b) else a - b


def _mul(a: Any, b: Any) -> Any:
    return _int_result(a * b) if _ints(a, b) else a * b


def _div(a: Any, b: Any) -> Any:
    if _ints(a, b):
        if b == 0 or (a == INT_MIN and b == -1):
            raise Unsupported  # divide by zero, overflow
        q = abs(a) // abs(b)  # CEL truncates toward zero
        return q if (a < 0) == (b < 0) else -q
    if b == 0.0:
        raise Unsupported  # IEEE infinity or NaN in CEL: left to cel-cpp
    return a / b


def _mod(a: Any, b: Any) -> Any:
    if not _ints(a, b) or b == 0 or (a == INT_MIN and b == -1):
        raise Unsupported  # doubles have no %, modulus by zero
    r = abs(a) % abs(b)  # the sign of the dividend, as in C
    return r if a >= 0 else -r


def _not(x: Any) -> bool:
    if type(x) is not bool:
        raise Unsupported
    return not x


def _neg(x: Any) -> Any:
    if type(x) is int and INT_MIN < x <= INT_MAX:
        return -x
    if type(x) is float:
        return -x
    raise Unsupported


def _and(a: Any, b: Any) -> bool:
    """`a && b` once `a` is known not to be false: CEL's value when both are bools."""
    if a is True and type(b) is bool:
        return b
    raise Unsupported  # an error or a non-bool on either side: CEL's commutative rules


def _or(a: Any, b: Any) -> bool:
    """`a || b` once `a` is known not to be true."""
    if a is False and type(b) is bool:
        return b
    raise Unsupported


def _index(container: Any, i: Any) -> Any:
    if type(container) is dict and type(i) is str and i in container:
        return container[i]
    if type(container) is list and type(i) is int and 0 <= i < len(container):
        return container[i]
    raise Unsupported  # no such key or index, or another type


def _has(m: Any, name: str) -> bool:
    if type(m) is dict:
        return name in m
    raise Unsupported


def _size(x: Any) -> int:
    if type(x) in (str, list, dict):
        return len(x)
    raise Unsupported


def _starts(s: Any, a: Any) -> bool:
    if type(s) is str and type(a) is str:
        return s.startswith(a)
    raise Unsupported


def _ends(s: Any, a: Any) -> bool:
    if type(s) is str and type(a) is str:
        return s.endswith(a)
    raise Unsupported


def _contains(s: Any, a: Any) -> bool:
    if type(s) is str and type(a) is str:
        return a in s
    raise Unsupported


_STRING_METHODS = {"startsWith": "_starts", "endsWith": "_ends", "contains": "_contains"}
_HELPERS = {name: value for name, value in globals().items() if name.startswith("_") and callable(value)}

# What a rule's function raises when it cannot decide: `Unsupported`, or KeyError for a variable
# the call's variables lack.
NOT_MODELLED = (Unsupported, KeyError)


def compile_rule(when: str, variables: frozenset[str]) -> Fn | None:
    """`when` (which cel-cpp compiled and type-checked already) as a Python function of a call's
    variables, or None when it is outside the subset. The function returns the condition's value
    or raises one of `NOT_MODELLED` (evaluate with cel-cpp then)."""
    try:
        parser = _Parser(when, variables)
        code = parser.parse()
    except (_Cannot, IndexError, KeyError, ValueError, RecursionError):
        return None
    try:
        fn: Fn = eval(f"lambda v: {code}", {**_HELPERS, **parser.consts})  # the text is made here
    except (SyntaxError, RecursionError, MemoryError):
        return None  # (nested past what CPython's compiler takes)
    return fn
