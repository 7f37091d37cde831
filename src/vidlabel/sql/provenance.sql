-- What made the answers of a labels.parquet (view labels): one row per provenance, most answers first.
-- model_revision is a column, or NULL for labels merged before it existed.
SELECT model, @model_revision@ AS model_revision, server, settings_fingerprint, prompt_hash, count(*) AS answers
FROM labels
WHERE status IN ('ok', 'error') AND model IS NOT NULL
GROUP BY ALL
ORDER BY answers DESC, server, settings_fingerprint
