-- Does one model's labels.parquet (view labels) hold exactly the posts of the inventory (view
-- inventory)? One row per problem found: problem, posts affected, a few example post ids. No row:
-- the post sets match, so every model's table holds the same posts.
WITH label_posts AS (SELECT post_id FROM labels),
missing AS (SELECT post_id FROM inventory EXCEPT SELECT post_id FROM label_posts),
unknown AS (SELECT post_id FROM label_posts EXCEPT SELECT post_id FROM inventory),
repeated AS (SELECT post_id FROM label_posts GROUP BY post_id HAVING count(*) > 1)
SELECT problem, posts, examples
FROM (
    SELECT 1 AS problem_order, 'inventory posts missing from the labels' AS problem, count(*) AS posts,
           list(post_id ORDER BY post_id)[1:3] AS examples
    FROM missing
    UNION ALL
    SELECT 2, 'posts not in the inventory', count(*), list(post_id ORDER BY post_id)[1:3] FROM unknown
    UNION ALL
    SELECT 3, 'posts with more than one row', count(*), list(post_id ORDER BY post_id)[1:3] FROM repeated
)
WHERE posts > 0
ORDER BY problem_order
