-- Throughput per shard job run and overall, from each request's started_at/finished_at (Unix seconds).
-- A job is the run that answered (labels.job_id, kept when a record is copied into another shard's
-- journal after classify.shards changed; older labels without it: one job per shard); its shard is
-- the one it ran (the job id's "shard-N/" prefix), not the one whose labels hold the record now.
--   span_s   first start to last finish.
--   busy_s   time with at least one request of the job in flight: the union of its request
--            intervals, so gaps (a pause for a retry, a server restart) are not counted as work.
--            Rates and GPU-hours use busy_s. For the overall row busy_s is the sum over jobs
--            (model-instance seconds), so its rates are per model instance, comparable across runs;
--            wall_requests_per_s is the whole campaign's rate (requests / overall span).
-- Server start-up and model loading happen before the first request and are not included.
-- GPU-hours: busy_s times the GPUs the job held (labels.gpus, recorded by the job), or
-- $gpus_per_job (cost.gpus_per_job) where the job used classify.endpoints and did not know them.
WITH req AS (
    SELECT coalesce(job_id, 'shard-' || CAST(shard AS VARCHAR)) AS job,
           coalesce(TRY_CAST(regexp_extract(job_id, '^shard-([0-9]+)/', 1) AS BIGINT), shard) AS shard,
           status, started_at, finished_at, prompt_tokens, completion_tokens, gpus
    FROM labels
    WHERE shard IS NOT NULL AND status IN ('ok', 'error')
      AND started_at IS NOT NULL AND finished_at IS NOT NULL
),
ordered AS (
    SELECT *,
        max(finished_at) OVER (PARTITION BY job ORDER BY started_at, finished_at
                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS previous_end
    FROM req
),
islands AS (
    SELECT *,
        sum(CASE WHEN previous_end IS NULL OR started_at > previous_end THEN 1 ELSE 0 END)
            OVER (PARTITION BY job ORDER BY started_at, finished_at ROWS UNBOUNDED PRECEDING) AS island
    FROM ordered
),
busy AS (
    SELECT job, sum(island_s) AS busy_s
    FROM (SELECT job, island, max(finished_at) - min(started_at) AS island_s FROM islands GROUP BY job, island)
    GROUP BY job
),
per_job AS (
    SELECT
        CAST(any_value(shard) AS VARCHAR) AS shard,
        job,
        count(*) AS requests,
        count(*) FILTER (WHERE status = 'ok') AS ok,
        count(*) FILTER (WHERE status = 'error') AS errors,
        coalesce(sum(prompt_tokens), 0) AS input_tokens,
        coalesce(sum(completion_tokens), 0) AS output_tokens,
        min(started_at) AS first_started_at,
        max(finished_at) AS last_finished_at,
        max(finished_at) - min(started_at) AS span_s,
        any_value(b.busy_s) AS busy_s,
        coalesce(max(gpus), $gpus_per_job) AS gpus,
        any_value(b.busy_s) * coalesce(max(gpus), $gpus_per_job) / 3600.0 AS gpu_hours,
        any_value(shard) AS shard_number
    FROM req JOIN busy b USING (job)
    GROUP BY job
),
overall AS (
    SELECT 'all' AS shard, NULL AS job, sum(requests) AS requests, sum(ok) AS ok, sum(errors) AS errors,
        sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens,
        min(first_started_at) AS first_started_at, max(last_finished_at) AS last_finished_at,
        max(last_finished_at) - min(first_started_at) AS span_s, sum(busy_s) AS busy_s,
        NULL AS gpus, sum(gpu_hours) AS gpu_hours, NULL AS shard_number
    FROM per_job
    HAVING count(*) > 0
),
combined AS (
    SELECT * FROM per_job
    UNION ALL
    SELECT * FROM overall
)
SELECT
    shard, job, requests, ok, errors, input_tokens, output_tokens, first_started_at, last_finished_at,
    span_s, busy_s, gpus,
    requests / nullif(busy_s, 0) AS requests_per_s,
    input_tokens / nullif(busy_s, 0) AS input_tokens_per_s,
    output_tokens / nullif(busy_s, 0) AS output_tokens_per_s,
    (input_tokens + output_tokens) / nullif(busy_s, 0) AS tokens_per_s,
    requests / nullif(span_s, 0) AS wall_requests_per_s,
    gpu_hours,
    gpu_hours * $gpu_hour_usd AS cost_usd
FROM combined
ORDER BY shard_number NULLS LAST, first_started_at
