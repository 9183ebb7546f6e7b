"""The alert rules in deploy/prometheus/ checked by Prometheus' own tool: `promtool check rules`
and `promtool test rules` (every alert unit-tested firing and quiet, runcap-alerts.test.yml);
a rule changed so that it never fires fails those tests; every rule has a summary and a runbook
naming a query in queries/, and uses only metrics a real runcap exports.

promtool comes from Debian's prometheus package (scripts/setup.sh); without it these tests skip,
and fail under CI."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO
from tests.support.alerts import ALERTS, METRIC, RULE_TESTS, RULES
from tests.support.tools import need_command


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    tool = need_command("promtool", "the alert rules are checked with Prometheus' promtool")
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def test_promtool_unit_tests_of_every_alert_pass() -> None:
    done = promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    names = [a["alert"] for a in ALERTS]
    assert len(set(names)) == len(names)
    for name in names:
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no unit test where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{name}: no unit test where it stays quiet"
    assert {c["alertname"] for c in cases} <= set(names), "a unit test of an alert that does not exist"


@pytest.mark.parametrize("alert", [a["alert"] for a in ALERTS])
def test_a_rule_that_never_fires_fails_its_unit_test(alert: str, tmp_path: Path) -> None:
    """The unit tests catch a broken rule: each alert, its expression made one that is never
    true, fails `promtool test rules`."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == alert:
                rule["expr"] = f"({rule['expr']}) and on() vector(0) > 1"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    assert promtool("check", "rules", RULES.name, cwd=tmp_path).returncode == 0
    done = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0, f"{alert} never fires, yet its unit tests pass:\n{out}"
    assert f"alertname: {alert}" in out and "got:[]" in out, out


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_each_rule_has_a_summary_and_a_runbook_naming_a_query(rule: dict[str, Any]) -> None:
    notes = rule["annotations"]
    assert notes["summary"].strip(), rule["alert"]
    queries = re.findall(r"\bqueries/([a-z_]+)\.sql\b", notes["runbook"])
    assert queries, f"{rule['alert']}: the runbook names no query in queries/"
    for q in queries:
        assert (REPO / "queries" / f"{q}.sql").is_file(), f"{rule['alert']}: queries/{q}.sql does not exist"
    assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]


def exported_names(text: str) -> set[str]:
    """The sample names an exposition declares (a histogram's _bucket, _sum and _count too)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


async def test_the_rules_use_only_metrics_runcap_exports(runcap_factory) -> None:  # type: ignore[no-untyped-def]
    """Every metric an expression names is declared by a real runcap's /metrics (tracing on, so
    the span path's series are there; a labelled counter is declared before its first event)."""
    rc = await runcap_factory({"tracing": True})
    async with openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0) as c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}])
    text = rc.runtime.metrics.render().decode()
    exported = exported_names(text)
    used = {m for a in ALERTS for m in METRIC.findall(a["expr"])}
    assert used, "no runcap metric in the rules"
    assert not used - exported, f"the rules use metrics runcap does not export: {sorted(used - exported)}"


def test_the_example_prometheus_config_loads_the_rules() -> None:
    example = REPO / "deploy" / "prometheus" / "prometheus.yml"
    done = promtool("check", "config", str(example))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout


def _sum(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


async def test_added_latency_leaves_out_the_wait_for_the_upstream(runcap_factory, upstream) -> None:  # type: ignore[no-untyped-def]
    """RuncapAddedLatencyHigh's metric: an upstream that takes DELAY before answering (buffered
    or streamed) adds nothing to runcap_added_latency_seconds — exactly: each call's added time is
    its duration less at least DELAY, whatever the machine's speed; a refused call adds none."""
    delay = 0.4
    upstream.scripts["slow"] = [{"text": "hi", "delay_s": delay}]
    rc = await runcap_factory()
    async with openai.AsyncOpenAI(base_url=rc.openai_url, api_key="k", max_retries=0) as c:
        for stream in (False, True):
            reply = await c.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], stream=stream,
                extra_headers={"X-Mock-Script": "slow"},
            )  # fmt: skip
            if stream:
                async for _ in reply:  # type: ignore[union-attr]
                    pass
        with pytest.raises(openai.APIStatusError):  # refused: never forwarded
            await c.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}],
                extra_headers={"X-Run-Max-Steps": "0"},
            )  # fmt: skip
    text = rc.runtime.metrics.render().decode()
    assert _sum(text, "runcap_added_latency_seconds_count") == 2
    duration = _sum(text, "runcap_request_duration_seconds_sum")  # the refused call's included
    added = _sum(text, "runcap_added_latency_seconds_sum")
    assert 0 < added <= duration - 2 * delay, (added, duration)
