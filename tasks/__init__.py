"""Prefect task adapters: one module per stage. They add retries, content-hash cache keys and
artifacts around the `kimi_pipeline` stage functions, and nothing else."""
