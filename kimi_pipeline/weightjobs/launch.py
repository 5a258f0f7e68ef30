"""Launch a torch.distributed job over N nodes: here, N `torch.distributed.run` agents on localhost.

At scale the same command runs once per node with MASTER_ADDR = node 0 (`node_command` prints it);
locally every "node" is one agent process with `--nproc-per-node` workers, rendezvousing statically on
a loopback port (deterministic ranks: node i owns ranks i*G .. i*G+G-1, so errors can name them).
Workers wrap their main in `rank_main`, which writes `rank_<r>.error.json` (type, message, traceback,
permanent or not) before exiting non-zero; the launcher turns those into one error naming the
failing rank and its node, with the tail of that node's log. When one agent fails the others are given
a short grace period and then terminated, so a dead rank never leaves the rest hanging in a collective.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import PermanentError, is_permanent
from kimi_pipeline.model.device import JOB_DEVICE_ENV, cuda_device_count
from kimi_pipeline.util.lifetime import bind_to_parent, die_with_parent
from kimi_pipeline.util.net import free_port
from kimi_pipeline.util.secret_env import without_secrets

WORKER_ENV = {
    "OMP_NUM_THREADS": "1",  # one intra-op thread per rank: 2 cores, several ranks
    "TORCHDYNAMO_DISABLE": "1",  # else megatron's first forward compiles for ~20 s on CPU
    "PYTHONUNBUFFERED": "1",
}
EXIT_PERMANENT = 3
DEVICE_BASE_VAR = "KIMI_LOCAL_DEVICE_BASE"  # first GPU index of a simulated node's ranks (read by init_distributed)
log = logging.getLogger(__name__)


class WeightJobError(RuntimeError):
    """A rank of the distributed job failed (or the job timed out); retrying may help."""

    def __init__(self, message: str, failures: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.failures = failures or []


class WeightJobPermanentError(WeightJobError, PermanentError):
    """A rank failed on bad input (corrupt shard, wrong shape): retrying cannot help."""


@dataclass
class JobResult:
    nodes: int
    procs_per_node: int
    seconds: float
    logs: list[Path]
    commands: list[list[str]] = field(default_factory=list)
    launcher: str = "local"  # or "ray": one agent per Ray node
    placement: list[str] = field(default_factory=list)  # each node's Ray node id (ray launcher)


# ---------------------------------------------------------------- worker side
def rank_main(main: Callable[[], Any], report_dir: str | Path) -> None:
    """Run a worker's main; on failure write rank_<RANK>.error.json and exit 1 (3 = permanent)."""
    rank = int(os.environ.get("RANK", "0"))
    bind_to_parent()  # this rank and the file writers megatron forks die with their agent
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised as an exit code
        if isinstance(e, SystemExit) and not e.code:
            raise
        report = Path(report_dir)
        report.mkdir(parents=True, exist_ok=True)
        payload = {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "node": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))),
            "host": os.uname().nodename,
            "type": type(e).__name__,
            "message": str(e),
            "permanent": is_permanent(e),
            "time": time.time(),
            "traceback": traceback.format_exc()[-4000:],
        }
        tmp = report / f".rank_{rank}.error.json.tmp"
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(report / f"rank_{rank}.error.json")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_PERMANENT if payload["permanent"] else 1)
    # Done: every file this rank wrote is closed and its report renamed into place. Skip the interpreter's
    # teardown (measured ~2-3 s with a 1 GB model: gc of the model, megatron's result-queue manager shut
    # down through atexit); the spawned manager follows by its parent watch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(rank_fn: Callable[[dict[str, Any]], Any], job_path: Path) -> None:
    """One rank of a weight job (`weightjobs.rank`): `rank_fn(job)` under `rank_main` (this rank's error report
    on failure)."""

    job = json.loads(Path(job_path).read_text())
    rank_main(lambda: rank_fn(job), job["report_dir"])


# ---------------------------------------------------------------- launcher side
def node_command(module: str, args: list[str], *, nnodes: int, node_rank: int, nproc_per_node: int,
                 master_addr: str, master_port: int, python: str | None = None) -> list[str]:
    """The torchrun command for one node (static rendezvous: node 0 hosts the store on master_port, listening on
    master_addr alone: `weightjobs.agent`)."""
    return [
        python or sys.executable, "-m", "kimi_pipeline.weightjobs.agent",
        f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc_per_node}",
        f"--master-addr={master_addr}", f"--master-port={master_port}",
        "--max-restarts=0", "--monitor-interval=0.5",
        "-m", module, *args,
    ]


def scale_out_command(module: str, args: list[str], *, nnodes: int, nproc_per_node: int, master_port: int = 29500) -> str:
    """What to run on each node of a real cluster (shared filesystem paths; NODE_RANK and MASTER_ADDR per node)."""
    cmd = node_command(module, args, nnodes=nnodes, node_rank=0, nproc_per_node=nproc_per_node,
                       master_addr="$MASTER_ADDR", master_port=master_port, python="python")
    cmd = [("--node-rank=$NODE_RANK" if c.startswith("--node-rank=") else c) for c in cmd]
    return " ".join(c if c.startswith(("--master-addr=$", "--node-rank=$")) else shlex.quote(c) for c in cmd)


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep = [ln for ln in lines if "Warning" not in ln and "warnings.warn" not in ln]
    return "\n".join(keep[-n:])


def read_failures(report_dir: Path) -> list[dict[str, Any]]:
    """Per-rank error reports, earliest first (the first is the root cause; later ones are usually fallout)."""
    out = []
    for p in sorted(report_dir.glob("rank_*.error.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(out, key=lambda f: f.get("time", 0))


def read_rank_reports(report_dir: Path, prefix: str, world: int) -> list[dict[str, Any]]:
    """Every rank's `<prefix>_<rank>.json` result, by rank; a job that exited cleanly with one missing is
    incomplete (a rank skipped its work): refused, never half-used."""
    reports = [json.loads(p.read_text()) for p in sorted(Path(report_dir).glob(f"{prefix}_*.json"))
               if not p.name.endswith(".error.json")]
    reports.sort(key=lambda r: r["rank"])
    if len(reports) != world:
        raise WeightJobPermanentError(
            f"{report_dir}: {len(reports)} of {world} ranks reported {prefix!r} results although the job "
            "exited cleanly; the job is incomplete")
    return reports


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


def launch_manual(module: str, args: list[str], *, nodes: int, procs_per_node: int, work_dir: str | Path,
                  report_dir: str | Path, name: str, report_prefix: str = "rank", master_port: int = 29500,
                  timeout: float | None = None, poll_s: float = 1.0) -> JobResult:
    """For clusters without Ray (SLURM, plain hosts): write the per-node command to
    `<work_dir>/<name>.run-on-every-node.sh` (fixed port; the job file and output stay put while we wait),
    log it, and wait until every rank reported — or one failed (its error report names rank and node)."""
    work_dir, report_dir = Path(work_dir), Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*report_dir.glob("rank_*.error.json"), *report_dir.glob(f"{report_prefix}_*.json")]:
        stale.unlink()
    command = scale_out_command(module, args, nnodes=nodes, nproc_per_node=procs_per_node, master_port=master_port)
    script = work_dir / f"{name}.run-on-every-node.sh"
    script.write_text("#!/bin/sh\n# On every node of the job: NODE_RANK=0..%d, MASTER_ADDR=<node 0's address>, the\n"
                      "# shared filesystem mounted at the same path, this environment's python on PATH.\n"
                      "exec %s\n" % (nodes - 1, command))
    script.chmod(0o755)
    world = nodes * procs_per_node
    log.warning("%s: convert.launcher=manual: run on each of the %d nodes (NODE_RANK=0..%d, MASTER_ADDR=node 0):\n  %s\n"
                "waiting for %d ranks to report in %s", name, nodes, nodes - 1, command, world, report_dir)
    t0, noted, logs = time.monotonic(), 0.0, [work_dir / "logs" / f"{name}.node{i}.log" for i in range(nodes)]
    while True:
        failures = read_failures(report_dir)
        if failures:
            raise _job_error(name, nodes, procs_per_node, [None] * nodes, failures, logs, False, timeout)
        done = [p for p in report_dir.glob(f"{report_prefix}_*.json") if not p.name.endswith(".error.json")]
        if len(done) >= world:
            return JobResult(nodes, procs_per_node, time.monotonic() - t0, [], [command.split()], "manual")
        waited = time.monotonic() - t0
        if timeout is not None and waited > timeout:
            raise WeightJobError(f"{name}: {len(done)} of {world} ranks reported within {timeout:.0f} s; run "
                                     f"{script} on every node (NODE_RANK, MASTER_ADDR set)")
        if waited - noted > 60:
            noted = waited
            log.info("%s: %d of %d ranks reported after %.0f s", name, len(done), world, waited)
        time.sleep(poll_s)


def launch_local(module: str, args: list[str], *, nodes: int, procs_per_node: int, work_dir: str | Path,
                 report_dir: str | Path, name: str = "job", env: dict[str, str] | None = None,
                 timeout: float | None = None, grace: float = 15.0, port_attempts: int = 3) -> JobResult:
    """Run `python -m module args` as a `nodes`×`procs_per_node` torch.distributed job on this host.

    Raises WeightJobPermanentError / WeightJobError naming the failing rank when any agent fails.
    The rendezvous port is picked free just before the launch; if another process grabs it in between
    (node 0 cannot listen), the job is relaunched on a new port, up to `port_attempts` times.
    """
    work_dir, report_dir = Path(work_dir), Path(report_dir)
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    gpus = cuda_device_count()
    if nodes * procs_per_node > gpus:  # one rank per GPU, never several (4 K2-sized ranks would OOM one)
        if gpus:
            log.warning("%s: %d ranks but %d GPU(s) on this host: the ranks run on CPU (gloo); on a Ray cluster "
                        "(cluster.address) every node runs its own ranks on its own GPUs", name, nodes * procs_per_node,
                        gpus)
        env = {**(env or {}), "CUDA_VISIBLE_DEVICES": "", JOB_DEVICE_ENV: "cpu"}
    for attempt in range(1, port_attempts + 1):
        for stale in report_dir.glob("rank_*.error.json"):
            stale.unlink()
        codes, seconds, logs, commands, timed_out = _run(module, args, nodes, procs_per_node, log_dir, name, env,
                                                         timeout, grace)
        if all(c == 0 for c in codes):
            return JobResult(nodes, procs_per_node, seconds, logs, commands)
        failures = read_failures(report_dir)
        if failures or timed_out or attempt == port_attempts or not _port_clash(logs[0]):
            raise _job_error(name, nodes, procs_per_node, codes, failures, logs, timed_out, timeout)
    raise AssertionError("unreachable")


def _port_clash(log: Path) -> bool:
    text = _tail(log, 200)
    return "Address already in use" in text or "EADDRINUSE" in text


def _run(module: str, args: list[str], nodes: int, ppn: int, log_dir: Path, name: str, env: dict[str, str] | None,
         timeout: float | None, grace: float) -> tuple[list[int | None], float, list[Path], list[list[str]], bool]:
    port = free_port()
    full_env = {**without_secrets(), **WORKER_ENV, "KIMI_LAUNCH_TIME": repr(time.time()), **(env or {})}
    commands, procs, logs = [], [], []
    t0 = time.monotonic()
    timed_out = False
    try:
        for node in range(nodes):
            cmd = node_command(module, args, nnodes=nodes, node_rank=node, nproc_per_node=ppn,
                               master_addr="127.0.0.1", master_port=port)
            log_path = log_dir / f"{name}.node{node}.log"
            node_env = {**full_env, DEVICE_BASE_VAR: str(node * ppn)}  # this host's GPUs are shared by its "nodes"
            with open(log_path, "wb") as fh:
                # own session (stopped as a group); dies with the launcher (a killed launcher leaves nothing)
                procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=node_env,
                                              start_new_session=True, preexec_fn=die_with_parent))
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
    return [p.returncode for p in procs], time.monotonic() - t0, logs, commands, timed_out


def _job_error(name: str, nodes: int, ppn: int, codes: list[int | None], failures: list[dict[str, Any]],
               logs: list[Path], timed_out: bool, timeout: float | None) -> WeightJobError:
    node_codes = ", ".join(f"node {i}: exit {c}" for i, c in enumerate(codes))
    if failures:
        first = failures[0]
        node = first.get("rank", 0) // ppn
        others = sorted({f["rank"] for f in failures[1:]})
        msg = (f"{name}: rank {first['rank']} (node {node}) failed: {first['type']}: {first['message']}"
               + (f"\n(ranks {others} failed after it)" if others else "")
               + f"\n[{node_codes}]\n--- node {node} log tail ({logs[node]}) ---\n{_tail(logs[node])}")
        cls = WeightJobPermanentError if first.get("permanent") else WeightJobError
        return cls(msg, failures)
    bad = next((i for i, c in enumerate(codes) if c not in (0, None)), 0)
    what = f"timed out after {timeout:.0f} s" if timed_out else "failed without an error report (killed, OOM, or a crash in the launcher)"
    return WeightJobError(
        f"{name}: {what} on node {bad} (ranks {bad * ppn}..{bad * ppn + ppn - 1})\n[{node_codes}]\n"
        f"--- node {bad} log tail ({logs[bad]}) ---\n{_tail(logs[bad])}"
    )
