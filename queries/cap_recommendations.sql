-- cap_recommendations: What caps should each task have? Per task and metric (steps, tool calls,
-- tokens, dollars, wall-clock seconds): p50 / p95 / p99 / max over the task's COMPLETED runs, the
-- cap its newest run carried, and the share of all its runs that this cap stops.
--
-- Advice: set each cap near the p99 of successful (completed) runs, with a little headroom — a
-- cap below that stops good runs, a cap far above it lets a looping run burn money. If many runs
-- hit the cap (share_stopped high) while completed runs sit well below it, the task is out of
-- scope for the agent (it loops or wanders): fix the agent or the task, not the cap.
--
-- Columns:
--   runs, completed_runs  the task's runs in the window (latest state per run), and the completed
--                         ones the percentiles are taken over (quantileExact: observed values).
--   current_cap           the cap recorded on the task's most recently started run (NULL: none);
--                         for wall_clock_s it is that run's deadline minus its start.
--   runs_stopped          runs (any status) this cap would stop: usage reached current_cap, or the
--                         run was stopped by this kind of cap (its status, or a 402 naming the
--                         header: X-Run-Max-Usd vs X-Run-Max-Tokens tell budget_exceeded apart).
--   share_stopped         runs_stopped / runs.
-- tokens = input + output tokens (what X-Run-Max-Tokens counts).
--
-- Run trees: a run's dollar and token caps bound its whole subtree (the ledger reserves a
-- sub-agent's calls against every ancestor's cap), so for a root run that started sub-agents
-- (X-Run-Parent) the usd and tokens values are its tree's totals: the root and every run below it
-- (latest state of each, in the window). Steps and tool calls count per run; their subtree caps
-- (X-Run-Max-Tree-Steps, X-Run-Max-Tree-Tool-Calls) get metrics of their own, tree_steps and
-- tree_tool_calls (the tree's totals), listed only for a task some of whose runs have sub-agents.
-- A sub-agent's own row counts its own use (the tree is its root's).
--
-- @param since  DateTime64(6, 'UTC')  = now() - INTERVAL 7 DAY   -- runs updated since
-- @param task   String                = ''                        -- one task; '' = all
-- @priority task metric p99 current_cap runs_stopped share_stopped completed_runs p95 p50 max runs
SELECT
    task,
    metric,
    count() AS runs,
    countIf(status = 'completed') AS completed_runs,
    if(completed_runs = 0, NULL, quantileExactIf(0.5)(value, status = 'completed')) AS p50,
    if(completed_runs = 0, NULL, quantileExactIf(0.95)(value, status = 'completed')) AS p95,
    if(completed_runs = 0, NULL, quantileExactIf(0.99)(value, status = 'completed')) AS p99,
    if(completed_runs = 0, NULL, maxIf(value, status = 'completed')) AS max,
    any(cap_now) AS current_cap,
    countIf(stopped OR (cap_now IS NOT NULL AND value >= cap_now)) AS runs_stopped,
    round(runs_stopped / runs, 4) AS share_stopped
FROM
(
    SELECT
        task,
        status,
        tree_runs > 1 AS has_subagents,
        m.1 AS metric,
        m.2 AS value,
        m.4 AS stopped,
        -- the newest run's cap, NULL included (a tuple keeps argMax from skipping NULLs); runs that
        -- started at the same instant: the greatest run id, so the answer does not depend on the order
        -- rows arrive in
        argMax(tuple(m.3), (started_at, run_id)) OVER (PARTITION BY task, metric).1 AS cap_now
    FROM
    (
        SELECT *
        FROM runcap.runs
        WHERE updated_at >= {since:DateTime64(6, 'UTC')}
            AND ({task:String} = '' OR task = {task:String})
        ORDER BY run_id, updated_at DESC, steps DESC
        LIMIT 1 BY run_id
    ) AS r
    LEFT JOIN
    (
        SELECT run_id, groupUniqArray(extract(error, '^(X-Run-[A-Za-z-]+):')) AS headers
        FROM runcap.spans
        WHERE status_code = 402 AND started_at >= {since:DateTime64(6, 'UTC')} - INTERVAL 1 DAY
        GROUP BY run_id
    ) AS refused USING (run_id)
    LEFT JOIN
    (
        -- each tree's totals, under its root's id (a root without sub-agents: its own; rows from
        -- before run trees have root_run_id '': each its own root)
        SELECT
            if(root_run_id = '', run_id, root_run_id) AS run_id,
            count() AS tree_runs,
            sum(cost_usd) AS tree_usd,
            sum(input_tokens + output_tokens) AS tree_tokens,
            sum(steps) AS tree_steps,
            sum(tool_calls) AS tree_tool_calls
        FROM
        (
            SELECT *
            FROM runcap.runs
            WHERE updated_at >= {since:DateTime64(6, 'UTC')}
            ORDER BY run_id, updated_at DESC, steps DESC
            LIMIT 1 BY run_id
        )
        GROUP BY run_id
    ) AS trees USING (run_id)
    ARRAY JOIN [
        ('steps', toFloat64(steps), CAST(max_steps, 'Nullable(Float64)'),
            status = 'steps_exceeded' OR has(headers, 'X-Run-Max-Steps')),
        ('tool_calls', toFloat64(tool_calls), CAST(max_tool_calls, 'Nullable(Float64)'),
            status = 'tool_calls_exceeded' OR has(headers, 'X-Run-Max-Tool-Calls')),
        ('tokens', toFloat64(if(tree_runs > 1, tree_tokens, input_tokens + output_tokens)),
            CAST(max_tokens, 'Nullable(Float64)'), has(headers, 'X-Run-Max-Tokens')),
        ('usd', toFloat64(if(tree_runs > 1, tree_usd, cost_usd)), CAST(max_usd, 'Nullable(Float64)'),
            has(headers, 'X-Run-Max-Usd')),
        ('tree_steps', toFloat64(if(tree_runs > 1, tree_steps, steps)), CAST(NULL, 'Nullable(Float64)'),
            has(headers, 'X-Run-Max-Tree-Steps')),
        ('tree_tool_calls', toFloat64(if(tree_runs > 1, tree_tool_calls, tool_calls)),
            CAST(NULL, 'Nullable(Float64)'), has(headers, 'X-Run-Max-Tree-Tool-Calls')),
        ('wall_clock_s', dateDiff('microsecond', started_at, updated_at) / 1e6,
            dateDiff('microsecond', started_at, deadline) / 1e6,
            status = 'deadline_exceeded')
    ] AS m
)
GROUP BY task, metric
HAVING metric NOT IN ('tree_steps', 'tree_tool_calls') OR max(has_subagents)
ORDER BY task, indexOf(['steps', 'tool_calls', 'tokens', 'usd', 'wall_clock_s', 'tree_steps', 'tree_tool_calls'], metric)
