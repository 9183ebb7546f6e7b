# runcap's production image: `runcap serve` talking to server-side storage (ClickHouse server,
# S3/MinIO, Redis). Built by docker-compose.yml; usable on its own:
#
#   docker build -t runcap .
#   docker run -p 8787:8787 -e RUNCAP_CLICKHOUSE_URL=... -e RUNCAP_S3_URL=... -e RUNCAP_REDIS_URL=... runcap
#
# Installed WITHOUT the `embedded` extra: chdb (~530 MB) is only needed when spans are kept in
# process; production writes them to a ClickHouse server (RUNCAP_CLICKHOUSE_URL). With `redis` (the
# shared ledger) and `fast` (uvloop).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package needs (see .dockerignore): a change to tests or docs does not rebuild this.
COPY pyproject.toml README.md ./
COPY proxy ./proxy
# proxy/sql is a symlink to ../queries: the on-call SQL ships inside the package
COPY queries ./queries
# Then two checks that fail the build rather than the first start: the package's SQL files (span
# store migrations, on-call queries) were installed, and chdb was not. (Run from /, where the
# source tree cannot shadow the installed package.)
RUN pip install ".[redis,fast]" \
    && cd / \
    && python -c "import sys, pathlib, importlib.resources as r; \
missing = [d for d in ('spans/migrations', 'sql') if not list(pathlib.Path(str(r.files('proxy') / d)).glob('*.sql'))]; \
sys.exit(f'runcap was installed without its SQL files in proxy/{missing}: see package-data in pyproject.toml' if missing else 0)" \
    && python -c "import importlib.util, sys; sys.exit('chdb is installed' if importlib.util.find_spec('chdb') else 0)" \
    && rm -rf /src

# A non-root user owning only its data directory (ledger fallback, span WAL, local payloads).
# `runcap serve` runs the span shipper as a child process in the same container.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/runcap --create-home --shell /usr/sbin/nologin runcap \
    && mkdir -p /var/lib/runcap/data && chown -R runcap:runcap /var/lib/runcap
USER runcap
WORKDIR /var/lib/runcap
ENV RUNCAP_DATA_DIR=/var/lib/runcap/data

EXPOSE 8787
# Ready = the ledger answers (GET /readyz); python is the only client in a slim image.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8787/readyz', timeout=2).status != 200)"]

ENTRYPOINT ["runcap"]
CMD ["serve", "--listen", "0.0.0.0:8787"]
