-- timeouts: What timed out, and where? Every call cut by time, newest first: model calls cut by
-- the run's deadline (504), /tools calls cut by the tool's timeout_s or the run's deadline, and
-- upstream answers 408 / 504. A side-effecting /tools call cut by time has outcome `unknown` (it
-- may or may not have taken effect): see unknown_outcomes and `runcap reconcile`.
--
-- @param since   DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR   -- window start (ignored when run_id is set)
-- @param run_id  String                = ''                         -- one run; '' = every run in the window
-- @param limit   UInt32                = 100                        -- rows
-- @priority started_at run_id target outcome error status_code kind step duration_ms task idempotency_key
SELECT
    started_at,
    run_id,
    task,
    step,
    kind,
    if(kind = 'model', model, tool_name) AS target,
    outcome,
    status_code,
    round(duration_ms, 1) AS duration_ms,
    idempotency_key,
    substring(error, 1, 200) AS error
FROM runcap.spans
WHERE kind IN ('model', 'tool')
    AND (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
    AND (
        outcome IN ('timeout', 'deadline_exceeded')
        OR (outcome = 'unknown' AND status_code = 504)
        OR (outcome = 'error' AND status_code IN (408, 504))
    )
ORDER BY started_at DESC, run_id
LIMIT {limit:UInt32}
