"""The RL post-training pipeline as a library: download → validate → convert → cluster → train → export.

Each stage is a `Stage` in `stages` (the DAG, and `stages.runner.run_stage`, the one runner that records every
stage); the work lives in the packages beside it (`hub`, `data`, `convert`, `cluster`, `rl`, `eval`, `quant`, ...),
driven by the typed recipes of `recipes`. The entry for people is the `kimi` CLI (`cli.main`); Prefect's flow and
task adapters (flows/, tasks/) call the same stages. No module here imports Prefect: the CLI's `run` and `serve`
reach flows/ lazily, after setting Prefect's environment."""
