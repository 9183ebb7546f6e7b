-- cap_hits: Which caps are stopping runs, for which tasks, and since when? Per time bucket, task
-- and cap: the runs that ended stopped by it and the calls runcap refused because of it.
--
-- Two sources, side by side (neither is a sum over run versions):
--   runs_stopped   runs whose latest state (runcap.runs, newest version per run) is that stop,
--                  bucketed by when the run was last updated. A run ended by an answer-only final
--                  step is stopped by its cap without any refused call.
--   refused_calls  calls refused in that bucket: 402 (the error names the header, e.g.
--                  X-Run-Max-Usd), 504 deadline, 410 cancelled — model calls and /tools calls.
--   runs_refused   distinct runs among them; `headers` the cap headers the 402s named.
-- cap is the run status: budget_exceeded (X-Run-Max-Usd or X-Run-Max-Tokens — see `headers`),
-- steps_exceeded, tool_calls_exceeded, repeats_exceeded (X-Run-Max-Repeats: the model repeated
-- itself; queries/loops.sql says on what), deadline_exceeded, cancelled; in a run tree,
-- ancestor_budget_exceeded / ancestor_deadline_exceeded: a sub-run stopped by an ancestor's cap or
-- deadline (not terminal: a top-up or extension of that ancestor lets it go on — run_tree_cost.sql
-- shows the tree).
--
-- @param since     DateTime64(6, 'UTC')  = now() - INTERVAL 7 DAY   -- window start
-- @param bucket_s  UInt32                = 3600                      -- bucket width in seconds
-- @param task      String                = ''                        -- one task; '' = all
-- @priority bucket cap task runs_stopped refused_calls runs_refused example_runs headers
SELECT
    bucket,
    task,
    cap,
    sum(n_stopped) AS runs_stopped,
    sum(n_refused) AS refused_calls,
    uniqExactIf(run_id, n_refused > 0) AS runs_refused,
    arraySort(groupUniqArrayArray(named)) AS headers,
    arraySlice(arraySort(groupUniqArray(run_id)), 1, 5) AS example_runs
FROM
(
    SELECT
        toStartOfInterval(updated_at, toIntervalSecond({bucket_s:UInt32})) AS bucket,
        task,
        status AS cap,
        run_id,
        1 AS n_stopped,
        0 AS n_refused,
        CAST([], 'Array(String)') AS named
    FROM
    (
        SELECT run_id, task, status, updated_at
        FROM runcap.runs
        WHERE updated_at >= {since:DateTime64(6, 'UTC')}
        ORDER BY run_id, updated_at DESC, steps DESC
        LIMIT 1 BY run_id
    )
    WHERE status IN ('budget_exceeded', 'steps_exceeded', 'tool_calls_exceeded', 'repeats_exceeded',
                     'deadline_exceeded', 'cancelled', 'ancestor_budget_exceeded',
                     'ancestor_deadline_exceeded')
        AND ({task:String} = '' OR task = {task:String})

    UNION ALL

    SELECT
        toStartOfInterval(started_at, toIntervalSecond({bucket_s:UInt32})) AS bucket,
        task,
        multiIf(
            status_code = 402 AND header IN ('X-Run-Max-Usd', 'X-Run-Max-Tokens'), 'budget_exceeded',
            status_code = 402 AND header = 'X-Run-Max-Steps', 'steps_exceeded',
            status_code = 402 AND header = 'X-Run-Max-Tool-Calls', 'tool_calls_exceeded',
            status_code = 402 AND header = 'X-Run-Max-Repeats', 'repeats_exceeded',
            status_code = 402, 'budget_exceeded',
            outcome
        ) AS cap,
        run_id,
        0 AS n_stopped,
        1 AS n_refused,
        if(header = '', CAST([], 'Array(String)'), [header]) AS named
    FROM
    (
        SELECT
            started_at, run_id, status_code, outcome,
            -- /tools calls often carry no X-Run-Task: take the run's task from its other spans
            max(task) OVER (PARTITION BY run_id) AS task,
            extract(error, '^(X-Run-[A-Za-z-]+):') AS header
        FROM runcap.spans
        WHERE started_at >= {since:DateTime64(6, 'UTC')}
            AND kind IN ('model', 'tool')
            AND run_id IN (
                SELECT run_id FROM runcap.spans
                WHERE started_at >= {since:DateTime64(6, 'UTC')}
                    AND (
                        (outcome = 'budget_exceeded' AND status_code = 402)
                        OR (outcome = 'deadline_exceeded' AND status_code = 504)
                        OR (outcome = 'cancelled' AND status_code = 410)
                    )
            )
    )
    WHERE ((outcome = 'budget_exceeded' AND status_code = 402)
            OR (outcome = 'deadline_exceeded' AND status_code = 504)
            OR (outcome = 'cancelled' AND status_code = 410))
        AND ({task:String} = '' OR task = {task:String})
)
GROUP BY bucket, task, cap
ORDER BY bucket DESC, task, cap
