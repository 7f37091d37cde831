-- labels.parquet: one row per inventory post, in inventory order.
-- Classified posts carry their shard record; excluded posts get status 'excluded' and the
-- exclusion reason/detail in error_kind/error. merge_problems.sql has already guaranteed that
-- each post matches exactly one of the two, so the LEFT JOINs cannot multiply rows.
-- The answer_columns placeholder is generated: one json_extract_string(answers, '$."<id>"') AS "<id>" per question,
-- so a question the model did not answer (error, or a key missing from the JSON) is NULL; so is
-- record_columns, from the journal record's fields, and post_columns (vidlabel.analyze.merge.post_columns):
-- what the post is, from its manifest row (m) where it has one, else the inventory (i), as far as the
-- columns of each allow; the manifest holds one row per classified post, checked like the shards.
SELECT
    i.post_id,
    CAST(l.shard AS INTEGER) AS shard,
    CASE WHEN l.post_id IS NOT NULL THEN CAST(l.status AS VARCHAR) ELSE 'excluded' END AS status,
    CASE WHEN l.post_id IS NOT NULL THEN CAST(l.error_kind AS VARCHAR) ELSE CAST(e.reason AS VARCHAR) END
        AS error_kind,
    CASE WHEN l.post_id IS NOT NULL THEN CAST(l.error AS VARCHAR) ELSE CAST(e.detail AS VARCHAR) END AS error,
    @answer_columns@,
    -- The record's columns (vidlabel.serve.record.MERGED_FIELDS): tokens, times, probabilities and the
    -- provenance (what made the answer, docs/outputs.md); NULL where the shards predate a column.
    @record_columns@,
    -- What the post is (post_type, items by kind, items dropped) and its token estimates per kind.
    @post_columns@
FROM inventory i
LEFT JOIN shard_labels l USING (post_id)
LEFT JOIN excluded e USING (post_id)
LEFT JOIN manifest m USING (post_id)
ORDER BY i.file_row_number
