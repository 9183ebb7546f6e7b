-- run_timeline: What did this run do, step by step? One line per span in time order: model
-- calls with tokens, cost and cumulative cost; tool calls the model requested (tool_call), results
-- the agent sent back (tool_result), calls through /tools (tool); outcome, status and duration.
-- Hashes are full: `runcap payload HASH` prints a stored request/response body. Used by
-- `runcap run RUN_ID`. `context` says what a context policy did to a model call's request
-- (policy, input tokens removed, and the hash prefix of the request as the agent sent it — in
-- full in attributes['context.original_request_hash']; request_hash is the one forwarded), or, for a call refused by X-Run-Max-Context-Tokens, the cap.
-- `cost_parts` says what made up a model call's cost, USD by token kind and fee (input,
-- cache_read, cache_write, output, reasoning, input_audio, output_audio, web_search,
-- file_search, code_execution), with the billed units beyond text tokens (audio tokens, uses of
-- the provider's tools) and runcap's bound on those uses; a tool call the provider executed for
-- the model (a remote MCP server, a web search) is a `tool_call` with tool `(provider) NAME`.
--
-- @param run_id  String                = ''                          -- the run; '' = the most recently active run
-- @param since   DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR    -- window for picking the run when run_id = ''
SELECT
    started_at,
    step,
    kind,
    model,
    if(attributes['tool.executed_by'] = 'provider', concat('(provider) ', tool_name), tool_name) AS tool,
    input_tokens,
    output_tokens,
    cost_usd,
    arrayStringConcat(
        arrayConcat(
            arrayMap(k -> concat(substring(k, 6), ' ', attributes[k]),
                     arraySort(arrayFilter(k -> startsWith(k, 'cost.'), mapKeys(attributes)))),
            arrayMap(k -> concat(substring(k, 7), ' x', attributes[k]),
                     arraySort(arrayFilter(k -> startsWith(k, 'usage.'), mapKeys(attributes)))),
            if(attributes['hosted.max_uses_set'] != '', [concat('uses <= ', attributes['hosted.max_uses_set'])], [])
        ),
        ', '
    ) AS cost_parts,
    sum(cost_usd) OVER (ORDER BY started_at, kind_order, span_id ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cumulative_usd,
    args_hash,
    result_hash,
    outcome,
    status_code,
    round(duration_ms, 1) AS duration_ms,
    idempotency_key,
    request_hash,
    response_hash,
    substring(error, 1, 200) AS error,
    multiIf(
        attributes['context.policy'] != '',
        concat(attributes['context.policy'], ' -', attributes['context.removed_tokens'], ' tok, sent as ',
               substring(attributes['context.original_request_hash'], 1, 12)),
        error LIKE 'X-Run-Max-Context-Tokens:%',
        concat('over max_context_tokens ', attributes['context.max_tokens']),
        ''
    ) AS context,
    run_id
FROM
(
    SELECT
        *,
        -- equal times: a result sent back comes before the model call whose request carried it
        indexOf(['tool_result', 'model', 'tool_call', 'tool'], kind) AS kind_order
    FROM runcap.spans
    WHERE run_id = if(
        {run_id:String} != '',
        {run_id:String},
        (SELECT run_id FROM runcap.spans WHERE started_at >= {since:DateTime64(6, 'UTC')}
         ORDER BY started_at DESC LIMIT 1)
    )
)
ORDER BY started_at, kind_order, span_id
