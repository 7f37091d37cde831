-- The cell of the 2x2 table ("yes" is positive) of every (question, human-labelled post), with its
-- sampling probability and phase (two-phase designs). A post the model gave no answer for counts as a wrong answer (fn when the
-- human said "yes", fp when "no"), so that a model is never scored on fewer, easier posts than
-- another; answered = false marks them. A tied human label (0.5) has no cell (NULL): not compared.
-- Cells: 0 tp, 1 fp, 2 fn, 3 tn (vidlabel.analyze.estimators.TP ...).
SELECT
    h.question,
    h.post_id,
    h.probability,
    h.phase,
    a.answer IN ('yes', 'no') AS answered,
    CASE
        WHEN h.y NOT IN (0, 1) THEN NULL
        WHEN h.y = 1 AND a.answer = 'yes' THEN 0
        WHEN h.y = 0 AND a.answer = 'yes' THEN 1
        WHEN h.y = 1 THEN 2
        WHEN h.y = 0 AND a.answer = 'no' THEN 3
        ELSE 1
    END AS cell
FROM human_valid h
JOIN answers_long a USING (post_id, question)
ORDER BY h.question, h.post_id
