"""GRPO training stage on a real local Ray cluster: megatron policy actor(s) + an embedded HTTP engine.

Covers: metrics / checkpoints / summary section; engine logprobs after weight sync equal the trainer's
(the TIS ratio); `kimi eval` of the step-4 checkpoint and of the HF directory; `kimi train --quiet`; kill -9
of the trainer at a random step, and kill -9 while megatron writes a checkpoint, then a retry resumes from
the last complete checkpoint and ends with exactly the metrics and eval rows of an uninterrupted run (routing
replay on); the only engine killed in each phase of its work (rollout, decode, weight sync, eval) survived
with the same metrics; EP2 across 2 trainer actors. Tests kill and inspect only their own processes and segments.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from support import engine_gate
from support.common import (
    REPRODUCIBLE,
    TIMING,
    TRAIN_SET,
    assert_eval_agrees_with_its_problems,
    assert_same_rows,
    stable_row,
    tiny_overrides,
    train_recipe,
)
from support.learning import read_summary
from support.processes import cmdline
from support.save_gate import GATE_ENV

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def save_gate(tmp_path_factory) -> Path:
    """The directory that arms `support.save_gate` in this module's Ray workers (see the mid-save kill test)."""
    return tmp_path_factory.mktemp("save_gate")


@pytest.fixture(scope="module")
def engine_gate_dir(tmp_path_factory) -> Path:
    """The directory that arms `support.engine_gate` in this module's Ray workers (see the engine-kill test)."""
    return tmp_path_factory.mktemp("engine_gate")


class _Listening:
    """Every listening TCP socket of this process and its descendants (Ray's processes, the conversion's agents
    and ranks, the actors), sampled from /proc every 0.25 s: most live only while their part of the run does."""

    def __init__(self) -> None:
        from support.sockets import listeners, with_descendants

        self.seen: set = set()
        self._stop = threading.Event()
        self._sample = lambda: self.seen.update(listeners(with_descendants([os.getpid()])))
        self._thread = threading.Thread(target=self._run, name="listening-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def stop(self) -> set:
        if not self._stop.is_set():
            self._sample()
            self._stop.set()
            self._thread.join(30)
        return self.seen


@pytest.fixture(scope="module")
def listening():
    """Where the module's tiny run listens, from before its conversion to the end of its training (`trained`)."""
    sampler = _Listening()
    yield sampler
    sampler.stop()


@pytest.fixture(scope="module")
def ray_local(save_gate, engine_gate_dir, listening):
    import ray

    from kimi_pipeline.cluster.env import use_loopback_ray
    from kimi_pipeline.cluster.lifecycle import export_driver_env

    export_driver_env("token")  # as the cluster stage does; also refreshes Ray's cached config
    use_loopback_ray(True)  # a one-node cluster, as the cluster stage starts it: every Ray process on 127.0.0.1
    os.environ[GATE_ENV] = str(save_gate)  # the raylet, and so every worker, inherits it
    os.environ[engine_gate.GATE_ENV] = str(engine_gate_dir)
    # every worker runs the gates' hook, so every worker (plain tasks too, not only the stage's actors, whose
    # env carries our sys.path) needs tests/ on its path to import it
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "support.gates.install",
                          "env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    yield
    ray.shutdown()
    use_loopback_ray(False)
    os.environ.pop(GATE_ENV, None)
    os.environ.pop(engine_gate.GATE_ENV, None)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, listening) -> tuple[Path, Path]:
    """A run dir after download → validate → convert (1 rank: the conversion has its own tests)."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.stages import CONVERT, DOWNLOAD, VALIDATE, prepared_run

    root = tmp_path_factory.mktemp("train")
    tiny = root / "tiny"
    shutil.copytree(Path(__file__).resolve().parents[2] / "data" / "tiny", tiny)
    r = train_recipe(tiny)
    with prepared_run(r, root / "base") as run:  # let go before the tests copy it and run `kimi train` in the copies
        run_stage(DOWNLOAD, stages.download.run, r, run)
        run_stage(VALIDATE, stages.validate.run, r, run)
        run_stage(CONVERT, stages.convert.run, r, run)
    return tiny, run


def _copy_run(base: Path, dst: Path) -> Path:
    shutil.copytree(base, dst, symlinks=True)
    return dst


def _rows(run: Path) -> list[dict]:
    from kimi_pipeline.report.metrics_log import read_jsonl

    return read_jsonl(run / "train" / "metrics.jsonl")


# the resume tests' recipe: reproducible, and routing replay on (the rollout's expert ids drive the trainer's routers)
RESUME_SET = REPRODUCIBLE + ["rollout.routing_replay=true"]


SAVE_ROLLOUTS = ["rollout.save_data=true"]


def _kimi_train(run: Path, sets: list[str], quiet: bool = False) -> tuple[dict, str]:
    """`kimi train` in a child process on this module's Ray cluster: (the train section it prints, its terminal
    output, stdout and stderr)."""
    import ray

    args = [sys.executable, "-m", "kimi_pipeline.cli", "train", "--run-dir", str(run),
            "--ray-address", ray.get_runtime_context().gcs_address] + (["--quiet"] if quiet else [])
    for item in sets:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("{"):]), out.stdout + out.stderr


@pytest.fixture(scope="module")
def trained(prepared, ray_local, tmp_path_factory) -> tuple[Path, Path, dict, str]:
    """The module's one uninterrupted run, of the resume tests' recipe (evals at 0, 2, 4), its rollouts saved
    (train/rollouts): read by the metrics, eval, `--quiet` and replay tests, and what every interrupted run must end
    as (`uninterrupted`). Run as `kimi train` (its terminal output is the `--quiet` test's loud side). (tiny data
    dir, run dir, the train section, the terminal output.)"""
    tiny, base = prepared
    run = _copy_run(base, tmp_path_factory.mktemp("uninterrupted") / "run")
    section, out = _kimi_train(run, tiny_overrides(tiny) + TRAIN_SET + RESUME_SET + SAVE_ROLLOUTS)
    return tiny, run, section, out


def test_train_records_metrics_checkpoints_and_evals(trained):
    from kimi_pipeline.report.summary import RunSummary

    tiny, run, section, _ = trained
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward_mean", "solved_group_fraction", "response_len_mean", "clip_fraction", "entropy", "tis_mean",
                "grad_norm", "lr", "rollout_tokens_per_s", "train_tokens_per_s", "step_seconds"):
        assert key in rows[0], key
    # weight sync: the engine's sampling logprobs equal the trainer's on the same tokens (TIS ratio ~ 1), although
    # colocated the engine released its weights every step and took them back through the sync (rl/handoff.py)
    for r in rows:
        assert abs(r["tis_min"] - 1) < 1e-3 and abs(r["tis_max"] - 1) < 1e-3, r
        # the same agreement as the train/inference mismatch every row records (rl/grpo.py: mismatch_metrics)
        assert r["mismatch_abs_logp_mean"] <= r["mismatch_abs_logp_max"] < 1e-3 and 0 <= r["mismatch_k3"] < 1e-6, r
        # routing replay on: the routers take the engine's experts, so there is no agreement to measure
        assert "routing_agreement" not in r, r
        assert r["handoff_seconds"] > 0, r
    summary = RunSummary(run).read()
    assert summary["stages"]["train"]["status"] == "completed"
    assert summary["train"]["steps"] == 4 and section["checkpoint"].endswith("iter_0000004")
    assert (Path(section["checkpoint_dir"]) / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert [e["step"] for e in summary["eval"]] == [0, 2, 4]
    assert set(summary["eval"][0]) >= {"avg_at_n", "pass_at_1", "pass_at_n", "maj_at_n"}
    assert (run / "eval" / "eval.jsonl").is_file() and (run / "eval" / "step_0000004.json").is_file()
    assert list((run / "train" / "tensorboard").glob("events.out.tfevents.*")), "TensorBoard logger"


def test_the_run_listens_on_loopback_only(trained, listening):
    """Issue 40 item 4: every socket the tiny run's processes listened on, from the conversion to the end of its
    training, is on loopback: the conversion's torchrun agent (its rendezvous store) and rank, Ray's GCS, raylet,
    workers and agents, the trainer's rendezvous store and gloo pairs, the engine's HTTP server."""
    seen = listening.stop()
    commands = " ".join(x.command for x in seen)
    for what in ("kimi_pipeline.weightjobs.agent", "kimi_pipeline.weightjobs.rank", "gcs_server", "raylet",
                 "ray::PolicyWorker", "ray::EmbeddedEngine"):
        assert what in commands, (what, sorted({x.command[:80] for x in seen}))
    print(f"{len(seen)} listening sockets of {len({x.pid for x in seen})} processes during the run")
    assert sorted({(x.address, x.port, x.command[:80]) for x in seen if not x.loopback}) == []


def test_kimi_eval_checkpoint_reproduces_the_in_training_eval(trained, tmp_path):
    """`kimi eval --checkpoint iter_0000004` (torch_dist) gives the numbers the run recorded at step 4."""
    tiny, run, _, _ = trained
    recorded = {e["step"]: e for e in json.loads((run / "summary.json").read_text())["eval"]}
    args = [sys.executable, "-m", "kimi_pipeline.cli", "eval", "--checkpoint",
            str(run / "train" / "checkpoints" / "iter_0000004"), "--model-dir", str(tiny / "model"),
            "--data", str(tiny / "aime-tiny.jsonl"), "--out", str(tmp_path / "eval")]
    for item in TRAIN_SET + RESUME_SET:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])
    for key in ("avg_at_n", "pass_at_1", "pass_at_n", "maj_at_n"):
        assert result[key] == pytest.approx(recorded[4][key]), key
    (table,) = (tmp_path / "eval").rglob("step_0000004.json")  # the per-problem table this eval wrote
    assert_eval_agrees_with_its_problems(result, table)
    # an HF directory evaluates too (the shipped base policy = step 0 without the fake-INT4 experts): its scores
    # are what its per-problem table adds up to, and the table agrees with the responses it recorded
    hf = subprocess.run(args[:5] + [str(tiny / "model")] + args[6:], capture_output=True, text=True, timeout=300)
    assert hf.returncode == 0, hf.stderr[-2000:]
    base = json.loads(hf.stdout[hf.stdout.index("{"):])
    assert base["step"] == 0 and base["problems"] == result["problems"] == 96
    (table,) = (tmp_path / "eval").rglob("step_0000000.json")
    assert_eval_agrees_with_its_problems(base, table)


def _progress_lines(text: str, steps: int) -> tuple[list[str], list[str]]:
    """The rollout and eval progress lines in a terminal output (the formats the learning test reads)."""
    return (re.findall(rf"^step +\d+/{steps}  reward .* ETA \S+$", text, re.M),
            re.findall(r"^eval at step \d+: avg@2 .*$", text, re.M))


def test_kimi_train_quiet_drops_the_progress_lines_not_the_result(prepared, trained, tmp_path):
    """`kimi train` prints one progress line per rollout and per eval on stderr (the module's uninterrupted run: 4
    rollouts, evals at 0, 2, 4); with `--quiet` none, while the stage still trains, evaluates and prints its section
    (one rollout on this module's Ray cluster)."""
    tiny, base = prepared
    assert [len(lines) for lines in _progress_lines(trained[3], 4)] == [4, 3], trained[3][-3000:]
    run = _copy_run(base, tmp_path / "quiet")
    section, out = _kimi_train(run, tiny_overrides(tiny) + TRAIN_SET + ["rollout.num_rollout=1", "eval.interval=1"],
                               quiet=True)
    assert section["steps"] == 1 and section["checkpoint"].endswith("iter_0000001"), section
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1]
    # replay off (the tiny recipe measures routing agreement): the trainer's routers pick the engine's experts
    assert rows[0]["routing_agreement"] >= 0.99, rows[0]
    assert [e["step"] for e in json.loads((run / "summary.json").read_text())["eval"]] == [0, 1]  # evaluated
    assert _progress_lines(out, 1) == ([], []), out[-3000:]


def _eval_rows(run: Path) -> list[dict]:
    """The run's eval rows (summary.json) without their wall-clock `seconds`."""
    return [{k: v for k, v in e.items() if k != "seconds"} for e in read_summary(run)["eval"]]


@pytest.fixture(scope="module")
def uninterrupted_run(trained) -> Path:
    return trained[1]


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run) -> tuple[list[dict], list[dict]]:
    """The metrics and eval rows of the uninterrupted run."""
    rows, evals = [stable_row(x) for x in _rows(uninterrupted_run)], _eval_rows(uninterrupted_run)
    assert [e["step"] for e in evals] == [0, 2, 4]
    return rows, evals


def _retry_resumes(r, crashed: Path, uninterrupted, caplog, resumed_after: int = 2) -> None:
    """The stage retry resumes from the step-`resumed_after` checkpoint and ends with the metrics and eval rows
    of the uninterrupted run (each eval row once, the resumed ones included)."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.stages import TRAIN

    assert json.loads((crashed / "summary.json").read_text())["stages"]["train"]["status"] == "failed"
    with caplog.at_level("INFO", logger="kimi_pipeline.rl.loop"):
        run_stage(TRAIN, stages.train.run, r, crashed)  # the retry
    assert f"at step {resumed_after}" in " ".join(m for m in caplog.messages if m.startswith("resumed from")), caplog.text
    expected_rows, expected_evals = uninterrupted
    assert_same_rows([stable_row(x) for x in _rows(crashed)], expected_rows, resumed_after=resumed_after)
    assert _eval_rows(crashed) == expected_evals


def test_kill_9_then_retry_resumes_with_identical_metrics(prepared, ray_local, uninterrupted, tmp_path, caplog):
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.rl.ray_errors import TrainingError
    from kimi_pipeline.stages import TRAIN

    tiny, base = prepared
    r = train_recipe(tiny, RESUME_SET)
    crashed = _copy_run(base, tmp_path / "crashed")
    kill_at = random.Random().choice([3, 4])  # after the step-2 checkpoint; step 4 kills before its save lands
    print(f"killing the trainer after step {kill_at - 1} (during step {kill_at})")

    def kill_trainer(row: dict) -> None:
        if row["step"] == kill_at - 1:
            for pid in _trainer_pids():
                os.kill(pid, signal.SIGKILL)

    with pytest.raises(TrainingError, match="resumes from the latest checkpoint"):
        run_stage(TRAIN, stages.train.run, r, crashed, on_step=kill_trainer)
    _retry_resumes(r, crashed, uninterrupted, caplog)


def test_kill_9_during_a_checkpoint_save_resumes_from_the_previous_checkpoint(prepared, ray_local, uninterrupted,
                                                                              save_gate, tmp_path, caplog):
    """A real SIGKILL while megatron writes the step-4 checkpoint (a shard file on disk, its metadata, the
    rename into place and the tracker not): the half-written `iter_0000004.tmp` is never read, the retry resumes
    from step 2, replaces the leftover and ends as the uninterrupted run did."""
    import threading

    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.rl.ray_errors import TrainingError
    from kimi_pipeline.stages import TRAIN

    tiny, base = prepared
    r = train_recipe(tiny, RESUME_SET)
    crashed = _copy_run(base, tmp_path / "crashed")
    ckpts = crashed / "train" / "checkpoints"
    (save_gate / "arm").write_text("4")
    held: list[str] = []
    stop = threading.Event()

    def kill_when_held() -> None:  # waits on the gate's file, not on time (the test's timeout bounds a hang)
        while not list(save_gate.glob("held-*")):
            if stop.wait(0.05):  # the stage ended without reaching the gate: kill nothing
                return
        held.extend(p.read_text() for p in save_gate.glob("held-*"))
        for pid in _trainer_pids():  # the trainer and any writer process it forked
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_held, daemon=True)
    killer.start()
    try:
        with pytest.raises(TrainingError, match="resumes from the latest checkpoint"):
            run_stage(TRAIN, stages.train.run, r, crashed)
    finally:
        (save_gate / "arm").unlink()
        stop.set()
        killer.join(60)
        for p in save_gate.glob("held-*"):
            p.unlink()
    tmp = ckpts / "iter_0000004.tmp"
    assert held and all(Path(h).parent == tmp for h in held), held
    assert list(tmp.glob("*.distcp")) and not (tmp / ".metadata").exists()  # killed mid-write
    assert not (ckpts / "iter_0000004").exists()
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    _retry_resumes(r, crashed, uninterrupted, caplog)
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (ckpts / "iter_0000004" / ".metadata").is_file() and not tmp.exists()


def test_a_full_disk_during_a_save_fails_permanently_and_leaves_no_partial_checkpoint(prepared, ray_local, save_gate,
                                                                                      tmp_path):
    """Issue 40 item 6: the disk fills up while megatron writes the step-2 checkpoint (ENOSPC at its shard's fsync,
    `support.save_gate`). The stage fails at once with a permanent error naming the checkpoint and the full disk,
    not three retries that redo the rollouts to fail again; the partial iter_0000002.tmp is gone and no tracker
    claims a checkpoint."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.errors import PermanentError
    from kimi_pipeline.stages import TRAIN

    tiny, base = prepared
    run = _copy_run(base, tmp_path / "run")
    (save_gate / "enospc").write_text("2")
    try:
        with pytest.raises(PermanentError, match=r"CheckpointSpaceError .*iter_0000002: the disk filled up during the "
                                                 r"save .*No space left on device.*iter_0000002\.tmp was removed"):
            run_stage(TRAIN, stages.train.run, train_recipe(tiny, RESUME_SET + ["rollout.num_rollout=2"]), run,
                      evaluate=lambda step, urls: {})
    finally:
        (save_gate / "enospc").unlink()
    ckpts = run / "train" / "checkpoints"
    assert not list(ckpts.glob("iter_*")) and not (ckpts / "latest_checkpointed_iteration.txt").exists()
    assert json.loads((run / "summary.json").read_text())["stages"]["train"]["status"] == "failed"


def test_a_corrupt_latest_checkpoint_is_skipped_for_the_previous_one(trained, ray_local, uninterrupted, tmp_path,
                                                                     caplog):
    """Issue 40 item 6: one flipped byte in a shard of the step-4 checkpoint (same size). The resume checks it against
    the manifest the save wrote (sizes, CRC-32), warns naming both checkpoints, resumes from step 2 and ends with the
    uninterrupted run's metrics and evals. Without the check megatron loads the damaged tensor as it is."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.model.checkpoint_manifest import MANIFEST
    from kimi_pipeline.stages import TRAIN

    tiny, done, _, _ = trained
    run = _copy_run(done, tmp_path / "run")
    ckpts = run / "train" / "checkpoints"
    assert (ckpts / "iter_0000004" / MANIFEST).is_file() and (ckpts / "iter_0000002" / MANIFEST).is_file()
    shard = ckpts / "iter_0000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="kimi_pipeline.rl.trainer_group"), \
            caplog.at_level("INFO", logger="kimi_pipeline.rl.loop"):
        run_stage(TRAIN, stages.train.run, train_recipe(tiny, RESUME_SET + SAVE_ROLLOUTS), run)
    assert (f"{ckpts / 'iter_0000004'} does not verify (__0_0.distcp: CRC-32 differs from the save's (corrupt)); "
            f"resuming from {ckpts / 'iter_0000002'} instead") in caplog.text, caplog.text
    assert "at step 2" in " ".join(m for m in caplog.messages if m.startswith("resumed from"))
    expected_rows, expected_evals = uninterrupted
    assert_same_rows([stable_row(x) for x in _rows(run)], expected_rows, resumed_after=2)
    assert _eval_rows(run) == expected_evals


RESTART_KEYS = ("engine_restarts", "retried_requests")


def _kill_held_engines(gate: Path, stop: threading.Event, killed: list[str]) -> None:
    """SIGKILL each engine `support.engine_gate` holds, recording the point it was held at."""
    while not stop.is_set():
        for held in gate.glob("held-*"):
            pid = int(held.name.split("-")[1])
            point = (gate / f"point-{pid}").read_text()
            os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(psutil.NoSuchProcess):  # its raylet may reap it before we look
                psutil.Process(pid).wait(30)
            held.unlink()
            killed.append(point)
        stop.wait(0.02)


def _arm(gate: Path, point: str, count: int = 1) -> None:
    tmp = gate / "arm.tmp"
    tmp.write_text(f"{point} {count}")
    tmp.rename(gate / "arm")


def _without(row: dict, keys) -> dict:
    return {k: v for k, v in row.items() if k not in keys}


def test_an_engine_killed_in_every_phase_is_restarted_and_the_run_ends_as_uninterrupted(
        prepared, ray_local, engine_gate_dir, uninterrupted, tmp_path):
    """The only engine is SIGKILLed four times in one run, each where its work is held for the kill
    (`support.engine_gate`, no timing): step 2's rollout before any answer, the step-2 eval mid-decode, step 3's
    weight sync at a bucket, step 4's rollout mid-decode (random decode steps). Each time the rollout manager
    restarts it in its placement, the trainer syncs it to the policy and what it dropped runs again (the rollout
    from the same prompts, the eval with its seed, the sync whole): the run ends with the uninterrupted run's metrics
    and evals, and each row counts the restarts of its step (the eval's in the next row) and the requests sent
    again. Issue 40 item 2 on the way: the run dir holds the metrics of an earlier attempt that died before its first
    checkpoint, its last line torn mid-write; a fresh start begins metrics.jsonl afresh (it used to append to them)."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.eval.record import EvalSections, run_eval_step
    from kimi_pipeline.hub.fetch import model_root
    from kimi_pipeline.stages import TRAIN

    tiny, base = prepared
    run = _copy_run(base, tmp_path / "run")
    (run / "train").mkdir()
    (run / "train" / "metrics.jsonl").write_text('{"step": 1, "reward_mean": -1.0}\n{"step": 2, "reward_me')
    recipe = train_recipe(tiny, RESUME_SET + ["rollout.max_engine_restarts=4"])
    gate, rng = engine_gate_dir, random.Random()
    decode_steps = [rng.randint(1, 12), rng.randint(1, 12)]
    print(f"mid-decode kills at decode steps {decode_steps}")
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_held_engines, args=(gate, stop, killed), daemon=True)

    def after(row: dict) -> None:  # step 1 has no eval: the engine's next batch is step 2's rollout
        if row["step"] == 1:
            _arm(gate, "generate")
        elif row["step"] == 3:
            _arm(gate, "decode", decode_steps[1])

    evals: list[int] = []

    def evaluate(step: int, urls: list[str]) -> dict:  # called again for an eval the engines dropped
        evals.append(step)
        if evals.count(2) == 1:
            _arm(gate, "decode", decode_steps[0])
        result = run_eval_step(EvalSections.of(recipe), run, step, urls, model_root(run))
        if step == 2:  # the next weights an engine loads: step 3's sync (the eval's own restart has synced)
            _arm(gate, "weights")
        return result

    killer.start()
    try:
        run_stage(TRAIN, stages.train.run, recipe, run, on_step=after, evaluate=evaluate)
    finally:
        stop.set()
        killer.join(60)
        (gate / "arm").unlink(missing_ok=True)
    assert killed == ["generate 1", f"decode {decode_steps[0]}", "weights 1", f"decode {decode_steps[1]}"]
    assert evals == [0, 2, 2, 4]
    rows = _rows(run)
    assert [(r["engine_restarts"], r["retried_requests"] > 0) for r in rows] == \
        [(0.0, False), (1.0, True), (2.0, False), (1.0, True)]
    expected_rows, expected_evals = uninterrupted
    assert_same_rows([_without(stable_row(x), RESTART_KEYS) for x in rows],
                     [_without(x, RESTART_KEYS) for x in expected_rows], resumed_after=0)
    assert _eval_rows(run) == expected_evals


def test_an_engine_past_max_engine_restarts_fails_the_stage_retryably_naming_it(prepared, ray_local,
                                                                               engine_gate_dir, tmp_path):
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.rl.ray_errors import TrainingError
    from kimi_pipeline.stages import TRAIN

    tiny, base = prepared
    run = _copy_run(base, tmp_path / "run")
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_held_engines, args=(engine_gate_dir, stop, killed), daemon=True)
    _arm(engine_gate_dir, "generate")  # no eval: the engine's first batch is step 1's rollout
    killer.start()
    try:
        with pytest.raises(TrainingError, match=r"rollout engine 0 .*rollout.max_engine_restarts=0"):
            run_stage(TRAIN, stages.train.run, train_recipe(tiny, RESUME_SET + ["rollout.max_engine_restarts=0"]),
                      run, evaluate=lambda step, urls: {})
    finally:
        stop.set()
        killer.join(60)
        (engine_gate_dir / "arm").unlink(missing_ok=True)
    assert killed == ["generate 1"]


def test_saved_rollouts_replayed_without_engines_give_the_recorded_metrics(prepared, ray_local, uninterrupted_run):
    """`rollout.save_data` wrote one safetensors/JSON pair per step; `--replay-rollouts` trains on them with no engine
    and gives the recording run's metrics (loss, grad norm, KL, TIS ... every key both rows have, timings aside),
    recorded in the run dir's replay/ and as summary.json's `replay` stage, beside training's."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.report.metrics_log import read_jsonl
    from kimi_pipeline.stages import TRAIN

    tiny, _ = prepared
    saved = uninterrupted_run / "train" / "rollouts"
    assert sorted(p.name for p in saved.iterdir()) == sorted(f"step_{i:07d}.{ext}" for i in range(1, 5)
                                                             for ext in ("json", "safetensors"))
    section = run_stage(TRAIN, stages.train.run, train_recipe(tiny, RESUME_SET), uninterrupted_run, replay=saved,
                        record_as="replay")
    recorded, replayed = _rows(uninterrupted_run), read_jsonl(uninterrupted_run / "replay" / "metrics.jsonl")
    assert [r["step"] for r in replayed] == [1, 2, 3, 4]
    for got, want in zip(replayed, recorded):
        common = (set(got) & set(want)) - TIMING
        assert {"loss", "grad_norm", "tis_mean", "reward_mean", "global_batch_size"} <= common
        assert {k: got[k] for k in common} == {k: want[k] for k in common}, got["step"]
        assert not {k for k in got if k.startswith("sync")}  # no engine took weights
    summary = read_summary(uninterrupted_run)
    assert summary["stages"]["replay"]["status"] == summary["stages"]["train"]["status"] == "completed"
    assert section["checkpoint_step"] == 4 and (uninterrupted_run / "replay" / "checkpoints").is_dir()


def test_rollout_only_generates_and_scores_without_training(prepared, ray_local, uninterrupted_run, tmp_path):
    """`--rollout-only`: engines, no trainer; rows of rollout metrics, no checkpoint; its first rollout draws the
    training run's first prompts (same stream, same seed). The samples are not the training run's: its engines
    serve the weights the trainer synced to them (fake-INT4 experts under QAT, as here), these the checkpoint as
    loaded (measured: log-probs of equal responses up to 0.027 apart)."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.report.metrics_log import read_jsonl
    from kimi_pipeline.rl.rollout_data import load_rollout
    from kimi_pipeline.stages import TRAIN

    tiny, base = prepared
    run = _copy_run(base, tmp_path / "run")
    run_stage(TRAIN, stages.train.run, train_recipe(tiny, RESUME_SET + SAVE_ROLLOUTS + ["rollout.num_rollout=2"]), run,
              rollout_only=True, record_as="rollout_only")
    rows = read_jsonl(run / "rollout-only" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all("reward_mean" in r and "loss" not in r for r in rows)
    assert not (run / "rollout-only" / "checkpoints").exists() and not (run / "train" / "metrics.jsonl").exists()
    (mine, metrics), (theirs, _) = (load_rollout(d, 1) for d in (run / "rollout-only" / "rollouts",
                                                                 uninterrupted_run / "train" / "rollouts"))
    assert [s.prompt_ids for s in mine] == [s.prompt_ids for s in theirs]
    assert metrics["reward_mean"] == rows[0]["reward_mean"] and metrics["samples"] == len(mine)


def _trainer_pids() -> list[int]:
    """This test's trainer actors only: `ray.init` in `ray_local` started the raylet as our child, so the
    PolicyWorker processes of our cluster are our descendants; a `kimi run` beside the test is never touched."""
    return [p.pid for p in psutil.Process().children(recursive=True)
            if any("ray::PolicyWorker" in part for part in cmdline(p))]


def test_ep2_across_two_trainer_actors(prepared, ray_local, engine_gate_dir, tmp_path):
    """Also: the engine killed while step 2's sync hands it the bucket. Rank 0's post fails mid-sync; it drains the
    sync's collectives with rank 1 before raising (raised at once, rank 1 would wait in the last barrier forever),
    both ranks drop their updater, the engine restarts and the sync runs again whole."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.stages import TRAIN

    tiny, base = prepared
    run = _copy_run(base, tmp_path / "ep2")
    r = train_recipe(tiny, ["parallel.ep=2", "cluster.gpus_per_node=2", "rollout.num_rollout=2", "eval.interval=2"])
    from kimi_pipeline.weight_sync import shm

    trainers: set[int] = set()
    segments: list[list[str]] = []
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_held_engines, args=(engine_gate_dir, stop, killed), daemon=True)

    def note_trainers(row: dict) -> None:  # while the run is live: its trainers and the segments they own
        trainers.update(_trainer_pids())
        segments.append([p.name for pid in trainers for p in shm.shm_dir().glob(f"{shm.PREFIX}{pid}-*")])
        if row["step"] == 1:
            _arm(engine_gate_dir, "weights")

    killer.start()
    try:
        section = run_stage(TRAIN, stages.train.run, r, run, evaluate=lambda step, urls: {}, on_step=note_trainers)
    finally:
        stop.set()
        killer.join(60)
        (engine_gate_dir / "arm").unlink(missing_ok=True)
    assert killed == ["weights 1"]
    rows = _rows(run)
    assert [x["engine_restarts"] for x in rows] == [0.0, 1.0]
    m = r.model
    routed_bytes = (m.num_layers - m.first_k_dense) * m.num_experts * 3 * m.moe_ffn_hidden_size * m.hidden_size * 4
    assert [x["step"] for x in rows] == [1, 2] and section["steps"] == 2
    assert all(x["optimizer_steps"] == -(-(x["samples"] - x["samples_trimmed"]) // x["global_batch_size"]) for x in rows)
    # one engine on this host: the first of its ranks hands it each bucket through its segment (a new one for the
    # updater built after the failed sync); the trainers removed them (ours only: named after the owner's pid)
    assert len(trainers) == 2 and [len(x) for x in segments] == [1, 1] and segments[0] != segments[1], segments
    assert not [p for pid in trainers for p in shm.shm_dir().glob(f"{shm.PREFIX}{pid}-*")]
    for x in rows:
        assert abs(x["tis_min"] - 1) < 1e-3 and abs(x["tis_max"] - 1) < 1e-3, x
        # issue 14 item 9: each of the 2 DP ranks computed logprobs and gradients for its half only
        assert x["train_samples"] == (x["samples"] - x["samples_trimmed"]) / 2, x
        # colocated: every rank assembles every bucket (one here) with one EP all-gather of the experts it lacks,
        # between the two barriers around the buckets (issue 39 item 1)
        assert x["sync_chunks"] == 1.0 and x["sync_collectives"] == 3.0, x
        assert x["sync_received_bytes"] == routed_bytes / 2, x


def test_a_permanent_error_inside_an_actor_is_not_retried(ray_local):
    """Issue 14 item 10: Ray wraps an actor's exception; a PermanentError (say, an engine that cannot load the
    model) used to become a retryable TrainingError. Lost actors and engines stay retryable."""
    import ray

    from kimi_pipeline.engine.client import EngineBadRequest, EngineRequestError
    from kimi_pipeline.errors import PermanentError
    from kimi_pipeline.rl.ray_errors import TrainingError, stage_error

    @ray.remote
    def launch_engine(err):
        raise err

    for err, kind in ((PermanentError("model dir has no config.json"), PermanentError),
                      (ConnectionError("node went away"), TrainingError)):
        with pytest.raises(ray.exceptions.RayError) as info:
            ray.get(launch_engine.remote(err))
        got = stage_error(info.value)
        assert isinstance(got, kind) and (kind is PermanentError) == (not isinstance(got, TrainingError))
        assert str(err) in str(got)
    assert isinstance(stage_error(EngineBadRequest("HTTP 400")), PermanentError)
    assert isinstance(stage_error(EngineRequestError("connection refused")), TrainingError)

    # the rollout manager is an actor that calls engine actors: their errors arrive wrapped twice
    @ray.remote
    class Manager:
        def start(self, err):
            return ray.get(launch_engine.remote(err))

        def generate(self):
            raise EngineRequestError("engine 0 at 127.0.0.1:1: connection refused")

    m = Manager.remote()
    with pytest.raises(ray.exceptions.RayError) as info:
        ray.get(m.start.remote(PermanentError("model dir has no config.json")))
    got = stage_error(info.value)
    assert isinstance(got, PermanentError) and "no config.json" in str(got)
    with pytest.raises(ray.exceptions.RayError) as info:
        ray.get(m.generate.remote())
    got = stage_error(info.value)
    assert isinstance(got, TrainingError) and "rollout engine failed" in str(got) and "connection refused" in str(got)

    # a lost actor is named: Ray gives its class only on a later line of the error
    @ray.remote
    class Doomed:
        def die(self):
            os._exit(1)

    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(Doomed.remote().die.remote())
    got = stage_error(info.value)
    assert isinstance(got, TrainingError) and "[actor " in str(got) and "Doomed (pid " in str(got), got
    # ... and so is an engine that only an HTTP error names, by the driver's URL → engine map
    engines = {"http://10.0.0.2:3000": "rollout engine 0 (EmbeddedEngine actor)",
               "http://10.0.0.2:30001": "rollout engine 1 (EmbeddedEngine actor)"}
    got = str(stage_error(EngineRequestError("http://10.0.0.2:30001/generate: ReadError: connection reset"), engines))
    assert "rollout engine 1 (EmbeddedEngine actor)" in got and "engine 0" not in got, got


def test_health_rules_stop_the_real_loop_at_their_step_and_keep_bad_weights_out_of_the_checkpoints(prepared, ray_local,
                                                                                                      tmp_path):
    """Issue 43 item 2, faults injected into the real loop. A loss that overflows (entropy bonus 1e38: the loss is
    -inf, the gradient norm inf) stops step 1 before its optimizer step: no checkpoint at all. A mismatch bound
    below what any engine meets (|Δ log p| max > 1e-9 for 2 steps) stops step 2 before its checkpoint and names
    step 1's. Re-run with that rule off, as the stop says, the run resumes from step 1's checkpoint and the collapse
    rule (window 1, any drop below the best) stops at the first step whose reward falls, naming the checkpoint
    before it; truncation (warn above 0) only warns. Each stop lands in summary.json's train section."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.model.checkpoint_dirs import saved_steps
    from kimi_pipeline.rl.health_rules import OK, STOP, WARN, HealthStop
    from kimi_pipeline.stages import TRAIN

    tiny, base = prepared
    # an eval at step 0 only (the runs stop first); a checkpoint every step
    quick = ["rollout.num_rollout=8", "eval.interval=8", "checkpoint.save_interval=1"]

    run = _copy_run(base, tmp_path / "overflow")
    with pytest.raises(HealthStop) as stop:
        run_stage(TRAIN, stages.train.run, train_recipe(tiny, quick + ["grpo.entropy_coef=1e38"]), run)
    assert stop.value.rule == "nonfinite" and stop.value.step == 1
    assert re.search(r"gradient norm is (inf|nan)", str(stop.value)), stop.value
    assert stop.value.resume is None and saved_steps(run / "train" / "checkpoints") == []
    assert [(r["step"], r["health_nonfinite"]) for r in _rows(run)] == [(1, STOP)]
    assert read_summary(run)["train"]["health"]["stop"]["rule"] == "nonfinite"

    run = _copy_run(base, tmp_path / "rules")
    ckpts = run / "train" / "checkpoints"
    mismatch = "health.mismatch={metric: mismatch_abs_logp_max, max: 1.0e-9, steps: 2}"
    rules = quick + ["health.truncation={max_fraction: 0.0}", "health.collapse=off"]
    with pytest.raises(HealthStop) as stop:
        run_stage(TRAIN, stages.train.run, train_recipe(tiny, rules + [mismatch]), run)
    rows = _rows(run)
    assert all(r["mismatch_abs_logp_max"] > 1e-9 for r in rows)
    assert [r["health_mismatch"] for r in rows] == [WARN, STOP] and stop.value.step == 2
    assert stop.value.resume == ckpts / "iter_0000001" and saved_steps(ckpts) == [1]
    assert f"resume from {ckpts / 'iter_0000001'}" in str(stop.value) and "health.mismatch=off" in str(stop.value)
    assert read_summary(run)["train"]["health"]["stop"] == stop.value.summary()

    collapse = ["health.mismatch=off", "health.collapse={window: 1, fraction: 1.0, steps: 1}"]
    with pytest.raises(HealthStop) as stop:
        run_stage(TRAIN, stages.train.run, train_recipe(tiny, rules[:-1] + collapse), run)
    rows = _rows(run)
    rewards = [r["reward_mean"] for r in rows]
    fell = next(i for i in range(1, len(rewards)) if rewards[i] < max(rewards[:i])) + 1  # the first step that fell
    assert stop.value.rule == "collapse" and stop.value.step == fell == rows[-1]["step"]
    assert [r["health_collapse"] for r in rows[1:]] == [OK] * (fell - 2) + [STOP]  # row 1 is the first attempt's
    assert stop.value.resume == ckpts / f"iter_{fell - 1:07d}" and saved_steps(ckpts) == list(range(1, fell))
    assert all(r["health_truncation"] == (WARN if r["truncated_fraction"] > 0 else OK) for r in rows[1:])
