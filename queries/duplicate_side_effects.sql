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
--   seen_as = 'executed'           calls through /tools or MCP (`times` = `executed_times`: every
--                                  call that came to runcap, whatever became of it); `outcomes` in
--                                  time order. What reached the tool, counted apart (they add up
--                                  to `times`):
--                                    ran      the tool got the call and answered (ok or error);
--                                    unknown  cut after it may have reached the tool (timeout,
--                                             cancel, reset): may or may not have taken effect;
--                                    replays  answered from the idempotency record: the tool was
--                                             not called again;
--                                    refused  stopped before the tool: refused by runcap (409
--                                             while an earlier attempt is unknown, 402 a cap, 403
--                                             a rule, 422 a reused key, ...) or the tool
--                                             unreachable (502): the tool was not called.
--                                  "Refunded twice?": ran + unknown is how often it may have
--                                  happened — ran > 1 means it did. later_all_replayed = true means
--                                  every repeat was a replay. `idempotency_keys` > 1 means the
--                                  repeats were distinct operations (X-Run-Operation-Id /
--                                  Idempotency-Key); 0 means a tool without side effects (no
--                                  idempotency): they all ran.
--   ran, unknown, replays, refused, later_all_replayed, idempotency_keys are NULL on 'requested' rows.
--
-- Whether a call reached the tool is the span's attributes['tool.reached'] (true / unknown /
-- false); spans written before runcap recorded it are judged by their outcome (ok and error
-- ran, unknown without a 409 is unknown, the rest refused).
--
-- Columns kept first on a narrow terminal (`runcap query` at 80 columns):
-- @priority run_id tool_name seen_as times ran unknown replays refused outcomes args_hash
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
    ran,
    unknown,
    replays,
    refused,
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
            if(kind = 'tool', toNullable(countIf(reached = 'true')), NULL) AS ran,
            if(kind = 'tool', toNullable(countIf(reached = 'unknown')), NULL) AS unknown,
            if(kind = 'tool', toNullable(countIf(outcome = 'replayed')), NULL) AS replays,
            if(kind = 'tool', toNullable(countIf(reached = 'false' AND outcome != 'replayed')), NULL) AS refused,
            if(kind = 'tool', toNullable(toBool(countIf(outcome = 'replayed') = count() - 1)), NULL) AS later_all_replayed,
            if(kind = 'tool', toNullable(uniqExactIf(idempotency_key, idempotency_key != '')), NULL) AS idempotency_keys,
            arraySort(groupUniqArray(step)) AS steps,
            min(started_at) AS first_at,
            max(started_at) AS last_at,
            arrayMap(x -> x.2, arraySort(groupArray((started_at, outcome)))) AS outcomes
        FROM
        (
            SELECT
                run_id, task, tool_name, args_hash, kind, outcome, status_code, idempotency_key, step,
                started_at,
                multiIf(
                    attributes['tool.reached'] != '', attributes['tool.reached'],
                    outcome IN ('ok', 'error'), 'true',
                    outcome = 'unknown' AND status_code != 409, 'unknown',
                    'false'
                ) AS reached
            FROM runcap.spans
        )
        WHERE kind IN ('tool', 'tool_call')
            AND args_hash != ''
            AND (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
            AND ({tool:String} = '' OR tool_name = {tool:String})
        GROUP BY run_id, tool_name, args_hash, kind
    )
)
WHERE times >= {min_count:UInt32}
ORDER BY run_last_at DESC, run_id, tool_name, args_hash, seen_as DESC
