-- Per-request token counts for the histograms.
SELECT prompt_tokens, completion_tokens
FROM labels
WHERE status IN ('ok', 'error') AND (prompt_tokens IS NOT NULL OR completion_tokens IS NOT NULL)
