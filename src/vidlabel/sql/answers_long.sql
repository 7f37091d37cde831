-- One row per (post, question) from the wide labels.parquet, keeping posts without an answer:
-- a missing answer is information (the model failed), not something to drop.
-- p_yes: the model's probability of "yes", P(yes) / (P(yes) + P(no)) from the answer_probs JSON,
-- NULL when the file has no answer_probs column, the server gave none, or they are not a
-- probability pair.
-- The three placeholders are generated from the configured question ids, in the same order.
SELECT
    post_id,
    status,
    unnest([@question_names@]) AS question,
    unnest([@question_columns@]) AS answer,
    unnest([@question_probs@]) AS p_yes
FROM labels
