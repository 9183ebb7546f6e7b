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

stamp=.venv/.runcap-installed
want="$(sha256sum pyproject.toml | cut -c1-16) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
    echo "$want" > "$stamp"
fi
