"""The common rules in Python (proxy/toolcall/fastcel.py) against cel-cpp itself, the oracle: on
generated expressions of the subset and generated arguments — edge values included (int64's and
the doubles' bounds, NaN, -0.0, integers a uint to CEL or beyond it, lone surrogates, nesting) —
every value the Python function gives is cel-cpp's value, of the same type; where it says
`Unsupported`, the caller asks cel-cpp. And whole policies decide the same with and without it.

Fixed counts from fixed seeds (no time budget), each with a minimum of cases the Python side
decided itself, so the comparison is never vacuous."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from proxy.config.rules import environment, read_rules, variable_names
from proxy.toolcall.fastcel import INT_MAX, INT_MIN, Unsupported, compile_rule, convertible
from proxy.toolcall.policy import ToolPolicy

ENV = environment(http=True)
NAMES = frozenset(variable_names(http=True))
KEYS = ["a", "b", "c"]
EDGE_INTS = [
    0,
    1,
    -1,
    2,
    3,
    -5,
    7,
    100,
    INT_MAX,
    INT_MIN,
    2**53,
    2**53 + 1,
    -(2**53) - 1,
    2**63,
    2**64 - 1,
    2**64,
]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, 2.5, -3.0, 1e300, 9007199254740992.0, math.nan, math.inf, -math.inf]
EDGE_STRS = ["", "EUR", "eu", "x", "xyz", "é1", "日本", "a'b", 'q"', "line\nbreak"]


def value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 2 and roll < 0.12:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2 and roll < 0.2:
        return {k: value(rng, depth + 1) for k in rng.sample(KEYS, rng.randint(0, 3))}
    return rng.choice(
        [
            *EDGE_INTS,
            *EDGE_FLOATS,
            *EDGE_STRS,
            True,
            False,
            None,
            rng.randint(-1000, 1000),
            rng.random() * 200 - 100,
        ]
    )


def make_args(rng: random.Random) -> dict[str, Any]:
    args = {k: value(rng) for k in rng.sample(KEYS, rng.randint(0, 3))}
    if rng.random() < 0.02:
        args["b"] = "\ud800"  # json.loads lets a lone surrogate through; cel-cpp cannot hold it
    return args


def literal(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return str(rng.choice([0, 1, 2, 3, 5, 7, 10, 100, 1000, INT_MAX, -1, -5, INT_MIN]))
    if kind == 1:
        return rng.choice(["0.0", "1.5", "2e3", "100.0", "-2.5", "1e300"])
    if kind == 2:
        return rng.choice(["''", "'EUR'", "'x'", '"xyz"', "'é'", "'a\\'b'", "'\\n'"])
    if kind == 3:
        return rng.choice(["true", "false", "null"])
    if kind == 4:
        return "[" + ", ".join(literal(rng) for _ in range(rng.randint(0, 3))) + "]"
    return rng.choice(["run.task", "tool.name", "run.spent_usd", "run.steps", "method"])


def operand(rng: random.Random, depth: int) -> str:
    roll = rng.random()
    if depth > 2 or roll < 0.45:
        return (
            rng.choice([f"args.{rng.choice(KEYS)}", f"args['{rng.choice(KEYS)}']"])
            if roll < 0.3
            else literal(rng)
        )
    if roll < 0.6:
        return f"({operand(rng, depth + 1)} {rng.choice('+-*/%')} {operand(rng, depth + 1)})"
    if roll < 0.7:
        return f"-{operand(rng, depth + 1)}"
    if roll < 0.8:
        return f"{operand(rng, depth + 1)}[{rng.choice(['0', '1', '-1', repr(rng.choice(KEYS))])}]"
    if roll < 0.9:
        return rng.choice([f"size({operand(rng, depth + 1)})", f"{operand(rng, depth + 1)}.size()"])
    test = condition(rng, depth + 1) if rng.random() < 0.8 else f"args.{rng.choice(KEYS)}"
    return f"({test} ? {operand(rng, depth + 1)} : {operand(rng, depth + 1)})"


def condition(rng: random.Random, depth: int = 0) -> str:
    roll = rng.random()
    if depth > 2 or roll < 0.5:
        op = rng.choice(["<", "<=", ">", ">=", "==", "!=", "in"])
        return f"{operand(rng, depth + 1)} {op} {operand(rng, depth + 1)}"
    if roll < 0.65:
        method = rng.choice(["startsWith", "endsWith", "contains"])
        return f"{operand(rng, depth + 1)}.{method}({operand(rng, depth + 1)})"
    if roll < 0.72:
        return f"has(args.{rng.choice(KEYS)})"
    if roll < 0.8:
        return f"!({condition(rng, depth + 1)})"
    sides = [condition(rng, depth + 1) if rng.random() < 0.85 else f"args.{rng.choice(KEYS)}" for _ in "lr"]
    return f"({sides[0]} {rng.choice(['&&', '||'])} {sides[1]})"  # (a dyn side: any value, at run time)


def variables(rng: random.Random, args: Any) -> dict[str, Any]:
    return {
        "args": args, "tool.name": "refund", "tool.server": "", "run.id": "r1",
        "run.task": rng.choice(["", "x"]), "run.tenant": "", "method": "POST", "path": "",
        "run.spent_usd": 1.5, "run.steps": 2, "run.step": 2, "run.tool_calls": 0,
    }  # fmt: skip


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is float and math.isnan(a):
        return math.isnan(b)
    return bool(a == b) and (type(a) is not float or math.copysign(1, a) == math.copysign(1, b))


def test_every_value_the_python_rules_give_is_cel_cpps() -> None:
    rng = random.Random(2026)
    compiled = decided = 0
    for _ in range(6000):
        text = condition(rng) if rng.random() < 0.8 else operand(rng, 0)
        try:
            program = ENV.compile(text)
        except RuntimeError:
            continue  # the type checker refuses it: a config error, never evaluated
        fn = compile_rule(text, NAMES)
        assert fn is not None, f"outside the subset: {text!r}"
        compiled += 1
        for _ in range(3):
            args = make_args(rng)
            if not convertible(args):
                continue  # every rule goes to cel-cpp then (ToolPolicy.decide)
            var = variables(rng, args)
            try:
                got = fn(var)
            except Unsupported:
                continue
            decided += 1
            want = program.eval(ENV.Activation(var)).value()
            if type(got) in (list, dict):
                continue  # (a list's ExprValue is not compared here; conditions are bools)
            assert same(got, want), f"{text!r} on {args!r}: Python {got!r}, cel-cpp {want!r}"
    print(f"compiled {compiled}, decided in Python {decided}")
    assert compiled >= 1500 and decided >= 2500, (compiled, decided)


@pytest.mark.parametrize(
    "text",
    [
        "args.tags.exists(t, t == 'vip')",  # macros other than has()
        "args.a.matches('^x')",  # RE2
        "args.a > 1u",  # unsigned literal
        "args.a == 0x10",  # hex literal
        "args.a == r'x'",  # raw string
        "args.a == b'x'",  # bytes
        "args.a == '\\u00e9'",  # an escape outside the subset
        "args.a == 1 == true",  # a chained relation
        "args.a == 007",
        "timestamp(args.t) > timestamp('2026-01-01T00:00:00Z')",
        "int(args.a) > 1",
        "{'k': 1}['k'] == args.a",  # map literals
    ],
)
def test_an_expression_outside_the_subset_is_left_to_cel_cpp(text: str) -> None:
    assert compile_rule(text, NAMES) is None


def test_the_python_side_reports_what_it_does_not_model() -> None:
    """Errors CEL gives (a missing key, a type mismatch, an overflow, a division by zero) and
    values it does not model are `Unsupported` here — never a value of its own."""
    cases = {
        "args.a > 100": [{}, {"a": "x"}, {"a": True}, {"a": 2**63}, {"a": None}],
        "args.a + 1 > 0": [{"a": INT_MAX}, {"a": 1.5}],
        "(args.a + 1) * 0 == 0": [{"a": INT_MAX}],  # the overflow in between is CEL's error
        "args.a / 0 == 1": [{"a": 5}],
        "args.a % 0 == 1": [{"a": 5}],
        "-args.a < 0": [{"a": INT_MIN}],
        "args.a == [1]": [{"a": [1]}],
        "args.a.startsWith('x')": [{"a": 1}],
        "args.a[2] == 1": [{"a": [1, 2]}],
        "!args.a": [{"a": 1}],
        "args.a && true": [{"a": 1}],
        "args.a || false": [{"a": 1}, {"a": "x"}],  # a non-bool side: CEL's error, not Python's truth
        "(args.a ? 1 : 2) == 1": [{"a": 1}, {"a": None}],
        "args.a == 9007199254740993": [{"a": 9007199254740992.0}],
    }
    for text, argss in cases.items():
        fn = compile_rule(text, NAMES)
        assert fn is not None, text
        for args in argss:
            with pytest.raises(Unsupported):
                fn({"args": args})


def test_cel_semantics_the_python_side_keeps() -> None:
    """The rules where Python's own operators differ from CEL's, checked against cel-cpp."""
    cases = [
        ("args.a / 2 == -2", {"a": -5}),  # truncation toward zero (Python floors: -3)
        ("args.a % 3 == -2", {"a": -5}),  # the dividend's sign (Python: 1)
        ("args.a == 1", {"a": 1.0}),  # heterogeneous numeric equality
        ("args.a == 'x'", {"a": 1}),  # another kind: not equal, not an error
        ("args.a == true", {"a": 1}),  # a bool is not a number
        ("args.a in [1, 'x']", {"a": 1.0}),
        ("size(args.a) == 2", {"a": "é1"}),  # code points
        ("args.a > 1", {"a": math.nan}),
        ("args.a != args.a", {"a": math.nan}),
        ("args.a > 1 && args.b", {"a": 0}),  # false && (error) is false
        ("args.b || args.a < 1", {"a": 0}),  # (error) || true: not modelled, cel-cpp says true
        ("'k' in args.a", {"a": {"k": 1}}),
        ("args.a >= 1.5", {"a": 2}),
        ("args.a < 'b'", {"a": "ab"}),
        ("args.a.endsWith('z')", {"a": "xyz"}),
        ("args.a.startsWith('z')", {"a": "xyz"}),
        ("args.a.contains('y')", {"a": "xyz"}),
        ("args.a.contains('xz')", {"a": "xyz"}),
        ("(args.a ? 'y' : 'n') == 'n'", {"a": False}),
    ]
    for text, args in cases:
        fn = compile_rule(text, NAMES)
        assert fn is not None, text
        var = {"args": args}
        want = ENV.compile(text).eval(ENV.Activation(var)).value()
        try:
            got = fn(var)
        except Unsupported:
            continue
        assert same(got, want), (text, args, got, want)
    assert compile_rule("args.a / 2 == -2", NAMES)({"args": {"a": -5}}) is True  # type: ignore[misc]
    assert compile_rule("args.a % 3 == -2", NAMES)({"args": {"a": -5}}) is True  # type: ignore[misc]


def test_policies_decide_the_same_with_and_without_the_python_rules() -> None:
    rng = random.Random(7)
    decided = errors = 0
    for _ in range(400):
        whens = []
        while len(whens) < rng.randint(1, 12):
            text = condition(rng) if rng.random() < 0.85 else "args.c.exists(t, t == 1)"
            try:
                if ENV.compile(text).return_type() in (ENV.compile("true").return_type(),):
                    whens.append(text)
            except RuntimeError:
                continue
        rules = read_rules(
            [{"name": f"r{i}", "when": w, "effect": "deny"} for i, w in enumerate(whens)], "w", "t", http=True
        )
        fast, slow = ToolPolicy(rules, http=True), ToolPolicy(rules, http=True, fast=False)
        for _ in range(5):
            var = variables(rng, make_args(rng))
            got, want = fast.decide(var), slow.decide(var)
            assert (got.rule, got.error) == (want.rule, want.error), (whens, var)
            decided += got.rule is not None and not got.error
            errors += bool(got.error)
    assert decided >= 200 and errors >= 300, (decided, errors)


def test_a_fallback_keeps_no_frames_of_the_ones_before() -> None:
    """Each `Unsupported` is a new exception: a shared instance re-raised gathers every raise's
    traceback (and the frames, with the call's arguments, they hold) — memory growing with every
    tool call that falls back to cel-cpp."""
    fn = compile_rule("args.a > 1", NAMES)
    assert fn is not None
    caught = []
    for _ in range(200):
        try:
            fn({"args": {}})
        except Unsupported as e:
            caught.append(e)
    assert len({id(e) for e in caught}) == 200

    def depth(e: BaseException) -> int:
        n, tb = 0, e.__traceback__
        while tb is not None:
            n, tb = n + 1, tb.tb_next
        return n

    assert max(depth(e) for e in caught) <= 5
