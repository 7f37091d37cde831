-- Classified posts outside the frame of the human sample's design (table design_posts; no row when
-- there is no design): posts classified after label_sample drew the sample. Per question, their
-- count and the model's answers on them, which is all that describes them.
-- @answers@: answers_long, or one post type's part of it (vidlabel.analyze.post_types).
SELECT
    question,
    count(*) AS posts,
    count(*) FILTER (WHERE answer IN ('yes', 'no')) AS answered,
    count(*) FILTER (WHERE answer = 'yes') AS yes
FROM @answers@
WHERE status IN ('ok', 'error')
  AND EXISTS (SELECT 1 FROM design_posts)
  AND post_id NOT IN (SELECT post_id FROM design_posts)
GROUP BY question
