-- PPI++ mean estimate per question from ppi_items(question, yhat, y, r), in the form ppi_py's
-- ppi_mean_ci computes it (checked against ppi_py to 1e-9 in tests/test_stats.py):
--   big_n   population size (all classified posts, labelled ones included),
--   n       labelled posts; w = r rescaled to average 1 over them (ppi_py's normalisation),
--   theta1  the lambda = 1 estimate, the centre of the power-tuning gradients,
--   lambda  covar_pop(w(y - theta1), w(yhat - theta1)) / ((1 + n/N) * var_samp of the pooled
--           gradients w(yhat - theta1) over labelled and (yhat - theta1) over all), clipped to [0, 1];
--           0 when the predictions do not vary (ppi_py would divide by zero: no information anyway),
--   estimate = lambda * mean(yhat) + mean(w (y - lambda yhat)),
--   imputed_var = var_pop(lambda yhat) / N,  rectifier_var = var_pop(w (y - lambda yhat)) / n.
-- The reported estimate of a uniform sample is cross-fitted (crossfit_*): each labelled post i takes
--   lambda_i = Cov(y, yhat) over the other labelled posts / ((1 + (n - 1)/N) var_pop(yhat) over all),
--   clipped to [0, 1], and crossfit_estimate = avg over the labelled of lambda_i mean(yhat) + y_i - lambda_i yhat_i,
--   crossfit_rectifier_var = var_pop(y - lambda_i yhat) / n, crossfit_imputed_var = avg(lambda_i)^2 var_pop(yhat) / N:
-- lambda tuned on the labels it corrects leaned on them (-0.39 SD of bias at prevalence 0.01 with 100 labels,
-- docs/statistics.md); lambda_i does not see y_i, so the estimate is unbiased up to O(1/N). Unweighted:
-- the uniform design only (estimators.active_mean cross-fits the weighted ones the same way).
WITH sizes AS (
    SELECT question, count(*) AS big_n, count(y) AS n, sum(r) AS r_sum, avg(yhat) AS yhat_mean,
           var_pop(yhat) AS yhat_var
    FROM ppi_items
    GROUP BY question
),
labelled AS (
    SELECT i.question, i.y, i.yhat, i.r * s.n / s.r_sum AS w
    FROM ppi_items i JOIN sizes s USING (question)
    WHERE i.y IS NOT NULL
),
theta1 AS (
    SELECT s.question, any_value(s.yhat_mean) + avg(l.w * (l.y - l.yhat)) AS theta1
    FROM sizes s JOIN labelled l USING (question)
    GROUP BY s.question
),
gradient_cov AS (
    SELECT question, covar_pop(w * (y - theta1), w * (yhat - theta1)) AS cov_grad
    FROM labelled JOIN theta1 USING (question)
    GROUP BY question
),
pooled_var AS (
    SELECT question, var_samp(g) AS pooled_var
    FROM (
        SELECT question, w * (yhat - theta1) AS g FROM labelled JOIN theta1 USING (question)
        UNION ALL
        SELECT question, yhat - theta1 AS g FROM ppi_items JOIN theta1 USING (question)
    )
    GROUP BY question
),
tuned AS (
    SELECT
        s.question, s.big_n, s.n, s.yhat_mean, s.yhat_var, t.theta1, c.cov_grad, p.pooled_var,
        CASE
            WHEN p.pooled_var > 0
                THEN greatest(0.0, least(1.0, c.cov_grad / ((1 + s.n / s.big_n) * p.pooled_var)))
            ELSE 0.0
        END AS lambda
    FROM sizes s
    JOIN theta1 t USING (question)
    JOIN gradient_cov c USING (question)
    JOIN pooled_var p USING (question)
),
label_sums AS (
    SELECT question, count(*) AS n, sum(y) AS sy, sum(yhat) AS sf, sum(y * yhat) AS syf
    FROM labelled
    GROUP BY question
),
crossfit AS (
    SELECT
        l.question, l.y, l.yhat,
        CASE
            WHEN s.yhat_var > 0 AND c.n > 1 THEN greatest(0.0, least(1.0,
                ((c.syf - l.y * l.yhat) / (c.n - 1) - ((c.sy - l.y) / (c.n - 1)) * ((c.sf - l.yhat) / (c.n - 1)))
                / ((1 + (c.n - 1) / s.big_n) * s.yhat_var)))
            ELSE 0.0
        END AS lambda_i
    FROM labelled l JOIN label_sums c USING (question) JOIN sizes s USING (question)
),
crossfit_moments AS (
    SELECT
        x.question,
        avg(x.lambda_i * s.yhat_mean + x.y - x.lambda_i * x.yhat) AS crossfit_estimate,
        avg(x.lambda_i) * avg(x.lambda_i) * any_value(s.yhat_var) / any_value(s.big_n) AS crossfit_imputed_var,
        var_pop(x.y - x.lambda_i * x.yhat) / count(*) AS crossfit_rectifier_var,
        avg(x.lambda_i) AS crossfit_lambda
    FROM crossfit x JOIN sizes s USING (question)
    GROUP BY x.question
)
SELECT
    t.question, t.big_n, t.n, t.yhat_mean, t.theta1, t.cov_grad, t.pooled_var, t.lambda,
    t.lambda * t.yhat_mean + avg(l.w * (l.y - t.lambda * l.yhat)) AS estimate,
    t.lambda * t.lambda * t.yhat_var / t.big_n AS imputed_var,
    var_pop(l.w * (l.y - t.lambda * l.yhat)) / t.n AS rectifier_var,
    avg(l.w * l.y) AS human_mean,
    any_value(x.crossfit_estimate) AS crossfit_estimate,
    any_value(x.crossfit_imputed_var) AS crossfit_imputed_var,
    any_value(x.crossfit_rectifier_var) AS crossfit_rectifier_var,
    any_value(x.crossfit_lambda) AS crossfit_lambda
FROM tuned t JOIN labelled l USING (question) JOIN crossfit_moments x USING (question)
GROUP BY t.question, t.big_n, t.n, t.yhat_mean, t.yhat_var, t.theta1, t.cov_grad, t.pooled_var, t.lambda
ORDER BY t.question
