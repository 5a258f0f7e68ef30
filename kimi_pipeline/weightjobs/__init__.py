"""The distributed weight jobs, side by side: the conversion (HF → torch_dist: `conversion`, its ranks
`convert_rank`, its verification `convert_verify`) and the INT4 export (`int4_export`, `export_rank`,
`export_verify`). Both run as one kind of job in one layout (`job.JobLayout`, from the recipe's `convert` section):
a job file on the shared filesystem (`job_file`), one torchrun agent per node started on this host, by hand, or by
a Ray agent per node (`launch`, `ray_agents`), per-rank reports and failures turned into one error naming the rank
and its node (`launch`), and the one entry both call (`job.run_weight_job`).

Every rank starts at one thin entry, `rank` (`python -m kimi_pipeline.weightjobs.rank KIND --job JOB.json`), which
imports the rank body of its kind."""
