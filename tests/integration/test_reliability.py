"""Faults a nightly run meets, at the level where each is decided (the others live next to their stage:
test_train kill -9, test_hub_download corrupt shard re-fetch, test_convert interrupted conversion,
test_validate malformed rows; flow level: test_deployment kill -9 through a served deployment run):

- a corrupt model shard fails the flow at `download`, not retried, naming the file; the failure hook
  writes DIR/FAILED.md and posts the webhook (secrets redacted); a fixed re-run clears FAILED.md; a flow run on a
  run dir another run holds fails at once naming the holder and writes nothing there;
- `kimi run` stopped by SIGTERM or killed -9 mid-conversion leaves nothing it started running, and summary.json
  says the conversion did not finish;
- a Ray node lost during `train`: the stage fails clearly (the actors it lost), and once the node is
  back the retry resumes from the last checkpoint and completes;
- the Ray head lost during `kimi run`'s training: the run fails at once naming the head (summary, FAILED.md), leaves
  nothing of the cluster, and a re-run resumes from the last checkpoint;
- `kimi run` itself killed -9 while it trains: nothing it started is left (Prefect server, run guard, the cluster with
  its engines and trainers), training is marked interrupted, and a re-run resumes to the uninterrupted run's metrics;
- the W&B mirror of the metrics (real wandb, offline) writes no secret into any file;
- no downloaded file is ever unpickled: none of our code can (static), and pickles planted in the
  model directory are never loaded on the download → validate → convert path or by the model loaders.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.common import ROOT, tiny_overrides, train_recipe
from support.processes import cmdline
from support.webhook_server import webhook_receiver

from kimi_pipeline.cluster.procs import gone

sys.path.insert(0, str(ROOT))

HF_SENTINEL = "hf_ReliabilitySentinel0123456789ab"
# on PYTHONPATH, arms `support.save_gate` in every process of a `kimi run` (the Ray actors inherit the driver's sys.path)
SITE_HOOKS = Path(__file__).resolve().parents[1] / "support" / "site"


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def webhook():
    with webhook_receiver() as (url, received):
        yield url, received


# --------------------------------------------------------------------------- corrupt shard + failure hook


@pytest.mark.slow
def test_corrupt_shard_fails_the_flow_naming_it_and_the_failure_hook_reports(tmp_path, tiny_copy, webhook,
                                                                             monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from support.prefect_home import migrated_test_harness

    from flows.kimi import kimi
    from flows.notify import FAILED_FILE

    url, received = webhook
    monkeypatch.setenv("KIMI_NOTIFY_WEBHOOK", url)
    monkeypatch.setenv("HF_TOKEN", HF_SENTINEL)
    index = json.loads((tiny_copy / "model" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = tiny_copy / "model" / sorted(set(index.values()))[-1]
    flip_byte(shard)  # inside the tensor data: only the sha256 in the shipped MANIFEST can tell
    run_dir = tmp_path / "run"
    with migrated_test_harness():
        state = kimi(recipe="tiny", overrides=tiny_overrides(tiny_copy), run_dir=str(run_dir), return_state=True)
        with get_client(sync_client=True) as c:
            this_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            runs = c.read_task_runs(flow_run_filter=this_run)
        failed = (run_dir / FAILED_FILE).read_text()
        summary = json.loads((run_dir / "summary.json").read_text())
        flip_byte(shard)  # restored: the same run dir completes and the stale FAILED.md goes away
        again = kimi(recipe="tiny", overrides=tiny_overrides(tiny_copy), run_dir=str(run_dir), until="download",
                     return_state=True)
        notes_before = len(received)
        held = tmp_path / "held"
        holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_DIR, str(held)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            refused = kimi(recipe="tiny", overrides=tiny_overrides(tiny_copy), run_dir=str(held), until="download",
                           return_state=True)
        finally:
            holder.kill()
            holder.wait(timeout=30)
    # one run per run directory: a flow run on a directory another run holds fails at once naming the holder, and
    # writes nothing there (no summary, no FAILED.md in the other run's directory)
    assert refused.is_failed() and f"pid {holder.pid}" in str(refused.message) and "flow run other-run" in str(
        refused.message), refused.message
    assert sorted(p.name for p in held.iterdir()) == [".run.lock"]
    assert len(received) == notes_before + 1 and received[-1]["run_dir"] is None
    assert state.is_failed()
    # not retried: a corrupt local file is a permanent error
    assert [(t.name.rsplit("-", 1)[0], t.state.name, t.run_count) for t in runs] == [("download", "Failed", 1)]
    assert summary["stages"]["download"]["status"] == "failed"
    assert str(shard) in summary["stages"]["download"]["error"] and "sha256" in summary["stages"]["download"]["error"]

    assert "download" in failed and shard.name in failed and "Re-running with the same parameters" in failed
    assert notes_before == 1, received
    note = received[0]
    assert note["state"] == "Failed" and note["failed_stages"] == ["download"] and note["run_dir"] == str(run_dir)
    assert shard.name in note["text"] and note["flow_run_id"] == str(state.state_details.flow_run_id)
    assert HF_SENTINEL not in json.dumps(note) and HF_SENTINEL not in failed
    assert again.is_completed() and not (run_dir / FAILED_FILE).exists() and notes_before == 1


HOLD_RUN_DIR = """
import sys, time
from kimi_pipeline.util import run_lock
run_lock.take(sys.argv[1], "other-run")
print("held", flush=True)
time.sleep(600)
"""


def test_failure_report_redacts_secrets(monkeypatch):
    from flows.notify import redact

    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-abcdef123")
    text = redact("401 for hf_abcdefghijklmnopqrstuvwx with key wandb-key-abcdef123")
    assert text == "401 for <hf-token> with key <WANDB_API_KEY>"


WANDB_OWNER = """
import sys
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.report.metrics_log import MetricsLog, open_wandb
recipe = load_recipe("tiny")
run = open_wandb(None, "tiny-secrets", recipe.model_dump(mode="json", exclude={"hub": {"token"}}))  # as rl/loop.py
assert run is not None, "no W&B run"
log = MetricsLog(sys.argv[1], wandb_run=run)
for step in (1, 2):
    log.log({"step": step, "reward_mean": 0.25 * step, "wandbProbeMetric": 7.0})
log.close()
"""


def test_wandb_run_writes_no_secret(tmp_path):
    """The train stage's W&B mirror (open_wandb + MetricsLog; wandb from the dev extra, offline: no network
    here) with WANDB_API_KEY / HF_TOKEN sentinels in its environment: the run is written, and no file it
    wrote holds either (HOME, TMPDIR and every W&B dir point into tmp_path, and all of tmp_path is searched)."""
    import os
    import subprocess

    import wandb  # noqa: F401 - a dev dependency: without it this check would prove nothing

    wandb_key, hf_token = "wandbSentinelKey-5d0c2e71b9", "hf_WandbSentinel0123456789abcdef"
    dirs = {name: tmp_path / name.lower() for name in ("HOME", "TMPDIR", "WANDB_DIR", "WANDB_CONFIG_DIR",
                                                       "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")}
    for d in dirs.values():
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "XDG_"))}
    env.update({k: str(v) for k, v in dirs.items()}, WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_API_KEY=wandb_key, HF_TOKEN=hf_token)
    out = subprocess.run([sys.executable, "-c", WANDB_OWNER, str(tmp_path / "metrics.jsonl")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    runs = [p for p in files if p.suffix == ".wandb"]
    assert runs and all(b"wandbProbeMetric" in p.read_bytes() for p in runs), files  # the run logged the rows
    leaks = [str(p) for p in files if wandb_key.encode() in p.read_bytes() or hf_token.encode() in p.read_bytes()]
    leaks += [stream for stream, text in (("stdout", out.stdout), ("stderr", out.stderr))
              if wandb_key in text or hf_token in text]
    assert leaks == [], leaks
    print(f"W&B wrote {len(files)} files: no secret")


# --------------------------------------------------------------------------- a Ray node lost during train


@pytest.mark.slow
def test_ray_node_lost_during_train_fails_clearly_and_the_retry_resumes(tmp_path_factory):
    """Simulated 2-node cluster (head + one extra raylet, 2 CPUs each; the trainer bundles are spread one per
    node, so the extra node always hosts trainer rank 1 and its node's engine). After the step-2 checkpoint the
    extra node dies (raylet and its workers, SIGKILL): the TrainingError names an actor it hosted; the
    infrastructure brings a node back; the retry resumes at step 2."""

    import ray
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.cluster.lifecycle import embedded_layout, stop_cluster
    from kimi_pipeline.cluster.local import LocalCluster
    from kimi_pipeline.report.metrics_log import read_jsonl
    from kimi_pipeline.rl.ray_errors import TrainingError
    from kimi_pipeline.stages import CLUSTER, CONVERT, DOWNLOAD, TRAIN, VALIDATE, prepare_run

    root = Path(tempfile_dir())
    tiny = root / "tiny"
    shutil.copytree(ROOT / "data" / "tiny", tiny)
    r = train_recipe(tiny, ["cluster.nodes=2", "cluster.cpus_per_node=2"])
    run = prepare_run(r, root / "run")
    run_stage(DOWNLOAD, stages.download.run, r, run)
    run_stage(VALIDATE, stages.validate.run, r, run)
    run_stage(CONVERT, stages.convert.run, r, run)
    section = run_stage(CLUSTER, stages.cluster.run, r, run)
    lost: dict = {}
    try:
        assert section["nodes"] == 2 and section["cpus"] == 4
        extra = next(n["node_id"] for n in section["node_list"] if not n["is_head"])
        cluster = LocalCluster.load(run)

        def lose_node(row: dict) -> None:
            if row["step"] != 2:
                return
            raylet = next(p for p in cluster.processes() if any(a == f"--node_id={extra}" for a in cmdline(p))
                          and p.name() == "raylet")
            victims = [raylet, *raylet.children(recursive=True)]
            titles = [" ".join(cmdline(p)) for p in victims]
            lost["actors"] = sorted(c for c in ("PolicyWorker", "EmbeddedEngine") for t in titles if f"ray::{c}" in t)
            for p in victims:
                p.kill()
            lost["processes"], lost["t"] = len(victims), time.monotonic()

        with pytest.raises(TrainingError) as failure:
            run_stage(TRAIN, stages.train.run, r, run, evaluate=lambda step, urls: {}, on_step=lose_node)
        detect_s = time.monotonic() - lost["t"]
        assert lost["actors"], "no actor ran on the lost node"
        msg = str(failure.value)
        assert "a retry resumes from the latest checkpoint" in msg, msg
        # whichever surfaces first (the dead rank, its peer's failed collective, the rollout engine the lost node
        # also hosted), the error names an actor that was on the lost node
        assert any(actor in msg for actor in lost["actors"]), (lost["actors"], msg)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["stages"]["train"]["status"] == "failed"
        before = read_jsonl(run / "train" / "metrics.jsonl")
        assert [x["step"] for x in before] == [1, 2]

        # the node comes back (KubeRay / the autoscaler / an operator would do this), then the retry
        _, workers = embedded_layout(r.cluster)
        cluster._start_worker(workers[0], 2, 120)
        t0 = time.monotonic()
        run_stage(TRAIN, stages.train.run, r, run, evaluate=lambda step, urls: {})
        retry_s = time.monotonic() - t0
        rows = read_jsonl(run / "train" / "metrics.jsonl")
        assert [x["step"] for x in rows] == [1, 2, 3, 4]
        assert rows[:2] == before  # resumed after step 2, not restarted
        assert json.loads((run / "summary.json").read_text())["stages"]["train"]["status"] == "completed"
        print(f"lost node hosted {lost['actors']} ({lost['processes']} processes killed); failure raised "
              f"{detect_s:.1f} s later as {failure.type.__name__}; retry from step 2 took {retry_s:.1f} s")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_cluster(run)
        shutil.rmtree(root, ignore_errors=True)


def tempfile_dir() -> str:
    """Short: Ray's socket paths must fit under 107 bytes."""
    import tempfile

    return tempfile.mkdtemp(prefix="kr-node-", dir="/tmp")


# --------------------------------------------------------------------------- no pickle of downloaded files

PICKLE_CALLS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("torch", "load"),
                ("cloudpickle", "load"), ("cloudpickle", "loads"), ("joblib", "load"), ("dill", "load"),
                ("dill", "loads"), ("pd", "read_pickle"), ("pandas", "read_pickle"), ("numpy", "load"),
                ("np", "load"), ("torch.serialization", "load"), ("_pickle", "loads")}
OUR_LOADERS = {"EngineModel"}  # engine/model.py: reads *.safetensors only (iter_safetensors)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _calls():
    files = [p for d in ("kimi_pipeline", "tasks", "flows") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Call, ast.ImportFrom)):
                yield path, node


def test_no_code_path_calls_an_unpickler():
    """Static: nothing in the pipeline calls an unpickler (torch.load, pickle, numpy allow_pickle, ...)."""
    problems = []
    for path, node in _calls():
        if isinstance(node, ast.ImportFrom):
            if node.module in ("pickle", "_pickle", "cloudpickle", "dill"):
                problems.append(f"{path}:{node.lineno} imports from {node.module}")
            continue
        name = _dotted(node.func)
        parts = tuple(name.rsplit(".", 1)) if "." in name else ("", name)
        if parts in PICKLE_CALLS:
            allow = {k.arg: k.value for k in node.keywords}.get("allow_pickle")
            if parts[0] in ("np", "numpy") and not (isinstance(allow, ast.Constant) and allow.value is True):
                continue  # numpy refuses pickles by default
            problems.append(f"{path}:{node.lineno} calls {name}")
    assert problems == [], "\n".join(problems)


def test_transformers_model_loaders_are_told_safetensors_only():
    """Without use_safetensors=True, transformers falls back to unpickling pytorch_model.bin when a
    directory has no safetensors (weights_only, but still a pickle of a downloaded file)."""
    problems = []
    for path, node in _calls():
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        receiver, _, attr = name.rpartition(".")
        if attr != "from_pretrained" or "Tokenizer" in receiver or receiver in OUR_LOADERS:
            continue
        flag = {k.arg: k.value for k in node.keywords}.get("use_safetensors")
        if not (isinstance(flag, ast.Constant) and flag.value is True):
            problems.append(f"{path}:{node.lineno} {name}(...) without use_safetensors=True")
    assert problems == [], "\n".join(problems)


class Payload:
    """Unpickling this creates a marker file: proof that something loaded the pickle."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow
def test_planted_pickles_in_the_model_dir_are_never_loaded(tmp_path, tiny_copy, monkeypatch):
    """Dynamic: a model directory that also ships pickles (as many hub repos do) next to its safetensors.
    Unpickling any of them creates a marker file, in this process or in the conversion's torchrun ranks;
    in this process every unpickler entry point is also trapped."""
    import torch
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.data.tiny_assets import write_manifests
    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.model.hf_model import load_hf_model
    from kimi_pipeline.model.tokenizer import load_tokenizer
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.stages import CONVERT, DOWNLOAD, VALIDATE, prepare_run

    marker = tmp_path / "UNPICKLED"
    planted = ["pytorch_model.bin", "training_args.bin", "optimizer.pt", "rng_state.pth", "tokenizer.pkl"]
    for name in planted:
        (tiny_copy / "model" / name).write_bytes(pickle.dumps(Payload(marker)))
    write_manifests(tiny_copy)  # they are part of the "downloaded" model, checksummed like the rest
    calls: list[str] = []

    def trap(name, real):
        def wrapper(*args, **kwargs):
            calls.append(f"{name}{args[:1]!r}")
            raise AssertionError(f"{name} called on the pipeline path")
        return wrapper

    for mod, attr in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, attr, trap(f"{mod.__name__}.{attr}", getattr(mod, attr)))

    class TrapUnpickler(pickle.Unpickler):  # a class (libraries subclass it at import), trapped on load()
        def load(self):
            calls.append("pickle.Unpickler.load")
            raise AssertionError("pickle.Unpickler.load called on the pipeline path")

    monkeypatch.setattr(pickle, "Unpickler", TrapUnpickler)

    r = load_recipe("tiny", tiny_overrides(tiny_copy) + ["convert.nodes=1", "convert.pp=1", "convert.ep=1"])
    run = prepare_run(r, tmp_path / "run")
    section = run_stage(DOWNLOAD, stages.download.run, r, run)
    manifest = json.loads((run / "download" / "manifest.json").read_text())
    assert set(planted) <= set(manifest["model"]["files"]), "the planted files are part of the download"
    run_stage(VALIDATE, stages.validate.run, r, run)
    model_dir = Path(manifest["model"]["root"])
    load_tokenizer(model_dir)
    EngineModel.from_pretrained(model_dir)  # the rollout engine's and eval's loader
    load_hf_model(model_dir)  # transformers' loader (conversion verify, export verify)
    # a torchrun rank + logits verification against transformers
    converted = run_stage(CONVERT, stages.convert.run, r, run)
    assert converted["verified"] is True and section["model"]["safetensors_files"] >= 1
    assert calls == [] and not marker.exists()
    # the trap and the payload work: loading one planted file the way a careless loader would
    with pytest.raises(AssertionError, match="torch.load called"):
        torch.load(model_dir / "pytorch_model.bin")
    monkeypatch.undo()
    pickle.loads((model_dir / "training_args.bin").read_bytes())
    assert marker.exists()


# --------------------------------------------------------------------------- the run's own process dies


AGENT = "kimi_pipeline.weightjobs.agent"  # a conversion node's agent (torchrun's, with a store bound to its address)


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory) -> Path:
    """One Prefect home for the kill tests, its database already migrated (support/prefect_home.py)."""
    from support.prefect_home import migrated_home

    return migrated_home(tmp_path_factory.mktemp("prefect-home"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_kimi_run_stopped_during_convert_leaves_nothing_it_started_and_says_so(sig, tmp_path, tiny_copy,
                                                                               prefect_home):
    """`kimi run` signalled while its conversion runs: its temporary Prefect API server, the conversion's agents and
    ranks and the run guard are all gone afterwards (SIGTERM, SIGINT: the run unwinds; SIGKILL: the run guard stops
    them), and summary.json says the conversion did not finish; after the kill -9, a re-run of the directory takes
    it over and completes."""
    run_dir = tmp_path / "run"
    cmd, env = _kimi_run(run_dir, "convert", tiny_overrides(tiny_copy), prefect_home)
    seen = _Started()
    with _in_background(cmd, env, tmp_path / "kimi-run.log") as proc:
        owner = psutil.Process(proc.pid)
        names = seen.names
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            seen.look(owner)
            summary = _summary_or_empty(run_dir)
            if summary.get("stages", {}).get("convert", {}).get("status") == "running" and any(
                    AGENT in c for c in names.values()):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the conversion never ran: {(tmp_path / 'kimi-run.log').read_text()[-3000:]}")
        time.sleep(1.0)
        seen.look(owner)
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=180)
    out = (tmp_path / "kimi-run.log").read_text()
    assert any("uvicorn" in c and "prefect.server" in c for c in names.values()), names  # the test saw the server
    assert any("run_guard" in c for c in names.values()) and any(AGENT in c
                                                                 for c in names.values()), names
    left = seen.left_running(90)  # SIGKILL: the guard notices within its poll and gives each a grace period
    assert not left, f"left running after {sig.name}: {left}\n{out[-3000:]}"
    convert = json.loads((run_dir / "summary.json").read_text())["stages"]["convert"]
    assert convert["status"] == "failed", convert
    if sig == signal.SIGTERM:
        assert code == 130 and "run stopped (stopped by SIGTERM" in out, out[-3000:]
    elif sig == signal.SIGINT:  # Ctrl-C
        assert code == 130 and "run stopped (stopped by SIGINT: re-run with the same --run-dir" in out, out[-3000:]
    else:
        assert code == -signal.SIGKILL
        assert convert.get("interrupted") is True and f"pid {proc.pid}" in convert["error"], convert
        assert "re-run with the same run directory" in convert["error"]
        # the re-run of the same directory takes over the dead run's lock (naming it) and converts afresh
        again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        out = again.stdout + again.stderr
        assert again.returncode == 0, out[-3000:]
        assert f"pid {proc.pid}" in out and "taking it over" in out, out[-3000:]
        stages = json.loads((run_dir / "summary.json").read_text())["stages"]
        assert stages["convert"]["status"] == "completed" and "interrupted" not in stages["convert"], stages


class _Started:
    """The processes a run started (its descendants, and any others `add`ed), each named while it lives."""

    def __init__(self) -> None:
        self.processes: dict[int, psutil.Process] = {}
        self.names: dict[int, str] = {}

    def look(self, owner: psutil.Process) -> None:
        """What `owner` has started so far. Renamed on every look: a child caught between fork and exec still shows
        its parent's command line (seen on a loaded host: the run guard named as `kimi run`, the test then missed
        it)."""
        self.add(owner.children(recursive=True))

    def add(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            self.processes.setdefault(p.pid, p)
            if line := cmdline(p):
                self.names[p.pid] = " ".join(line)[:200]

    def left_running(self, within_s: float) -> dict[int, str]:
        """Those still running after up to `within_s` seconds of waiting for them to go (empty: all gone)."""
        deadline = time.monotonic() + within_s
        while True:
            left = {pid: self.names.get(pid, "?") for pid, p in self.processes.items() if not gone(p)}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)


def _arm_save_gate(gate: Path, step: int) -> None:
    """Arm `support.save_gate` for `step`'s checkpoint, what an earlier run's writers left in it cleared."""
    for f in gate.iterdir():
        f.unlink()
    (gate / "arm").write_text(str(step))


def _held_writers(gate: Path, proc: subprocess.Popen, log: Path, each_poll=lambda: None) -> list[psutil.Process]:
    """The processes `support.save_gate` holds in its armed step's checkpoint write, once one holds; disarmed then
    (the held ones stay held). Fails with the run's log should `proc` end first."""
    deadline = time.monotonic() + 600
    while not (held := list(gate.glob("held-*"))):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        each_poll()
        time.sleep(0.2)
    (gate / "arm").unlink()
    return [psutil.Process(int(f.name.removeprefix("held-"))) for f in held]


def _kimi_run(run_dir: Path, until: str, overrides: list[str], prefect_home: Path) -> tuple[list[str], dict[str, str]]:
    """`kimi run` of the tiny recipe on `run_dir` up to `until` with this module's Prefect home: (command, env)."""
    from support.learning import kimi_command

    cmd = [*kimi_command(), "run", "--run-dir", str(run_dir), "--until", until]
    return cmd + [a for o in overrides for a in ("--set", o)], {**os.environ, "PREFECT_HOME": str(prefect_home),
                                                                 "COLUMNS": "200"}


@contextlib.contextmanager
def _in_background(cmd: list[str], env: dict[str, str], log_path: Path):
    """`cmd` in its own session, its output in `log_path`; killed on the way out if it still runs."""
    with open(log_path, "w") as log:
        # SIGINT as a terminal's Ctrl-C finds it: a shell starts background jobs (a suite run with `&`, its workers
        # and so this test) with SIGINT ignored, and a child inherits that
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def _summary_or_empty(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_kimi_run_killed_then_its_ray_head_lost_during_train_each_leaves_nothing_and_re_runs_resume(
        tmp_path, tiny_copy, prefect_home):
    """Issue 40 item 7, two faults of `kimi run`'s training on one run directory, each met by the next re-run (one
    download, validation and conversion for both: the faults are in training):

    1. `kimi run` killed -9 while it trains (step 3's row written, step 4's checkpoint half-written, the last whole
       one at step 2): nothing it started is left (its Prefect API server and run guard, the Ray cluster with its
       engines and trainer actors, the checkpoint's writer), and summary.json marks training interrupted.
    2. The re-run takes the dead run's lock over and resumes from the step-2 checkpoint: the step 3 it computes again
       is the step 3 the killed run had computed uninterrupted, every non-timing key equal. Then, while it writes
       step 4's checkpoint, its Ray head (GCS server and head raylet, SIGKILL) dies: the run fails without retrying
       what a retry cannot fix; the error, summary.json and FAILED.md name the head; nothing of the cluster is left.
    3. The next re-run brings a cluster up, resumes from step 2 again and completes: rows 1-2 as first written, step 3
       again equal to the uninterrupted one, then step 4; FAILED.md gone.

    Each fault lands at a point of the run's own progress, not after a wait: `support.save_gate` (armed in the run's
    processes by `support/site/sitecustomize.py`) holds the writer of step 4's checkpoint until the fault. Polling
    for step 3's row instead once let a loaded box finish step 4's save before the kill (CI, 2026-11-29)."""
    from support.common import REPRODUCIBLE, TRAIN_SET, stable_row
    from support.save_gate import GATE_ENV

    from kimi_pipeline.cluster.local import LocalCluster
    from kimi_pipeline.model.checkpoint_dirs import latest_step
    from kimi_pipeline.report.metrics_log import read_jsonl

    run_dir = tmp_path / "run"
    cmd, env = _kimi_run(run_dir, "train", tiny_overrides(tiny_copy) + TRAIN_SET + REPRODUCIBLE, prefect_home)
    gate = tmp_path / "save-gate"
    gate.mkdir()
    env = {**env, GATE_ENV: str(gate), "PYTHONPATH": os.pathsep.join(
        p for p in (str(SITE_HOOKS), env.get("PYTHONPATH")) if p)}
    metrics = run_dir / "train" / "metrics.jsonl"
    checkpoints = run_dir / "train" / "checkpoints"

    # 1. kill -9 of `kimi run` while step 4's checkpoint is being written (step 3's row is written before step 4)
    seen = _Started()
    _arm_save_gate(gate, 4)
    with _in_background(cmd, env, tmp_path / "kimi-run-1.log") as proc:
        owner = psutil.Process(proc.pid)
        names = seen.names
        writers = _held_writers(gate, proc, tmp_path / "kimi-run-1.log", lambda: seen.look(owner))
        ray_processes = LocalCluster.load(run_dir).processes()
        seen.add([*ray_processes, *writers])  # named while they live: the actors go as soon as Ray sees their owner,
        os.kill(proc.pid, signal.SIGKILL)  # the driver, gone
        assert proc.wait(timeout=60) == -signal.SIGKILL
    killed = read_jsonl(metrics)
    assert [r["step"] for r in killed] == [1, 2, 3], killed
    assert latest_step(checkpoints) == 2, sorted(p.name for p in checkpoints.iterdir())
    assert any("uvicorn" in c and "prefect.server" in c for c in names.values()), names  # the test saw the server
    assert any("run_guard" in c for c in names.values()), names
    assert any("ray::PolicyWorker" in names[p.pid] for p in ray_processes), [names[p.pid] for p in ray_processes]
    left = seen.left_running(120)  # the guard and the cluster's watchdog notice within their polls, then stop
    assert not left, f"left running after kill -9 of `kimi run`: {left}"
    train = json.loads((run_dir / "summary.json").read_text())["stages"]["train"]
    assert train["status"] == "failed" and train.get("interrupted") is True, train
    assert f"pid {proc.pid}" in train["error"] and "re-run with the same run directory" in train["error"], train

    # 2. the re-run resumes; while it writes step 4's checkpoint the Ray head dies
    log_2 = tmp_path / "kimi-run-2.log"
    _arm_save_gate(gate, 4)
    with _in_background(cmd, env, log_2) as proc_2:
        _held_writers(gate, proc_2, log_2)
        assert "step 3/4" in log_2.read_text(), log_2.read_text()[-3000:]  # this run's own step 3
        cluster = LocalCluster.load(run_dir)
        head = [p for p in cluster.processes() if p.name() in ("gcs_server", "raylet")]
        assert sorted(p.name() for p in head) == ["gcs_server", "raylet"], head
        for p in head:
            p.kill()
        killed_at = time.monotonic()
        code = proc_2.wait(timeout=300)
        fail_s = time.monotonic() - killed_at  # from the kill to the run's exit, not to the end of the checks below
    out = log_2.read_text()
    assert f"pid {proc.pid}" in out and "taking it over" in out, out[-3000:]
    resumed = read_jsonl(metrics)
    assert [r["step"] for r in resumed][:3] == [1, 2, 3], resumed
    assert resumed[:2] == killed[:2]  # kept, timings and all: resumed from the step-2 checkpoint, not restarted
    assert stable_row(resumed[2]) == stable_row(killed[2])  # step 3 again == step 3 as the uninterrupted run had it
    address = cluster.address
    assert code == 1, out[-3000:]
    named = f"the Ray head at {address} stopped answering"
    assert named in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stages"]["train"]["status"] == "failed" and named in summary["stages"]["train"]["error"]
    assert named in (run_dir / "FAILED.md").read_text()
    left = LocalCluster.load(run_dir).processes()
    assert left == [], [" ".join(cmdline(p)) for p in left]

    # 3. the next re-run completes from the step-2 checkpoint
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    assert rows[:2] == killed[:2]
    assert stable_row(rows[2]) == stable_row(killed[2])
    stages = json.loads((run_dir / "summary.json").read_text())["stages"]
    assert stages["train"]["status"] == "completed" and "interrupted" not in stages["train"], stages
    assert not (run_dir / "FAILED.md").exists()
    print(f"kill -9 during step 4's save: nothing left; head killed during the re-run's: the run failed {fail_s:.1f} s "
          "later naming it; the next re-run resumed from step 2 to the uninterrupted metrics")
