-- The usable rows of a burn-in sample (table human_checked of humans.load_human_labels), every
-- coder's label as its own row, so that aggregate resolves them (adjudication, majority, tie 0.5)
-- as it resolves any labels. Each row carries the burn-in's sampling probability n0/N ($pi) and
-- phase 1 of the two-phase design. A row holding only an adjudication keeps an empty label.
SELECT
    c.post_id,
    c.question,
    CASE c.y WHEN 1 THEN 'yes' WHEN 0 THEN 'no' END AS label,
    CAST($pi AS DOUBLE) AS sampling_probability,
    CAST(NULL AS VARCHAR) AS annotator,
    CASE c.adjudicated WHEN 1 THEN 'yes' WHEN 0 THEN 'no' END AS adjudication,
    1 AS phase
FROM human_checked c
WHERE c.issue IS NULL
ORDER BY c.line
