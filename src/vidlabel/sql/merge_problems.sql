-- Consistency of the merge inputs: every inventory post must end up in exactly one place,
-- either one label row (it was classified) or one exclusion row (it never reached the model).
-- One row per kind of problem, with a count and a few example post ids for the message.
-- Views: inventory(post_id), excluded(post_id), shard_labels(post_id, shard).
WITH label_counts AS (
    SELECT post_id, count(*) AS n FROM shard_labels GROUP BY post_id
),
duplicate_shards AS (
    SELECT post_id, list(DISTINCT shard ORDER BY shard) AS shards
    FROM shard_labels SEMI JOIN (SELECT post_id FROM label_counts WHERE n > 1) USING (post_id)
    GROUP BY post_id
),
excluded_counts AS (
    SELECT post_id, count(*) AS n FROM excluded GROUP BY post_id
),
inventory_counts AS (
    SELECT post_id, count(*) AS n FROM inventory GROUP BY post_id
),
problems AS (
    SELECT 'duplicate post_id in the inventory' AS problem, post_id FROM inventory_counts WHERE n > 1
    UNION ALL
    SELECT 'duplicate post_id in the label shards (shards ' || array_to_string(shards, ', ') || ')', post_id
    FROM duplicate_shards
    UNION ALL
    SELECT 'duplicate post_id in excluded.parquet', post_id FROM excluded_counts WHERE n > 1
    UNION ALL
    SELECT 'post both classified and excluded', l.post_id
    FROM label_counts l JOIN excluded_counts e USING (post_id)
    UNION ALL
    SELECT 'labelled post not in the inventory (stale shard?)', l.post_id
    FROM label_counts l ANTI JOIN inventory_counts i USING (post_id)
    UNION ALL
    SELECT 'excluded post not in the inventory', e.post_id
    FROM excluded_counts e ANTI JOIN inventory_counts i USING (post_id)
    UNION ALL
    SELECT 'inventory post missing from every label shard and from excluded.parquet', i.post_id
    FROM inventory_counts i ANTI JOIN label_counts l USING (post_id) ANTI JOIN excluded_counts e USING (post_id)
)
SELECT problem, count(*) AS posts, list(post_id ORDER BY post_id)[1:5] AS examples
FROM problems
GROUP BY problem
ORDER BY problem
