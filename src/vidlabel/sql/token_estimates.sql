-- Per classified post, the manifest's estimate of its input tokens by kind, for the histograms by
-- kind (a post without items of a kind has 0 there and is left out of that kind's histogram).
SELECT est_video_tokens, est_image_tokens, est_audio_tokens, est_text_tokens
FROM labels
WHERE status IN ('ok', 'error')
  AND (est_video_tokens IS NOT NULL OR est_image_tokens IS NOT NULL OR est_audio_tokens IS NOT NULL
       OR est_text_tokens IS NOT NULL)
