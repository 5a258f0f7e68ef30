"""Deployment kimi/full for real: `kimi serve` (a Prefect server on loopback + the served deployment,
started the way a background job would be) in a fixture, driven with the `prefect` CLI from "another
shell" on the shortened tiny DAG:

- `prefect deployment run kimi/full --watch` completes; a second run triggered meanwhile waits on the
  deployment's concurrency limit, then finds download/validate/convert/export Cached;
- the Prefect UI in headless Chromium shows the flow run (screenshot kept);
- kill -9 of the trainer mid-run: the train task's retry resumes and ends with the uninterrupted metrics,
  while the run holds the per-cluster concurrency slot;
- secrets given to the served runs never reach logs, artifacts, parameters or the run dir;
- SIGTERM stops `kimi serve` (and its server) cleanly;
- the multi-host variant: infra/prefect/setup.sh deploys prefect.yaml to a work pool, a worker started
  as a background job runs a flow and stops on SIGTERM.

The served runs are module fixtures (`run_a`, `killed_run`), made once by the first test that asks for them: each
test names the runs it reads, so any selection (`-k kill_9`, `--lf`) runs it for real instead of skipping.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support.common import ONE_NODE_WEIGHT_JOBS, REPRODUCIBLE, ROOT, assert_same_rows, stable_row

sys.path.insert(0, str(ROOT))

from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import (  # noqa: E402
    ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId,
)
from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: E402

from flows.serve import full_deployment, start_server  # noqa: E402
from kimi_pipeline.cluster.local import LocalCluster  # noqa: E402
from kimi_pipeline.cluster.procs import gone  # noqa: E402
from kimi_pipeline.report.metrics_log import read_jsonl  # noqa: E402
from kimi_pipeline.util.net import free_port  # noqa: E402
from support.prefect_home import migrated_home  # noqa: E402
from support.processes import cmdline  # noqa: E402
from support.webhook_server import wait_for, webhook_receiver  # noqa: E402

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# The served runs prove the deployment (queueing, caches, retries, secrets, the UI), not the weight jobs' layout.
SHORT = ["rollout.num_rollout=4", "eval.interval=2", "checkpoint.save_interval=2", "rollout.rollout_batch_size=16",
         "rollout.over_sampling_batch_size=32", "eval.n_samples_per_prompt=4", "quant.int4_qat=true",
         *ONE_NODE_WEIGHT_JOBS, *REPRODUCIBLE]  # run c's metrics are compared bit for bit with run a's
HF_SENTINEL = "hf_SentinelTokenKimiG7x2Qw9ZpL4"
WANDB_SENTINEL = "wandbSentinelKey-93f1c07a5e"
STAGES = ("download", "validate", "convert", "cluster", "train", "export")
CACHED = ("download", "validate", "convert", "export")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000"]
# Chromium's virtual time runs ahead while the page waits on nothing, and real time while it waits on the API: on a
# loaded host (the suite's other worker) the UI's log query may answer after 10 s of it; a later load waits longer.
UI_BUDGETS_MS = (10_000, 30_000, 60_000)
STABLE_COPY = ROOT / "runs" / "test-artifacts" / "prefect-ui.png"

# Time limits, seconds. The served runs are module fixtures, made by the first test that needs them, and
# pytest-timeout counts fixture set-up in that test's time: each test's limit covers every fixture it may have
# to make (so `-k kill_9` or `--lf` alone has room for run a too), and every inner wait sits below it.
SERVE_S = 240  # `kimi serve` up, its deployment readable
RUN_S = 600  # one shortened tiny run through the deployment, from `prefect deployment run` to a final state
CHROMIUM_S = 180  # one headless Chromium page load
CHECKS_S = 120  # a test's own API reads and file checks
RUN_A_S = 2 * RUN_S  # run a, then the second run queued behind it
KILLED_S = 2 * RUN_S  # run c up to its step-2 checkpoint, then its retry to the end
# How often the served runner looks for runs to start (Prefect's default: every 10 s) and how long a run the
# deployment's concurrency limit turned away waits before it is offered again (default 30 s): the queueing and the
# runs are the same, each run starts up to 10 s sooner and the queued second run up to 30 s sooner after the first.
QUICK_POLLS = {"PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "5"}


def _background_job() -> None:
    """What `cmd &` in a non-interactive shell does to a child: SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def client(api_url: str):
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as c:
            yield c


def cli_env(api_url: str, home: Path) -> dict[str, str]:
    env = dict(os.environ, PREFECT_API_URL=api_url, PREFECT_HOME=str(home), NO_COLOR="1", COLUMNS="200")
    for var in ("HF_TOKEN", "WANDB_API_KEY"):
        env.pop(var, None)
    return env


def prefect(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def run_deployment(params: dict, env: dict[str, str], watch: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "prefect", "deployment", "run", "kimi/full", "--params", json.dumps(params)]
    return subprocess.Popen(cmd + (["--watch"] if watch else []), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd="/")


def flow_run_id(output: str) -> str:
    m = re.search(r"UUID: ([0-9a-f-]{36})", output)
    assert m, output[-3000:]
    return m.group(1)


def left(deadline: float) -> float:
    """Seconds until `deadline` (time.monotonic()), at least 1: the timeout of the next wait."""
    return max(deadline - time.monotonic(), 1.0)


def stop(proc: subprocess.Popen) -> None:
    """Kill a `prefect deployment run` a fixture started, if a failed wait left it running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def wait_for_id(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, list[str]]:
    """Read a running `prefect deployment run` until it prints the flow run's UUID."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "UUID:" in line:
            return flow_run_id(line), lines
    raise AssertionError("no flow run UUID printed:\n" + "".join(lines)[-3000:])


def wait_state(api_url: str, run_id: str, done, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with client(api_url) as c:
            fr = c.read_flow_run(run_id)
        if fr.state and done(fr.state):
            return fr
        time.sleep(1)
    raise AssertionError(f"flow run {run_id} not {what} after {timeout:.0f} s (state {fr.state})")


def task_runs(api_url: str, run_id: str):
    with client(api_url) as c:
        return c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))


def task_states(api_url: str, run_id: str) -> dict[str, str]:
    return {tr.name.rsplit("-", 1)[0]: tr.state.name for tr in task_runs(api_url, run_id)}


def state_names(api_url: str, run_id: str, task_run_id=None) -> list[str]:
    with client(api_url) as c:
        states = c.read_task_run_states(task_run_id) if task_run_id else c.read_flow_run_states(run_id)
    return [s.name for s in states]


def all_logs(api_url: str, run_ids: list[str]) -> list:
    """Every log line of the flow runs (the API pages at 200)."""
    out: list = []
    with client(api_url) as c:
        while page := c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=run_ids)), limit=200, offset=len(out)):
            out += page
    return out


def train_rows(run_dir: Path) -> list[dict]:
    return [stable_row(r) for r in read_jsonl(run_dir / "train" / "metrics.jsonl")]


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`kimi serve --port P --no-schedule`, as a background job with (sentinel) secrets in its env."""
    root = tmp_path_factory.mktemp("served")
    port = free_port()
    wandb_dir = root / "wandb"  # the runs' W&B mirror (wandb is a dev dependency), offline: no network here
    wandb_dirs = {k: wandb_dir / k.lower() for k in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR",
                                                     "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")}
    for d in wandb_dirs.values():
        d.mkdir(parents=True)
    env = dict(os.environ, PREFECT_HOME=str(migrated_home(root / "prefect-home")), HF_TOKEN=HF_SENTINEL,
               WANDB_API_KEY=WANDB_SENTINEL, PREFECT_LOGGING_LEVEL="INFO", WANDB_MODE="offline", WANDB_SILENT="true",
               **QUICK_POLLS, **{k: str(d) for k, d in wandb_dirs.items()})
    env.pop("PREFECT_API_URL", None)
    log = open(root / "serve.log", "w")
    kimi = [str(BIN / "kimi")] if (BIN / "kimi").exists() else [sys.executable, "-m", "kimi_pipeline.cli"]
    proc = subprocess.Popen([*kimi, "serve", "--port", str(port), "--no-schedule"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_background_job, cwd=root)
    api_url = f"http://127.0.0.1:{port}/api"
    info = {"proc": proc, "root": root, "port": port, "api_url": api_url, "ui_url": f"http://127.0.0.1:{port}",
            "log": root / "serve.log", "env": cli_env(api_url, root / "client-home"), "wandb_dir": wandb_dir}
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (root / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "kimi serve did not start:\n" + (root / "serve.log").read_text()[-3000:]
            if "stop with Ctrl-C or SIGTERM" in (root / "serve.log").read_text():
                with client(api_url) as c, contextlib.suppress(Exception):
                    info["deployment"] = c.read_deployment_by_name("kimi/full")
                    break
            time.sleep(1)
        yield info
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def run_a(served):
    """Run a, the uninterrupted reference: `prefect deployment run kimi/full --watch` on the shortened tiny DAG,
    and a second run with the same parameters triggered while it runs (the deployment's concurrency limit queues
    it; it then finds the caches). Both have finished when this returns, so the deployment is free again."""
    api, env = served["api_url"], served["env"]
    run_dir = served["root"] / "run-a"
    params = {"recipe": "tiny", "overrides": SHORT, "run_dir": str(run_dir)}
    t0 = time.monotonic()
    deadline = t0 + RUN_S
    first = run_deployment(params, env, watch=True)
    try:
        first_id, lines = wait_for_id(first, min(60, left(deadline)))
        wait_state(api, first_id, lambda s: s.is_running(), min(120, left(deadline)), "running")
        second = prefect("deployment", "run", "kimi/full", "--params", json.dumps(params), env=env,
                         timeout=min(120, left(deadline)))
        assert second.returncode == 0, second.stdout + second.stderr
        second_id = flow_run_id(second.stdout)
        out, _ = first.communicate(timeout=left(deadline))
    finally:
        stop(first)
    first_s = time.monotonic() - t0
    assert first.returncode == 0, "".join(lines) + out[-4000:]
    second_run = wait_state(api, second_id, lambda s: s.is_final(), RUN_S, "finished")
    with client(api) as c:
        first_run = c.read_flow_run(first_id)
    return {"id": first_id, "flow_run": first_run, "output": out, "run_dir": run_dir, "seconds": round(first_s, 1),
            "second_id": second_id, "second_run": second_run}


@pytest.fixture(scope="module")
def killed_run(served, run_a):
    """Run c: the shortened run until train, its trainer SIGKILLed after the step-2 checkpoint, before step 4's.
    After run a (its reference), so that the deployment runs nothing else meanwhile. What the run showed before
    the kill (trainer processes, the secrets in their environment, the cluster slot) is recorded for the tests to
    assert."""
    api, env = served["api_url"], served["env"]
    run_dir = served["root"] / "run-c"
    deadline = time.monotonic() + RUN_S
    proc = run_deployment({"recipe": "tiny", "overrides": SHORT, "run_dir": str(run_dir), "until": "train"}, env,
                          watch=True)
    try:
        run_id, _ = wait_for_id(proc, min(60, left(deadline)))
        tracker = run_dir / "train" / "checkpoints" / "latest_checkpointed_iteration.txt"
        while not (tracker.is_file() and tracker.read_text().strip() == "2"):
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise AssertionError(f"run c ended or ran {RUN_S} s without its step-2 checkpoint:\n"
                                     + proc.stdout.read()[-3000:])
            time.sleep(0.2)
        cluster = LocalCluster.load(run_dir)
        trainers = [p for p in cluster.processes() if "ray::PolicyWorker" in " ".join(cmdline(p))]
        assert trainers, "no PolicyWorker process in the run's Ray cluster"
        trainer_secrets = sorted(k for k in ("HF_TOKEN", "WANDB_API_KEY") if k in trainers[0].environ())
        with client(api) as c:
            slots = c.read_global_concurrency_limit_by_name("kimi-cluster-local").active_slots
        for p in trainers:
            p.kill()  # SIGKILL, after the step-2 checkpoint, before step 4's
        killed_at = time.monotonic()
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        stop(proc)
    return {"id": run_id, "run_dir": run_dir, "returncode": proc.returncode, "output": out, "trainers": len(trainers),
            "trainer_secrets": trainer_secrets, "slots": slots,
            "retry_to_done_s": round(time.monotonic() - killed_at, 1)}


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.timeout(SERVE_S + CHECKS_S)
def test_served_deployment_is_the_prefect_yaml_one(served):
    d = served["deployment"]
    assert d.parameters == {"recipe": "tiny", "overrides": [], "run_dir": None, "until": None}
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in d.schedules] == [("0 2 * * *", "UTC", False)]
    assert d.global_concurrency_limit.limit == 1 and d.concurrency_options.collision_strategy.value == "ENQUEUE"
    assert d.entrypoint == "flows.kimi.kimi" and "kimi" in d.tags
    assert [s.active for s in full_deployment(schedule=True).schedules] == [True]  # `kimi serve` default
    with client(served["api_url"]) as c:
        assert c.read_global_concurrency_limit_by_name("kimi-cluster-local").limit == 1
    log = served["log"].read_text()
    assert f"Prefect UI:  http://127.0.0.1:{served['port']}" in log


@pytest.mark.timeout(SERVE_S + RUN_A_S + CHECKS_S)
def test_deployment_run_watch_completes_and_a_queued_second_run_hits_the_caches(served, run_a):
    api, run_dir = served["api_url"], run_a["run_dir"]
    assert "Flow run finished successfully in 'Completed'" in run_a["output"], run_a["output"][-4000:]
    states = task_states(api, run_a["id"])
    for stage in (*STAGES, "eval-step"):
        assert states.get(stage) == "Completed", states

    fr1, fr2 = run_a["flow_run"], run_a["second_run"]
    assert fr2.state.is_completed(), fr2.state
    history = state_names(api, run_a["second_id"])
    assert "AwaitingConcurrencySlot" in history, history  # queued behind the first by concurrency_limit 1
    assert fr2.start_time >= fr1.end_time, (fr1.end_time, fr2.start_time)
    states2 = task_states(api, run_a["second_id"])
    assert {s: states2[s] for s in CACHED} == {s: "Cached" for s in CACHED}, states2
    assert states2["cluster"] == "Completed" and states2["train"] == "Completed"  # live state: never cached

    summary = json.loads((run_dir / "summary.json").read_text())
    assert all(summary["stages"][s]["status"] == "completed" for s in STAGES), summary["stages"]
    assert summary["train"]["steps"] == 4 and len(train_rows(run_dir)) == 4
    assert not (run_dir / "FAILED.md").exists()
    check_summary_contract(run_dir, summary)
    print(f"first run {run_a['seconds']:.0f} s wall; queued second run {fr2.total_run_time.total_seconds():.1f} s "
          "of run time")


def check_summary_contract(run_dir: Path, s: dict) -> None:
    """Every section automation reads, with the keys the issues name, plus the plots summary.md links."""
    assert s["convert"]["verified"] is True and s["convert"]["max_abs_diff"] == 0.0 and s["convert"]["nodes"] == 1
    assert s["cluster"]["nodes"] == 1 and s["cluster"]["address"] and s["cluster"]["cpus"] >= 1
    assert s["train"]["checkpoint"].endswith("iter_0000004")
    assert isinstance(s["train"]["reward_first"], float) and isinstance(s["train"]["reward_last"], float)
    assert [e["step"] for e in s["eval"]] == [0, 2, 4]
    assert set(s["eval"][0]) >= {"avg_at_n", "pass_at_1", "pass_at_n", "maj_at_n"}
    assert s["export"]["dequant_exact"] is True and s["export"]["int4_bytes"] < s["export"]["bf16_bytes"]
    for png in ("reward", "eval", "response_length", "stability"):
        assert (run_dir / "plots" / f"{png}.png").stat().st_size > 1000
    assert "![reward](plots/reward.png)" in (run_dir / "summary.md").read_text()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


# decided at collection, before the served runs are made for it
@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium to load the Prefect UI with: `make browser` "
                    "(part of `make test`) installs Debian's chromium with apt")
@pytest.mark.timeout(SERVE_S + RUN_A_S + 2 * len(UI_BUDGETS_MS) * CHROMIUM_S + CHECKS_S)
def test_prefect_ui_shows_the_flow_run_in_headless_chromium(served, run_a, tmp_path):
    exe = _chromium()
    url = f"{served['ui_url']}/runs/flow-run/{run_a['id']}"
    png = tmp_path / "prefect-ui.png"
    common = [exe, *CHROMIUM_FLAGS]
    for attempt, budget in enumerate(UI_BUDGETS_MS):  # the first load whose page shows every task's logs
        budget_flag = f"--virtual-time-budget={budget}"
        shot = subprocess.run([*common, budget_flag, f"--user-data-dir={tmp_path / f'shot-{attempt}'}",
                               f"--screenshot={png}", url], capture_output=True, text=True, timeout=CHROMIUM_S)
        assert png.is_file() and png.stat().st_size > 20_000, shot.stderr[-2000:]
        dom = subprocess.run([*common, budget_flag, f"--user-data-dir={tmp_path / f'dom-{attempt}'}", "--dump-dom",
                              url], capture_output=True, text=True, timeout=CHROMIUM_S).stdout
        text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
        logged_tasks = set(re.findall(r"\b(download|validate|convert|cluster|train|export)-[0-9a-f]{3}\b", text))
        if logged_tasks == set(STAGES):
            break
    STABLE_COPY.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(png, STABLE_COPY)
    assert "Can't connect to Server API" not in text, text[:2000]
    assert f"Flow Run: {run_a['flow_run'].name}" in text, text[:2000]
    assert "Completed" in text and "Deployment full" in text, text[:2000]
    assert logged_tasks == set(STAGES), (logged_tasks, text[:3000])
    print(f"screenshot {png.stat().st_size} bytes -> {STABLE_COPY}")


@pytest.mark.timeout(SERVE_S + RUN_A_S + KILLED_S + CHECKS_S)
def test_kill_9_of_the_trainer_in_a_served_run_retries_and_resumes_with_identical_metrics(served, run_a, killed_run):
    api, run_id, run_dir = served["api_url"], killed_run["id"], killed_run["run_dir"]
    assert killed_run["trainer_secrets"] == []  # the flow's secrets stay in its process: Ray's never get them
    assert killed_run["returncode"] == 0, killed_run["output"][-4000:]
    assert killed_run["slots"] == 1  # the run held the cluster's slot while training
    train = [tr for tr in task_runs(api, run_id) if tr.name.startswith("train-")]
    assert len(train) == 1 and train[0].state.is_completed()
    history = state_names(api, run_id, train[0].id)
    assert "AwaitingRetry" in history and "Retrying" in history, history
    assert train[0].run_count == 2, train[0].run_count
    logs = all_logs(api, [run_id])
    assert any("a retry resumes from the latest checkpoint" in lg.message for lg in logs)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_same_rows(rows, train_rows(run_a["run_dir"]), resumed_after=2)  # the retry == the uninterrupted run
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["stages"]["train"]["status"] == "completed" and s["train"]["checkpoint"].endswith("iter_0000004")
    print(f"killed {killed_run['trainers']} trainer process(es); retry finished {killed_run['retry_to_done_s']} s "
          "later")


@pytest.mark.timeout(SERVE_S + RUN_A_S + KILLED_S + CHECKS_S)
def test_secrets_never_reach_logs_artifacts_parameters_or_the_run_dir(served, run_a, killed_run):
    """HF_TOKEN and WANDB_API_KEY sentinels, and each run's engine key, appear in none of the places searched."""
    runs = [run_a, killed_run]
    ids = [run_a["id"], killed_run["id"], run_a["second_id"]]
    logs = all_logs(served["api_url"], ids)
    with client(served["api_url"]) as c:
        artifacts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
        params = [c.read_flow_run(i).parameters for i in ids]
    assert len(logs) > 20 and len(artifacts) >= 6  # there is something to search
    assert "launch-plan" in {a.key for a in artifacts}  # the train task shows where its actors go
    texts = {"logs": "\n".join(lg.message for lg in logs),
             "artifacts": "\n".join(f"{a.key} {a.description} {json.dumps(a.data, default=str)}" for a in artifacts),
             "parameters": json.dumps(params),
             "serve output": served["log"].read_text(errors="replace")}
    for top in [r["run_dir"] for r in runs] + [served["wandb_dir"]]:  # + every file the runs' W&B mirror wrote
        for p in top.rglob("*"):
            if p.is_file() and not p.is_symlink():
                texts[str(p)] = p.read_bytes().decode("latin-1")
    assert any(k.endswith("summary.json") for k in texts) and any(k.endswith("summary.md") for k in texts)
    wandb_runs = [k for k, text in texts.items() if k.endswith(".wandb") and "reward_mean" in text]
    assert len(wandb_runs) >= len(runs), "the runs' W&B mirror wrote no run: the WANDB_API_KEY check proves nothing"
    leaks = [where for where, text in texts.items() if HF_SENTINEL in text or WANDB_SENTINEL in text]
    assert leaks == []
    # each run's engine key: in its own 0600 DIR/engine.key and nowhere else (Ray logs included)
    keys = {r["run_dir"] / "engine.key": (r["run_dir"] / "engine.key").read_text() for r in runs}
    assert all(k.stat().st_mode & 0o777 == 0o600 for k in keys) and len(set(keys.values())) == len(runs)
    key_leaks = [where for where, text in texts.items() if where not in map(str, keys)
                 and any(key in text for key in keys.values())]
    assert key_leaks == []
    print(f"searched {len(texts)} places ({len(logs)} log lines, {len(artifacts)} artifacts): no secret")


@pytest.mark.ends_shared  # last in this file in every order: the other tests share this server
@pytest.mark.timeout(SERVE_S + 90 + 30 + CHECKS_S)
def test_kimi_serve_stops_cleanly_on_sigterm(served):
    """`kimi serve` stops on SIGTERM with everything it started, the flow runs' leftovers included: so it stops the
    module's server after the runs the other tests made on it (`ends_shared`), rather than a fresh one."""
    proc = served["proc"]
    assert proc.poll() is None
    family = psutil.Process(proc.pid).children(recursive=True)  # the server (own session), flow-run leftovers
    assert any("prefect" in " ".join(cmd) and "server" in cmd for cmd in map(cmdline, family))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=90)
    seconds = time.monotonic() - t0
    assert rc == 0, served["log"].read_text()[-3000:]
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", served["port"])) != 0  # the server is gone
    deadline = time.monotonic() + 30
    while (left := [p for p in family if not gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [cmdline(p) for p in left]
    print(f"kimi serve stopped {seconds:.1f} s after SIGTERM")


def test_a_sigkilled_server_owner_leaves_no_server_behind(tmp_path):
    """kill -9 can't be handled, so the server (own session, for Ctrl-C ordering) dies with its owner."""
    code = ("import sys, time; from pathlib import Path; from flows.serve import start_server; "
            "s = start_server(0, home=Path(sys.argv[1])); print(s.port, s.process.pid, flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(migrated_home(tmp_path / "home"))], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    try:
        port, server_pid = map(int, owner.stdout.readline().split())
        owner.kill()
        owner.wait(timeout=10)
        with contextlib.suppress(psutil.NoSuchProcess):  # it may be gone before we look: that is the claim
            server = psutil.Process(server_pid)
            server.wait(timeout=30)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        owner.kill()
        with contextlib.suppress(psutil.NoSuchProcess, UnboundLocalError):
            if server.is_running():
                server.kill()


# ------------------------------------------------------------------------------------- the work-pool variant


def test_prefect_yaml_work_pool_worker_failure_notices_and_sigterm(tmp_path):
    """infra/prefect/setup.sh (work pool, cluster limit, failure Automation, `prefect deploy` of prefect.yaml)
    against a real server; worker.sh started as a background job runs a flow; a failing run is reported
    by the flow's hook and by the server-side Automation; SIGTERM stops the worker."""
    server = start_server(port=0, home=migrated_home(tmp_path / "server-home"))
    worker = None
    try:
        with webhook_receiver() as (hook_url, received):
            env = cli_env(server.api_url, tmp_path / "client-home")
            env.update(KIMI_NOTIFY_WEBHOOK=hook_url, KIMI_NOTIFY_STATES="Failed Crashed")
            setup = subprocess.run(["bash", str(ROOT / "infra" / "prefect" / "setup.sh")], env=env,
                                   capture_output=True, text=True, timeout=300, cwd=tmp_path)
            assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
            with client(server.api_url) as c:
                d = c.read_deployment_by_name("kimi/full")
                assert c.read_global_concurrency_limit_by_name("kimi-cluster-local").limit == 1
                automation = c.read_automations_by_name("kimi-run-failed")
                c.pause_deployment(d.id)  # no 02:00 run mid-test
            assert d.work_pool_name == "kimi-process" and d.entrypoint == "flows/kimi.py:kimi"
            assert d.parameters == {"recipe": "tiny", "overrides": [], "run_dir": None, "until": None}
            schedules = [(x.schedule.cron, x.schedule.timezone, x.active) for x in d.schedules]
            assert schedules == [("0 2 * * *", "UTC", True)]
            assert d.global_concurrency_limit.limit == 1 and d.concurrency_options.collision_strategy.value == "ENQUEUE"
            assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                     {"directory": "{{ $KIMI_PROJECT_DIR }}"}}]
            assert len(automation) == 1 and automation[0].trigger.expect == {"prefect.flow-run.Failed",
                                                                             "prefect.flow-run.Crashed"}

            # `cmd &` from a script leaves SIGINT ignored in the child (what Prefect's worker stops on) ...
            probe = subprocess.run(["bash", "-c", f"{sys.executable} -c 'import signal; print(signal.getsignal("
                                    "signal.SIGINT) == signal.SIG_IGN)' & wait"], capture_output=True, text=True,
                                   timeout=60)
            assert probe.stdout.strip() == "True", probe.stdout + probe.stderr
            # ... worker.sh started exactly that way still stops on SIGTERM
            pidfile, log = tmp_path / "worker.pid", tmp_path / "worker.log"
            # (polling the pool every 2 s, not Prefect's 10: each of the two runs below starts sooner, nothing else)
            subprocess.run(["bash", "-c", f"bash {ROOT}/infra/prefect/worker.sh --name ci-worker > {log} 2>&1 & "
                            f"echo $! > {pidfile}"], env={**env, "PREFECT_WORKER_QUERY_SECONDS": "2"}, check=True,
                           timeout=30, cwd=tmp_path)
            worker = psutil.Process(int(pidfile.read_text()))

            def deployment_run(params: dict) -> subprocess.CompletedProcess:
                return subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "kimi/full", "--watch",
                                       "--params", json.dumps(params)], env=env, capture_output=True, text=True,
                                      timeout=300, cwd="/")

            run_dir = tmp_path / "run-w"
            done = deployment_run({"until": "download", "run_dir": str(run_dir)})
            assert done.returncode == 0, done.stdout[-3000:] + log.read_text()[-3000:]
            with client(server.api_url) as c:
                fr = c.read_flow_run(flow_run_id(done.stdout))
            assert fr.state.is_completed() and fr.work_pool_name == "kimi-process"
            assert (run_dir / "download" / "manifest.json").is_file()
            assert received == []

            bad = deployment_run({"recipe": "no-such-recipe", "run_dir": str(tmp_path / "run-bad")})
            assert bad.returncode == 1 and "Flow run finished in state 'Failed'" in bad.stdout, bad.stdout[-3000:]
            bad_id = flow_run_id(bad.stdout)
            t0 = time.monotonic()
            wait_for(received, 2, 90)
            by_source = {n.get("source", "hook"): n for n in received}
            assert set(by_source) == {"hook", "prefect-automation"}, received
            assert by_source["hook"]["flow_run_id"] == bad_id and "no-such-recipe" in by_source["hook"]["text"]
            assert by_source["prefect-automation"] == {**by_source["prefect-automation"], "flow_run_id": bad_id,
                                                       "state": "Failed"}
            print(f"failure notices: hook + automation within {time.monotonic() - t0:.1f} s of the failed run")

            t0 = time.monotonic()
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
            print(f"worker stopped {time.monotonic() - t0:.1f} s after SIGTERM")
            assert "Worker 'ci-worker' stopped!" in log.read_text(), log.read_text()[-2000:]
    finally:
        if worker is not None and worker.is_running():
            worker.kill()
        server.stop()
