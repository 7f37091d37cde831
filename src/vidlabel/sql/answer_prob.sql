-- P(yes) of one question from labels.answer_probs ('{"<question>": {"yes": p, "no": q}}'):
-- p / (p + q) when both are numbers in [0, 1] with a positive sum, else NULL. The placeholders are
-- the texts of p and q (their elements of answers_long.sql's _prob_texts, generated from a checked
-- question id): answer_probs is parsed once per post for every question, not once per value.
CASE
    WHEN TRY_CAST(@yes@ AS DOUBLE) BETWEEN 0 AND 1
     AND TRY_CAST(@no@ AS DOUBLE) BETWEEN 0 AND 1
     AND TRY_CAST(@yes@ AS DOUBLE) + TRY_CAST(@no@ AS DOUBLE) > 0
    THEN TRY_CAST(@yes@ AS DOUBLE) / (TRY_CAST(@yes@ AS DOUBLE) + TRY_CAST(@no@ AS DOUBLE))
END
