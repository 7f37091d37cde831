-- What did not get a label, by stage and reason:
--   manifest      posts excluded before classification (probe errors, too long, transcode errors...),
--   classify      requests that ended in an error, by error_kind,
--   human_labels  rows of the human-label file that could not be used (human_checked.issue).
SELECT stage, reason, count
FROM (
    SELECT 'manifest' AS stage, coalesce(error_kind, 'unknown') AS reason, count(*) AS count, 1 AS stage_order
    FROM labels WHERE status = 'excluded' GROUP BY ALL
    UNION ALL
    SELECT 'classify', coalesce(error_kind, 'unknown'), count(*), 2
    FROM labels WHERE status = 'error' GROUP BY ALL
    UNION ALL
    SELECT 'human_labels', issue, count(*), 3
    FROM human_checked WHERE issue IS NOT NULL GROUP BY ALL
)
ORDER BY stage_order, count DESC, reason
