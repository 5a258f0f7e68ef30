"""Evaluation: AIME-style metrics (avg@n, pass@k, maj@n) over sampled responses (`scores`), scored on rollout
engines (`evaluate`; `record.score_engines` with the recipe's seed and grader). Entries: `record.run_eval_step`, the
train stage's periodic eval (one call per step, recorded in DIR/eval and summary.json); `record.evaluate_checkpoint`,
`kimi eval` on any checkpoint; `served.publish_scored`, the export stage's score of the INT4 export loaded as it
will be served, and its publication."""
