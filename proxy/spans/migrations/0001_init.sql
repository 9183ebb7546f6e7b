-- 0001: the span store's first schema: runcap.spans (one row per step event) and runcap.runs
-- (latest state of each run). Column names and types are the contract in DESIGN.md
-- ("Span store"); engines, keys, codecs and indexes are ours.
--
-- Applied at start-up by proxy/spans/clickhouse.py on chdb and on a ClickHouse server alike.
-- `{database:Identifier}` is a ClickHouse query parameter: the runner passes the configured
-- database name (default `runcap`). Every statement is IF NOT EXISTS, so re-running is harmless.
-- Statements end with `;` at the end of a line (the runner splits there).

CREATE DATABASE IF NOT EXISTS {database:Identifier};

-- spans: append-only, written by the span pipeline in batches of ~1,000-5,000 rows.
--
-- ENGINE MergeTree, not ReplacingMergeTree: a span is never updated, and a plain MergeTree lets
--   count()/sum() be exact without FINAL. Duplicates from a retried batch are prevented at insert
--   time instead: the writer sends `insert_deduplication_token = <batch_id>:spans`, and
--   non_replicated_deduplication_window keeps the tokens of the last 100,000 inserted blocks
--   (one block per batch and partition), so a batch replayed from the spool, even after a
--   restart, is dropped by the engine. (On ReplicatedMergeTree the equivalent is
--   replicated_deduplication_window, whose default is smaller: raise it there.)
-- PARTITION BY month of started_at: time-window queries and dashboards prune whole partitions;
--   months keep the part count low at this write rate; retention can DROP PARTITION.
-- ORDER BY (run_id, started_at, step): the most frequent question is "what did run X do"
--   (`runcap run`, the duplicates query), which reads a contiguous key range in time order.
--   Time windows across runs rely on partition pruning plus the minmax index below.
-- Codecs: ids and hashes are random hex, so only ZSTD helps; started_at is nearly monotonic within
--   a run (Delta); counters are small integers (T64 packs the unused high bits); free text
--   (error, attributes) compresses well with ZSTD.
CREATE TABLE IF NOT EXISTS {database:Identifier}.spans
(
    run_id String CODEC(ZSTD(1)),
    trace_id String CODEC(ZSTD(1)),
    span_id String CODEC(ZSTD(1)),
    parent_span_id String CODEC(ZSTD(1)),
    kind LowCardinality(String),
    step UInt32 CODEC(T64, ZSTD(1)),
    started_at DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    duration_ms Float64 CODEC(ZSTD(1)),
    ttft_ms Nullable(Float64) CODEC(ZSTD(1)),
    task LowCardinality(String),
    provider LowCardinality(String),
    model LowCardinality(String),
    endpoint LowCardinality(String),
    status_code UInt16 CODEC(T64, ZSTD(1)),
    outcome LowCardinality(String),
    error String CODEC(ZSTD(3)),
    input_tokens UInt64 CODEC(T64, ZSTD(1)),
    output_tokens UInt64 CODEC(T64, ZSTD(1)),
    cache_read_tokens UInt64 CODEC(T64, ZSTD(1)),
    cache_write_tokens UInt64 CODEC(T64, ZSTD(1)),
    reasoning_tokens UInt64 CODEC(T64, ZSTD(1)),
    cost_usd Decimal(18, 9) CODEC(ZSTD(1)),
    price_known Bool,
    tool_name String CODEC(ZSTD(1)),
    tool_call_id String CODEC(ZSTD(1)),
    args_hash String CODEC(ZSTD(1)),
    result_hash String CODEC(ZSTD(1)),
    idempotency_key String CODEC(ZSTD(1)),
    request_hash String CODEC(ZSTD(1)),
    response_hash String CODEC(ZSTD(1)),
    attributes Map(LowCardinality(String), String) CODEC(ZSTD(3)),

    -- granule-level time pruning inside a partition (parts are sorted by run_id, not by time)
    INDEX idx_started_at started_at TYPE minmax GRANULARITY 1,
    -- "who else called this tool with these arguments": args_hash lookups across runs
    INDEX idx_args_hash args_hash TYPE bloom_filter(0.01) GRANULARITY 4,
    -- tool_name has few distinct values per granule block: a set index skips blocks without it
    INDEX idx_tool_name tool_name TYPE set(100) GRANULARITY 4,
    -- lookups by idempotency key (reconcile, "did this key run twice")
    INDEX idx_idempotency_key idempotency_key TYPE bloom_filter(0.01) GRANULARITY 4
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(started_at)
ORDER BY (run_id, started_at, step)
SETTINGS non_replicated_deduplication_window = 100000;

-- runs: a new version of a run's row on every step (the pipeline writes the snapshot with
-- each batch).
--
-- ENGINE ReplacingMergeTree(updated_at): merges keep the newest version per run_id, so the table
--   stays about one row per run. Merges are eventual: until one happens several versions are
--   visible, so every query MUST deduplicate itself, e.g.
--     SELECT run_id, argMax(status, updated_at) AS status, ... FROM runcap.runs GROUP BY run_id
--   or
--     SELECT * FROM runcap.runs ORDER BY updated_at DESC LIMIT 1 BY run_id
--   and never sum over all versions. (FINAL works too but is slower on large tables.)
-- PARTITION BY month of started_at: a run's started_at never changes, so all its versions share
--   a partition, which ReplacingMergeTree needs to replace them.
-- ORDER BY run_id: the dedup key, and the lookup key of `GET /runs/{id}`-style queries.
-- The same insert-token deduplication as spans makes a retried batch exact before any merge.
CREATE TABLE IF NOT EXISTS {database:Identifier}.runs
(
    run_id String CODEC(ZSTD(1)),
    task LowCardinality(String),
    started_at DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    updated_at DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    status LowCardinality(String),
    steps UInt32 CODEC(T64, ZSTD(1)),
    tool_calls UInt32 CODEC(T64, ZSTD(1)),
    input_tokens UInt64 CODEC(T64, ZSTD(1)),
    output_tokens UInt64 CODEC(T64, ZSTD(1)),
    cost_usd Decimal(18, 9) CODEC(ZSTD(1)),
    max_usd Nullable(Decimal(18, 9)),
    max_tokens Nullable(UInt64),
    max_steps Nullable(UInt32),
    max_tool_calls Nullable(UInt32),
    deadline Nullable(DateTime64(6, 'UTC')),

    INDEX idx_updated_at updated_at TYPE minmax GRANULARITY 1
)
ENGINE = ReplacingMergeTree(updated_at)
PARTITION BY toYYYYMM(started_at)
ORDER BY run_id
SETTINGS non_replicated_deduplication_window = 100000;
