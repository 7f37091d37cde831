-- Token distribution per request, one row per direction (always all six, in this order):
--   input, output                  what the server reported (usage) per classified post that reports it,
--   input_video, input_image,      the manifest's estimate of the input tokens of each kind (media tokens
--   input_audio, input_text        with their markers; audio where the model hears it; the prompt's text),
--                                  over the classified posts that send that kind (a post without images is
--                                  not an image request); the server reports no split by kind.
-- Percentiles interpolate linearly (quantile_cont), like numpy.percentile's default.
-- prefill_decode_ratio = total input / total output tokens over the requests that report both (usage rows).
WITH req AS (
    SELECT prompt_tokens, completion_tokens, est_video_tokens, est_image_tokens, est_audio_tokens, est_text_tokens
    FROM labels WHERE status IN ('ok', 'error')
),
ratio AS (
    SELECT sum(prompt_tokens) / nullif(sum(completion_tokens), 0) AS prefill_decode_ratio
    FROM req WHERE prompt_tokens IS NOT NULL AND completion_tokens IS NOT NULL
),
directions(row_order, direction, source) AS (
    VALUES (1, 'input', 'server usage'), (2, 'output', 'server usage'),
           (3, 'input_video', 'manifest estimate'), (4, 'input_image', 'manifest estimate'),
           (5, 'input_audio', 'manifest estimate'), (6, 'input_text', 'manifest estimate')
),
counts AS (
    SELECT 1 AS row_order, prompt_tokens AS tokens FROM req
    UNION ALL SELECT 2, completion_tokens FROM req
    UNION ALL SELECT 3, nullif(est_video_tokens, 0) FROM req
    UNION ALL SELECT 4, nullif(est_image_tokens, 0) FROM req
    UNION ALL SELECT 5, nullif(est_audio_tokens, 0) FROM req
    UNION ALL SELECT 6, nullif(est_text_tokens, 0) FROM req
)
SELECT d.direction, d.source, count(c.tokens) AS requests, sum(c.tokens) AS total, avg(c.tokens) AS mean,
       quantile_cont(c.tokens, 0.5) AS p50, quantile_cont(c.tokens, 0.9) AS p90,
       quantile_cont(c.tokens, 0.99) AS p99, max(c.tokens) AS max,
       CASE WHEN d.row_order <= 2 THEN any_value(r.prefill_decode_ratio) END AS prefill_decode_ratio
FROM directions d
LEFT JOIN counts c USING (row_order)
CROSS JOIN ratio r
GROUP BY d.row_order, d.direction, d.source
ORDER BY d.row_order
