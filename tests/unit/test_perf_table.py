"""bench/perf_table.py's arithmetic and output, on a recorded result: the ratios the issue's
targets are stated in, the markdown table, and the README rewritten between its markers only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.perf_table import BEGIN, END, markdown, ratios, write_readme

NAMES = (
    "direct",
    "floor",
    "tuned floor",
    "runcap default",
    "runcap capped",
    "runcap tracing off",
    "runcap sidecar",
)


def result(cpu: dict[str, float]) -> dict[str, Any]:
    summary = {
        n: {
            "max_rps": 1000.0, "cpu_ms": cpu[n], "shipper_cpu_ms": None, "added_p50_ms": 0.5,
            "added_p99_ms": 2.0, "p50_ms": 1.0, "p99_ms": 3.0, "ttfb_p50_ms": 1.5, "errors": 0,
        }
        for n in NAMES
    }  # fmt: skip
    return {
        "started": "2026-12-02 01:00", "finished": "01:10", "loadavg_before": "0.5 0.5 0.5",
        "loadavg_after": "0.6 0.5 0.5", "loadavg_max": 0.6, "rounds": 3, "duration": 10.0,
        "concurrency": 64, "rate": 200.0, "summary": summary, "ratios": ratios(summary),
        "memory": {n: {"tree_mb": 50.0, "process_mb": 40.0} for n in NAMES},
    }  # fmt: skip


CPU = {
    "direct": 0.08, "floor": 0.32, "tuned floor": 0.25, "runcap default": 0.85, "runcap capped": 0.92,
    "runcap tracing off": 0.60, "runcap sidecar": 0.80,
}  # fmt: skip


def test_ratios_are_runcaps_own_work_over_the_floors() -> None:
    r = ratios(result(CPU)["summary"])
    assert r["runcap default own / floor"] == round((0.85 - 0.32) / 0.32, 2)  # the 1.65x
    assert r["runcap capped own / tuned floor"] == round((0.92 - 0.25) / 0.25, 2)
    assert r["tracing cost in the proxy, ms"] == 0.25
    assert "floor own / floor" not in r and "direct own / floor" not in r


def test_markdown_has_a_column_per_path_and_flags_a_loaded_machine() -> None:
    quiet = result(CPU)
    table = markdown(quiet)
    header = table.splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")][1:] == list(NAMES)
    assert "| CPU ms / request, serving process (saturated) | 0.080 | 0.320 | 0.250 | 0.850 |" in table
    assert "+0.50 / +2.00" in table
    assert "Loaded machine" not in table
    assert "Loaded machine" in markdown({**quiet, "loadavg_max": 7.5})


def test_the_readme_is_rewritten_between_the_markers_only(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{BEGIN}\nold table\n{END}\nafter\n")
    write_readme("| new |\n", readme)
    write_readme("| newer |\n", readme)
    assert readme.read_text() == f"before\n{BEGIN}\n| newer |\n{END}\nafter\n"


def test_the_mcp_row_has_each_paths_added_latency_and_none_for_paths_without_mcp() -> None:
    r = result(CPU)
    for name, added in (("floor", 1.2), ("runcap default", 2.1)):
        r["summary"][name] |= {"mcp_added_p50_ms": added, "mcp_added_p99_ms": added * 2}
    r["mcp_rate"] = 50.0
    row = next(line for line in markdown(r).splitlines() if line.startswith("| MCP"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "MCP read-only tools/call: added p50 / p99 @50 calls/s vs direct, ms"
    assert cells[1:] == ["—", "+1.20 / +2.40", "—", "+2.10 / +4.20", "—", "—", "—"]
