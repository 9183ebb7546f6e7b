"""Tool policies (README "Tool policies"): the check both tool gateways make before the ledger's
begin — `/tools/{name}` (proxy/tools/gateway.py) and MCP `tools/call` (proxy/mcp/tools_call.py)
alike — so a call a rule denies, or that waits for a person, has reached neither the tool nor
the idempotency records.

A tool's rules (compiled at start-up: proxy/config/rules.py) are evaluated in order; the first
whose `when` holds decides:

* `allow` → the call goes on; `deny` → `ToolCallDenied` (403 `tool_call_denied`, the rule's
  reason in the message; MCP answers it as a `tools/call` result with `isError: true`, which the
  model reads);
* `approve` → the call waits at the `ApprovalGate` (approval.py) until a person decides;
* `cap` → allowed while the run's calls matching the rule are fewer than `max_calls`, denied
  after. Counted in the ledger as the tool calls of a run of its own,
  `{run}/policy:{tool}/{rule}` (a `/` never occurs in a run id), keyed by the call's idempotency
  key: atomic across replicas, nothing new in the ledger, a replay of the same call is not
  counted twice, and a call the ledger then refuses is given back (`Admission.release`).

No rule holds → `allow`. A rule that cannot be evaluated (an argument missing, of another type,
a number out of range) denies the call — fail closed — with the evaluation error as the reason,
on the span (`policy.error`) and in `runcap_policy_decisions_total{effect="error"}`.

A tool without rules costs one dict lookup; the run's state is read from the ledger (one
`touch_run`) only for a tool whose rules use `run.spent_usd`, `run.steps` or `run.tool_calls`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.caps import RunCaps, RunRequest
from proxy.config import Config
from proxy.config.rules import ToolRule, environment, variable_names
from proxy.errors import BudgetExceeded, Rejection
from proxy.hashing import parse_json
from proxy.ledger.base import Ledger, RunState, ToolCallRequest
from proxy.server.metrics import Metrics
from proxy.toolcall.call import ToolCall
from proxy.toolcall.fastcel import NOT_MODELLED, Fn, compile_rule, convertible

if TYPE_CHECKING:
    from proxy.toolcall.approval import ApprovalGate


@dataclass(frozen=True, slots=True)
class PolicyDecision:
    effect: str  # "allow" | "deny" | "approve"   (a cap over its limit is a "deny")
    rule: str = ""  # the deciding rule's name; "" = no rule matched
    reason: str = ""
    mode: str = "wait"  # approve: "wait" | "defer"


class ToolCallDenied(Rejection):
    """A rule of the tool's policy denies the call (or its cap is used up, or it failed to
    evaluate): nothing reached the tool. `param` names the rule."""

    status = 403
    type = "tool_call_denied"
    code = "denied_by_rule"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a tool's rules say of one call: the deciding rule (None: none holds), and the
    evaluation error when the rule could not be evaluated."""

    rule: ToolRule | None
    error: str = ""


class ToolPolicy:
    """One tool's compiled rules, in order; the first that holds decides.

    A rule of the common kind (toolcall/fastcel.py: comparisons, string tests, membership,
    `&&` / `||` over arguments and the run) is evaluated in Python — exactly, or it says it cannot
    and that rule goes to cel-cpp — because cel-cpp's working set is cold between two tool calls
    of a busy process (~130 µs for ten rules, against ~15 µs in Python). The other rules are
    evaluated by cel-cpp in chunks: each chunk is one CEL program,
    `(when0) ? 0 : ((when1) ? 1 : ... -1)`, that gives the index of the first of its rules that
    holds — one call into CEL for up to `CHUNK` rules instead of one per rule. The semantics are
    the rules' one by one: a rule is evaluated only when the ones before it are false, and an
    error in one (which fails the whole chunk) is told apart by evaluating that chunk's rules one
    by one (`_diagnose`)."""

    CHUNK = 16  # rules per program; cel-cpp's recursion limit (32) bounds how deep one may nest

    def __init__(self, rules: tuple[ToolRule, ...], *, http: bool, fast: bool = True) -> None:
        self.rules = rules
        self.env = environment(http=http)  # the one the rules were compiled in
        self.needs_state = any(r.needs_state for r in rules)
        names = frozenset(variable_names(http=http))
        fns = [compile_rule(r.when, names) if fast else None for r in rules]
        # (first rule, rules, CEL program or None, Python function or None): a Python rule alone
        # (its program is the rule's own when it falls back), the others in chunks.
        self.chunks: list[tuple[int, int, Any, Fn | None]] = []
        at = 0
        while at < len(rules):
            if fns[at] is not None:
                self.chunks.append((at, 1, rules[at].program, fns[at]))
                at += 1
                continue
            run = 1
            while at + run < len(rules) and fns[at + run] is None and run < self.CHUNK:
                run += 1
            size = run
            while True:
                program = self._combined(at, size)
                if program is not None or size == 1:
                    break
                size //= 2  # deep conditions: fewer per program
            self.chunks.append((at, size, program, None))
            at += size
        self.fast = any(fn is not None for fn in fns)

    def _combined(self, at: int, size: int) -> Any:
        expression = "-1"
        for index in range(at + size - 1, at - 1, -1):
            expression = f"({self.rules[index].when}) ? {index} : ({expression})"
        try:
            return self.env.compile(expression)
        except RuntimeError:
            return None  # past the recursion limit: that rule is evaluated on its own

    def decide(self, variables: Mapping[str, Any]) -> Verdict:
        # Python only on arguments cel-cpp would take (it converts them all at its first eval,
        # whichever rule reads them): else every rule goes to cel-cpp, which gives its error.
        fast = self.fast and convertible(variables.get("args"))
        activation = None
        for at, size, program, fn in self.chunks:
            if fn is not None and fast:
                try:
                    value = fn(variables)
                except NOT_MODELLED:
                    value = None
                if value is True:
                    return Verdict(self.rules[at])
                if value is False:
                    continue
            if activation is None:
                try:
                    activation = self.env.Activation(variables)
                except Exception as e:  # arguments CEL cannot hold: nothing can be decided on them
                    return Verdict(self.rules[0], f"the arguments cannot be evaluated: {e}")
            if fn is not None or program is None:
                verdict = self._diagnose(activation, at, size)
            else:
                try:
                    value = program.eval(activation).value()
                except Exception:
                    value = None
                if value == -1:
                    continue
                if type(value) is int:
                    return Verdict(self.rules[value])
                verdict = self._diagnose(activation, at, size)  # an error value: whose?
            if verdict.rule is not None:
                return verdict
        return Verdict(None)

    def _diagnose(self, activation: Any, at: int, size: int) -> Verdict:
        """The chunk's rules one by one: the first that holds, or the first that fails."""
        for rule in self.rules[at : at + size]:
            try:
                value = rule.program.eval(activation).value()
            except Exception as e:
                return Verdict(rule, f"{type(e).__name__}: {e}")
            if value is True:
                return Verdict(rule)
            if value is not False:  # an error value (its text), or not a bool at all
                return Verdict(rule, value if isinstance(value, str) else f"the condition gave {value!r}")
        return Verdict(None)


def _state_variables(state: RunState) -> dict[str, Any]:
    steps = state.steps
    return {
        "run.spent_usd": state.spent_usd_nanos / 1e9,
        "run.steps": steps,
        "run.step": steps,
        "run.tool_calls": state.tool_calls,
    }


class Admission:
    """A call the policy let through; `release` gives back what it counted (a cap rule's claim)
    when the ledger then refuses the call, so a call never executed is not counted."""

    __slots__ = ("_claim", "_ledger")

    def __init__(self, ledger: Ledger | None = None, claim: tuple[str, str] | None = None) -> None:
        self._ledger = ledger
        self._claim = claim

    async def release(self) -> None:
        if self._ledger is not None and self._claim is not None:
            run_id, key = self._claim
            await self._ledger.resolve_tool_call(run_id, key, done=False, now=time.time(), force=True)
            self._claim = None


ADMITTED = Admission()


def policies_of(config: Config) -> dict[str, ToolPolicy]:
    """Every configured tool's policy, by the tool's name in the ledger (`refund`,
    `mcp:crm/refund`); tools without rules are not in it."""
    out = {name: ToolPolicy(t.rules, http=True) for name, t in config.tools.items() if t.rules}
    for server in config.mcp.values():
        for name, tool in server.tools.items():
            if tool.rules:
                out[f"mcp:{server.name}/{name}"] = ToolPolicy(tool.rules, http=False)
    return out


class PolicyCheck:
    """The check both gateways make before `begin_tool_call` (`admit`)."""

    def __init__(self, config: Config, ledger: Ledger, metrics: Metrics, gate: ApprovalGate,
                 tenants: bool = False) -> None:  # fmt: skip
        self.policies = policies_of(config)
        self.ledger = ledger
        self.metrics = metrics
        self.gate = gate
        self.tenants = tenants  # run ids are `{tenant}:{id}` (client tokens are on)

    def has_rules(self, qualified: str) -> bool:
        return qualified in self.policies

    async def admit(
        self, call: ToolCall, req: ToolCallRequest, run: RunRequest, *, args: Any, server: str = "",
        method: str = "", path: str = "", keepalive: Callable[[], Awaitable[None]] | None = None,
    ) -> Admission:  # fmt: skip
        """Decide on the call `req` describes (`req.tool` names its policy): raise `ToolCallDenied`
        for a denial, hold it at the gate for an approval, claim a cap rule's count. The
        decision goes on the call's span (`policy.rule`, `policy.effect`, ...)."""
        policy = self.policies.get(req.tool)
        if policy is None:
            return ADMITTED
        variables = self._variables(run, args, call.tool, server, method, path)
        if policy.needs_state:
            state = await self.metrics.timed_ledger_op("touch_run", self.ledger.touch(run, time.time()))
            variables.update(_state_variables(state))
        verdict = policy.decide(variables)
        rule = verdict.rule
        if rule is None:
            self._decided(call, req.tool, PolicyDecision("allow"))
            return ADMITTED
        if verdict.error:
            reason = (
                f"rule {rule.name!r} could not be evaluated on these arguments ({verdict.error}), and "
                "runcap denies a call its policy cannot decide"
            )
            decision = PolicyDecision("deny", rule.name, reason)
            self._decided(call, req.tool, decision, error=verdict.error)
            raise self._denied(call, decision)
        if rule.effect == "cap":
            return await self._claim(call, req, rule)
        decision = PolicyDecision(rule.effect, rule.name, rule.reason, rule.mode)
        self._decided(call, req.tool, decision)
        if rule.effect == "deny":
            raise self._denied(call, decision)
        if rule.effect == "approve":
            await self.gate.hold(call, req, decision, keepalive)
        return ADMITTED

    def _variables(
        self, run: RunRequest, args: Any, tool: str, server: str, method: str, path: str
    ) -> dict[str, Any]:
        """What a rule reads of the call (the run's state is added when a rule reads it)."""
        tenant, _, own_id = run.run_id.partition(":") if self.tenants else ("", "", run.run_id)
        variables: dict[str, Any] = {
            "args": args if isinstance(args, dict) else {},
            "tool.name": tool,
            "tool.server": server,
            "run.id": own_id,
            "run.task": run.task,
            "run.tenant": tenant,
        }
        if not server:
            variables["method"] = method
            variables["path"] = path
        return variables

    def judge_requested(
        self, name: str, arguments: str, provider: bool, run: RunRequest, state: RunState | None
    ) -> dict[str, str]:
        """What the rules would decide on a call the model requested in its answer — recorded on
        its `tool_call` span (`policy.enforced` = `false`), never enforced there: a function call
        the agent executes is decided when it comes through `/tools` (same name) or `/mcp`; one
        the provider executed (`server_label/tool`, rules of `[mcp.server_label.tools.tool]`)
        has already happened. {} when no configured tool of that name has rules."""
        server, _, tool = name.partition("/") if provider else ("", "", name)
        key = f"mcp:{server}/{tool}" if server else name
        policy = self.policies.get(key)
        if policy is None or not tool:
            return {}
        ok, args = parse_json(arguments)
        variables = self._variables(run, args if ok else {}, tool, server, "POST", "")
        if policy.needs_state and state is not None:
            variables.update(_state_variables(state))
        verdict = policy.decide(variables)
        out = {"policy.enforced": "false", "policy.rule": "", "policy.effect": "allow"}
        if verdict.rule is not None:
            out["policy.rule"] = verdict.rule.name
            out["policy.effect"] = "deny" if verdict.error else verdict.rule.effect
            if verdict.error:
                out["policy.error"] = verdict.error
            elif verdict.rule.reason:
                out["policy.reason"] = verdict.rule.reason
        return out

    async def _claim(self, call: ToolCall, req: ToolCallRequest, rule: ToolRule) -> Admission:
        """One of the cap rule's `max_calls`: the call's key in a run of the rule's own."""
        assert rule.max_calls is not None
        quota_run = f"{req.run_id}/policy:{req.tool}/{rule.name}"
        key = req.key or secrets.token_hex(16)  # a call without side effects: each one counts
        caps = RunCaps(max_tool_calls=rule.max_calls)
        quota = ToolCallRequest(
            quota_run,
            "",
            caps,
            time.time(),
            f"policy:{req.tool}/{rule.name}",
            key,
            req.args_hash,
            op_hash=key,
        )
        try:
            start = await self.metrics.timed_ledger_op("policy_cap", self.ledger.begin_tool_call(quota))
        except BudgetExceeded:
            limit = rule.max_calls
            reason = (
                f"rule {rule.name!r} allows {limit} such call{'s' if limit != 1 else ''} per run and run "
                f"{req.run_id} has made {'them' if limit != 1 else 'it'}"
                + (f" ({rule.reason})" if rule.reason else "")
            )
            decision = PolicyDecision("deny", rule.name, reason)
            self._decided(call, req.tool, decision, cap=True)
            raise self._denied(call, decision) from None
        except Rejection:
            # The same key in flight or unknown in the quota run: this call was counted already
            # (the ledger's own begin then decides what the repeat gets).
            start = None
        counted = start is not None and start.action == "execute"
        if counted:  # completed at once: a repeat of this key is a replay there, not counted again
            now = time.time()
            await self.metrics.timed_ledger_op(
                "policy_cap", self.ledger.complete_tool_call(quota_run, key, 200, {}, b"", now)
            )
        self._decided(call, req.tool, PolicyDecision("allow", rule.name, rule.reason), cap=True)
        return Admission(self.ledger, (quota_run, key)) if counted else ADMITTED

    def _decided(self, call: ToolCall, tool: str, decision: PolicyDecision, *, error: str = "",
                 cap: bool = False) -> None:  # fmt: skip
        call.attributes["policy.effect"] = decision.effect
        call.attributes["policy.rule"] = decision.rule
        if decision.reason:
            call.attributes["policy.reason"] = decision.reason
        if decision.effect == "approve":
            call.attributes["policy.mode"] = decision.mode
        if cap:
            call.attributes["policy.cap"] = "true"
        if error:
            call.attributes["policy.error"] = error
        self.metrics.policy_decisions.labels(tool, "error" if error else decision.effect).inc()

    def _denied(self, call: ToolCall, decision: PolicyDecision) -> ToolCallDenied:
        why = decision.reason or "the operator's policy denies it"
        return ToolCallDenied(
            f"tool {call.tool!r}: call denied by rule {decision.rule!r}: {why}. The call was not executed "
            "— answer without it, or call it with arguments the policy allows",
            param=decision.rule,
        )
