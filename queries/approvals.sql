-- approvals: What was approved, by whom, and how long did the run wait? One row per approval a
-- tool rule asked for (`effect = "approve"`): the call (run, tool, argument hash, the rule), its
-- state now (pending / approved / denied / expired), who decided and why, and how long the run
-- waited for the decision — from the request to the decision, or, for a call held until it was
-- refused (expiry, the run's deadline, a cancel), the time it was held.
--
-- Read from the `approval` spans: `requested` (the call asked), `decided` (a person's decision,
-- its duration_ms the time since the request), `released` / `refused` (a held call's wait ending).
-- held_calls: the requests of the call that were held in `wait` mode until it was approved.
--
-- @param since   DateTime64(6, 'UTC')  = now() - INTERVAL 7 DAY  -- approvals requested since
-- @param run_id  String                = ''                       -- one run; '' = every run
-- @param state   String                = ''                       -- pending, approved, denied, expired; '' = all
-- @choices state pending approved denied expired
-- @priority approval_id state decided_by waited_ms tool_name run_id reason rule requested_at
SELECT
    approval_id,
    run_id,
    tool_name,
    rule,
    state,
    decided_by,
    reason,
    requested_at,
    if(state = 'pending', NULL, round(waited_ms, 1)) AS waited_ms,
    held_calls,
    args_hash
FROM
(
    SELECT
        attributes['approval.id'] AS approval_id,
        any(run_id) AS run_id,
        any(tool_name) AS tool_name,
        any(attributes['approval.rule']) AS rule,
        any(args_hash) AS args_hash,
        min(started_at) AS requested_at,
        -- the decision outranks the end of a wait, which outranks the request
        argMax(attributes['approval.state'], rank) AS state,
        argMax(attributes['approval.by'], rank) AS decided_by,
        argMax(attributes['approval.reason'], rank) AS reason,
        argMax(duration_ms, rank) AS waited_ms,
        countIf(attributes['approval.event'] = 'released') AS held_calls
    FROM
    (
        SELECT
            run_id, tool_name, args_hash, started_at, duration_ms, attributes,
            multiIf(
                attributes['approval.event'] = 'decided', 3,
                attributes['approval.event'] IN ('released', 'refused'), 2,
                1
            ) AS rank
        FROM runcap.spans
        WHERE kind = 'approval'
            AND started_at >= {since:DateTime64(6, 'UTC')}
            AND ({run_id:String} = '' OR run_id = {run_id:String})
    )
    GROUP BY approval_id
)
WHERE {state:String} = '' OR state = {state:String}
ORDER BY requested_at, approval_id
