-- Confusion counts per question between resolved human labels and the model ("yes" is positive).
-- Labelled posts without a model answer cannot be compared, nor can a tied human label (0.5);
-- both are counted separately.
SELECT
    h.question,
    count(*) FILTER (WHERE h.y = 1 AND a.answer = 'yes') AS tp,
    count(*) FILTER (WHERE h.y = 0 AND a.answer = 'yes') AS fp,
    count(*) FILTER (WHERE h.y = 1 AND a.answer = 'no') AS fn,
    count(*) FILTER (WHERE h.y = 0 AND a.answer = 'no') AS tn,
    count(*) FILTER (WHERE a.answer IS NULL OR a.answer NOT IN ('yes', 'no')) AS no_model_answer,
    count(*) FILTER (WHERE h.y NOT IN (0, 1) AND a.answer IN ('yes', 'no')) AS tied_labels
FROM human_valid h
JOIN answers_long a USING (post_id, question)
GROUP BY h.question
