"""The distributed weight jobs: conversion (HF → torch_dist), its verification, and the INT4 export all run as one
kind of job, here: a job file on the shared filesystem (`job_file`), one torchrun agent per node started on this
host, by hand, or by a Ray agent per node (`launch`, `ray_agents`), per-rank reports and failures turned into one
error naming the rank and its node (`launch`), and the one entry both stages call (`run.run_weight_job`).

Every rank starts at one thin entry, `rank` (`python -m kimi_pipeline.weightjobs.rank KIND --job JOB.json`); what a
rank does lives with its job: `weightjobs.convert_rank`, `weightjobs.convert_verify`, `weightjobs.export_rank`."""
