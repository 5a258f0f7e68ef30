"""Issue 40 item 4: the torch.distributed rendezvous of the conversion and export ranks, the trainers and the
weight-update groups listen on the address they are given, not on every interface (`kimi_pipeline.util.rendezvous`,
`kimi_pipeline.weightjobs.agent`)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from support.sockets import listeners

from kimi_pipeline.util.net import free_port
from kimi_pipeline.util.rendezvous import tcp_store
from kimi_pipeline.weight_sync.dist_group import make_group
from kimi_pipeline.weightjobs.agent import BACKEND, torchrun_args
from kimi_pipeline.weightjobs.commands import NodeCommand
from kimi_pipeline.weightjobs.launch import launch_local

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = datetime.timedelta(seconds=60)


def _mine() -> set[tuple[str, int]]:
    return {(x.address, x.port) for x in listeners([os.getpid()])}


def test_a_store_listens_on_the_address_it_is_given():
    """torch's own TCPStore server listens on every interface whatever host it is given (the reason for
    `tcp_store`); `tcp_store` listens on the host alone, picks a free port for port 0, and serves clients."""
    before = _mine()
    plain = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT)
    assert {a for a, p in _mine() - before if p == plain.port} <= {"::", "0.0.0.0"}
    ours = tcp_store("127.0.0.1", 0, 2, True, TIMEOUT, wait_for_workers=False)
    assert {(a, p) for a, p in _mine() - before if p == ours.port} == {("127.0.0.1", ours.port)}
    client = tcp_store("127.0.0.1", ours.port, 2, False, TIMEOUT)
    client.set("k", "v")
    assert ours.get("k") == b"v"
    del plain, ours, client


def test_a_loopback_weight_update_group_listens_on_loopback_only():
    """Both members of a gloo weight-update group at 127.0.0.1 (the trainer's rank 0 hosting the store, an
    engine's rank): the store and both gloo pair listeners are on loopback."""
    before = _mine()
    groups = {}
    free = free_port()  # as `WeightGroup` picks it
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, make_group("127.0.0.1", free, r, 2, "gloo",
                                                                                    "kimi-test-group")))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(groups) == {0, 1}
    new = _mine() - before
    assert ("127.0.0.1", free) in new and len(new) >= 3, new  # the store and two gloo listeners
    assert all(a in ("127.0.0.1", "::ffff:127.0.0.1") for a, _ in new), new


@pytest.mark.slow  # a megatron process (~10 s)
def test_the_trainers_rendezvous_listens_on_loopback_only():
    """A lone trainer process (`init_distributed`, megatron's groups included) listens on loopback alone."""
    code = ("import json, os, torch\n"
            "from kimi_pipeline.model.parallel import init_distributed\nfrom kimi_pipeline.recipes.layout import Layout\n"
            "from support.sockets import listeners\n"
            "init_distributed(Layout(), device=torch.device('cpu'))\n"
            "print(json.dumps([x.address for x in listeners([os.getpid()])]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    addresses = json.loads(done.stdout.strip().splitlines()[-1])
    assert addresses and set(addresses) <= {"127.0.0.1", "::ffff:127.0.0.1"}, addresses


def test_torchrun_static_arguments_become_the_bound_backend():
    argv = ["--nnodes=2", "--node-rank=1", "--nproc-per-node=1", "--master-addr=10.0.0.7", "--master-port=29500",
            "--max-restarts=0", "-m", "mod", "--master-port=1"]
    assert torchrun_args(argv) == ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=0", f"--rdzv-backend={BACKEND}",
                                   "--rdzv-endpoint=10.0.0.7:29500", "--rdzv-conf=rank=1", "-m", "mod",
                                   "--master-port=1"]


@pytest.mark.slow  # two torchrun agents and their ranks (~6 s)
def test_a_weight_job_listens_on_its_master_address_only(tmp_path):
    """A 2-node local weight job as the conversion runs (one torchrun agent per node, rendezvous on 127.0.0.1):
    node 0's agent hosts the store on 127.0.0.1:MASTER_PORT, every rank's gloo listener is on loopback, and
    nothing of the job listens on another interface."""
    out = tmp_path / "out"
    out.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *(p for p in sys.path if p)])}
    res = launch_local(NodeCommand("support.listening_rank", (str(out),), 2, 1), work_dir=tmp_path,
                       report_dir=tmp_path / "r", name="listen", env=env, timeout=240, grace=5)
    assert res.ok, res
    port = int(next(a for a in res.commands[0] if a.startswith("--master-port=")).split("=")[1])
    seen = [x for r in (0, 1) for x in json.loads((out / f"rank_{r}.json").read_text())]
    assert any(x["agent"] and x["port"] == port for x in seen), seen  # node 0's agent hosts the store
    assert sum(not x["agent"] for x in seen) >= 2, seen  # each rank's gloo listener
    assert all(x["address"] in ("127.0.0.1", "::ffff:127.0.0.1") for x in seen), seen
