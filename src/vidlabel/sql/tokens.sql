-- Token distribution per request (one row per classified post that reports usage), input then output.
-- Percentiles interpolate linearly (quantile_cont), like numpy.percentile's default.
-- prefill_decode_ratio = total input / total output tokens over the requests that report both.
WITH req AS (
    SELECT prompt_tokens, completion_tokens FROM labels WHERE status IN ('ok', 'error')
),
ratio AS (
    SELECT sum(prompt_tokens) / nullif(sum(completion_tokens), 0) AS prefill_decode_ratio
    FROM req WHERE prompt_tokens IS NOT NULL AND completion_tokens IS NOT NULL
)
SELECT 'input' AS direction, count(prompt_tokens) AS requests, sum(prompt_tokens) AS total,
       avg(prompt_tokens) AS mean, quantile_cont(prompt_tokens, 0.5) AS p50,
       quantile_cont(prompt_tokens, 0.9) AS p90, quantile_cont(prompt_tokens, 0.99) AS p99,
       max(prompt_tokens) AS max, any_value(prefill_decode_ratio) AS prefill_decode_ratio
FROM req, ratio
UNION ALL
SELECT 'output', count(completion_tokens), sum(completion_tokens), avg(completion_tokens),
       quantile_cont(completion_tokens, 0.5), quantile_cont(completion_tokens, 0.9),
       quantile_cont(completion_tokens, 0.99), max(completion_tokens), any_value(prefill_decode_ratio)
FROM req, ratio
