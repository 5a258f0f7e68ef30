"""What a run tells people and automation: `summary` (DIR/summary.json, `RunSummary`, which the stage runner
updates as each stage ends), `metrics` (one metrics.jsonl row per step, mirrored to TensorBoard and W&B),
`progress` (live terminal lines), `stage_reports` (one renderer per DAG stage: the task layer's artifacts) and
`markdown` / `plots` (DIR/summary.md and its PNG plots, written when flow `kimi` ends). No Prefect, no Ray."""
