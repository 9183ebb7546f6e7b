"""Tool policies at start-up (proxy/config/rules.py): every rule is compiled when the
configuration is built, and each kind of bad rule is a `ConfigError` naming the tool and the rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.config import ConfigError, build_config

ACCEPTANCE = [
    {"name": "large", "when": "args.amount > 100", "effect": "approve", "reason": "over 100 needs a person"},
    {"name": "non-eur", "when": "args.currency != 'EUR'", "effect": "deny", "reason": "only EUR refunds"},
]


def http(rules: Any, **tool: Any) -> dict[str, Any]:
    return {"tools": {"refund": {"url": "http://127.0.0.1:9/refund", "rules": rules, **tool}}}


def mcp(rules: Any, **server: Any) -> dict[str, Any]:
    tools = {"refund": {"rules": rules}}
    return {"mcp": {"crm": {"url": "http://127.0.0.1:9/mcp", "tools": tools, **server}}}


def error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        build_config(raw, {})
    return str(e.value)


def rule(when: str = "true", effect: str = "deny", **more: Any) -> dict[str, Any]:
    return {"name": "r1", "when": when, "effect": effect, **more}


def test_acceptance_policy_compiles_on_both_gateways() -> None:
    tools = build_config(http(ACCEPTANCE), {}).tools["refund"].rules
    assert [(r.name, r.effect, r.mode, r.needs_state) for r in tools] == [
        ("large", "approve", "wait", False),
        ("non-eur", "deny", "wait", False),
    ]
    assert all(r.program is not None for r in tools)
    served = build_config(mcp(ACCEPTANCE), {}).mcp["crm"].tools["refund"].rules
    assert [r.name for r in served] == ["large", "non-eur"]
    state = build_config(http([rule("run.spent_usd > 2.0")]), {})
    assert state.tools["refund"].rules[0].needs_state  # the one kind of rule that reads the ledger


EFFECTS = "effect: expected one of allow, deny, approve, cap, got 'block'"
# Each row: the rules, and what the message must say beyond naming tool and rule.
BAD_RULES = [
    ("does not parse", [rule("args.amount >")], "Syntax error"),
    ("unknown variable", [rule("amount > 100")], "undeclared reference to 'amount'"),
    ("unknown field of run", [rule("run.dollars > 1.0")], "'run.dollars'"),
    ("unknown field of tool", [rule("tool.owner == 'x'")], "'tool.owner'"),
    ("double vs int", [rule("run.spent_usd > 2")], "(double, int)"),
    ("not a condition", [rule("run.steps + 1")], "is a int, not a condition"),
    ("unknown effect", [rule(effect="block")], EFFECTS),
    ("mode on deny", [rule(mode="wait")], "mode: only an approve rule has a mode"),
    ("bad mode", [rule(effect="approve", mode="later")], "mode: expected wait or defer"),
    ("cap without max_calls", [rule(effect="cap")], "max_calls: a cap rule needs max_calls"),
    ("cap of zero", [rule(effect="cap", max_calls=0)], "max_calls: a cap rule needs max_calls"),
    ("max_calls on allow", [rule(effect="allow", max_calls=2)], "only a cap rule has max_calls"),
    ("duplicate name", [rule(effect="allow"), rule("false")], ").name: used by another rule of this tool"),
    ("unknown key", [rule(because="x")], ".because: unknown setting"),
    ("empty when", [rule(" ")], "when: required"),
]


@pytest.mark.parametrize(("what", "rules", "says"), BAD_RULES, ids=[r[0] for r in BAD_RULES])
def test_bad_rule_is_a_config_error_naming_tool_and_rule(what: str, rules: Any, says: str) -> None:
    index = len(rules) - 1
    message = error(http(rules))
    assert message.startswith(f"tools.refund.rules[{index}] (rule \"r1\" of tool 'refund')"), message
    assert says in message, message
    served = error(mcp(rules))
    named = f"mcp.crm.tools.refund.rules[{index}] (rule \"r1\" of tool 'refund' of MCP server 'crm')"
    assert served.startswith(named) and says in served, served


def test_http_only_variables_are_not_there_for_mcp() -> None:
    method = [rule("method == 'POST' && path == ''")]
    assert build_config(http(method), {}).tools["refund"].rules[0].name == "r1"
    assert "undeclared reference to 'method'" in error(mcp(method))


def test_rule_without_a_name_and_rules_not_a_list() -> None:
    assert error(http([{"when": "true", "effect": "deny"}])).startswith(
        "tools.refund.rules[0] (of tool 'refund').name: required"
    )
    assert error(http({"name": "r1"})) == (
        "tools.refund.rules: expected an array of tables ([[tools.refund.rules]] sections)"
    )


def test_rules_for_a_tool_that_is_not_configured() -> None:
    assert error({"tools": {"refund": {"rules": [rule()]}}}) == (
        "tools.refund.rules: rules for tool 'refund', which is not configured (tools.refund.url is missing)"
    )
    assert error({"mcp": {"crm": {"tools": {"refund": {"rules": [rule()]}}}}}) == (
        "mcp.crm.tools.refund.rules: rules for tool 'refund' of MCP server 'crm', which is not configured "
        "(mcp.crm.url is missing)"
    )
    # A tool the operator denied outright: its rules could never apply.
    assert error(mcp([rule()], deny=["refund"])).startswith(
        "mcp.crm.tools.refund.rules: tool 'refund' of MCP server 'crm' is denied (mcp.crm.deny)"
    )


def test_cel_is_loaded_only_when_a_tool_has_rules(tmp_path: Path) -> None:
    """cel-cpp and protobuf are ~10 MB of the serving process's RSS: an app built from a
    configuration without rules does not import them, one with a rule does (bench/README.md)."""
    probe = (
        "import sys\n"
        "from proxy.app import build_app\n"
        "from proxy.config import build_config\n"
        f"raw = {{'data_dir': {str(tmp_path)!r}, 'tracing': False}}\n"
        "if sys.argv[1] == 'rules':\n"
        "    raw['tools'] = {'refund': {'url': 'http://127.0.0.1:9/refund', 'rules': [\n"
        "        {'name': 'r1', 'when': 'args.amount > 100', 'effect': 'deny'}]}}\n"
        "build_app(build_config(raw, {}))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('cel_expr_python', 'google.protobuf')))[:1])\n"
    )
    seen = {
        kind: subprocess.run(
            [sys.executable, "-c", probe, kind], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
        for kind in ("none", "rules")
    }
    assert seen == {"none": "[]", "rules": "['cel_expr_python']"}
