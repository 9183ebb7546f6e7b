-- run_cost: Where did the money go in this run? Per step and model: tokens by kind, cost,
-- cumulative cost, share of the run's total, and the most expensive step flagged; then one
-- subtotal row per model and the run's total.
--
-- Token columns are as the provider reported them: input_tokens counts ALL input tokens
-- (cache_read_tokens and cache_write_tokens are the parts of it read from / written to the
-- prompt cache); output_tokens includes reasoning_tokens. Refused calls (402/410/504) are
-- listed with their outcome and cost 0. price_known = false: the model has no known price and
-- its cost is counted as 0 (see unpriced_models).
--
-- cost_parts: what made up the cost, USD by token kind and fee (input, cache_read, cache_write,
-- output, reasoning, input_audio, output_audio, and per-use fees: web_search, file_search,
-- code_execution); billed_units: what was billed beyond text tokens (audio tokens, uses of the
-- provider's tools). Both from the model spans' attributes (cost.*, billed.*).
--
-- row = 'step'  one step (model call) — cumulative_usd runs over steps in order;
--       'model' subtotal of one model over the run (step = 0);
--       'run'   the run's total (step = 0, model = '').
--
-- @param run_id String                = ''                          -- the run; '' = the most expensive run in the window
-- @param since  DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR    -- window for picking the run when run_id = ''
-- @priority row step model cost_usd share_pct calls outcomes cumulative_usd input_tokens output_tokens run most_expensive price_known cache_read_tokens cache_write_tokens reasoning_tokens
SELECT
    run,
    row,
    step,
    model,
    calls,
    outcomes,
    n_input AS input_tokens,
    n_cache_read AS cache_read_tokens,
    n_cache_write AS cache_write_tokens,
    n_output AS output_tokens,
    n_reasoning AS reasoning_tokens,
    usd AS cost_usd,
    if(row = 'step', sum(usd) OVER (PARTITION BY row ORDER BY step, model ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW), NULL) AS cumulative_usd,
    round(if(run_usd = 0, 0, 100 * toFloat64(usd) / toFloat64(run_usd)), 2) AS share_pct,
    row = 'step' AND usd > 0 AND usd = max(if(row = 'step', usd, 0)) OVER () AS most_expensive,
    all_priced AS price_known,
    arrayStringConcat(arrayMap((k, v) -> concat(k, ' ', toString(v)), parts.1, parts.2), ', ') AS cost_parts,
    arrayStringConcat(arrayMap((k, v) -> concat(k, ' ', toString(v)), units.1, units.2), ', ') AS billed_units
FROM
(
    SELECT
        *,
        max(if(row = 'run', usd, 0)) OVER () AS run_usd
    FROM
    (
        SELECT
            any(run_id) AS run,
            -- grouping() follows standard SQL here: a bit is set for a column NOT in the grouping set
            multiIf(grouping(step, model) = 0, 'step', grouping(step, model) = 2, 'model', 'run') AS row,
            step,
            model,
            count() AS calls,
            arraySort(groupUniqArray(outcome)) AS outcomes,
            sum(input_tokens) AS n_input,
            sum(cache_read_tokens) AS n_cache_read,
            sum(cache_write_tokens) AS n_cache_write,
            sum(output_tokens) AS n_output,
            sum(reasoning_tokens) AS n_reasoning,
            sum(cost_usd) AS usd,
            min(price_known) AS all_priced,
            sumMap(
                arrayMap(k -> substring(k, 6), arrayFilter(k -> startsWith(k, 'cost.'), mapKeys(attributes))),
                arrayMap(k -> toDecimal128(attributes[k], 9), arrayFilter(k -> startsWith(k, 'cost.'), mapKeys(attributes)))
            ) AS parts,
            sumMap(
                arrayMap(k -> substring(k, 8), arrayFilter(k -> startsWith(k, 'billed.'), mapKeys(attributes))),
                arrayMap(k -> toUInt64(attributes[k]), arrayFilter(k -> startsWith(k, 'billed.'), mapKeys(attributes)))
            ) AS units
        FROM runcap.spans
        WHERE kind = 'model'
            AND run_id = if(
                {run_id:String} != '',
                {run_id:String},
                (
                    SELECT run_id
                    FROM runcap.spans
                    WHERE kind = 'model' AND started_at >= {since:DateTime64(6, 'UTC')}
                    GROUP BY run_id
                    ORDER BY sum(cost_usd) DESC, max(started_at) DESC, run_id
                    LIMIT 1
                )
            )
        GROUP BY GROUPING SETS ((step, model), (model), ())
    )
)
ORDER BY
    indexOf(['step', 'model', 'run'], row),
    step,
    model
