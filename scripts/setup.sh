#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a virtualenv in .venv with runcap and everything its
# demo and tests need. Re-runs are fast: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "runcap needs Python >= 3.11 (found $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

extras=${RUNCAP_EXTRAS:-embedded,redis,fast,demo,test,temporal}

# The Redis ledger's tests run a real redis-server (Debian's package).
if [[ ",$extras," == *,test,* ]] && ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        echo "redis-server is missing: install it (apt-get install redis-server) to run the Redis tests" >&2
    fi
fi

# The alert rules' tests (tests/system/test_alert_rules.py, tests/system/test_prometheus_scrape.py) run
# promtool and a real Prometheus server: Debian's prometheus package (its service is not started).
if [[ ",$extras," == *,test,* ]] && ! { command -v promtool && command -v prometheus; } >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    else
        echo "promtool/prometheus are missing: install them (apt-get install prometheus) to run the alert rules' tests" >&2
    fi
fi

# Two node folders with npm packages pinned by their package-lock.json: tests/node, the Vercel
# AI SDK (tests/system/test_frameworks.py), and tests/grafana-schema, Grafana's dashboard types and tsc
# (tests/system/test_dashboard_schema.py). Without node those tests are skipped with a loud reason
# (and fail under CI=true).
if [[ ",$extras," == *,test,* ]]; then
    if ! command -v npm >/dev/null 2>&1; then
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
        else
            echo "npm is missing: install nodejs and npm (apt-get install nodejs npm) to run the node tests" >&2
        fi
    fi
    for node_dir in tests/node tests/grafana-schema; do
        node_stamp=$node_dir/node_modules/.runcap-installed
        node_want="$(cat "$node_dir/package.json" "$node_dir/package-lock.json" | sha256sum | cut -c1-16)"
        if command -v npm >/dev/null 2>&1 && [ "$(cat "$node_stamp" 2>/dev/null)" != "$node_want" ]; then
            if npm ci --prefix "$node_dir" --no-audit --no-fund --loglevel=error >/dev/null; then
                echo "$node_want" > "$node_stamp"
            else
                echo "npm ci in $node_dir failed: its tests will be skipped" >&2
            fi
        fi
    done
fi

stamp=.venv/.runcap-installed
want="$(sha256sum pyproject.toml | cut -c1-16) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
    echo "$want" > "$stamp"
fi
