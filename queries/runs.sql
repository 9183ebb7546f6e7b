-- runs: What ran recently, and how did each run end? The latest state of each run (runcap.runs,
-- newest version per run — never a sum over versions), newest first. cap_hit names the cap that
-- stopped the run as the header that set it — X-Run-Max-Usd, X-Run-Max-Tokens, X-Run-Max-Steps,
-- X-Run-Max-Tool-Calls, X-Run-Max-Repeats, X-Run-Deadline — or 'cancel' ('' when none did; for budget_exceeded with
-- both a dollar and a token cap, the one more used up). Used by `runcap runs`.
--
-- @param since   DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR   -- runs updated since
-- @param task    String                = ''                         -- one task; '' = all
-- @param status  String                = ''                         -- one status; '' = all
-- @param limit   UInt32                = 50                         -- rows
-- @choices status active completed budget_exceeded deadline_exceeded steps_exceeded tool_calls_exceeded repeats_exceeded cancelled
-- @priority run_id status steps cost_usd cap_hit updated_at task tool_calls max_usd input_tokens output_tokens
SELECT
    run_id,
    task,
    status,
    multiIf(
        status = 'steps_exceeded', 'X-Run-Max-Steps',
        status = 'tool_calls_exceeded', 'X-Run-Max-Tool-Calls',
        status = 'repeats_exceeded', 'X-Run-Max-Repeats',
        status = 'deadline_exceeded', 'X-Run-Deadline',
        status = 'cancelled', 'cancel',
        status != 'budget_exceeded', '',
        max_usd IS NULL, 'X-Run-Max-Tokens',
        max_tokens IS NULL, 'X-Run-Max-Usd',
        toFloat64(cost_usd) / greatest(toFloat64(max_usd), 1e-9)
            >= (input_tokens + output_tokens) / greatest(toFloat64(max_tokens), 1), 'X-Run-Max-Usd',
        'X-Run-Max-Tokens'
    ) AS cap_hit,
    steps,
    tool_calls,
    input_tokens,
    output_tokens,
    cost_usd,
    max_usd,
    max_tokens,
    max_steps,
    max_tool_calls,
    deadline,
    started_at,
    updated_at
FROM
(
    SELECT *
    FROM runcap.runs
    WHERE updated_at >= {since:DateTime64(6, 'UTC')}
    ORDER BY run_id, updated_at DESC, steps DESC
    LIMIT 1 BY run_id
)
WHERE ({task:String} = '' OR task = {task:String})
    AND ({status:String} = '' OR status = {status:String})
ORDER BY updated_at DESC, run_id
LIMIT {limit:UInt32}
