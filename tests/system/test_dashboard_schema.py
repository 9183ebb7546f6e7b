"""The dashboards in dashboards/ against Grafana's own schema: each JSON file, written out as a
TypeScript literal, must satisfy Grafana's `Dashboard` type from the npm package @grafana/schema
(the types Grafana's frontend uses) and runcap's narrowing of it (tests/grafana-schema/dashboard.ts:
the panel plugins' option and field-config types, and the ClickHouse data source plugin's query
model) under `tsc --noEmit --strict`. A panel Grafana would reject fails here; the second test
plants such panels and checks that each one is caught. The data source provisioning is checked
against the plugin's settings the same way.

The npm packages are pinned in tests/grafana-schema/package-lock.json (scripts/setup.sh runs
`npm ci` there); without node or them the tests skip, and fail under CI."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO
from tests.support.tools import need_command, need_file

SCHEMA_DIR = REPO / "tests" / "grafana-schema"
BOARDS = {p.stem: json.loads(p.read_text()) for p in sorted((REPO / "dashboards").glob("*.json"))}


def typescript_of(name: str, board: dict[str, Any]) -> str:
    literal = json.dumps(board, indent=2)
    types = json.dumps(str(SCHEMA_DIR / "dashboard"))
    return (
        f"import type {{ GrafanaDashboard, RuncapDashboard }} from {types};\n\n"
        f"// dashboards/{name}.json: Grafana's types narrowed to its panel plugins and the ClickHouse\n"
        "// plugin's query model\n"
        f"export const board = {literal} satisfies RuncapDashboard;\n\n"
        "// and Grafana's own Dashboard type as it stands\n"
        f"export const grafana = {literal} satisfies GrafanaDashboard;\n"
    )


def datasource_typescript(datasource: dict[str, Any]) -> str:
    types = json.dumps(str(SCHEMA_DIR / "dashboard"))
    return (
        f"import type {{ ClickHouseDatasource }} from {types};\n\n"
        "// dashboards/provisioning/datasources/clickhouse.yaml: the plugin's settings\n"
        f"export const datasource = {json.dumps(datasource, indent=2)} satisfies ClickHouseDatasource;\n"
    )


def typecheck_sources(sources: dict[str, str], where: Path) -> dict[str, list[str]]:
    """tsc's errors per source file (none: it type-checks)."""
    node = need_command("node", "the dashboard schema check runs tsc")
    install = "npm ci --prefix tests/grafana-schema"
    tsc = need_file(SCHEMA_DIR / "node_modules" / "typescript" / "bin" / "tsc", install)
    need_file(SCHEMA_DIR / "node_modules" / "@grafana" / "schema", install)
    where.mkdir(parents=True, exist_ok=True)
    (where / "node_modules").symlink_to(SCHEMA_DIR / "node_modules")  # '@grafana/schema' resolves here
    for name, source in sources.items():
        (where / f"{name}.ts").write_text(source)
    config = {"extends": str(SCHEMA_DIR / "tsconfig.json"), "files": [f"{n}.ts" for n in sources]}
    (where / "tsconfig.json").write_text(json.dumps(config))
    done = subprocess.run(
        [node, str(tsc), "-p", str(where / "tsconfig.json"), "--pretty", "false"],
        cwd=where, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors: dict[str, list[str]] = {name: [] for name in sources}
    for line in done.stdout.splitlines():
        m = re.match(r"^(?:.*/)?([\w.-]+)\.ts\(\d+,\d+\): error ", line)
        if m and m.group(1) in errors:
            errors[m.group(1)].append(line)
    assert done.returncode == 0 or any(errors.values()), done.stdout + done.stderr  # tsc itself failed
    return errors


def typecheck(boards: dict[str, dict[str, Any]], where: Path) -> dict[str, list[str]]:
    return typecheck_sources({name: typescript_of(name, b) for name, b in boards.items()}, where)


def test_every_dashboard_satisfies_grafanas_schema(tmp_path: Path) -> None:
    assert set(BOARDS) == {"runcap-cost", "runcap-runs", "runcap-tools"}
    errors = typecheck(BOARDS, tmp_path)
    assert errors == {name: [] for name in BOARDS}, "\n".join(e for es in errors.values() for e in es)


# -- a broken panel fails ------------------------------------------------------------------------


def _panel(panels: list[dict[str, Any]], type_: str) -> dict[str, Any]:
    return next(p for p in panels if p["type"] == type_)


def _set(path: str, value: Any) -> Any:
    """A breakage: set `path` (dots; `panel:TYPE` picks the first panel of that type) to `value`."""

    def apply(board: dict[str, Any]) -> None:
        keys = path.split(".")
        node: Any = board
        for k in keys[:-1]:
            if k.startswith("panel:"):
                node = _panel(node, k.split(":", 1)[1])
            elif isinstance(node, list):
                node = node[int(k)]
            else:
                node = node[k]
        if value is _DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value

    return apply


_DELETE = object()

BREAKAGES = {
    # panels
    "unknown_panel_type": _set("panels.panel:table.type", "tabel"),
    "retired_angular_graph_panel": _set("panels.panel:timeseries.type", "graph"),
    "stat_color_mode_not_in_plugin": _set("panels.panel:stat.options.colorMode", "rainbow"),
    "timeseries_legend_mode_misspelt": _set("panels.panel:timeseries.options.legend.displayMode", "lists"),
    "timeseries_draw_style_unknown": _set(
        "panels.panel:timeseries.fieldConfig.defaults.custom.drawStyle", "dots"
    ),
    "grid_position_misspelt": _set("panels.panel:stat.gridPos", {"h": 4, "w": 6, "x": 0, "Y": 0}),
    "grid_position_as_text": _set("panels.panel:stat.gridPos.w", "6"),
    "field_config_without_defaults": _set("panels.panel:stat.fieldConfig", {"overrides": []}),
    "unknown_panel_field": _set("panels.panel:table.fieldconfig", {}),
    # the ClickHouse plugin's query model
    "query_without_sql": _set("panels.panel:stat.targets.0.rawSql", _DELETE),
    "query_in_the_builder_without_options": _set("panels.panel:stat.targets.0.editorType", "builder"),
    "query_type_of_an_older_plugin": _set("panels.panel:timeseries.targets.0.queryType", "timeSeries"),
    "format_not_the_query_types": _set("panels.panel:timeseries.targets.0.format", 1),
    "query_field_misspelt": _set("panels.panel:table.targets.0.rawSQL", "SELECT 1"),
    "query_of_another_datasource": _set("panels.panel:table.targets.0.datasource.type", "prometheus"),
    # variables and the dashboard
    "variable_refresh_unknown": _set("templating.list.0.refresh", 5),
    "variable_query_as_plain_text": _set("templating.list.0.query", "SELECT 1"),
    "time_range_as_a_number": _set("time", {"from": 6, "to": "now"}),
}


def test_each_planted_breakage_fails_the_type_check(tmp_path: Path) -> None:
    boards = {}
    for name, breakage in BREAKAGES.items():
        board = copy.deepcopy(BOARDS["runcap-cost"] if "table" not in name else BOARDS["runcap-runs"])
        breakage(board)
        boards[name] = board
    errors = typecheck(boards, tmp_path)
    passed = [name for name, errs in errors.items() if not errs]
    assert not passed, f"tsc accepted these broken dashboards: {passed}"


# -- the data source provisioning ----------------------------------------------------------------

DS_FILE = REPO / "dashboards" / "provisioning" / "datasources" / "clickhouse.yaml"


def test_the_provisioned_datasource_has_the_plugins_settings(tmp_path: Path) -> None:
    [ds] = yaml.safe_load(DS_FILE.read_text())["datasources"]
    broken = copy.deepcopy(ds)
    broken["jsonData"]["protocol"] = "https"  # the plugin knows native and http (secure: true)
    misspelt = copy.deepcopy(ds)
    misspelt["jsonData"]["defaultDb"] = misspelt["jsonData"].pop("defaultDatabase")
    sources = {
        n: datasource_typescript(d) for n, d in (("ds", ds), ("broken", broken), ("misspelt", misspelt))
    }
    errors = typecheck_sources(sources, tmp_path)
    assert errors["ds"] == [], errors["ds"]
    assert errors["broken"] and errors["misspelt"], errors
