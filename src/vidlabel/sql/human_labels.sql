-- Human labels, normalised, checked and resolved. Every input row stays in human_checked, with
-- `issue` NULL when it is usable and otherwise the reason it is not (reported in summary.md,
-- errors.csv and the log; never dropped silently). Usable rows are then resolved to one label per
-- (post, question) in human_resolved. Views/tables read: human_raw (the file, text columns),
-- questions(question, position), labels, design_posts(post_id, pi, drawn, phase): the design the
-- labels were drawn under (human_design; empty without one). The placeholders are generated: the
-- question column name, the sampling-probability, adjudication and phase columns (NULL when the
-- file has none), whether the probability column exists and whether a design is given. With a
-- design, a label takes its post's probability and phase from it; a label on a post outside its
-- frame or not drawn is outside the design, and one whose own sampling_probability disagrees with
-- it belongs to another draw.
-- A label as 1/0: yes/no, y/n, true/false, or a number equal to 1 or 0 ("1", "1.0", "1.00", "0e0", ...).
CREATE OR REPLACE TEMP MACRO label_value(label_text) AS CASE
    WHEN label_text IN ('yes', 'y', 'true', 't') THEN 1.0
    WHEN label_text IN ('no', 'n', 'false', 'f') THEN 0.0
    WHEN TRY_CAST(label_text AS DOUBLE) = 1 THEN 1.0
    WHEN TRY_CAST(label_text AS DOUBLE) = 0 THEN 0.0
END;

CREATE OR REPLACE TABLE human_checked AS
WITH raw AS (
    SELECT
        row_number() OVER () AS line,
        trim(CAST(post_id AS VARCHAR)) AS post_id,
        trim(CAST(@question_column@ AS VARCHAR)) AS question,
        lower(trim(CAST(label AS VARCHAR))) AS label_text,
        nullif(lower(trim(CAST(@adjudication_column@ AS VARCHAR))), '') AS adjudication_text,
        CAST(@probability_column@ AS VARCHAR) AS probability_text,
        nullif(trim(CAST(@phase_column@ AS VARCHAR)), '') AS phase_text,
        @has_probability@ AS has_probability,
        @has_design@ AS has_design
    FROM human_raw
),
parsed AS (
    SELECT
        raw.*,
        label_value(label_text) AS y,
        label_value(adjudication_text) AS adjudicated,
        TRY_CAST(probability_text AS DOUBLE) AS file_probability,
        CASE WHEN has_design THEN d.pi ELSE TRY_CAST(probability_text AS DOUBLE) END AS probability,
        CASE WHEN has_design THEN d.phase ELSE TRY_CAST(TRY_CAST(phase_text AS DOUBLE) AS INTEGER) END AS phase,
        d.post_id IS NOT NULL AS in_frame,
        d.drawn,
        l.status AS post_status
    FROM raw
    LEFT JOIN labels l USING (post_id)
    LEFT JOIN design_posts d USING (post_id)
),
first_issue AS (
    SELECT
        parsed.*,
        CASE
            WHEN post_id IS NULL OR post_id = '' THEN 'missing post_id'
            WHEN question IS NULL OR question = '' THEN 'missing question'
            WHEN question NOT IN (SELECT question FROM questions) THEN 'unknown question'
            WHEN post_status IS NULL THEN 'unknown post_id'
            WHEN adjudication_text IS NOT NULL AND adjudicated IS NULL THEN 'invalid adjudication'
            WHEN y IS NULL AND adjudicated IS NULL THEN 'invalid label'
            WHEN has_probability AND NOT (has_design AND probability_text IS NULL)
                 AND NOT coalesce(file_probability > 0 AND file_probability <= 1, false)
                THEN 'invalid sampling_probability'
            WHEN phase_text IS NOT NULL AND NOT coalesce(TRY_CAST(phase_text AS DOUBLE) IN (1, 2), false)
                THEN 'invalid phase'
            WHEN post_status = 'excluded' THEN 'post excluded before classification'
            WHEN has_design AND NOT in_frame THEN 'post outside the sampling frame (human_design)'
            WHEN has_design AND NOT drawn THEN 'post not drawn in the design (human_design)'
            WHEN has_design AND abs(file_probability - probability) > 1e-9
                THEN 'sampling_probability differs from human_design (another draw?)'
        END AS issue
    FROM parsed
),
-- One post drawn once has one inclusion probability: copies that disagree on it cannot be weighted.
probability_spread AS (
    SELECT
        first_issue.*,
        max(probability) FILTER (WHERE issue IS NULL) OVER (PARTITION BY post_id, question)
            - min(probability) FILTER (WHERE issue IS NULL) OVER (PARTITION BY post_id, question) AS spread
    FROM first_issue
)
SELECT
    line, post_id, question, label_text, y, adjudicated, probability, phase,
    CASE
        WHEN issue IS NOT NULL THEN issue
        WHEN spread > 1e-9 THEN 'conflicting sampling_probability'
    END AS issue
FROM probability_spread
ORDER BY line;

-- One label per (post, question) from its usable rows: the adjudicated label when a row carries
-- one, else the majority of the coders' labels; a tie counts 0.5 (half the coders said yes), so
-- an ambiguous post stays in the sample instead of vanishing with the labels that disagree.
CREATE OR REPLACE TABLE human_resolved AS
WITH votes AS (
    SELECT
        post_id, question,
        count(*) AS copies,
        count(adjudicated) AS adjudications,
        count(DISTINCT y) AS distinct_labels,
        CASE WHEN count(adjudicated) > 0 THEN avg(adjudicated) ELSE avg(y) END AS vote,
        any_value(probability) AS probability,
        any_value(phase) AS phase
    FROM human_checked
    WHERE issue IS NULL
    GROUP BY post_id, question
)
SELECT
    post_id, question,
    CASE WHEN vote > 0.5 THEN 1.0 WHEN vote < 0.5 THEN 0.0 ELSE 0.5 END AS y,
    probability,
    phase,
    copies,
    CASE
        WHEN adjudications > 0 AND (copies > 1 OR distinct_labels > 1) THEN 'adjudicated'
        WHEN copies = 1 THEN NULL
        WHEN distinct_labels = 1 AND vote IN (0, 1) THEN 'agreeing copies'
        WHEN vote = 0.5 THEN 'tie counted as 0.5'
        ELSE 'majority of conflicting labels'
    END AS resolution
FROM votes
ORDER BY post_id, question
