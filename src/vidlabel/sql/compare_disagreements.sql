-- The (post, question) pairs a person should look at, one row each, over the classified posts:
--   'answers differ'    the models that answered gave different answers (some may also have failed),
--   'some gave no answer'  the models that answered agree, but at least one other model gave no answer.
-- Tables read: model_answers, questions, inventory (video_path), human_valid (resolved human labels).
-- The placeholder is generated: per model, its answer and P(yes) as "answer_<name>", "p_yes_<name>".
-- distinct_answers counts which of 'yes' and 'no' occur (a count(DISTINCT ...) per group cost twice as much).
-- Order: posts with a human label first (they show which model was right), then by post and question.
WITH per_item AS (
    SELECT
        post_id, question,
        count(*) FILTER (WHERE answer IN ('yes', 'no')) AS answered,
        CAST(bool_or(answer = 'yes') IS TRUE AS INTEGER) + CAST(bool_or(answer = 'no') IS TRUE AS INTEGER)
            AS distinct_answers,
        count(*) FILTER (WHERE answer IS NULL OR answer NOT IN ('yes', 'no')) AS unanswered,
        string_agg(model, ', ' ORDER BY position)
            FILTER (WHERE answer IS NULL OR answer NOT IN ('yes', 'no')) AS no_answer_from,
        bool_or(status IN ('ok', 'error')) AS classified,
        @answer_columns@
    FROM model_answers
    GROUP BY post_id, question
)
SELECT
    p.post_id,
    i.video_path,
    p.question,
    CASE WHEN p.distinct_answers > 1 THEN 'answers differ' ELSE 'some gave no answer' END AS kind,
    p.answered,
    p.no_answer_from,
    p.* EXCLUDE (post_id, question, answered, distinct_answers, unanswered, no_answer_from, classified),
    CASE h.y WHEN 1 THEN 'yes' WHEN 0 THEN 'no' WHEN 0.5 THEN 'tie' END AS human_label
FROM per_item p
JOIN questions q USING (question)
LEFT JOIN inventory i USING (post_id)
LEFT JOIN human_valid h USING (post_id, question)
WHERE p.classified AND (p.distinct_answers > 1 OR (p.answered > 0 AND p.unanswered > 0))
ORDER BY h.y IS NULL, p.post_id, q.position
