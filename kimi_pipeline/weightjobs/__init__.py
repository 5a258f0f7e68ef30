"""The distributed weight jobs, side by side: the conversion (HF → torch_dist: `conversion`, its ranks
`convert_rank`, its verification `convert_verify`) and the INT4 export (`int4_export`, `export_rank`,
`export_verify`, the model check's child `export_model_check`). Both run through one entry, `job.run_weight_job`, in
one layout (`job.JobLayout`, from the recipe's `convert` section): a job file per phase on the shared filesystem
(`job_file`), the per-node command built once (`commands`), one torchrun agent per node started on this host or by
hand (`launch`) or by a Ray actor per node (`ray_agents`, `ray_node`), and every launch judged the same way
(`outcome`: every rank's report, or one error naming the failing rank and its node).

Every rank starts at one thin entry, `rank` (`python -m kimi_pipeline.weightjobs.rank KIND --job JOB.json`), which
imports the rank body of its kind and writes the rank's error report when it fails."""
