-- Consistency of the manifest shards with the label shards (when the merge is given the manifest):
-- one manifest row per post, and every labelled post in the manifest (its token estimates come from
-- there; a label shard made from another manifest would pair answers with the wrong estimates).
-- Same shape as merge_problems.sql. Views: manifest(post_id), shard_labels(post_id).
WITH manifest_counts AS (
    SELECT post_id, count(*) AS n FROM manifest GROUP BY post_id
),
problems AS (
    SELECT 'duplicate post_id in the manifest shards' AS problem, post_id FROM manifest_counts WHERE n > 1
    UNION ALL
    SELECT 'labelled post not in the manifest shards (stale label shard?)', l.post_id
    FROM (SELECT DISTINCT post_id FROM shard_labels) l ANTI JOIN manifest_counts m USING (post_id)
)
SELECT problem, count(*) AS posts, list(post_id ORDER BY post_id)[1:5] AS examples
FROM problems
GROUP BY problem
ORDER BY problem
