"""One node's torchrun agent of a weight job, whose rendezvous store listens only on --master-addr.

`python -m kimi_pipeline.weightjobs.agent` takes torchrun's arguments (`commands.NodeCommand`). torchrun's static
rendezvous makes node 0's agent host a TCPStore on --master-addr:--master-port
(torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py:63-74), and torch's TCPStore server listens on every
interface whatever host it is given (`util.rendezvous`). The same static rendezvous is registered here under its own
name (torchrun's registry refuses a second "static", rendezvous/api.py:359-363) with the store bound to the master
address, and the static arguments are passed to torchrun as that backend's endpoint and rank.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as handlers
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler
from torch.distributed.run import main as torchrun

from kimi_pipeline.util.lifetime import bind_to_parent_if_asked
from kimi_pipeline.util.rendezvous import tcp_store

BACKEND = "kimi-static"


class BoundStaticRendezvous(StaticTCPRendezvous):
    """torchrun's static rendezvous, its store made by `util.rendezvous.tcp_store` (same arguments)."""

    def get_backend(self) -> str:
        return BACKEND  # the registry checks the handler's name against the requested one (rendezvous/api.py:380-384)

    def next_rendezvous(self) -> RendezvousInfo:
        if not self._store:  # StaticTCPRendezvous makes its store only when it has none
            self._store = tcp_store(self.master_addr, self.master_port, self.world_size, self.rank == 0,
                                    self.timeout, multi_tenant=True)
        return super().next_rendezvous()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    """As torchrun's static handler (its checks and defaults), with the bound store."""
    params.config["rank"] = int(params.config["rank"])  # --rdzv-conf values arrive as strings
    static = create_rdzv_handler(params)
    return BoundStaticRendezvous(static.master_addr, static.master_port, static.rank, static.world_size,
                                 static.run_id, int(static.timeout.total_seconds()))


def torchrun_args(argv: list[str]) -> list[str]:
    """torchrun's static arguments (--node-rank=R --master-addr=A --master-port=P, `=` form, before the
    module) as this backend's: --rdzv-backend, --rdzv-endpoint=A:P, --rdzv-conf=rank=R."""
    split = argv.index("-m") if "-m" in argv else len(argv)
    ours, rest = argv[:split], argv[split:]
    values = dict(a[2:].split("=", 1) for a in ours if a.startswith(("--node-rank=", "--master-addr=", "--master-port=")))
    if set(values) != {"node-rank", "master-addr", "master-port"}:
        raise SystemExit(f"{__name__}: give --node-rank=, --master-addr= and --master-port= (got {ours})")
    host = values["master-addr"]
    host = f"[{host}]" if ":" in host else host
    kept = [a for a in ours if not a.startswith(("--node-rank=", "--master-addr=", "--master-port="))]
    return [*kept, f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={host}:{values['master-port']}",
            f"--rdzv-conf=rank={values['node-rank']}", *rest]


def main(argv: list[str] | None = None) -> None:
    handlers.register(BACKEND, _create)
    torchrun(torchrun_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    bind_to_parent_if_asked()  # a local or Ray launch dies with its launcher; a manual one lives with its shell
    main()
