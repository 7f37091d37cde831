-- labels.parquet: one row per inventory post, in inventory order.
-- Classified posts carry their shard record; excluded posts get status 'excluded' and the
-- exclusion reason/detail in error_kind/error. merge_problems.sql has already guaranteed that
-- each post matches exactly one of the two, so the LEFT JOINs cannot multiply rows.
-- The answer_columns placeholder is generated: one json_extract_string(answers, '$."<id>"') AS "<id>" per question,
-- so a question the model did not answer (error, or a key missing from the JSON) is NULL.
SELECT
    i.post_id,
    CAST(l.shard AS INTEGER) AS shard,
    CASE WHEN l.post_id IS NOT NULL THEN CAST(l.status AS VARCHAR) ELSE 'excluded' END AS status,
    CASE WHEN l.post_id IS NOT NULL THEN CAST(l.error_kind AS VARCHAR) ELSE CAST(e.reason AS VARCHAR) END
        AS error_kind,
    CASE WHEN l.post_id IS NOT NULL THEN CAST(l.error AS VARCHAR) ELSE CAST(e.detail AS VARCHAR) END AS error,
    @answer_columns@,
    CAST(l.prompt_tokens AS BIGINT) AS prompt_tokens,
    CAST(l.completion_tokens AS BIGINT) AS completion_tokens,
    CAST(l.latency_s AS DOUBLE) AS latency_s,
    CAST(l.started_at AS DOUBLE) AS started_at,
    CAST(l.finished_at AS DOUBLE) AS finished_at,
    CAST(l.answer_probs AS VARCHAR) AS answer_probs,
    -- Provenance: what made the answer (docs/outputs.md).
    CAST(l.model AS VARCHAR) AS model,
    CAST(l.server AS VARCHAR) AS server,
    CAST(l.settings_fingerprint AS VARCHAR) AS settings_fingerprint,
    CAST(l.prompt_hash AS VARCHAR) AS prompt_hash,
    CAST(l.request_fingerprint AS VARCHAR) AS request_fingerprint,
    CAST(l.gpus AS BIGINT) AS gpus
FROM inventory i
LEFT JOIN shard_labels l USING (post_id)
LEFT JOIN excluded e USING (post_id)
ORDER BY i.file_row_number
