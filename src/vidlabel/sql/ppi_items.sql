-- Inputs of the bias correction, one row per (question, classified post):
--   yhat  the model's prediction: its probability of "yes" when the labels carry one (p_yes),
--         else its answer as 1/0. A post without an answer gets the question's model share as
--         its prediction: PPI stays valid for any prediction that does not look at the human
--         labels, the rectifier term corrects whatever this imputation gets wrong, and the posts
--         (and any human labels on them) stay in the population instead of vanishing with their errors.
--   no_answer  the model gave no yes/no answer for this question (failed request, missing key),
--   y     the resolved human label (NULL when the post has none; 0.5 for a tie),
--   r     1 / sampling probability for labelled posts (1 when the file gives none),
--   phase the phase of a two-phase design the label belongs to (NULL for a one-phase design).
-- Only the posts of the human sample's frame (table design_posts, when it holds any): posts classified
-- after the sample was drawn are outside the population the labels stand for (sql/prevalence_outside_frame.sql).
-- @answers@: answers_long, or one post type's part of it (vidlabel.analyze.post_types): the population
-- is then that type's classified posts, and the labels on them a sample of it under the same design.
CREATE OR REPLACE TABLE ppi_items AS
WITH model_share AS (
    SELECT question, avg(CASE answer WHEN 'yes' THEN 1.0 WHEN 'no' THEN 0.0 END) AS share
    FROM @answers@
    WHERE status IN ('ok', 'error')
    GROUP BY question
)
SELECT
    a.question,
    a.post_id,
    CASE
        WHEN a.answer IN ('yes', 'no') AND a.p_yes IS NOT NULL THEN a.p_yes
        WHEN a.answer = 'yes' THEN 1.0
        WHEN a.answer = 'no' THEN 0.0
        ELSE coalesce(m.share, 0.0)
    END AS yhat,
    a.answer IS NULL OR a.answer NOT IN ('yes', 'no') AS no_answer,
    h.y,
    CASE WHEN h.y IS NOT NULL THEN coalesce(1.0 / h.probability, 1.0) END AS r,
    h.phase
FROM @answers@ a
JOIN model_share m USING (question)
LEFT JOIN human_valid h ON h.post_id = a.post_id AND h.question = a.question
WHERE a.status IN ('ok', 'error')
  AND (NOT EXISTS (SELECT 1 FROM design_posts) OR a.post_id IN (SELECT post_id FROM design_posts))
