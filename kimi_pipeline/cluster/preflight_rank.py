"""One rank of the preflight collective: join the layout's world, all-reduce one bucket, report as one JSON line.

Run by `preflight.NodeProbe.collective` (`python -m kimi_pipeline.cluster.preflight_rank`) with torch.distributed's
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) plus KIMI_PREFLIGHT_BYTES, KIMI_PREFLIGHT_DEVICE
and KIMI_PREFLIGHT_TIMEOUT_S. A rank that cannot join says why (its own error) instead of hanging: the process group
is created with the timeout, and the parent kills what outlives it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(os.environ.get("KIMI_PREFLIGHT_DEVICE", "cpu"))
    if device.type == "cuda":  # one GPU per rank, the node's local rank (as the trainer's ranks take them)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    nbytes = int(os.environ["KIMI_PREFLIGHT_BYTES"])
    timeout = datetime.timedelta(seconds=float(os.environ["KIMI_PREFLIGHT_TIMEOUT_S"]))
    out: dict = {"rank": rank}
    t0 = time.perf_counter()
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=timeout, **({"device_id": device} if device.type == "cuda" else {}))
        out["join_seconds"] = round(time.perf_counter() - t0, 3)
        bucket = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(bucket)  # warm-up: connections and algorithms are set up here
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        dist.all_reduce(bucket)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t1
        if bucket[0].item() != world * world:  # two all-reduces of ones: world, then world * world
            raise RuntimeError(f"all-reduce gave {bucket[0].item()}, expected {world * world}")
        # bus bandwidth as nccl-tests reports it for all-reduce: 2 (n - 1) / n of the bytes, per second
        bus_gbps = 2 * (world - 1) / world * nbytes / seconds / 1e9
        out.update(ok=True, seconds=round(seconds, 6), bus_gbps=round(bus_gbps, 3))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the parent, which names this rank's node
        first = (str(e).strip().splitlines() or [""])[0][:300]
        out.update(ok=False, error=f"{type(e).__name__}: {first}", seconds_waited=round(time.perf_counter() - t0, 1))
    print(json.dumps(out), flush=True)
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
