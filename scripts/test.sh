#!/usr/bin/env bash
# The whole test suite, with its own set-up (virtualenv, packages): lint, the import layers,
# types, then every tier of tests (tests/unit, tests/app, tests/system) on both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check proxy tests bench examples
.venv/bin/lint-imports --no-cache   # the import layers (pyproject.toml [tool.importlinter])
.venv/bin/mypy                      # types on proxy/ (pyproject.toml [tool.mypy])
# Both cores (pytest-xdist), a whole test file per worker: a file's module fixtures (MCP servers,
# ClickHouse) start once. RUNCAP_TEST_WORKERS=0 runs in one process.
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${RUNCAP_TEST_WORKERS:-2}" --dist loadfile "$@"
