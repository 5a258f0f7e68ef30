"""Start a weight job's per-node agents on this host (`launch_local`), or hand the per-node command to whoever runs
the nodes (`launch_manual`: clusters without Ray). The Ray launcher is `ray_agents.launch_ray`.

Locally every "node" is one torchrun agent process with `--nproc-per-node` workers, rendezvousing statically on a
loopback port. When one agent fails the others are given a short grace period and then terminated, so a dead rank
never leaves the rest hanging in a collective. A launcher only starts and waits: it returns every agent's exit in a
`JobResult`, and `outcome` turns a failed one into the error naming the rank (`job.run_weight_job`)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from kimi_pipeline.model.device import JOB_DEVICE_ENV, LOCAL_DEVICE_BASE_ENV, cuda_device_count
from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.lifetime import bound_env
from kimi_pipeline.util.net import free_port
from kimi_pipeline.util.secret_env import without_secrets
from kimi_pipeline.weightjobs.commands import WORKER_ENV, NodeCommand
from kimi_pipeline.weightjobs.outcome import JobResult, WeightJobError

log = logging.getLogger(__name__)


def launch_manual(command: NodeCommand, *, work_dir: str | Path, report_dir: str | Path, name: str,
                  report_prefix: str = "rank", master_port: int = 29500, timeout: float | None = None,
                  poll_s: float = 1.0) -> JobResult:
    """For clusters without Ray (SLURM, plain hosts): write the per-node command to
    `<work_dir>/<name>.run-on-every-node.sh` (fixed port; the job file and output stay put while we wait),
    log it, and wait until every rank reported, or one failed (its error report names rank and node)."""
    work_dir, report_dir = Path(work_dir), Path(report_dir)
    nodes, world = command.nnodes, command.nnodes * command.nproc_per_node
    report_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*report_dir.glob("rank_*.error.json"), *report_dir.glob(f"{report_prefix}_*.json")]:
        stale.unlink()
    text = command.scale_out(master_port)
    script = work_dir / f"{name}.run-on-every-node.sh"
    atomic_write_text(script, "#!/bin/sh\n# On every node of the job: NODE_RANK=0..%d, MASTER_ADDR=<node 0's address>, "
                      "the\n# shared filesystem mounted at the same path, this environment's python on PATH.\n"
                      "exec %s\n" % (nodes - 1, text), mode=0o755)  # whole and executable once it is there
    log.warning("%s: convert.launcher=manual: run on each of the %d nodes (NODE_RANK=0..%d, MASTER_ADDR=node 0):"
                "\n  %s\nwaiting for %d ranks to report in %s", name, nodes, nodes - 1, text, world, report_dir)
    t0, noted = time.monotonic(), 0.0
    while True:
        seconds = time.monotonic() - t0
        if any(report_dir.glob("rank_*.error.json")):  # a rank failed: its report names it
            return JobResult(nodes, command.nproc_per_node, seconds, [], [text.split()], "manual", codes=[None] * nodes)
        done = [p for p in report_dir.glob(f"{report_prefix}_*.json") if not p.name.endswith(".error.json")]
        if len(done) >= world:
            return JobResult(nodes, command.nproc_per_node, seconds, [], [text.split()], "manual", codes=[0] * nodes)
        if timeout is not None and seconds > timeout:
            raise WeightJobError(f"{name}: {len(done)} of {world} ranks reported within {timeout:.0f} s; run "
                                 f"{script} on every node (NODE_RANK, MASTER_ADDR set)")
        if seconds - noted > 60:
            noted = seconds
            log.info("%s: %d of %d ranks reported after %.0f s", name, len(done), world, seconds)
        time.sleep(poll_s)


def launch_local(command: NodeCommand, *, work_dir: str | Path, report_dir: str | Path, name: str = "job",
                 env: dict[str, str] | None = None, timeout: float | None = None, grace: float = 15.0,
                 port_attempts: int = 3) -> JobResult:
    """Run `command` with every node's agent on this host; returns every agent's exit (`JobResult.ok`).

    The rendezvous port is picked free just before the launch; if another process grabs it in between
    (node 0 cannot listen), the job is relaunched on a new port, up to `port_attempts` times.
    """
    work_dir, report_dir = Path(work_dir), Path(report_dir)
    nodes, ppn = command.nnodes, command.nproc_per_node
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    gpus = cuda_device_count()
    if nodes * ppn > gpus:  # one rank per GPU, never several (4 K2-sized ranks would OOM one)
        if gpus:
            log.warning("%s: %d ranks but %d GPU(s) on this host: the ranks run on CPU (gloo); on a Ray cluster "
                        "(cluster.address) every node runs its own ranks on its own GPUs", name, nodes * ppn, gpus)
        env = {**(env or {}), "CUDA_VISIBLE_DEVICES": "", JOB_DEVICE_ENV: "cpu"}
    for attempt in range(1, port_attempts + 1):
        for stale in report_dir.glob("rank_*.error.json"):
            stale.unlink()
        result = _run(command, log_dir, name, env, timeout, grace)
        if (result.ok or result.timed_out or attempt == port_attempts or any(report_dir.glob("rank_*.error.json"))
                or not _port_clash(result.logs[0])):
            return result
        log.warning("%s: node 0 could not listen on its rendezvous port (taken meanwhile); relaunching", name)
    raise AssertionError("unreachable")


def _port_clash(node0_log: Path) -> bool:
    try:
        text = node0_log.read_text(errors="replace")[-20000:]
    except OSError:
        return False
    return "Address already in use" in text or "EADDRINUSE" in text


def _run(command: NodeCommand, log_dir: Path, name: str, env: dict[str, str] | None, timeout: float | None,
         grace: float) -> JobResult:
    nodes, ppn = command.nnodes, command.nproc_per_node
    port = free_port()
    full_env = {**without_secrets(), **WORKER_ENV, "KIMI_LAUNCH_TIME": repr(time.time()), **(env or {})}
    commands, procs, logs = [], [], []
    t0 = time.monotonic()
    timed_out = False
    try:
        for node in range(nodes):
            cmd = command.for_node(node, "127.0.0.1", port)
            log_path = log_dir / f"{name}.node{node}.log"
            # this host's GPUs, shared by its "nodes"; the agent dies with the launcher (a killed launcher leaves
            # nothing): it binds itself, as a preexec_fn could swallow a Ctrl-C (`util.lifetime.bound_env`)
            node_env = bound_env({**full_env, LOCAL_DEVICE_BASE_ENV: str(node * ppn)})
            with open(log_path, "wb") as fh:  # own session: stopped as a group
                procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=node_env,
                                              start_new_session=True))
            commands.append(cmd)
            logs.append(log_path)
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                break  # the others are stuck waiting for the dead rank
            if timeout is not None and time.monotonic() - t0 > timeout:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        _stop(procs)  # also on KeyboardInterrupt / SIGTERM of the launcher: never leave agents behind
    return JobResult(nodes, ppn, time.monotonic() - t0, logs, commands, codes=[p.returncode for p in procs],
                     timed_out=timed_out)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
