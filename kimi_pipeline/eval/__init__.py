"""Evaluation: AIME-style metrics (avg@n, pass@k, maj@n) over sampled responses (`metrics`), scored on rollout
engines (`run`). Entries: `record.run_eval_step`, the train stage's periodic eval (one call per step, recorded in
DIR/eval and summary.json); `record.evaluate_checkpoint`, `kimi eval` on any checkpoint; `served.score_export`,
the export stage's score of the INT4 export loaded as it will be served."""
