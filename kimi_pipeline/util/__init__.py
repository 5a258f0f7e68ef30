"""Small helpers the packages share, one concern per module: atomic writes and hashing (`files`), path resolution
and run directories (`paths`), the run-directory lock (`run_lock`), secrets kept out of text and environments
(`redact`, `secret_env`), free ports and rendezvous (`net`, `rendezvous`), child-process lifetime (`lifetime`), CPU
threads (`threads`), the sharded safetensors writer (`shards`) and Prefect's environment defaults (`prefect_env`, no
Prefect import). No entry: import what you use from its module."""
