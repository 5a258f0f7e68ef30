"""One rank of the distributed INT4 export (`python -m kimi_pipeline.weightjobs.rank export --job JOB.json`).

Launched like the conversion (`weightjobs.launch`: N torchrun agents here, the same command on every node
of a cluster). Each rank loads its slice of the torch_dist checkpoint (`weight_sync.policy_tensors`), quantizes the
tensors it is the designated source of (its experts; the lowest rank of a stage for shared weights),
writes them as its own temp-named shards into the shared output directory, reads them back and checks
them bit for bit against its tensors, and records shards, sizes, the check and its peak RSS in
`export_rank_<r>.json`. The launcher names the shards and writes the one index last
(`weightjobs.int4_export.export_distributed`, run by the export stage). Peak memory per rank: its model slice
plus one shard buffer. The rank runs under the thin entry `weightjobs.rank`, so megatron's helper process, which
re-imports the rank's `__main__`, does not load this module's model code.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from kimi_pipeline.hf.int4_checkpoint import write_int4_shards
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.model.device import job_device
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.weight_sync.policy_tensors import checkpoint_model, policy_tensors
from kimi_pipeline.weightjobs.export_verify import check_tensors
from kimi_pipeline.weightjobs.job_file import peak_rss_mb

REPORT_PREFIX = "export_rank"


def shard_prefix(rank: int) -> str:
    return f".rank{rank:05d}"


def export_rank(job: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    spec = ModelSpec.model_validate(job["model"])
    group = int(job["group_size"])
    layout = HFLayout(job.get("hf_prefix", ""))  # the base checkpoint's names (K2.5: language_model.)
    out = Path(job["out_dir"])
    with checkpoint_model(spec, job["checkpoint_dir"], job.get("step"), Layout(**job["layout"]),
                          device=job_device(job["device"])) as (model, parallel, _):
        rank = dist.get_rank() if dist.is_initialized() else 0
        t_load = time.monotonic()
        part = write_int4_shards(policy_tensors(model, spec, parallel, owned_only=True), out, group,
                                 max_shard_bytes=int(job["max_shard_bytes"]), prefix=shard_prefix(rank), layout=layout)
        t_write = time.monotonic()
        where = {n: s.file for s in part.shards for n in s.names}
        check = check_tensors(out, policy_tensors(model, spec, parallel, owned_only=True), group, weight_map=where,
                              layout=layout)
        t_check = time.monotonic()
    report = {
        "rank": rank,
        "part": part.to_json(),
        "check": dataclasses.asdict(check),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "seconds": {"load": round(t_load - t0, 3), "write": round(t_write - t_load, 3),
                    "check": round(t_check - t_write, 3), "total": round(time.monotonic() - t0, 3)},
    }
    atomic_write_json(Path(job["report_dir"]) / f"{REPORT_PREFIX}_{rank}.json", report)
    return report
