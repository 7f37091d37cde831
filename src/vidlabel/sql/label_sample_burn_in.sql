-- The usable rows of a burn-in sample (table human_checked of aggregate.load_human_labels), every
-- coder's label as its own row, so that aggregate resolves them (adjudication, majority, tie 0.5)
-- as it resolves any labels. Each row carries its post's sampling probability from table
-- burn_in_probability(post_id, question, sampling_probability): the post's inclusion probability in
-- the union of the burn-in and the new draw for a question coded in the new draw, the burn-in's own
-- n0/N for a question the new draw does not code. A row holding only an adjudication keeps an empty label.
SELECT
    c.post_id,
    c.question,
    CASE c.y WHEN 1 THEN 'yes' WHEN 0 THEN 'no' END AS label,
    p.sampling_probability,
    CAST(NULL AS VARCHAR) AS annotator,
    CASE c.adjudicated WHEN 1 THEN 'yes' WHEN 0 THEN 'no' END AS adjudication
FROM human_checked c
JOIN burn_in_probability p USING (post_id, question)
WHERE c.issue IS NULL
ORDER BY c.line
