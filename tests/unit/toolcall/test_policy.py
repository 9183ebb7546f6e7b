"""A tool's rules as `ToolPolicy` evaluates them (proxy/toolcall/policy.py): in chunks of one CEL
program each, with the semantics of the rules one by one — the first that holds decides, a rule is
evaluated only when those before it are false, and one that fails decides too (fail closed)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.config.rules import read_rules
from proxy.toolcall.policy import ToolPolicy, Verdict

# Conditions that hold, fail or error depending on the arguments (a missing key, a type mismatch).
CONDITIONS = [
    "args.amount > 100",
    "args.amount <= 5",
    "args.currency != 'EUR'",
    "args.currency == 'EUR' && args.amount > 50",
    "has(args.note) && args.note.startsWith('x')",
    "args.note.size() > 3",  # errors when note is absent
    "args.tags.exists(t, t == 'vip')",  # errors when tags is absent
    "args.amount / args.divisor > 1",  # errors on division by zero, or when divisor is absent
    "tool.name == 'other'",
    "run.task == 'nightly'",
    # deep enough that eight of them do not fit in one program (cel-cpp's recursion limit)
    DEEP := "(" * 20 + "args.amount" + "".join(f" + {i})" for i in range(20)) + " > 200",
]


# The conditions toolcall/fastcel.py evaluates in Python (the others are outside its subset).
SIMPLE = set(CONDITIONS) - {"args.tags.exists(t, t == 'vip')"}


def one_by_one(policy: ToolPolicy, variables: dict[str, Any]) -> Verdict:
    """The reference: every rule's own program, in order."""
    return policy._diagnose(policy.env.Activation(variables), 0, len(policy.rules))


def make_args(rng: random.Random) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if rng.random() < 0.9:
        args["amount"] = rng.choice([0, 3, 5, 7, 20, 60, 150, 2.5, "lots"])
    if rng.random() < 0.8:
        args["currency"] = rng.choice(["EUR", "USD"])
    if rng.random() < 0.5:
        args["note"] = rng.choice(["", "xyz", "hello"])
    if rng.random() < 0.5:
        args["tags"] = rng.sample(["vip", "new", "late"], rng.randint(0, 2))
    if rng.random() < 0.6:
        args["divisor"] = rng.choice([0, 1, 10])
    return args


@pytest.mark.parametrize("fast", [False, True], ids=["cel-cpp only", "with the Python rules"])
def test_chunked_evaluation_is_the_rules_one_by_one(fast: bool) -> None:
    """In chunks of CEL programs, and with the common rules evaluated in Python (fastcel.py)
    between them: the same verdict as every rule's own program in order."""
    rng = random.Random(23)
    decided = errors = 0
    for _ in range(300):
        n = rng.randint(1, 20)
        rules = read_rules(
            [{"name": f"r{i}", "when": rng.choice(CONDITIONS), "effect": "deny"} for i in range(n)],
            "tools.t.rules", "tool 't'", http=True,
        )  # fmt: skip
        policy = ToolPolicy(rules, http=True, fast=fast)
        assert sum(size for _, size, _, _ in policy.chunks) == n
        assert policy.fast == (fast and any(r.when in SIMPLE for r in rules))
        task = rng.choice(["", "nightly"])
        variables = {"args": make_args(rng), "tool.name": "refund", "tool.server": "", "run.task": task}
        got, want = policy.decide(variables), one_by_one(policy, variables)
        assert (got.rule, bool(got.error)) == (want.rule, bool(want.error)), (rules, variables)
        decided += got.rule is not None and not got.error
        errors += bool(got.error)
    assert decided >= 50 and errors >= 50  # both kinds of outcome were exercised


def test_deep_rules_get_programs_of_their_own_size() -> None:
    table = [{"name": f"r{i}", "when": DEEP, "effect": "deny"} for i in range(8)]
    table.append({"name": "small", "when": "args.amount < 10", "effect": "allow"})
    rules = read_rules(table, "w", "t", http=True)
    policy = ToolPolicy(rules, http=True, fast=False)
    assert len(policy.chunks) >= 2 and policy.chunks[0][1] > 1  # eight did not fit in one, a few did
    assert all(program is not None for _, _, program, _ in policy.chunks)
    assert policy.decide({"args": {"amount": 20}}).rule is rules[0]  # 20 + 190 > 200
    assert policy.decide({"args": {"amount": 5}}).rule is rules[8]
    assert policy.decide({"args": {"amount": 10}}) == Verdict(None)


def test_a_failing_rule_after_one_that_holds_is_never_evaluated() -> None:
    rules = read_rules(
        [{"name": "small", "when": "args.amount < 10", "effect": "allow"},
         {"name": "noted", "when": "args.note.size() > 3", "effect": "deny"}],
        "w", "t", http=True,
    )  # fmt: skip
    policy = ToolPolicy(rules, http=True)
    assert policy.fast
    assert policy.decide({"args": {"amount": 5}}) == Verdict(rules[0])
    failed = policy.decide({"args": {"amount": 50}})
    assert failed.rule is rules[1] and "Key not found in map" in failed.error
