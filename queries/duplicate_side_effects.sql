-- duplicate_side_effects: Why did this run call refund twice? Every (run, tool, arguments) seen
-- more than once: executed through runcap — /tools or an MCP server's tools/call (kind 'tool';
-- an MCP call's tool_name is the MCP tool, its args_hash that of params.arguments) — or only
-- requested by the model (kind 'tool_call', for agents that run their tools themselves), with
-- the steps, the times, and whether the later executions were idempotent replays or really ran
-- again.
--
-- One logical call can show up twice: the model requested it (tool_call span) and the agent then
-- executed it through /tools or MCP (tool span). Each kind is counted on its own row (`seen_as`), never
-- added together; `requested_times` and `executed_times` show both counts of the same
-- (run, tool, args_hash) on every row, also when the other kind was seen only once. (A tool
-- called through /tools under another name than the model's function shows up as two keys.)
--
-- Reading it:
--   seen_as = 'requested'          the model asked for it `times` times; what the agent did about
--                                  it is up to the agent (check executed_times and the tool).
--   seen_as = 'executed'           calls through /tools or MCP; `outcomes` in time order. `replays` = the
--                                  repeats runcap answered from the idempotency record without
--                                  calling the tool; later_all_replayed = true means the side
--                                  effect happened once. `idempotency_keys` > 1 means the repeats
--                                  were distinct operations (X-Run-Operation-Id / Idempotency-Key);
--                                  0 means a tool without side effects (no idempotency): they all ran.
--   replays, later_all_replayed, idempotency_keys are NULL on 'requested' rows.
--
-- @param run_id    String                = ''                          -- one run; '' = every run in the window
-- @param since     DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR    -- window start (ignored when run_id is set)
-- @param tool      String                = ''                          -- one tool name; '' = all
-- @param min_count UInt32                = 2                           -- report keys seen at least this often
SELECT
    run_id,
    task,
    tool_name,
    args_hash,
    seen_as,
    times,
    requested_times,
    executed_times,
    replays,
    later_all_replayed,
    idempotency_keys,
    steps,
    first_at,
    last_at,
    outcomes
FROM
(
    SELECT
        * EXCEPT task,
        max(task) OVER (PARTITION BY run_id) AS task,  -- /tools calls often carry no X-Run-Task
        sumIf(times, seen_as = 'requested') OVER (PARTITION BY run_id, tool_name, args_hash) AS requested_times,
        sumIf(times, seen_as = 'executed') OVER (PARTITION BY run_id, tool_name, args_hash) AS executed_times,
        max(last_at) OVER (PARTITION BY run_id) AS run_last_at
    FROM
    (
        SELECT
            run_id,
            any(task) AS task,
            tool_name,
            args_hash,
            if(kind = 'tool', 'executed', 'requested') AS seen_as,
            count() AS times,
            if(kind = 'tool', toNullable(countIf(outcome = 'replayed')), NULL) AS replays,
            if(kind = 'tool', toNullable(toBool(countIf(outcome = 'replayed') = count() - 1)), NULL) AS later_all_replayed,
            if(kind = 'tool', toNullable(uniqExactIf(idempotency_key, idempotency_key != '')), NULL) AS idempotency_keys,
            arraySort(groupUniqArray(step)) AS steps,
            min(started_at) AS first_at,
            max(started_at) AS last_at,
            arrayMap(x -> x.2, arraySort(groupArray((started_at, outcome)))) AS outcomes
        FROM runcap.spans
        WHERE kind IN ('tool', 'tool_call')
            AND args_hash != ''
            AND (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
            AND ({tool:String} = '' OR tool_name = {tool:String})
        GROUP BY run_id, tool_name, args_hash, kind
    )
)
WHERE times >= {min_count:UInt32}
ORDER BY run_last_at DESC, run_id, tool_name, args_hash, seen_as DESC
