-- context_outgrown: Which runs' context grew past N times its first step, and how much of it is
-- tool output? Per run: the input tokens of its first answered model call, of its largest and of
-- its last, the growth (largest / first), the share of the last call's messages that were tool
-- results (bytes of tool results / bytes of messages, as runcap measured the forwarded request),
-- the requests a context policy rewrote and the input tokens that removed, and the calls refused
-- by X-Run-Max-Context-Tokens.
--
-- A run whose context grows many times over while tool output is most of it is carrying old tool
-- results along: `X-Run-Context-Policy: offload` (or trimming them) is the fix. Growth without
-- much tool output is conversation history: summarise it, or cap it (X-Run-Max-Context-Tokens).
-- The same threshold drives the runcap_context_growth_alerts metric ([context] growth_alert).
-- Only answered model calls (outcome ok) count for the tokens; spans recorded before runcap
-- measured context have no tool-output share (0).
--
-- @param since   DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR   -- window start (ignored when run_id is set)
-- @param run_id  String                = ''                         -- one run; '' = every run in the window
-- @param growth  Float64               = 4                          -- runs whose largest call read at least this many times their first's input
-- @param limit   UInt32                = 50                         -- rows
-- @priority run_id growth steps first_input_tokens max_input_tokens tool_output_share rewrites context_refusals task last_input_tokens removed_tokens
SELECT
    run_id,
    task,
    steps,
    first_input_tokens,
    max_input_tokens,
    last_input_tokens,
    round(max_input_tokens / first_input_tokens, 2) AS growth,
    round(last_tool_output_share, 4) AS tool_output_share,
    rewrites,
    removed_tokens,
    context_refusals
FROM
(
    SELECT
        run_id,
        max(task) AS task,
        countIf(outcome = 'ok') AS steps,
        argMinIf(input_tokens, (step, started_at), outcome = 'ok') AS first_input_tokens,
        maxIf(input_tokens, outcome = 'ok') AS max_input_tokens,
        argMaxIf(input_tokens, (step, started_at), outcome = 'ok') AS last_input_tokens,
        argMaxIf(toFloat64OrZero(attributes['context.tool_output_share']), (step, started_at), outcome = 'ok')
            AS last_tool_output_share,
        countIf(attributes['context.policy'] != '') AS rewrites,
        sum(toUInt64OrZero(attributes['context.removed_tokens'])) AS removed_tokens,
        countIf(startsWith(error, 'X-Run-Max-Context-Tokens:')) AS context_refusals
    FROM runcap.spans
    WHERE kind = 'model'
        AND (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
    GROUP BY run_id
    HAVING steps > 0 AND first_input_tokens > 0 AND max_input_tokens >= {growth:Float64} * first_input_tokens
)
ORDER BY growth DESC, run_id
LIMIT {limit:UInt32}
