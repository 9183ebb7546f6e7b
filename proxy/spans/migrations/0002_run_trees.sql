-- 0002: run trees (issue 22). Every span and every run row names the run that spawned its run
-- (`parent_run_id`, '' for a root) and the tree's root (`root_run_id`, a root's own id), so
-- "where did the money of this task go across its sub-agents" is one GROUP BY root_run_id.
--
-- DEFAULT run_id: rows written before this migration have no root; ClickHouse computes the
--   default when it reads a part that lacks the column, so they read as roots of their own
--   (root_run_id = run_id, parent_run_id = ''). Queries still read an empty root_run_id as the
--   run's own id (`if(root_run_id = '', run_id, root_run_id)`), for rows written by other
--   tools without the column.
-- Codec: run ids are the same random-ish strings as run_id (ZSTD, as there); a run's rows all
--   carry the same two values, which ZSTD packs to almost nothing inside a run_id-sorted part.
-- Not in ORDER BY: the sorting key of a MergeTree cannot be changed for existing data, and a
--   tree's runs are few; the bloom filters below skip the granules of other trees.

ALTER TABLE {database:Identifier}.spans
    ADD COLUMN IF NOT EXISTS parent_run_id String DEFAULT '' CODEC(ZSTD(1)),
    ADD COLUMN IF NOT EXISTS root_run_id String DEFAULT run_id CODEC(ZSTD(1));

ALTER TABLE {database:Identifier}.spans
    ADD INDEX IF NOT EXISTS idx_root_run_id root_run_id TYPE bloom_filter(0.01) GRANULARITY 4;

ALTER TABLE {database:Identifier}.runs
    ADD COLUMN IF NOT EXISTS parent_run_id String DEFAULT '' CODEC(ZSTD(1)),
    ADD COLUMN IF NOT EXISTS root_run_id String DEFAULT run_id CODEC(ZSTD(1));

ALTER TABLE {database:Identifier}.runs
    ADD INDEX IF NOT EXISTS idx_root_run_id root_run_id TYPE bloom_filter(0.01) GRANULARITY 4;
