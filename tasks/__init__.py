"""Prefect task adapters: one module per stage (`download` … `export`; `train` also holds the eval task). Each runs
its `kimi_pipeline` stage through `common.run_stage_task` and adds retries, content-hash cache keys and artifacts
around it, and nothing else; `secrets` reads Prefect Secret blocks. Flow `kimi` (flows/kimi.py) calls them."""
