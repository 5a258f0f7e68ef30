"""Stage `cluster`: real Ray clusters on this host (embedded head, simulated 4-node cluster, infra
scripts), health checks that pass and fail, placement groups, and no Ray process left behind."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from kimi_pipeline import stages
from kimi_pipeline.cluster.env import (
    RAY_METRICS_VAR,
    SINGLE_HOST_VAR,
    SOCKET_PATH_MAX,
    SOCKET_PATH_TAIL,
    choose_temp_dir,
)
from kimi_pipeline.cluster.cluster_errors import ClusterConfigError, ClusterHealthError, LocalClusterTooSmall, PlacementError
from kimi_pipeline.cluster.readiness import ClusterFacts, NodeFacts, Requirements, wait_until_healthy
from kimi_pipeline.cluster.kuberay import check_manifest, manifest_presets, render_manifest
from kimi_pipeline.cluster.lifecycle import embedded_layout, resolve_address, stop_cluster
from kimi_pipeline.cluster.local import KERNEL_WORKER_PORTS, LocalCluster
from kimi_pipeline.cluster.placement import (
    GroupSpec,
    bundle_nodes,
    compute_placement,
    create_group,
    create_placement_groups,
    remove_placement_groups,
)
from kimi_pipeline.cluster.procs import MARKER_VAR, cluster_processes, ray_processes_alive
from kimi_pipeline.cluster.ray_submit import ray_submit_command
from kimi_pipeline.errors import is_permanent
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.stages import CLUSTER
from kimi_pipeline.util.redact import ray_worker_setup
from support.processes import cmdline
from support.stages import run_stage

# `make test-fast` leaves it out: local Ray clusters started and stopped (~4-12 s per test)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra" / "ray"
FLOW_SECRETS = {"HF_TOKEN": "hf_ClusterSentinel0123456789abcdef", "WANDB_API_KEY": "wandbClusterSentinel-5e21"}
_RUN_DIRS: list[Path] = []


def _placement(recipe, rollout_devices: int | None = None):
    """The recipe's placement (what the actor layout computes from its cluster and sglang sections)."""
    return compute_placement(recipe.cluster, recipe.sglang.gpus_per_engine, rollout_devices)


def short_run_dir(name: str) -> Path:
    """A run dir short enough for Ray's socket paths (tmp_path is not: it exercises the fallback)."""
    d = Path(tempfile.mkdtemp(prefix=f"kc-{name}-", dir="/tmp"))
    _RUN_DIRS.append(d)
    return d


@pytest.fixture(scope="module", autouse=True)
def _ray_hygiene():
    """Restore the env vars the stage exports, and stop any cluster a failed test left running."""
    exported = ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", RAY_METRICS_VAR, SINGLE_HOST_VAR)
    saved = {k: os.environ.get(k) for k in exported}
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
    for d in _RUN_DIRS:
        c = LocalCluster.load(d)
        if c is not None and c.state.get("mode") == "embedded":
            c.stop()
        shutil.rmtree(d, ignore_errors=True)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _snapshot(run_dir: Path) -> tuple[dict[int, str], LocalCluster]:
    c = LocalCluster.load(run_dir)
    assert c is not None
    procs = {}
    for p in c.processes():
        try:
            procs[p.pid] = p.name()
        except psutil.NoSuchProcess:  # exited while listed (the preflight's probe actors, killed as it ends)
            continue
    return procs, c


def _assert_all_gone(run_dir: Path, pids: dict[int, str]) -> None:
    """Every process we saw is gone, nothing carries the marker, nothing runs from the temp dir."""
    c = LocalCluster.load(run_dir)
    assert c is not None and c.stopped
    assert ray_processes_alive(pids) == [], {p: pids[p] for p in ray_processes_alive(pids)}
    assert cluster_processes(c.state["marker"], c.state["sids"]) == []
    temp = c.state["temp_dir"]
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE:
            assert temp not in " ".join(p.info["cmdline"] or []), p


# ---------------------------------------------------------------------------------------------
# Pure logic: requirements, placement plans, manifests, addresses (no Ray processes)
# ---------------------------------------------------------------------------------------------


def _node(i: int, cpus=8.0, gpus=8.0, mem=1000.0, head=False) -> NodeFacts:
    return NodeFacts(f"{i:056x}", f"10.0.0.{i}", head, cpus, gpus, mem, {})


def test_requirements_follow_the_recipe():
    k = Requirements.of(load_recipe("kimi-k2.5").cluster)
    assert (k.nodes, k.gpus_per_node, k.cpus_per_node) == (32, 8, 1)
    t = Requirements.of(load_recipe("tiny").cluster)
    assert (t.nodes, t.gpus_per_node, t.cpus_per_node) == (1, 0, 1)
    apart = Requirements.of(load_recipe("tiny", ["cluster.colocate=false", "cluster.gpus_per_node=2"]).cluster)
    assert apart.cpus_per_node == 3  # two trainer ranks + the embedded engine


def test_missing_lists_every_shortfall():
    req = Requirements(nodes=4, gpus_per_node=8, cpus_per_node=16, memory_gb_per_node=500)
    ok = ClusterFacts("10.0.0.1:6379", "2.60.0", [_node(i, cpus=32) for i in range(4)])
    assert ok.missing(req) == []
    facts = ClusterFacts("10.0.0.1:6379", "2.60.0", [_node(1, cpus=32, head=True), _node(2, cpus=32, gpus=4), _node(3, cpus=8, mem=100)])
    missing = facts.missing(req)
    text = "\n".join(missing)
    assert "1 of 3 alive node(s) qualify" in text
    assert "nodes: 3 alive < 4 required (1 missing)" in text
    assert "node 10.0.0.2/" in text and "GPU 4 < 8" in text
    assert "node 10.0.0.3/" in text and "CPU 8 < 16" in text and "memory 100.0 GB < 500 GB" in text
    assert "cluster total GPU 20 < 32 required" in text


def test_placement_plans_for_the_presets():
    k25 = _placement(load_recipe("kimi-k2.5"))
    trainer = k25.group("trainer")
    assert trainer.strategy == "STRICT_SPREAD" and len(trainer.bundles) == 32
    assert trainer.bundles[0] == {"GPU": 8.0, "CPU": 8.0}
    assert [g.name for g in k25.groups] == ["trainer"]  # colocated: engines share the trainer bundles
    assert len(k25.engines) == 32 and k25.engines[5].bundles == (5,) and k25.engines[5].group == "trainer"
    assert k25.trainer_bundle(0) == 0 and k25.trainer_bundle(255) == 31
    assert k25.trainer_actor["GPU"] + k25.engine_actor["GPU"] <= 1.0

    thinking = _placement(load_recipe("kimi-k2-thinking"))  # 16-GPU engines span two nodes
    assert len(thinking.engines) == 16 and thinking.engines[1].bundles == (2, 3)

    apart = _placement(load_recipe("kimi-k2.5", ["cluster.colocate=false"]), rollout_devices=64)
    rollout = apart.group("rollout")
    assert len(rollout.bundles) == 8 and rollout.strategy == "STRICT_SPREAD"
    assert apart.engines[-1].group == "rollout" and apart.trainer_actor["GPU"] == 1.0

    tiny = _placement(load_recipe("tiny"))
    assert tiny.group("trainer").bundles == ({"CPU": 1.0},) and tiny.engines[0].group == "trainer"
    with pytest.raises(ClusterConfigError, match="gpus_per_engine"):
        _placement(load_recipe("kimi-k2.5", ["sglang.gpus_per_engine=12"], check=False))


def test_kuberay_manifests_are_generated_from_the_recipes():
    presets = manifest_presets()
    assert set(presets) == {"kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"}
    for name in presets:
        r = load_recipe(name)
        assert check_manifest(r) is None, check_manifest(r)
    text = (ROOT / "infra" / "kuberay" / "kimi-k2.5.yaml").read_text()
    import yaml

    doc = yaml.safe_load(text)
    head = doc["spec"]["headGroupSpec"]
    workers = doc["spec"]["workerGroupSpecs"][0]
    assert head["rayStartParams"]["num-gpus"] == "8" and workers["replicas"] == workers["maxReplicas"] == 31
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert doc["spec"]["authOptions"] == {"mode": "token"} and doc["metadata"]["name"] == "kimi-k2-5"
    # a recipe change is drift the check reports
    smaller = load_recipe("kimi-k2.5", ["cluster.nodes=16"], check=False)
    assert "differs from recipe" in check_manifest(smaller, ROOT / "infra" / "kuberay" / "kimi-k2.5.yaml")
    assert "replicas: 15" in render_manifest(smaller)


def test_cli_manifest_check_and_job_command(tmp_path):
    from typer.testing import CliRunner

    from kimi_pipeline.cli_cluster import cluster_app

    cli = CliRunner()
    ok = cli.invoke(cluster_app, ["manifest", "--check"])
    assert ok.exit_code == 0 and "kimi-k2.5" in ok.output
    drift = cli.invoke(cluster_app, ["manifest", "--check", "--recipe", "kimi-k2.5", "--set", "cluster.nodes=64"])
    assert drift.exit_code == 1 and "differs from recipe kimi-k2.5" in drift.output
    wrote = cli.invoke(cluster_app, ["manifest", "--write", "--recipe", "kimi-k2.5", "--dir", str(tmp_path)])
    assert wrote.exit_code == 0 and (tmp_path / "kimi-k2.5.yaml").read_text() == (ROOT / "infra/kuberay/kimi-k2.5.yaml").read_text()
    line = cli.invoke(cluster_app, ["job-command", "--recipe", "kimi-k2.5", "--dashboard", "http://10.0.0.1:8265"])
    assert line.exit_code == 0 and f"-- {sys.executable} -m kimi_pipeline.cli run --recipe kimi-k2.5" in line.output
    assert cli.invoke(cluster_app, ["down", "--run-dir", str(tmp_path)]).output.startswith("no running embedded cluster")


def test_addresses_and_embedded_limits():
    assert resolve_address("10.0.0.1") == "10.0.0.1:6379"
    assert resolve_address("head:6380") == "head:6380"
    with pytest.raises(ClusterConfigError, match="ray://"):
        resolve_address("ray://head:10001")
    with pytest.raises(ClusterConfigError, match="dashboard"):
        resolve_address("http://head:8265")
    with pytest.raises(ClusterConfigError, match="infra/ray") as e:
        embedded_layout(load_recipe("kimi-k2.5").cluster)
    assert is_permanent(e.value)
    if not shutil.which("nvidia-smi"):
        with pytest.raises(LocalClusterTooSmall, match="GPU") as e:
            embedded_layout(load_recipe("kimi-k2.5", ["cluster.nodes=1"], check=False).cluster)
        assert is_permanent(e.value)
    head, workers = embedded_layout(load_recipe("tiny", ["cluster.nodes=4"]).cluster)
    assert head.resources == {"node_0": 1.0} and [w.resources for w in workers] == [{f"node_{i}": 1.0} for i in (1, 2, 3)]
    assert all(n.num_cpus == 1 and n.num_gpus == 0 for n in [head, *workers])


def test_a_multi_node_cluster_without_token_auth_is_refused_unless_the_recipe_allows_it(tmp_path, monkeypatch):
    """Ray without token auth over several nodes lets anyone who reaches a node run code as the run's user: the
    cluster stage (an existing cluster or simulated nodes) and a weight job on a Ray cluster refuse it, naming the
    fix, before they connect or start anything; `cluster.allow_insecure=true` accepts it; one node (loopback) and
    token auth pass."""
    from kimi_pipeline.cluster.env import require_auth
    from kimi_pipeline.cluster.lifecycle import bring_up
    from kimi_pipeline.weightjobs.commands import NodeCommand
    from kimi_pipeline.weightjobs.ray_agents import launch_ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    for sets in (["cluster.nodes=2"], ["cluster.nodes=2", "cluster.address=127.0.0.1:9"]):
        with pytest.raises(ClusterConfigError, match="cluster.allow_insecure=true") as refused:
            bring_up(load_recipe("tiny", sets), tmp_path / "run")
        assert is_permanent(refused.value) and "RAY_AUTH_MODE=disabled" in str(refused.value)
        assert LocalCluster.load(tmp_path / "run") is None  # nothing started or recorded
    with pytest.raises(ClusterConfigError, match="allow_insecure"):
        launch_ray(NodeCommand("platform", (), 2, 1), work_dir=tmp_path, report_dir=tmp_path / "r",
                   address="127.0.0.1:9")
    assert load_recipe("tiny", ["cluster.nodes=2", "cluster.allow_insecure=true"]).cluster.allow_insecure
    require_auth("disabled", 2, allow_insecure=True)
    require_auth("disabled", 1, allow_insecure=False)
    require_auth("token", 32, allow_insecure=False)


def test_temp_dir_falls_back_when_socket_paths_would_be_too_long(tmp_path):
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    temp, note = choose_temp_dir(deep)
    try:
        assert len(str(temp)) + len(SOCKET_PATH_TAIL) <= SOCKET_PATH_MAX
        assert (deep / "ray").is_symlink() and (deep / "ray").resolve() == temp.resolve()
        assert "too long" in note and str(temp) in note
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    short = short_run_dir("short")
    temp, note = choose_temp_dir(short)
    assert temp == short.resolve() / "ray" and note is None


def test_token_is_created_once_and_private(tmp_path, monkeypatch):
    from kimi_pipeline.cluster import env as cenv

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setattr(cenv, "DEFAULT_TOKEN_PATH", tmp_path / ".ray" / "auth_token")
    assert cenv.ensure_token() == str(tmp_path / ".ray" / "auth_token")
    token = (tmp_path / ".ray" / "auth_token").read_text()
    assert len(token) == 64 and oct((tmp_path / ".ray" / "auth_token").stat().st_mode & 0o777) == "0o600"
    cenv.ensure_token()
    assert (tmp_path / ".ray" / "auth_token").read_text() == token  # never replaced
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "nope"))
    with pytest.raises(ClusterConfigError, match="RAY_AUTH_TOKEN_PATH"):
        cenv.ensure_token()
    monkeypatch.setenv("RAY_AUTH_MODE", "maybe")
    with pytest.raises(ClusterConfigError, match="RAY_AUTH_MODE"):
        cenv.auth_mode()


def test_ray_submit_command_uses_the_venv_interpreter():
    argv = ray_submit_command("kimi-k2.5", "http://10.0.0.1:8265")
    sep = argv.index("--")
    assert argv[sep + 1] == sys.executable and os.path.isabs(argv[sep + 1])
    assert argv[sep + 2 : sep + 6] == ["-m", "kimi_pipeline.cli", "run", "--recipe"]
    assert "cluster.address=auto" in argv and argv[argv.index("--address") + 1] == "http://10.0.0.1:8265"


def test_infra_scripts_parse_and_name_the_seed_variables():
    for script in ("env.sh", "head.sh", "worker.sh", "stop.sh"):
        subprocess.run(["bash", "-n", str(INFRA / script)], check=True)
    env = (INFRA / "env.sh").read_text()
    for var in ("MASTER_ADDR", "BASE_DIR", "GPUS_PER_NODE", "RAY_AUTH_MODE", "RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED"):
        assert var in env
    missing = subprocess.run(["bash", str(INFRA / "head.sh")], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert missing.returncode != 0 and "MASTER_ADDR" in missing.stderr


# ---------------------------------------------------------------------------------------------
# A real embedded cluster (one head), shared by the tests below
# ---------------------------------------------------------------------------------------------


def _start_embedded(run_dir: Path) -> dict:
    """Stage `cluster` on the tiny recipe, with the dashboard on (for the job test) and the flow's secrets in the
    environment it starts from (the Ray processes must not get them). The run dir is a pytest tmp dir: too long for
    Ray's sockets, so this also exercises the /tmp fallback."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _RUN_DIRS.append(run_dir)
    started_with = {"KIMI_RAY_DASHBOARD": "1", **FLOW_SECRETS}
    saved = {k: os.environ.get(k) for k in started_with}
    os.environ.update(started_with)
    try:
        section = run_stage(CLUSTER, stages.cluster.run, load_recipe("tiny"), run_dir)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    pids, cluster = _snapshot(run_dir)
    return {"run_dir": run_dir, "section": section, "pids": pids, "cluster": cluster}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """One embedded cluster (`_start_embedded`) the tests below only read or use; the teardown test stops its own."""
    started = _start_embedded(tmp_path_factory.mktemp("embedded") / "run")
    yield started
    stop_cluster(started["run_dir"])


def test_stage_reports_the_cluster(embedded):
    s, run_dir = embedded["section"], embedded["run_dir"]
    assert s["mode"] == "embedded" and s["nodes"] == 1 and s["gpus"] == 0 and s["cpus"] >= 1
    assert s["ray_version"] == "2.60.0" and s["auth_mode"] == "token" and s["address"].count(":") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stages"]["cluster"]["status"] == "completed"
    assert {k: summary["cluster"][k] for k in ("address", "nodes", "cpus", "gpus")} == {k: s[k] for k in ("address", "nodes", "cpus", "gpus")}
    assert json.loads((run_dir / "cluster" / "facts.json").read_text())["address"] == s["address"]
    assert "| node | head |" in (run_dir / "cluster" / "facts.md").read_text()
    # the fast preflight ran on the cluster just brought up: passed, its table beside the facts
    assert s["preflight"]["ok"] and s["preflight"]["failed"] == [] and "preflight (fast" in (run_dir / "cluster" / "facts.md").read_text()
    report = json.loads((run_dir / "cluster" / "preflight.json").read_text())
    assert report["fast"] and {c["name"] for c in report["checks"]} >= {"software: kimi-pipeline", "base_dir: shared",
                                                                        "ports between nodes"}
    assert "collective" not in {c["name"] for c in report["checks"]}
    assert "| base_dir: shared | yes |" in (run_dir / "cluster" / "preflight.md").read_text()
    assert s["temp_dir_note"] and "too long" in s["temp_dir_note"] and (run_dir / "ray").is_symlink()


def test_ray_processes_get_explicit_hygiene_env(embedded):
    names = set(embedded["pids"].values())
    assert {"raylet", "gcs_server"} <= names, names
    raylet = next(psutil.Process(p) for p, n in embedded["pids"].items() if n == "raylet")
    env = raylet.environ()
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert env["RAY_TMPDIR"] == embedded["section"]["temp_dir"] and MARKER_VAR in env
    assert env[RAY_METRICS_VAR] == "0"  # no Ray metrics on a cluster the run owns (`cluster.env.RAY_METRICS_OFF`)
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ[RAY_METRICS_VAR] == "0"  # for the stage's driver
    assert not set(FLOW_SECRETS) & set(env), "the raylet (and so every actor) got the flow's secrets"


def test_ray_workers_get_no_flow_secret_and_redact_their_logs(embedded, monkeypatch):
    """A worker of a run's driver (as rl/loop.py connects: `ray_worker_setup`, actor env_vars of its own) holds
    none of the flow's secrets though its driver does, and its log records are redacted before any handler."""
    import ray

    for k, v in FLOW_SECRETS.items():
        monkeypatch.setenv(k, v)
    ray.init(address=embedded["section"]["address"], log_to_driver=False, runtime_env=ray_worker_setup())
    try:
        @ray.remote(num_cpus=0, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})  # merged with the job's
        def worker_view() -> tuple[dict[str, str], str]:
            out = io.StringIO()
            logger = logging.getLogger("kimi_pipeline.probe")
            logger.addHandler(logging.StreamHandler(out))
            logger.warning("engine refused token %s", "hf_" + "Q" * 30)
            return {k: v for k, v in os.environ.items() if k in FLOW_SECRETS}, out.getvalue()

        held, logged = ray.get(worker_view.remote())
    finally:
        ray.shutdown()
    assert held == {}
    assert logged.strip() == "engine refused token <hf-token>"


def test_the_one_host_cluster_listens_on_loopback_only(embedded):
    """Every Ray process of the one-host cluster (GCS, raylet, workers, the dashboard, its agents and metrics
    exporters, the Ray Client server) and the driver's listen on 127.0.0.1 alone: nobody on another host reaches
    them. Such a cluster takes no second node (Ray's single-host mode), and says so."""
    import ray
    from support.sockets import listeners, session_members, with_descendants

    from kimi_pipeline.cluster.readiness import connected
    from kimi_pipeline.cluster.local import NodeSpec

    cluster = embedded["cluster"]
    assert cluster.loopback and embedded["section"]["address"].startswith("127.0.0.1:")
    with connected(cluster.address):
        assert set(ray.get([ray.remote(ray.util.get_node_ip_address).remote() for _ in range(2)])) == {"127.0.0.1"}
        sids = cluster.state["sids"]
        found = listeners(session_members(sids) | with_descendants(sids) | with_descendants([os.getpid()]))
    print(f"{len(found)} listening sockets of {len({x.pid for x in found})} processes")
    commands = " ".join(x.command for x in found)
    # the servers every cluster has from its start, and the dashboard this one was started with
    for process in ("gcs_server", "raylet", "dashboard.py"):
        assert process in commands, (process, found)
    # no Ray Client server (`cluster.ray_start`): the pipeline refuses ray:// addresses, so it would only be a port.
    # No log monitor: the run's drivers never stream the workers' output (`NodeSpec.log_monitor`). No autoscaler
    # monitor (`NodeSpec.autoscaler_monitor`: the nodes are fixed). (A worker listed may exit before its command line
    # is read: `cmdline` then gives [].)
    running = [" ".join(cmdline(p)) for p in cluster.processes()]
    assert "ray.util.client.server" not in commands and not [c for c in running if "ray.util.client.server" in c]
    for absent in ("log_monitor.py", "autoscaler/_private/monitor.py"):
        assert not [c for c in running if absent in c], (absent, running)
    assert [x for x in found if not x.loopback] == []
    # every port the kernel's, the workers' and the driver's too (`local.KERNEL_WORKER_PORTS`): none from Ray's fixed
    # worker range, which each raylet of the host hands out in the same order
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert [x for x in found if not low <= x.port <= high] == []
    with pytest.raises(ClusterConfigError, match="loopback"):
        cluster._start_worker(NodeSpec(num_cpus=1, num_gpus=0), 1, 60)


def test_a_driver_can_use_the_cluster(embedded):
    import ray

    ray.init(address=embedded["section"]["address"], log_to_driver=False)
    try:
        @ray.remote(num_cpus=1)
        def square(x: int) -> int:
            return x * x

        assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
        pgs = create_placement_groups(_placement(load_recipe("tiny")), timeout_s=30)
        assert len(bundle_nodes(pgs["trainer"])) == 1
        remove_placement_groups(pgs)
    finally:
        ray.shutdown()


def test_health_check_passes_and_fails_with_what_is_missing(embedded):
    address = embedded["section"]["address"]
    lines: list[str] = []
    facts = wait_until_healthy(address, Requirements.of(load_recipe("tiny").cluster), timeout_s=30, progress=lines.append)
    assert len(facts.nodes) == 1 and lines and lines[-1].startswith("cluster ready")
    lines.clear()
    t0 = time.monotonic()
    with pytest.raises(ClusterHealthError) as e:
        wait_until_healthy(address, Requirements(nodes=2, gpus_per_node=8, memory_gb_per_node=100000), timeout_s=3,
                           poll_s=0.5, progress=lines.append)
    assert time.monotonic() - t0 < 20
    msg = str(e.value)
    assert "nodes: 1 alive < 2 required" in msg and "GPU 0 < 8" in msg and "< 100000 GB" in msg
    assert e.value.missing and any(line.startswith("waiting for cluster") for line in lines)
    assert not is_permanent(e.value)  # an existing cluster may still be growing: retry


def test_existing_cluster_by_address_is_used_not_owned(embedded):
    """cluster.address: attach, check, report; the run never stops a cluster it did not start."""
    run_dir = short_run_dir("existing")
    address = embedded["section"]["address"]
    s = run_stage(CLUSTER, stages.cluster.run, load_recipe("tiny", [f"cluster.address={address}"]), run_dir,
                  timeout_s=30)
    assert s["mode"] == "existing" and s["address"] == address and s["nodes"] == 1
    assert stop_cluster(run_dir) is None
    from kimi_pipeline.cluster.env import gcs_reachable

    assert gcs_reachable(address) and embedded["cluster"].alive()
    too_big = load_recipe("tiny", [f"cluster.address={address}", "cluster.nodes=2", "parallel.dp=1"], check=False)
    with pytest.raises(ClusterHealthError, match="nodes: 1 alive < 2 required"):
        run_stage(CLUSTER, stages.cluster.run, too_big, run_dir, timeout_s=2)
    assert gcs_reachable(address)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stages"]["cluster"]["status"] == "failed" and "2 required" in summary["stages"]["cluster"]["error"]


def test_ray_job_submit_with_the_venv_interpreter(embedded):
    """The documented `ray job submit` form, for real: token auth, RAY_ADDRESS inside the job."""
    dash = embedded["section"]["dashboard"]
    assert dash and dash.startswith("http://127.0.0.1:")
    argv = ray_submit_command("tiny", dash)
    sep = argv.index("--")
    probe = [*argv[: sep + 1], sys.executable, "-c",
             "import os, ray; ray.init(); print('JOB-OK', os.environ['RAY_ADDRESS'], ray.cluster_resources()['CPU'])"]
    out = subprocess.run(probe, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"JOB-OK {embedded['section']['address']}" in out.stdout


def test_teardown_leaves_no_ray_process(tmp_path_factory):
    """On a cluster of its own: stopping the module's shared one would leave the tests that run after it (in any
    order) without a cluster."""
    embedded = _start_embedded(tmp_path_factory.mktemp("torn-down") / "run")
    run_dir = embedded["run_dir"]
    try:
        raise RuntimeError("the train stage failed")  # what the flow's `finally` sees
    except RuntimeError:
        pass
    finally:
        report = stop_cluster(run_dir)
    assert report["left"] == 0 and report["processes"] > 0
    _assert_all_gone(run_dir, embedded["pids"])
    assert stop_cluster(run_dir) is None  # idempotent
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["cluster"]["stopped"] is True
    assert not (run_dir / "ray").is_symlink() and list((run_dir / "ray").glob("session_*/logs"))  # logs moved back
    assert not Path(embedded["section"]["temp_dir"]).exists()


# ---------------------------------------------------------------------------------------------
# Failure paths: a failing stage and a dying owner leave nothing behind
# ---------------------------------------------------------------------------------------------


def test_failing_stage_stops_what_it_started():
    """Memory between Ray's usable share and the host's total: the start passes, the health check
    fails after the head is up; the stage must stop it and record what is missing."""
    run_dir = short_run_dir("fail")
    total_gb = psutil.virtual_memory().total / 1024**3
    r = load_recipe("tiny", [f"cluster.memory_gb_per_node={total_gb - 0.01:.2f}"])
    seen: dict[int, str] = {}
    with pytest.raises(LocalClusterTooSmall) as e:
        run_stage(CLUSTER, stages.cluster.run, r, run_dir, timeout_s=3)
    assert is_permanent(e.value) and any("memory" in m for m in e.value.missing)
    c = LocalCluster.load(run_dir)
    assert c is not None and c.state["sids"], "the head was started"
    seen = {pid: "" for pid in c.state["sids"]}
    _assert_all_gone(run_dir, seen)
    assert c.state["temp_dir"] == str(run_dir.resolve() / "ray")  # a short run dir holds Ray's temp dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stages"]["cluster"]["status"] == "failed" and "memory" in summary["stages"]["cluster"]["error"]


@pytest.mark.slow
def test_watchdog_stops_the_cluster_when_the_owner_is_killed():
    """`kimi run` killed with SIGKILL has no `finally`: the watchdog tears the cluster down."""
    run_dir = short_run_dir("owner")
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom kimi_pipeline.recipes import load_recipe\n"
        "from kimi_pipeline.stages import CLUSTER, cluster, stage_run\n"
        f"r, run_dir = load_recipe('tiny'), Path({str(run_dir)!r})\n"
        "with stage_run(CLUSTER, r, run_dir) as record:\n    record(cluster.run(r, run_dir))\n"
        "print('UP', flush=True)\ntime.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert owner.stdout.readline().strip() == "UP"
        pids, c = _snapshot(run_dir)
        assert "raylet" in pids.values() and c.state.get("watchdog_pid") in pids
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not LocalCluster.load(run_dir).stopped:
        time.sleep(0.5)
    # the watchdog itself (one of the cluster's processes) marks the cluster stopped, then exits: wait for it (a suite
    # run caught it alive in between)
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(c.state["watchdog_pid"]).wait(timeout=30)
    _assert_all_gone(run_dir, pids)
    assert "owner" in (run_dir / "cluster" / "watchdog.log").read_text()


# ---------------------------------------------------------------------------------------------
# A simulated 4-node cluster: 4 raylets on this host, one CPU and a node_<i> resource each
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_simulated_four_node_cluster_strict_spread_and_impossible_groups():
    import ray

    run_dir = short_run_dir("four")
    r = load_recipe("tiny", ["cluster.nodes=4"])
    section = run_stage(CLUSTER, stages.cluster.run, r, run_dir)
    pids, local = _snapshot(run_dir)
    try:
        assert section["nodes"] == 4 and section["cpus"] == 4
        assert sorted(k for n in section["node_list"] for k in n["resources"]) == [f"node_{i}" for i in range(4)]
        assert list(pids.values()).count("raylet") == 4
        # what a run's cluster leaves out: with the dashboard off no dashboard process (`cluster.ray_start`), no
        # autoscaler or log monitor (`NodeSpec`), and no idle workers started ahead of a driver on any raylet
        # (`env.RAY_PRESTART_OFF`: none could take a run's work, which always has a runtime_env)
        running = [" ".join(cmdline(p)) for p in local.processes()]
        for absent in ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "log_monitor.py"):
            assert not [c for c in running if absent in c], (absent, running)
        raylets = [psutil.Process(pid) for pid, name in pids.items() if name == "raylet"]
        assert [p.environ().get("RAY_prestart_worker_first_driver") for p in raylets] == ["0"] * 4
        ray.init(address=section["address"], log_to_driver=False)
        plan = _placement(r)
        trainer = plan.group("trainer")
        assert trainer.strategy == "STRICT_SPREAD" and len(trainer.bundles) == 4
        pgs = create_placement_groups(plan, timeout_s=30)
        nodes = bundle_nodes(pgs["trainer"])
        assert len(set(nodes)) == 4  # one bundle per node

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_cpus=1)
        def where() -> tuple[str, list[str]]:
            ctx = ray.get_runtime_context()
            mine = [n for n in ray.nodes() if n["NodeID"] == ctx.get_node_id()][0]
            return ctx.get_node_id(), [k for k in mine["Resources"] if k.startswith("node_")]

        ran = ray.get([
            where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pgs["trainer"], placement_group_bundle_index=i)).remote()
            for i in range(4)
        ])
        assert [n for n, _ in ran] == nodes and sorted(k[0] for _, k in ran) == [f"node_{i}" for i in range(4)]
        remove_placement_groups(pgs)

        t0 = time.monotonic()
        with pytest.raises(PlacementError) as e:
            create_group(GroupSpec("too-wide", tuple({"CPU": 1.0} for _ in range(5)), "STRICT_SPREAD"), timeout_s=3)
        assert "STRICT_SPREAD needs 5 distinct nodes; the cluster has 4" in str(e.value)
        with pytest.raises(PlacementError, match="fits on no node"):
            create_group(GroupSpec("too-big", ({"CPU": 2.0},), "PACK"), timeout_s=3)
        assert time.monotonic() - t0 < 30  # reported, not waited on forever
        assert is_permanent(e.value)
        from ray.util.placement_group import placement_group_table

        assert all(v["state"] == "REMOVED" for v in placement_group_table().values())
    finally:
        ray.shutdown()
        stop_cluster(run_dir)
    _assert_all_gone(run_dir, pids)


@pytest.mark.slow
def test_infra_scripts_start_a_head_and_a_worker():
    """infra/ray/head.sh + worker.sh for real (no GPUs here: GPUS_PER_NODE=0), with the cluster token
    on the "shared" BASE_DIR; checked from a separate driver process; stopped by marker, not `ray stop`."""
    from ray._private.services import get_node_ip_address

    from kimi_pipeline.cluster.procs import stop_cluster_processes
    from kimi_pipeline.util.net import free_ports

    base = short_run_dir("infra")
    marker = f"infra-{os.getpid()}"
    port, dashboard, client, head_agent, worker_agent = free_ports(5)  # distinct: Ray refuses one port twice
    env = dict(os.environ, MASTER_ADDR=get_node_ip_address(), BASE_DIR=str(base), GPUS_PER_NODE="0", NUM_CPUS="1",
               RAY_PORT=str(port), DASHBOARD_PORT=str(dashboard), RAY_TMPDIR=str(base / "tmp"), RAY_AUTH_MODE="token",
               **{MARKER_VAR: marker})
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop(SINGLE_HOST_VAR, None)  # left by a loopback cluster's driver in this process; a node's shell has none
    sids: list[int] = []
    names: dict[int, str] = {}

    def run(script: str, extra: str) -> str:
        p = subprocess.Popen(["bash", str(INFRA / script)], env={**env, "RAY_START_ARGS": extra}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        sids.append(p.pid)
        out = p.communicate(timeout=180)[0]
        assert p.returncode == 0, out[-3000:]
        return out

    try:
        # two nodes on one host: worker ports from the kernel (infra/ray/README.md, as the embedded clusters'), not
        # one range handed out twice
        kernel_ports = " ".join(KERNEL_WORKER_PORTS)
        out = run("head.sh", f"--ray-client-server-port {client} --dashboard-agent-listen-port {head_agent} "
                             f"{kernel_ports}")
        token = base / ".ray" / "auth_token"
        assert "created the cluster token" in out and oct(token.stat().st_mode & 0o777) == "0o600"
        run("worker.sh", f"--dashboard-agent-listen-port {worker_agent} {kernel_ports}")
        names = {p.pid: p.name() for p in cluster_processes(marker, sids)}
        assert list(names.values()).count("raylet") == 2
        probe = (
            "from kimi_pipeline.cluster.readiness import Requirements, wait_until_healthy; "
            f"f = wait_until_healthy('{env['MASTER_ADDR']}:{port}', Requirements(nodes=2, cpus_per_node=1), timeout_s=60); "
            "print('NODES', len(f.nodes), f.ray_version)"
        )
        check = subprocess.run([sys.executable, "-c", probe], env={**env, "RAY_AUTH_TOKEN_PATH": str(token)},
                               capture_output=True, text=True, timeout=120)
        assert "NODES 2 2.60.0" in check.stdout, check.stdout[-2000:] + check.stderr[-2000:]
    finally:
        assert stop_cluster_processes(marker, sids)["left"] == 0
    assert ray_processes_alive(names) == []


@pytest.mark.slow
def test_cli_up_keeps_the_cluster_and_down_stops_it():
    from typer.testing import CliRunner

    from kimi_pipeline.cli_cluster import cluster_app

    run_dir = short_run_dir("cli")
    cli = CliRunner()
    up = cli.invoke(cluster_app, ["up", "--recipe", "tiny", "--run-dir", str(run_dir)])
    assert up.exit_code == 0, up.output
    assert json.loads(up.output)["keep"] is True
    pids, c = _snapshot(run_dir)
    assert "watchdog_pid" not in c.state and "raylet" in pids.values()  # kept: nothing tears it down on exit
    assert stop_cluster(run_dir) == {"kept": True, "address": c.address}  # the flow's `finally` leaves it
    st = cli.invoke(cluster_app, ["status", "--run-dir", str(run_dir)])
    assert st.exit_code == 0 and json.loads(st.output)["nodes"] == 1
    down = cli.invoke(cluster_app, ["down", "--run-dir", str(run_dir)])
    assert down.exit_code == 0 and json.loads(down.output)["left"] == 0
    _assert_all_gone(run_dir, pids)


@pytest.mark.slow
def test_prefect_task_and_flow_finally_leave_no_ray_process():
    """The wiring the `kimi` flow uses: cluster_task (uncached, artifact), a later stage failing, and
    stop_cluster in the flow's `finally`."""
    from prefect import flow

    from tasks.cluster import cluster_task

    run_dir = short_run_dir("flow")
    seen: dict[str, dict] = {}

    @flow(name="cluster-wiring")
    def wiring(run_dir: str) -> None:
        try:
            section = cluster_task(load_recipe("tiny"), run_dir)
            seen["pids"] = {p.pid: p.name() for p in LocalCluster.load(Path(run_dir)).processes()}
            seen["section"] = section
            raise RuntimeError("the train stage failed")
        finally:
            stop_cluster(Path(run_dir))

    state = wiring(str(run_dir), return_state=True)
    assert state.is_failed() and "train stage failed" in str(state.result(raise_on_failure=False))
    assert seen["section"]["nodes"] == 1 and "raylet" in seen["pids"].values()
    _assert_all_gone(run_dir, seen["pids"])

    # this run's artifact (filtered by its flow run id), describing this run's cluster
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    (facts,) = [a for a in artifacts if a.key == "cluster-facts"]
    assert f"- address: `{seen['section']['address']}`" in facts.data, facts.data
    assert all(n["node_id"][:8] in facts.data for n in seen["section"]["node_list"]), facts.data
    (preflight,) = [a for a in artifacts if a.key == "cluster-preflight"]
    assert preflight.data.startswith("# Preflight of tiny: passed") and "| ports between nodes | yes |" in preflight.data
