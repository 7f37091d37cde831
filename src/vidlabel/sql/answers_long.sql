-- One row per (post, question) from the wide labels.parquet, keeping posts without an answer:
-- a missing answer is information (the model failed), not something to drop.
-- p_yes: the model's probability of "yes", P(yes) / (P(yes) + P(no)) from the answer_probs JSON,
-- NULL when the file has no answer_probs column, the server gave none, or they are not a
-- probability pair.
-- The placeholders are generated from the configured question ids, in the same order;
-- @prob_texts@ extracts every question's P(yes) and P(no) texts with one parse of answer_probs
-- (a parse per value made this query most of the aggregate stage's time at a million posts).
SELECT
    post_id,
    status,
    unnest([@question_names@]) AS question,
    unnest([@question_columns@]) AS answer,
    unnest([@question_probs@]) AS p_yes
FROM (SELECT *, @prob_texts@ AS _prob_texts FROM labels)
