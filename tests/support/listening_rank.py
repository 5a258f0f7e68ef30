"""A rank of a test weight job that records where its node listens: joins the job's default gloo group (through
its agent's store, as the conversion's ranks do), then writes the listening sockets of itself and of its torchrun
agent to `<out>/rank_<RANK>.json`. `python -m support.listening_rank OUT`."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from kimi_pipeline.util.rendezvous import gloo_on
from support.sockets import listeners


def main(out: Path) -> None:
    with gloo_on(os.environ["MASTER_ADDR"]):
        dist.init_process_group("gloo")
    dist.barrier()  # every rank's pairs are up
    found = [asdict(x) | {"agent": x.pid == os.getppid()} for x in listeners([os.getpid(), os.getppid()])]
    (out / f"rank_{os.environ['RANK']}.json").write_text(json.dumps(found))
    dist.barrier()  # nobody leaves before every rank looked
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
