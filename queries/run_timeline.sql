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
-- `detail` is what a terminal shows of a span beyond its figures: a note on what the other
-- columns cannot say, then the error (also in `error`, whole up to 200 characters). The notes:
--   caps_change   who changed the caps, what changed (old→new) and why
--                 (attributes caps.by, caps.old, caps.new, caps.reason);
--   a model call cut short (a cancelled stream, a deadline): which of input_tokens /
--                 output_tokens are the reservation it was charged at rather than the
--                 provider's report, and the tokens the provider had reported when it was cut
--                 (attributes usage.input, usage.output, usage.seen_*_tokens);
--   a model call that got no answer: "not a step" (attributes step.counted, upstream.failures);
--   X-Run-Max-Repeats: a tool call the model asked for again ("asked 3x"; attributes
--                 repeats.count), the step whose answer showed the loop ("loop: ...";
--                 repeats.stopped) and the answer-only step it caused (final_step.reason,
--                 repeats.reason).
--
-- Columns kept first on a narrow terminal (`runcap run` at 80 columns):
-- @priority step kind tool outcome detail cost_usd status_code context request_hash response_hash input_tokens output_tokens duration_ms started_at model cumulative_usd idempotency_key args_hash result_hash cost_parts
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
            arrayMap(k -> concat(substring(k, 8), ' x', attributes[k]),
                     arraySort(arrayFilter(k -> startsWith(k, 'billed.'), mapKeys(attributes)))),
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
    arrayStringConcat(arrayFilter(x -> x != '', [multiIf(
        kind = 'caps_change',
        concat(
            'by ', attributes['caps.by'], ': ',
            arrayStringConcat(
                arrayMap(
                    k -> concat(
                        k, ' ',
                        replaceRegexpOne(replaceAll(JSONExtractRaw(attributes['caps.old'], k), '"', ''), '(\\.[0-9]*[1-9])0+$|\\.0+$', '\\1'),
                        '→',
                        replaceRegexpOne(replaceAll(JSONExtractRaw(attributes['caps.new'], k), '"', ''), '(\\.[0-9]*[1-9])0+$|\\.0+$', '\\1')
                    ),
                    arrayFilter(
                        k -> JSONExtractRaw(attributes['caps.old'], k) != JSONExtractRaw(attributes['caps.new'], k),
                        JSONExtractKeys(attributes['caps.new'])
                    )
                ),
                ', '
            ),
            if(attributes['caps.reason'] != '', concat(' — ', attributes['caps.reason']), '')
        ),
        attributes['usage.input'] = 'reserved' OR attributes['usage.output'] = 'reserved',
        concat(
            'cut short: ',
            arrayStringConcat(
                arrayFilter(
                    x -> x != '',
                    [if(attributes['usage.input'] = 'reserved', 'in_tok', ''),
                     if(attributes['usage.output'] = 'reserved', 'out_tok', '')]
                ),
                '+'
            ),
            ' charged at the reservation (reported: ', attributes['usage.seen_input_tokens'], ' in, ',
            attributes['usage.seen_output_tokens'], ' out)'
        ),
        attributes['step.counted'] = 'false',
        concat('no answer, not a step',
               if(attributes['upstream.failures'] != '',
                  concat(' (', attributes['upstream.failures'], ' upstream failures in a row)'), '')),
        attributes['repeats.stopped'] != '',
        concat('loop: ', attributes['repeats.stopped'], ' — the next step answers without tools'),
        attributes['final_step.reason'] = 'max_repeats',
        concat('answer-only (X-Run-Max-Repeats): ', attributes['repeats.reason']),
        toUInt32OrZero(attributes['repeats.count']) > 1,
        concat('asked ', attributes['repeats.count'], 'x'),
        ''
    ), substring(error, 1, 200)]), ' · ') AS detail,
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
