-- loops: Which runs spun, on which tool and arguments, and where did runcap stop them? One row per
-- run and repeated call: a tool the model asked for with the same arguments (tool_call spans, same
-- tool_name and args_hash) at least min_repeats times, and every run runcap stopped for
-- repeating itself (X-Run-Max-Repeats), also when no single call reached min_repeats (a cycle).
--
--   requests         times the model asked for that call; `steps` the steps whose answers did
--   stopped_step     the step whose answer showed the loop (attributes['repeats.stopped']), 0: never
--   stopped_reason   what runcap saw: `repeat: TOOL ARGS requested N times` or `cycle: A, B repeated N times`
--   answer_only_step the step runcap answered without tools because of it
--                    (attributes['final_step.reason'] = 'max_repeats'), 0: none yet
--   refused          the run's model calls refused 402 max_repeats (the same request again, or a call
--                    after the answer-only step)
--   status           the run's latest status (runcap.runs): `repeats_exceeded` once the answer-only
--                    step was answered
--
-- @param since        DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR   -- window start (ignored when run_id is set)
-- @param run_id       String                = ''                         -- one run; '' = every run in the window
-- @param min_repeats  UInt32                = 2                          -- report a call asked for at least this often
-- @priority run_id tool requests stopped_step answer_only_step stopped_reason refused status args_hash task steps first_at last_at
SELECT
    c.run_id AS run_id,
    c.task AS task,
    c.tool_name AS tool,
    c.args_hash AS args_hash,
    c.requests AS requests,
    c.steps AS steps,
    s.stopped_step AS stopped_step,
    s.stopped_reason AS stopped_reason,
    s.answer_only_step AS answer_only_step,
    s.refused AS refused,
    r.status AS status,
    c.first_at AS first_at,
    c.last_at AS last_at
FROM
(
    SELECT
        run_id,
        max(task) AS task,
        tool_name,
        args_hash,
        count() AS requests,
        arraySort(groupUniqArray(step)) AS steps,
        min(started_at) AS first_at,
        max(started_at) AS last_at
    FROM runcap.spans
    WHERE kind = 'tool_call'
        AND attributes['tool.executed_by'] != 'provider'
        AND (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
    GROUP BY run_id, tool_name, args_hash
) AS c
LEFT JOIN
(
    -- what runcap did about it, per run
    SELECT
        run_id,
        maxIf(step, attributes['repeats.stopped'] != '') AS stopped_step,
        anyIf(attributes['repeats.stopped'], attributes['repeats.stopped'] != '') AS stopped_reason,
        maxIf(step, attributes['final_step.reason'] = 'max_repeats') AS answer_only_step,
        countIf(status_code = 402 AND startsWith(error, 'X-Run-Max-Repeats:')) AS refused
    FROM runcap.spans
    WHERE kind = 'model'
        AND (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
    GROUP BY run_id
) AS s ON s.run_id = c.run_id
LEFT JOIN
(
    SELECT run_id, status
    FROM runcap.runs
    WHERE run_id = {run_id:String} OR ({run_id:String} = '' AND updated_at >= {since:DateTime64(6, 'UTC')})
    ORDER BY run_id, updated_at DESC, steps DESC
    LIMIT 1 BY run_id
) AS r ON r.run_id = c.run_id
-- a run with no stop has 0 / '' from the joins (join_use_nulls is off)
WHERE c.requests >= {min_repeats:UInt32} OR (s.stopped_step > 0 AND c.requests > 1)
ORDER BY s.stopped_step > 0 DESC, c.requests DESC, c.last_at DESC, c.run_id, c.tool_name
