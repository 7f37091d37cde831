-- Completed requests over time per shard, counted in $bins equal time bins from the first start,
-- so the plot stays small for a million requests. Python turns the counts into cumulative curves.
WITH req AS (
    SELECT shard, started_at, finished_at
    FROM labels
    WHERE shard IS NOT NULL AND status IN ('ok', 'error')
      AND started_at IS NOT NULL AND finished_at IS NOT NULL
),
bounds AS (
    SELECT min(started_at) AS t0, greatest(max(finished_at) - min(started_at), 1e-9) / $bins AS width
    FROM req
)
SELECT
    shard,
    CAST(least(floor((finished_at - t0) / width), $bins - 1) AS INTEGER) AS bin,
    count(*) AS completed,
    any_value(t0) AS t0,
    any_value(width) AS width
FROM req, bounds
GROUP BY ALL
ORDER BY shard, bin
