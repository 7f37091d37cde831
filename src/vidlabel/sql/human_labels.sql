-- Human labels, normalised and checked. Every input row stays, with `issue` NULL when it is usable
-- and otherwise the reason it is not (reported in summary.md, errors.csv and the log; never dropped
-- silently). Views/tables: human_raw (the file, text columns), questions(question, position),
-- labels. The placeholders are generated: the question column name, the
-- sampling-probability column (NULL when the file has none) and whether it exists.
CREATE OR REPLACE TABLE human_checked AS
WITH raw AS (
    SELECT
        row_number() OVER () AS line,
        trim(CAST(post_id AS VARCHAR)) AS post_id,
        trim(CAST(@question_column@ AS VARCHAR)) AS question,
        lower(trim(CAST(label AS VARCHAR))) AS label_text,
        CAST(@probability_column@ AS VARCHAR) AS probability_text,
        @has_probability@ AS has_probability
    FROM human_raw
),
parsed AS (
    SELECT
        raw.*,
        CASE
            WHEN label_text IN ('yes', 'y', 'true', 't', '1', '1.0') THEN 1.0
            WHEN label_text IN ('no', 'n', 'false', 'f', '0', '0.0') THEN 0.0
        END AS y,
        TRY_CAST(probability_text AS DOUBLE) AS probability,
        l.status AS post_status
    FROM raw
    LEFT JOIN labels l USING (post_id)
),
first_issue AS (
    SELECT
        parsed.*,
        CASE
            WHEN post_id IS NULL OR post_id = '' THEN 'missing post_id'
            WHEN question IS NULL OR question = '' THEN 'missing question'
            WHEN question NOT IN (SELECT question FROM questions) THEN 'unknown question'
            WHEN post_status IS NULL THEN 'unknown post_id'
            WHEN y IS NULL THEN 'invalid label'
            WHEN has_probability AND NOT coalesce(probability > 0 AND probability <= 1, false)
                THEN 'invalid sampling_probability'
            WHEN post_status = 'excluded' THEN 'post excluded before classification'
        END AS issue
    FROM parsed
),
-- Among otherwise usable rows, several labels for one (post, question) either agree (keep the
-- first, flag the rest as duplicates) or conflict (no label can be trusted: flag them all).
ranked AS (
    SELECT
        first_issue.*,
        count(DISTINCT y) FILTER (WHERE issue IS NULL) OVER (PARTITION BY post_id, question) AS distinct_labels,
        row_number() OVER (PARTITION BY post_id, question, issue IS NULL ORDER BY line) AS copy
    FROM first_issue
)
SELECT
    line, post_id, question, label_text, y, probability,
    CASE
        WHEN issue IS NOT NULL THEN issue
        WHEN distinct_labels > 1 THEN 'conflicting duplicate labels'
        WHEN copy > 1 THEN 'duplicate label'
    END AS issue
FROM ranked
ORDER BY line
