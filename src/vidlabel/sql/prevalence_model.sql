-- Model-only prevalence per question over the classified posts (status ok or error; posts excluded
-- before classification are outside the population). A post without a yes/no answer counts in
-- posts and no_answer but not in the share: model_share = yes / answered.
-- @answers@: answers_long, or one post type's part of it (vidlabel.analyze.post_types).
SELECT
    question,
    count(*) AS posts,
    count(*) FILTER (WHERE answer IN ('yes', 'no')) AS answered,
    count(*) FILTER (WHERE answer = 'yes') AS yes,
    count(*) FILTER (WHERE answer = 'no') AS "no",
    count(*) FILTER (WHERE answer IS NULL OR answer NOT IN ('yes', 'no')) AS no_answer
FROM @answers@
WHERE status IN ('ok', 'error')
GROUP BY question
