"""The Prometheus alert rules runcap ships (deploy/prometheus) and the metric names they use."""

from __future__ import annotations

import re

import yaml

from tests.conftest import REPO

RULES = REPO / "deploy" / "prometheus" / "runcap-alerts.yml"


RULE_TESTS = REPO / "deploy" / "prometheus" / "runcap-alerts.test.yml"


ALERTS = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


METRIC = re.compile(r"\bruncap_[a-z0-9_]+\b")
