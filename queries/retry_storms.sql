-- retry_storms: Is something hammering the same call? The same arguments (or the same model
-- request) repeated in quick succession within a run: `quick_repeats` counts the calls that came
-- within window_s seconds of the previous identical one.
--
-- Identity: for tool calls (kind 'tool' through /tools, 'tool_call' requested by the model) the
-- args_hash; for model calls (kind 'model') the request_hash — byte-identical request bodies, i.e.
-- an agent resending the same request (only when payloads are stored; '' is skipped).
-- A tool call the model requested and the agent then executed through /tools shows as two rows
-- (kind tool_call and kind tool), each counted on its own. A model that asks for the same call
-- step after step, however slowly, is a loop rather than a storm: queries/loops.sql (and
-- X-Run-Max-Repeats, which stops it).
--
-- @param since        DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR   -- window start (ignored when run_id is set)
-- @param run_id       String                = ''                         -- one run; '' = every run in the window
-- @param window_s     Float64               = 60                         -- a repeat within this many seconds is quick
-- @param min_repeats  UInt32                = 3                          -- report when calls in quick succession >= this
-- @priority run_id kind target calls calls_in_quick_succession min_gap_s outcomes hash task median_gap_s steps first_at last_at
SELECT
    run_id,
    task,
    kind,
    if(kind = 'model', model, tool_name) AS target,
    hash,
    calls,
    quick_repeats + 1 AS calls_in_quick_succession,
    round(arrayMin(gaps), 3) AS min_gap_s,
    round(arrayReduce('median', gaps), 3) AS median_gap_s,
    first_at,
    last_at,
    steps,
    outcomes
FROM
(
    SELECT
        run_id,
        any(run_task) AS task,
        kind,
        any(model) AS model,
        tool_name,
        if(kind = 'model', request_hash, args_hash) AS hash,
        count() AS calls,
        arraySort(groupArray(started_at)) AS times,
        arrayPopFront(arrayDifference(arrayMap(t -> toUnixTimestamp64Micro(t), times))) AS gaps_us,
        arrayMap(g -> g / 1e6, gaps_us) AS gaps,
        arrayCount(g -> g <= {window_s:Float64}, gaps) AS quick_repeats,
        min(started_at) AS first_at,
        max(started_at) AS last_at,
        arraySort(groupUniqArray(step)) AS steps,
        arrayMap(x -> x.2, arraySort(groupArray((started_at, outcome)))) AS outcomes
    FROM
    (
        -- /tools calls often carry no X-Run-Task: take the run's task from its other spans
        SELECT *, max(task) OVER (PARTITION BY run_id) AS run_task
        FROM runcap.spans
        WHERE (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
    )
    WHERE kind IN ('model', 'tool', 'tool_call')
    GROUP BY run_id, kind, tool_name, hash
    HAVING hash != '' AND quick_repeats + 1 >= {min_repeats:UInt32}
)
ORDER BY calls_in_quick_succession DESC, last_at DESC, run_id
