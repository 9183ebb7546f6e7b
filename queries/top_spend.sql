-- top_spend: What cost the most in this window? The top runs, tasks or models by dollars spent.
--
-- One query, three groupings: `by` = 'run' (default), 'task' or 'model'; `key` is the run id,
-- the task label (X-Run-Task; '' = none given) or the model name. Costs are the model calls'
-- recorded cost_usd in the window; share_pct is the share of everything spent in the window.
-- unpriced_calls > 0: some calls had no known price and count as $0 here (see unpriced_models).
--
-- @param by     String                = 'run'                       -- run | task | model
-- @param since  DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR    -- window start
-- @param until  DateTime64(6, 'UTC')  = now() + INTERVAL 1 MINUTE   -- window end (exclusive)
-- @param limit  UInt32                = 20                          -- rows
-- @choices by run task model
-- @priority key cost_usd share_pct runs model_calls avg_usd_per_run unpriced_calls by tasks input_tokens output_tokens first_at last_at
SELECT
    {by:String} AS by,
    key,
    runs,
    tasks,
    model_calls,
    n_input AS input_tokens,
    n_output AS output_tokens,
    usd AS cost_usd,
    round(if(window_usd = 0, 0, 100 * toFloat64(usd) / toFloat64(window_usd)), 2) AS share_pct,
    toDecimal64(usd / runs, 9) AS avg_usd_per_run,
    unpriced_calls,
    first_at,
    last_at
FROM
(
    SELECT
        multiIf({by:String} = 'task', task, {by:String} = 'model', model, run_id) AS key,
        uniqExact(run_id) AS runs,
        arraySort(groupUniqArray(10)(task)) AS tasks,
        count() AS model_calls,
        sum(input_tokens) AS n_input,
        sum(output_tokens) AS n_output,
        sum(cost_usd) AS usd,
        sum(usd) OVER () AS window_usd,
        countIf(NOT price_known) AS unpriced_calls,
        min(started_at) AS first_at,
        max(started_at) AS last_at
    FROM runcap.spans
    WHERE kind = 'model'
        AND started_at >= {since:DateTime64(6, 'UTC')}
        AND started_at < {until:DateTime64(6, 'UTC')}
        AND throwIf({by:String} NOT IN ('run', 'task', 'model'), 'top_spend: parameter by must be run, task or model') = 0
    GROUP BY key
)
ORDER BY usd DESC, last_at DESC, key
LIMIT {limit:UInt32}
