-- Agreement between every pair of models (a before b in the config's order), per question, over
-- the posts both answered with "yes" or "no". Tables read: model_answers (one row per model, post
-- and question: position, model, post_id, status, question, answer, p_yes), models (position,
-- name) and questions (question, position). Every pair and question gets a row, with zero counts
-- when the two models never both answered.
WITH pairs AS (
    SELECT q.question, q.position AS question_position,
           a.position AS a_position, a.name AS model_a, b.position AS b_position, b.name AS model_b
    FROM questions q, models a, models b
    WHERE a.position < b.position
),
joint AS (
    SELECT
        a.question, a.position AS a_position, b.position AS b_position,
        count(*) FILTER (WHERE a.answer IN ('yes', 'no') AND b.answer IN ('yes', 'no')) AS both_answered,
        count(*) FILTER (WHERE a.answer = 'yes' AND b.answer = 'yes') AS both_yes,
        count(*) FILTER (WHERE a.answer = 'yes' AND b.answer = 'no') AS only_a_yes,
        count(*) FILTER (WHERE a.answer = 'no' AND b.answer = 'yes') AS only_b_yes,
        count(*) FILTER (WHERE a.answer = 'no' AND b.answer = 'no') AS both_no,
        -- classified posts that one model answered and the other did not
        count(*) FILTER (WHERE a.answer IN ('yes', 'no') AND b.answer IS DISTINCT FROM 'yes'
                           AND b.answer IS DISTINCT FROM 'no') AS only_a_answered,
        count(*) FILTER (WHERE b.answer IN ('yes', 'no') AND a.answer IS DISTINCT FROM 'yes'
                           AND a.answer IS DISTINCT FROM 'no') AS only_b_answered
    FROM model_answers a
    JOIN model_answers b ON a.post_id = b.post_id AND a.question = b.question AND a.position < b.position
    GROUP BY ALL
)
SELECT
    p.question, p.model_a, p.model_b,
    coalesce(j.both_answered, 0) AS both_answered,
    coalesce(j.both_yes, 0) AS both_yes,
    coalesce(j.only_a_yes, 0) AS only_a_yes,
    coalesce(j.only_b_yes, 0) AS only_b_yes,
    coalesce(j.both_no, 0) AS both_no,
    coalesce(j.only_a_answered, 0) AS only_a_answered,
    coalesce(j.only_b_answered, 0) AS only_b_answered
FROM pairs p
LEFT JOIN joint j USING (question, a_position, b_position)
ORDER BY p.question_position, p.a_position, p.b_position
