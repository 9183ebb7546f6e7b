-- context_growth: Which runs resend their whole history every step? Per run: input tokens per
-- model call in step order, how fast they grow, and how much of it the prompt cache absorbed.
--
-- An agent that resends the full conversation pays for every earlier step again on each call:
-- input_by_step climbs step after step (grows_every_step = true) and total_input_tokens dwarfs
-- the last step's input. When cached_share is low too, the provider's prompt cache is not
-- helping (unstable prefix, or caching off): summarise or trim history, or enable caching.
--
-- avg_growth_per_step = (last step's input - first step's input) / (steps - 1).
-- Only answered model calls (outcome ok) count; refused calls have no tokens.
--
-- @param since      DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR   -- window start (ignored when run_id is set)
-- @param run_id     String                = ''                         -- one run; '' = every run in the window
-- @param min_steps  UInt32                = 3                          -- runs with at least this many answered calls
-- @param limit      UInt32                = 50                         -- rows
-- @priority run_id steps first_input_tokens last_input_tokens avg_growth_per_step grows_every_step task max_input_tokens cached_share total_input_tokens total_output_tokens models input_by_step
SELECT
    run_id,
    task,
    steps,
    input_by_step[1] AS first_input_tokens,
    input_by_step[-1] AS last_input_tokens,
    arrayMax(input_by_step) AS max_input_tokens,
    if(steps < 2, 0, round((input_by_step[-1] - input_by_step[1]) / (steps - 1), 1)) AS avg_growth_per_step,
    toBool(steps > 1 AND arrayAll(d -> d > 0, arrayPopFront(arrayDifference(input_by_step)))) AS grows_every_step,
    total_input_tokens,
    total_output_tokens,
    round(if(total_input_tokens = 0, 0, cached / total_input_tokens), 4) AS cached_share,
    input_by_step,
    models
FROM
(
    SELECT
        run_id,
        max(task) AS task,
        count() AS steps,
        arrayMap(x -> x.3, arraySort(groupArray((step, started_at, toInt64(input_tokens))))) AS input_by_step,
        sum(input_tokens) AS total_input_tokens,
        sum(output_tokens) AS total_output_tokens,
        sum(cache_read_tokens) AS cached,
        arraySort(groupUniqArray(model)) AS models
    FROM runcap.spans
    WHERE kind = 'model'
        AND outcome = 'ok'
        AND (run_id = {run_id:String} OR ({run_id:String} = '' AND started_at >= {since:DateTime64(6, 'UTC')}))
    GROUP BY run_id
    HAVING steps >= greatest({min_steps:UInt32}, 1)
)
ORDER BY total_input_tokens DESC, run_id
LIMIT {limit:UInt32}
