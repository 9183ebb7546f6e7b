-- runs: What ran recently, and how did each run end? The latest state of each run (runcap.runs,
-- newest version per run — never a sum over versions), newest first. cap_hit names the cap that
-- stopped the run ('' when none did). Used by `runcap runs`.
--
-- @param since   DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR   -- runs updated since
-- @param task    String                = ''                         -- one task; '' = all
-- @param status  String                = ''                         -- one status; '' = all
-- @param limit   UInt32                = 50                         -- rows
SELECT
    run_id,
    task,
    status,
    if(status IN ('budget_exceeded', 'steps_exceeded', 'tool_calls_exceeded', 'deadline_exceeded', 'cancelled'),
       status, '') AS cap_hit,
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
