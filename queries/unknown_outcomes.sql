-- unknown_outcomes: Which side effects may or may not have happened? Side-effecting /tools calls
-- whose newest span (per run and idempotency key) has outcome `unknown`: cut by a timeout, a
-- cancel, a reset or a crash after they may have reached the tool. Repeats of such a call get
-- 409 (refused_repeats) until someone reconciles it with `runcap reconcile KEY --done/--not-done`.
--
-- "Not later resolved" is judged from spans: a reconcile itself writes no span, but what follows
-- it does — after --not-done the next attempt executes (outcome ok/error), after --done it is
-- replayed (outcome replayed) — and either drops the key from this list. A key reconciled with no
-- attempt since still shows here: `runcap reconcile` (the ledger) is the source of truth.
--
-- @param since   DateTime64(6, 'UTC')  = now() - INTERVAL 7 DAY   -- window start (ignored when run_id is set)
-- @param run_id  String                = ''                        -- one run; '' = every run in the window
-- @priority run_id idempotency_key tool_name why refused_repeats attempts first_unknown_at step last_at args_hash request_hash
SELECT
    run_id,
    idempotency_key,
    tool_name,
    args_hash,
    step,
    first_unknown_at,
    last_at,
    attempts,
    refused_repeats,
    why,
    request_hash
FROM
(
    SELECT
        run_id,
        idempotency_key,
        any(tool_name) AS tool_name,
        argMinIf(args_hash, started_at, outcome = 'unknown') AS args_hash,
        argMinIf(step, started_at, outcome = 'unknown') AS step,
        minIf(started_at, outcome = 'unknown') AS first_unknown_at,
        max(started_at) AS last_at,
        count() AS attempts,
        countIf(outcome = 'unknown' AND status_code = 409) AS refused_repeats,
        argMax(outcome, started_at) AS latest_outcome,
        substring(argMinIf(error, started_at, outcome = 'unknown'), 1, 200) AS why,
        argMinIf(request_hash, started_at, outcome = 'unknown') AS request_hash
    FROM runcap.spans
    WHERE kind = 'tool'
        AND idempotency_key != ''
        AND (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
    GROUP BY run_id, idempotency_key
)
WHERE latest_outcome = 'unknown'
ORDER BY first_unknown_at DESC, run_id, idempotency_key
