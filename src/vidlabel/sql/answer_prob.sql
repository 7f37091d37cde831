-- P(yes) of one question from labels.answer_probs ('{"<question>": {"yes": p, "no": q}}'):
-- p / (p + q) when both are numbers in [0, 1] with a positive sum, else NULL. The placeholder
-- is the JSON path of the question, '$."<question>"', generated from a checked question id.
CASE
    WHEN TRY_CAST(json_extract_string(answer_probs, @path@ || '.yes') AS DOUBLE) BETWEEN 0 AND 1
     AND TRY_CAST(json_extract_string(answer_probs, @path@ || '.no') AS DOUBLE) BETWEEN 0 AND 1
     AND TRY_CAST(json_extract_string(answer_probs, @path@ || '.yes') AS DOUBLE)
         + TRY_CAST(json_extract_string(answer_probs, @path@ || '.no') AS DOUBLE) > 0
    THEN TRY_CAST(json_extract_string(answer_probs, @path@ || '.yes') AS DOUBLE)
         / (TRY_CAST(json_extract_string(answer_probs, @path@ || '.yes') AS DOUBLE)
            + TRY_CAST(json_extract_string(answer_probs, @path@ || '.no') AS DOUBLE))
END
