-- unpriced_models: Which models is runcap charging as $0 because it has no price for them?
-- Model calls recorded with price_known = false: their cost_usd is 0, so dollar caps, run_cost
-- and top_spend undercount them. Fix: add [prices."MODEL"] to runcap.toml (USD per million
-- tokens), or check the model name for a typo. (Under a dollar cap such calls are refused unless
-- caps.allow_unpriced is set: `refused_calls` counts those.)
--
-- @param since  DateTime64(6, 'UTC')  = now() - INTERVAL 7 DAY   -- window start
-- @priority model calls uncharged_input_tokens uncharged_output_tokens runs provider ok_calls refused_calls tasks example_runs first_at last_at
SELECT
    provider,
    model,
    count() AS calls,
    countIf(outcome = 'ok') AS ok_calls,
    countIf(outcome != 'ok') AS refused_calls,
    uniqExact(run_id) AS runs,
    arraySort(groupUniqArray(task)) AS tasks,
    sum(input_tokens) AS uncharged_input_tokens,
    sum(output_tokens) AS uncharged_output_tokens,
    min(started_at) AS first_at,
    max(started_at) AS last_at,
    arraySlice(arraySort(groupUniqArray(run_id)), 1, 5) AS example_runs
FROM runcap.spans
WHERE kind = 'model'
    AND NOT price_known
    AND started_at >= {since:DateTime64(6, 'UTC')}
GROUP BY provider, model
ORDER BY calls DESC, provider, model
