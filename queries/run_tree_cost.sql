-- run_tree_cost: Where did the $4 go across the sub-agents? Per run of a run tree (a root and the
-- runs it spawned with X-Run-Parent, their children, ...): its own spend and its subtree's (itself
-- plus every run below it), tokens, steps, status and caps, in tree order; then one subtotal row
-- per depth and the tree's total.
--
-- Read subtree_usd against max_usd: a run's dollar cap bounds its whole subtree (the ledger
-- reserves a child's calls against every ancestor's cap), so subtree_usd <= max_usd on every row
-- that has one. A large subtree_usd on a row with a small cost_usd is a run that delegated the
-- spending: follow its children (the rows just below it, one depth further) to the run that spent.
--
-- Latest state per run (runcap.runs, newest version per run — never a sum over versions). Rows
-- written before run trees have root_run_id '' (or their own id): each is the root of its own tree.
-- A parent without a row of its own (it had not finished a step when the data was read) is listed
-- with status '' and own spend 0, directly under the root (its own parent is not known), so its
-- children's spend still adds up in its subtree and in the root's.
--
-- row = 'run'    one run: depth 0 is the root; tree_path is root → ... → run (ORDER BY it is a
--                depth-first walk, siblings by run id); cost_usd, tokens: the run's own;
--                subtree_*: the run and everything below it; share_pct: subtree_usd of the tree's.
--       'depth'  one depth of the tree (run_id = ''): runs at that depth (subtree_runs) and what
--                they spent themselves (cost_usd, tokens); subtree_usd: spent at that depth or below.
--       'tree'   the whole tree (depth = 0, run_id = ''): runs, spend, tokens.
--
-- @param run_id String                = ''                          -- a run of the tree (its root or any sub-agent: the whole tree is shown); '' = the most expensive tree in the window
-- @param since  DateTime64(6, 'UTC')  = now() - INTERVAL 24 HOUR    -- window for picking the tree when run_id = ''
-- @priority row depth run_id cost_usd subtree_usd share_pct status subtree_runs max_usd parent_run_id steps tokens subtree_tokens task tool_calls max_tokens max_steps max_tool_calls root_run_id tree_path
WITH
    -- the tree's root: the given run's (a run written before run trees is its own root), or the
    -- root of the tree that spent most in the window ('' when there is none)
    ifNull((
        SELECT if(
            {run_id:String} != '',
            ifNull(
                nullIf(
                    (
                        SELECT any(if(root_run_id = '', run_id, root_run_id))
                        FROM runcap.runs
                        WHERE run_id = {run_id:String}
                    ),
                    ''
                ),
                {run_id:String}
            ),
            (
                SELECT root
                FROM
                (
                    SELECT if(root_run_id = '', run_id, root_run_id) AS root, cost_usd, updated_at
                    FROM runcap.runs
                    WHERE updated_at >= {since:DateTime64(6, 'UTC')}
                    ORDER BY run_id, updated_at DESC, steps DESC
                    LIMIT 1 BY run_id
                )
                GROUP BY root
                ORDER BY sum(cost_usd) DESC, max(updated_at) DESC, root
                LIMIT 1
            )
        )
    ), '') AS tree_root,
    tree AS
    (
        SELECT *
        FROM
        (
            SELECT
                run_id,
                parent_run_id,
                if(root_run_id = '', run_id, root_run_id) AS root,
                task,
                status,
                steps,
                tool_calls,
                input_tokens + output_tokens AS tokens,
                cost_usd,
                max_usd,
                max_tokens,
                max_steps,
                max_tool_calls
            FROM runcap.runs
            WHERE root_run_id = tree_root OR run_id = tree_root
            ORDER BY run_id, updated_at DESC, steps DESC
            LIMIT 1 BY run_id
        )
        WHERE root = tree_root
    ),
    -- every run with its path up the tree: [run, parent, ..., root], walked through the parent
    -- links (at most one step per run of the tree, so a broken link cannot loop)
    paths AS
    (
        SELECT
            node.1 AS run_id,
            arrayFilter(
                x -> x != '',
                arrayFold(
                    (acc, i) -> if(acc[-1] = '', acc, arrayPushBack(acc, multiIf(
                        indexOf(ids, acc[-1]) > 0, parents[indexOf(ids, acc[-1])],
                        acc[-1] = tree_root, '',
                        tree_root  -- a parent without a row: hung under the root
                    ))),
                    range(length(ids)),
                    [node.1]
                )
            ) AS path,
            node.2 AS own_usd,
            node.3 AS own_tokens
        FROM
        (
            SELECT groupArray(run_id) AS ids, groupArray(parent_run_id) AS parents,
                groupArray(cost_usd) AS costs, groupArray(tokens) AS token_counts
            FROM tree
        )
        ARRAY JOIN arrayZip(ids, costs, token_counts) AS node
    ),
    -- each run's spend counted once in its own subtree and in every ancestor's
    nodes AS
    (
        SELECT
            path[k] AS run_id,
            any(length(path) - k) AS depth,
            any(if(k < length(path), path[k + 1], '')) AS parent_run_id,
            any(arrayReverse(arraySlice(path, k))) AS tree_path,
            count() AS subtree_runs,
            sum(own_usd) AS subtree_usd,
            sum(own_tokens) AS subtree_tokens
        FROM paths
        ARRAY JOIN arrayEnumerate(path) AS k
        GROUP BY run_id
    ),
    (SELECT sum(cost_usd) FROM tree) AS tree_usd
SELECT
    row,
    depth,
    run_id,
    parent_run_id,
    task,
    status,
    steps,
    tool_calls,
    tokens,
    cost_usd,
    subtree_usd,
    subtree_tokens,
    subtree_runs,
    round(if(tree_usd = 0, 0, 100 * toFloat64(subtree_usd) / toFloat64(tree_usd)), 2) AS share_pct,
    max_usd,
    max_tokens,
    max_steps,
    max_tool_calls,
    tree_root AS root_run_id,
    tree_path
FROM
(
    SELECT
        'run' AS row,
        n.depth AS depth,
        n.run_id AS run_id,
        n.parent_run_id AS parent_run_id,
        t.task AS task,
        t.status AS status,
        t.steps AS steps,
        t.tool_calls AS tool_calls,
        t.tokens AS tokens,
        toDecimal128(t.cost_usd, 9) AS cost_usd,
        toDecimal128(n.subtree_usd, 9) AS subtree_usd,
        n.subtree_tokens AS subtree_tokens,
        n.subtree_runs AS subtree_runs,
        t.max_usd AS max_usd,
        t.max_tokens AS max_tokens,
        t.max_steps AS max_steps,
        t.max_tool_calls AS max_tool_calls,
        n.tree_path AS tree_path
    FROM nodes AS n
    LEFT JOIN tree AS t ON t.run_id = n.run_id
    UNION ALL
    SELECT
        'depth', depth, '', '', '', '', sum(steps), sum(tool_calls), sum(tokens),
        toDecimal128(sum(cost_usd), 9), toDecimal128(sum(subtree_usd), 9), sum(subtree_tokens), count(),
        NULL, NULL, NULL, NULL, []
    FROM
    (
        -- what was spent at this depth or below: the subtrees of the runs at this depth
        SELECT n.depth AS depth, t.steps AS steps, t.tool_calls AS tool_calls, t.tokens AS tokens,
            t.cost_usd AS cost_usd, n.subtree_usd AS subtree_usd, n.subtree_tokens AS subtree_tokens
        FROM nodes AS n
        LEFT JOIN tree AS t ON t.run_id = n.run_id
    )
    GROUP BY depth
    UNION ALL
    SELECT
        'tree', 0, '', '', '', '', sum(steps), sum(tool_calls), sum(tokens), toDecimal128(sum(cost_usd), 9),
        toDecimal128(sum(cost_usd), 9), sum(tokens), count(), NULL, NULL, NULL, NULL, []
    FROM tree
)
ORDER BY
    indexOf(['run', 'depth', 'tree'], row),
    tree_path,
    depth
