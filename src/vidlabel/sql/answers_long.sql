-- One row per (post, question) from the wide labels.parquet, keeping posts without an answer:
-- a missing answer is information (the model failed), not something to drop.
-- The two placeholders are generated from the configured question ids, in the same order.
SELECT
    post_id,
    status,
    unnest([@question_names@]) AS question,
    unnest([@question_columns@]) AS answer
FROM labels
