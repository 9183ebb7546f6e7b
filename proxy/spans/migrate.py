"""Numbered schema migrations for the span store, applied at start-up on chdb and on a server.

Migrations are the files `migrations/NNNN_name.sql`, applied in version order. Each file is plain
ClickHouse SQL whose statements end with `;` at the end of a line, and which names the database as
the query parameter `{database:Identifier}`. Applied versions are recorded in
`{database}.schema_migrations`; every statement is also `IF NOT EXISTS`, so a start-up that dies
half-way, or two replicas starting together, simply apply the same statements again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

_FILE_RE = re.compile(r"^(\d{4})_(\w+)\.sql$")
_STATEMENT_END_RE = re.compile(r";[ \t]*$", re.M)
_COMMENT_RE = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)

# The ledger of applied versions. ReplacingMergeTree: two replicas recording the same version
# at once leave one row after merges; readers use DISTINCT anyway.
SCHEMA_MIGRATIONS_DDL = """
CREATE TABLE IF NOT EXISTS {database:Identifier}.schema_migrations
(
    version UInt32,
    name String,
    applied_at DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(applied_at)
ORDER BY version
"""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    """The migrations in `directory`, in version order; a repeated version is an error."""
    migrations: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _FILE_RE.match(path.name)
        if match is None:
            raise ValueError(f"migration file {path.name!r} is not named NNNN_name.sql")
        version = int(match.group(1))
        if version in migrations:
            raise ValueError(
                f"two migrations with version {version}: {migrations[version].name}, {path.stem}"
            )
        migrations[version] = Migration(version, path.stem, split_statements(path.read_text()))
    return [migrations[v] for v in sorted(migrations)]


def split_statements(sql: str) -> tuple[str, ...]:
    """Split at `;` ending a line; chunks that are only comments are dropped."""
    chunks = (chunk.strip() for chunk in _STATEMENT_END_RE.split(sql))
    return tuple(chunk for chunk in chunks if _COMMENT_RE.sub("", chunk).strip())


def apply_migrations(client: Any, database: str, migrations: list[Migration] | None = None) -> list[int]:
    """Bring `database` up to date through a clickhouse-connect client (HTTP or chdb); returns
    the versions applied now (empty when the schema was current)."""
    params = {"database": database}
    client.command("CREATE DATABASE IF NOT EXISTS {database:Identifier}", parameters=params)
    client.command(SCHEMA_MIGRATIONS_DDL, parameters=params)
    applied = {
        row[0]
        for row in client.query(
            "SELECT DISTINCT version FROM {database:Identifier}.schema_migrations", parameters=params
        ).result_rows
    }
    done: list[int] = []
    for migration in migrations if migrations is not None else load_migrations():
        if migration.version in applied:
            continue
        for statement in migration.statements:
            client.command(statement, parameters=params)
        client.insert(
            f"{_quote_identifier(database)}.schema_migrations",
            [[migration.version, migration.name, datetime.now(UTC)]],
            column_names=["version", "name", "applied_at"],
            column_type_names=["UInt32", "String", "DateTime64(3, 'UTC')"],
        )
        done.append(migration.version)
    return done


def _quote_identifier(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"
