#!/usr/bin/env bash
# The main job on embedded defaults: runcap + a scripted model, three agent runs, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNCAP_EXTRAS=${RUNCAP_EXTRAS:-embedded,fast,demo} bash scripts/setup.sh
exec .venv/bin/runcap demo "$@"
