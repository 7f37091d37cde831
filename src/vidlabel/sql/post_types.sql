-- One row per post type (issue 26; NULL: a post with no usable item, or labels merged before post
-- types): how many posts, how each ended, what they hold and what they cost.
--   posts, ok, error, excluded  every post of the inventory by status,
--   items_mean, items_max       items the post lists (n_items, dropped ones included),
--   posts_with_items_dropped    posts that lost an item (probe or conversion error) but kept others,
--   videos, images, audio       the usable items by kind (what was or would have been sent),
--   classified                  posts with a request (ok or error): the population of the token means
--                               and of the prevalences by type,
--   est_*_tokens_mean           the manifest's estimate per classified post (0 for a post without
--                               items of the kind), input_tokens_mean the server's usage per request
--                               that reported it.
SELECT
    post_type,
    count(*) AS posts,
    count(*) FILTER (WHERE status = 'ok') AS ok,
    count(*) FILTER (WHERE status = 'error') AS error,
    count(*) FILTER (WHERE status = 'excluded') AS excluded,
    avg(n_items) AS items_mean,
    max(n_items) AS items_max,
    count(*) FILTER (WHERE items_dropped IS NOT NULL) AS posts_with_items_dropped,
    sum(n_videos) AS videos,
    sum(n_images) AS images,
    sum(n_audio) AS audio,
    count(*) FILTER (WHERE status IN ('ok', 'error')) AS classified,
    avg(est_video_tokens) FILTER (WHERE status IN ('ok', 'error')) AS est_video_tokens_mean,
    avg(est_image_tokens) FILTER (WHERE status IN ('ok', 'error')) AS est_image_tokens_mean,
    avg(est_audio_tokens) FILTER (WHERE status IN ('ok', 'error')) AS est_audio_tokens_mean,
    avg(est_text_tokens) FILTER (WHERE status IN ('ok', 'error')) AS est_text_tokens_mean,
    avg(prompt_tokens) FILTER (WHERE status IN ('ok', 'error')) AS input_tokens_mean
FROM labels
GROUP BY post_type
