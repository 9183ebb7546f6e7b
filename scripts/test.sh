#!/usr/bin/env bash
# The whole test suite, with its own set-up (virtualenv, packages), then lint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check proxy tests bench examples
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
