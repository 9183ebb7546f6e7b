-- slow_tools: Which tools are slow or failing? Per tool: call count, latency percentiles, errors
-- and timeouts — for tools executed through runcap (/tools, and MCP servers' tools/call), and for
-- tools the agent runs itself.
--
-- source = 'executed'   /tools and MCP tools/call calls: duration_ms of the call as runcap made it.
--                       Replays (answered from the idempotency record) and refused calls
--                       (402/409/410, and 428: held for a person's approval; an MCP refusal's span
--                       carries the status /tools would have answered) are left out.
-- source = 'requested'  tools the model requested and the agent ran on its own: the time from the
--                       model's response (tool_call span) to the request that carried the result
--                       back (tool_result span, matched by tool_call_id). This includes the agent's
--                       own work between the two, so it is an upper bound of the tool's latency.
-- timeouts: outcome timeout / deadline_exceeded, or an unknown outcome with status 504 (a
-- side-effecting call cut by its timeout). errors: every other outcome that is not ok.
--
-- @param since      DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR   -- window start
-- @param tool       String                = ''                         -- one tool; '' = all
-- @param min_calls  UInt32                = 1                          -- tools with at least this many calls
-- @priority tool_name source calls p99_ms timeouts errors p50_ms p95_ms max_ms runs
SELECT
    source,
    tool_name,
    count() AS calls,
    uniqExact(run_id) AS runs,
    round(quantileExact(0.5)(ms), 1) AS p50_ms,
    round(quantileExact(0.95)(ms), 1) AS p95_ms,
    round(quantileExact(0.99)(ms), 1) AS p99_ms,
    round(max(ms), 1) AS max_ms,
    countIf(is_timeout) AS timeouts,
    countIf(NOT is_timeout AND result != 'ok') AS errors
FROM
(
    SELECT
        'executed' AS source,
        tool_name,
        run_id,
        duration_ms AS ms,
        outcome AS result,
        outcome IN ('timeout', 'deadline_exceeded') OR (outcome = 'unknown' AND status_code = 504) AS is_timeout
    FROM runcap.spans
    WHERE kind = 'tool'
        AND started_at >= {since:DateTime64(6, 'UTC')}
        AND outcome != 'replayed'
        AND status_code NOT IN (402, 409, 410, 428)
        AND ({tool:String} = '' OR tool_name = {tool:String})

    UNION ALL

    SELECT
        'requested' AS source,
        c.tool_name AS tool_name,
        c.run_id AS run_id,
        dateDiff('microsecond', c.started_at, r.started_at) / 1000 AS ms,
        r.outcome AS result,
        false AS is_timeout
    FROM
    (
        SELECT run_id, tool_call_id, tool_name, started_at
        FROM runcap.spans
        WHERE kind = 'tool_call' AND tool_call_id != '' AND started_at >= {since:DateTime64(6, 'UTC')}
            AND ({tool:String} = '' OR tool_name = {tool:String})
    ) AS c
    INNER JOIN
    (
        SELECT run_id, tool_call_id, started_at, outcome
        FROM runcap.spans
        WHERE kind = 'tool_result' AND tool_call_id != '' AND started_at >= {since:DateTime64(6, 'UTC')}
    ) AS r ON r.run_id = c.run_id AND r.tool_call_id = c.tool_call_id
)
GROUP BY source, tool_name
HAVING calls >= {min_calls:UInt32}
ORDER BY p95_ms DESC, source, tool_name
