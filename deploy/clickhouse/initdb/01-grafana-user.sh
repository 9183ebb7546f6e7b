#!/bin/bash
# Run once by the clickhouse-server image's entrypoint, on the first start with an empty data
# volume (scripts in /docker-entrypoint-initdb.d): a read-only `grafana` user for the dashboards'
# data source, allowed to SELECT from the runcap database only. readonly = 2 lets the Grafana
# plugin set per-query settings (max_execution_time) while forbidding writes and DDL.
#
# Changing GRAFANA_CLICKHOUSE_PASSWORD later does not change the user: run
#   ALTER USER grafana IDENTIFIED WITH sha256_password BY '...'
# as the runcap user, or recreate the clickhouse-data volume.
set -euo pipefail

: "${GRAFANA_CLICKHOUSE_PASSWORD:?GRAFANA_CLICKHOUSE_PASSWORD is not set}"
db="${CLICKHOUSE_DB:-runcap}"
# the password as the body of a SQL string literal: backslashes, then quotes, escaped
password="${GRAFANA_CLICKHOUSE_PASSWORD//\\/\\\\}"
password="${password//\'/\\\'}"

clickhouse client --host 127.0.0.1 --user "${CLICKHOUSE_USER}" --password "${CLICKHOUSE_PASSWORD}" --multiquery <<SQL
CREATE USER IF NOT EXISTS grafana IDENTIFIED WITH sha256_password BY '${password}' SETTINGS readonly = 2;
GRANT SELECT ON ${db}.* TO grafana;
SQL
