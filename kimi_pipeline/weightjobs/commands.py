"""The command every node of a weight job runs: one torchrun agent (`weightjobs.agent`) rendezvousing statically on
node 0 (deterministic ranks: node i owns ranks i*G .. i*G+G-1, so errors can name them). `NodeCommand` is built
once per job (`job.run_weight_job`) and handed to the launcher, which fills in where the rendezvous is: a loopback
port (`launch`), node 0's address on the Ray cluster (`ray_agents`), or `$MASTER_ADDR` for clusters without Ray
(`scale_out`, printed and written as the manual launcher's script)."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

AGENT_ENTRY = "kimi_pipeline.weightjobs.agent"
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",  # one intra-op thread per rank: 2 cores, several ranks
    "TORCHDYNAMO_DISABLE": "1",  # else megatron's first forward compiles for ~20 s on CPU
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class NodeCommand:
    """`python -m module args` as a `nnodes` x `nproc_per_node` torch.distributed job."""

    module: str
    args: tuple[str, ...]
    nnodes: int
    nproc_per_node: int

    def for_node(self, node_rank: int, master_addr: str, master_port: int, python: str | None = None) -> list[str]:
        """The torchrun command of node `node_rank` (static rendezvous: node 0 hosts the store on master_port,
        listening on master_addr alone: `weightjobs.agent`)."""
        return [
            python or sys.executable, "-m", AGENT_ENTRY,
            f"--nnodes={self.nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={self.nproc_per_node}",
            f"--master-addr={master_addr}", f"--master-port={master_port}",
            "--max-restarts=0", "--monitor-interval=0.5",
            "-m", self.module, *self.args,
        ]

    def scale_out(self, master_port: int = 29500) -> str:
        """What to run on each node of a real cluster (shared filesystem paths; NODE_RANK and MASTER_ADDR per
        node)."""
        cmd = self.for_node(0, "$MASTER_ADDR", master_port, python="python")
        cmd = [("--node-rank=$NODE_RANK" if c.startswith("--node-rank=") else c) for c in cmd]
        return " ".join(c if c.startswith(("--master-addr=$", "--node-rank=$")) else shlex.quote(c) for c in cmd)
