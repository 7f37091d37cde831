-- The population a human sample is drawn from: every classified post of labels.parquet (status ok or
-- error; posts excluded before classification are outside it, as in aggregate), in labels.parquet's
-- order. Per question: the model's P(yes) from answer_probs (NULL when unknown) and its hard answer
-- (1 yes, 0 no, NULL without one). The placeholders are generated from the question ids:
-- @probability_columns@ (NULL AS ... when labels.parquet has no answer_probs column), @answer_columns@.
SELECT
    post_id,
    status,
    @probability_columns@,
    @answer_columns@
FROM labels
WHERE status IN ('ok', 'error')
ORDER BY file_row_number
