"""SGLang checked against SGLang itself: the launch commands every preset plans, parsed by the pinned release's own
`ServerArgs` parser (`make sglang-parser` installs it for the tests, without its GPU dependencies)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from kimi_pipeline.engine.sglang import PARSER_PATH_VAR, parse_with_sglang, sglang_command
from kimi_pipeline.eval.served import ServedSections, export_sglang_engine
from kimi_pipeline.recipes import load_recipe, preset_names
from kimi_pipeline.rl.actor_layout import lay_out_actors
from kimi_pipeline.rl.rehearse import check_engine_commands

# `make test-fast` leaves it out: SGLang's own argument parser and process groups (~5-20 s per test)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PINNED = (ROOT / "requirements-sglang.txt").read_text().split("==")[1].strip()


@pytest.fixture(scope="module")
def parser_dir() -> Path:
    d = Path(os.environ[PARSER_PATH_VAR])
    assert (d / "sglang").is_dir(), f"no sglang in {d}: run `make sglang-parser` (make test does)"
    return d


def _planned_commands(recipe) -> list[list[str]]:
    plan = lay_out_actors(recipe, "/ckpt")
    assert plan.ok, plan.problems
    return [list(n.command) for e in plan.engines for n in e.nodes]


def _preset_commands(colocate: bool) -> tuple[list[str], list[list[str]]]:
    """(owner preset of each command, every SGLang preset's planned engine commands and its export scoring's)."""
    names = [n for n in preset_names() if load_recipe(n).rollout.engine == "sglang"]
    assert {"kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"} <= set(names)
    owners, commands = [], []
    for name in names:
        recipe = load_recipe(name, [f"cluster.colocate={str(colocate).lower()}", "rollout.routing_replay=true"])
        planned = _planned_commands(recipe)
        if any(len(e.nodes) > 1 for e in lay_out_actors(recipe, "/ckpt").engines):
            assert any("--nnodes" in c for c in planned)  # the multi-node engines' commands are in the set
        served = export_sglang_engine(ServedSections.of(recipe), Path("/run/export/int4")).command  # export scoring
        assert served[served.index("--tp-size") + 1] == "8" and "--nnodes" not in served  # one node serves INT4
        commands += planned + [served]
        owners += [name] * (len(planned) + 1)
    return owners, commands


@pytest.fixture(scope="module")
def preset_parses(parser_dir) -> dict[bool, list[tuple[str, str]]]:
    """colocate -> (owner preset, SGLang's error) for each command: both layouts' commands in one parse, so SGLang is
    imported once (~5 CPU-s). Read-only to the tests."""
    owned = {colocate: _preset_commands(colocate) for colocate in (True, False)}
    commands = owned[True][1] + owned[False][1]
    parsed = parse_with_sglang(commands, load_recipe("kimi-k2-instruct").sglang)
    assert parsed.version == PINNED, parsed.reason
    assert len(parsed.errors) == len(commands)
    errors = iter(parsed.errors)
    return {colocate: [(owner, next(errors)) for owner in owners] for colocate, (owners, _) in owned.items()}


@pytest.mark.parametrize("colocate", [True, False])
def test_every_preset_engine_command_parses_with_the_pinned_sglang(preset_parses, colocate):
    assert [(owner, error) for owner, error in preset_parses[colocate] if error] == []


def test_a_flag_sglang_does_not_know_fails_the_check(parser_dir):
    spec = load_recipe("kimi-k2.5").sglang
    cmd = sglang_command("/ckpt", spec, port=30000, gpus_per_node=8)
    parsed = parse_with_sglang([cmd + ["--cuda-graph-bs", "1", "2"], cmd + ["--no-such-flag"],
                                cmd + ["--tp-size", "eight"]], spec)
    assert "ambiguous option: --cuda-graph-bs" in parsed.errors[0]  # the name this project used before 0.5.23
    assert "unrecognized arguments: --no-such-flag" in parsed.errors[1]
    assert "--tp-size" in parsed.errors[2] and "invalid int value" in parsed.errors[2]


def test_without_an_importable_sglang_the_check_says_why(monkeypatch):
    monkeypatch.delenv(PARSER_PATH_VAR)
    spec = load_recipe("kimi-k2.5", ["sglang.python=/nonexistent/python"]).sglang
    parsed = parse_with_sglang([["--model-path", "/ckpt"]], spec)
    assert not parsed.checked and "/nonexistent/python" in parsed.reason and "make sglang-env" in parsed.reason


def test_rehearse_reports_a_command_sglang_refuses_naming_engine_and_node(parser_dir, monkeypatch):
    recipe = load_recipe("kimi-k2-instruct")
    plan = lay_out_actors(recipe, "/ckpt")
    bad = replace(plan.engines[3].nodes[1], command=plan.engines[3].nodes[1].command + ("--cuda-graph-bs", "8"))
    plan.engines[3] = replace(plan.engines[3], nodes=(plan.engines[3].nodes[0], bad))
    distinct = len({n.command for e in lay_out_actors(recipe, "/ckpt").engines for n in e.nodes})
    said = check_engine_commands(plan, recipe)
    assert said.startswith(f"{distinct} distinct command(s) parsed by sglang 0.5.23")  # one of them the planted
    assert [(p.field, p.message.split(":")[0]) for p in plan.problems] == [("sglang", "engine 3 node 1")]
    assert "ambiguous option: --cuda-graph-bs" in plan.problems[0].message

    monkeypatch.delenv(PARSER_PATH_VAR)
    monkeypatch.setenv("KIMI_SGLANG_PYTHON", "/nonexistent/python")
    assert check_engine_commands(lay_out_actors(recipe, "/ckpt"), recipe).startswith("not checked: no interpreter")


# An engine rank as SGLang's weight updater is one: its group held in a dict and popped when destroyed
# (model_runner_components/weight_updater.py:146-150). A group still referenced at the interpreter's exit is torn down
# there, and gloo then aborts the process now and then ("terminate called without an active exception": in 4 of 110
# runs of the member pair when this script kept `pg`; 0 of 80 with the pop, 2026-11-29).
_SGLANG_MEMBER = """
import sys, torch, torch.distributed as dist
from sglang.srt.utils.common import init_custom_process_group
port, rank, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
groups = {name: init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=3,
                                          rank=rank, group_name=name)}
t = torch.empty(2, 3, dtype=torch.bfloat16)
dist.broadcast(t, src=0, group=groups[name])  # as SGLang's receive_weights_from_distributed does
print(t.float().flatten().tolist(), flush=True)
dist.destroy_process_group(groups.pop(name))  # as SGLang's destroy_weights_update_group does: no reference kept
"""


def test_the_weight_update_group_meets_sglangs_own_init_custom_process_group(parser_dir):
    """Two engine ranks join with the pinned SGLang's `init_custom_process_group` (gloo, in their own processes,
    as SGLang's weight updater calls it); the trainer side is `dist_group.make_group`. They meet on the same
    store keys and the broadcast arrives: the layout the trainer forms is SGLang's."""
    import subprocess
    import sys

    import torch

    from kimi_pipeline.weight_sync.dist_group import broadcast, leave_group, make_group
    from kimi_pipeline.util.net import free_port

    port, name = free_port(), "kimi-weight-sync-test"
    env = {**os.environ, "PYTHONPATH": str(parser_dir)}
    members = [subprocess.Popen([sys.executable, "-P", "-c", _SGLANG_MEMBER, str(port), str(r), name], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (1, 2)]
    try:
        pg = make_group("127.0.0.1", port, 0, 3, "gloo", name)
        sent = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
        broadcast(pg, sent)
        outs = [m.communicate(timeout=240) for m in members]
        leave_group(pg)
    finally:
        for m in members:
            m.kill()
    for (out, err), m in zip(outs, members):
        assert m.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == str(sent.float().flatten().tolist())


_MERGE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
argv = json.loads(sys.argv[1])
print(parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(argv)).api_key)
"""


@pytest.mark.parametrize("host", ["10.1.2.3", "127.0.0.1"])
def test_every_sglang_engine_gets_the_runs_key_through_a_private_config_file(parser_dir, tmp_path, host):
    """SGLang reads the run's key from the 0600 `--config` file the engine writes (through SGLang's own merger), on
    loopback too, so the key is on no command line; the planned command of a multi-node layout binds to the node's
    address."""
    import json
    import stat
    import subprocess
    import sys

    from kimi_pipeline.engine.key import engine_api_key, use_run_key
    from kimi_pipeline.engine.sglang import SGLangEngine

    key = use_run_key(tmp_path).read_text()
    recipe = load_recipe("kimi-k2-instruct")
    assert recipe.cluster.nodes > 1
    planned = [n.command for e in lay_out_actors(recipe, "/ckpt").engines for n in e.nodes]
    assert all(c[c.index("--host") + 1] == "<node-ip>" for c in planned)
    assert not any(key in " ".join(c) for c in planned)
    engine = SGLangEngine("/ckpt", recipe.sglang, port=30000, host=host, gpus_per_node=8,
                          dist_init_addr=f"{host}:5000", python=sys.executable)
    argv = engine.launch_command()[3:]  # what start() runs, without `python -m sglang.launch_server`
    path = argv[argv.index("--config") + 1]
    try:
        assert key not in " ".join(argv) and engine_api_key() == key
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
        done = subprocess.run([sys.executable, "-P", "-c", _MERGE, json.dumps(argv)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(parser_dir)}, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == key
    finally:
        engine.stop()
    assert not Path(path).exists()


# --------------------------------------------------------------------------- SGLang's process: environment and restart


def test_sglang_runs_on_its_own_environment_not_the_trainers():
    """The server gets the engine actor's environment without the trainer's (its PYTHONPATH would put the trainer's
    transformers / compressed-tensors before SGLang's pins), the seeds' NCCL timeout, the hub offline (the model is on
    local disk: no token needed), and SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 when colocated, without which
    --enable-memory-saver keeps the CUDA graphs (cuda_graph_dedup_mixin.py:307-311)."""
    from kimi_pipeline.engine.sglang import releases_cuda_graphs, sglang_env
    from kimi_pipeline.rl.actor_layout import worker_env

    actor = {**worker_env("cuda", 4, choose_own_gpu=True, trainer=False), "PATH": "/usr/bin", "HF_TOKEN": "hf_x",
             "WANDB_API_KEY": "w", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in worker_env("cuda", trainer=False)  # megatron's, trainer ranks only
    assert worker_env("cuda")["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    env = sglang_env(actor, memory_saver=True)
    for gone in ("PYTHONPATH", "TORCHDYNAMO_DISABLE", "CUDA_DEVICE_MAX_CONNECTIONS", "HF_TOKEN", "WANDB_API_KEY",
                 "OMP_NUM_THREADS"):
        assert gone not in env, gone
    assert env["PATH"] == "/usr/bin" and env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["NCCL_TIMEOUT"] == "3600"
    assert env["HF_HUB_OFFLINE"] == "1" and env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1" and releases_cuda_graphs(env)
    assert not releases_cuda_graphs(sglang_env({**actor, "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}, memory_saver=False))


def test_the_engine_process_is_started_with_that_environment(monkeypatch, tmp_path):
    """SGLangEngine.start hands sglang_env to the server process (it passed os.environ whole)."""
    import subprocess as sp

    from kimi_pipeline.engine import sglang as sgl

    recipe = load_recipe("kimi-k2-thinking")
    seen = {}

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        seen.update(kw["env"])
        raise Stop

    monkeypatch.setattr(sgl, "require_sglang", lambda python: None)
    monkeypatch.setattr(sp, "Popen", popen)
    monkeypatch.setenv("PYTHONPATH", "/trainer/venv/site-packages")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spec = recipe.sglang.model_copy(update={"gpus_per_engine": 8})
    engine = sgl.SGLangEngine("/ckpt", spec, port=30000, memory_saver=True, python="python")
    with pytest.raises(Stop):
        engine.start(memory_probe=lambda gpus: [(80 << 30, 80 << 30)] * len(gpus))
    assert "PYTHONPATH" not in seen and "CUDA_DEVICE_MAX_CONNECTIONS" not in seen
    assert seen["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"


def test_plan_counts_cuda_graphs_released_only_with_the_memory_saver_variable(monkeypatch):
    """`kimi plan` frees the engine's CUDA graphs in the colocated train phase because the server runs with
    SGLANG_MEMORY_SAVER_CUDA_GRAPH=1; without it the graphs stay in every phase."""
    from kimi_pipeline.plan import command, get_gpu, make_plan

    recipe = load_recipe("kimi-k2-thinking", ["cluster.colocate=true"])
    with_var = make_plan(recipe, get_gpu("h200"))["gpu_mem_gb"]
    monkeypatch.setattr(command, "sglang_env", lambda base, memory_saver: {})
    without = make_plan(recipe, get_gpu("h200"))["gpu_mem_gb"]
    assert with_var["cuda_graphs"] > 0
    assert without["total_train"] == pytest.approx(with_var["total_train"] + with_var["cuda_graphs"], abs=0.02)
    assert without["total_rollout"] == with_var["total_rollout"]


def test_a_restarted_engine_waits_until_the_dead_ones_gpu_memory_is_back():
    """SGLang sizes its memory from what is free when it starts (kv_cache_configurator.py:2990-3007): the wait holds
    a start until every GPU has mem_fraction_static of its memory free (probe injected: no GPU here), names the
    engine when it gives up, and does nothing on CPU (no GPUs)."""
    from kimi_pipeline.engine.sglang import SGLangLaunchError, wait_for_gpu_memory

    total = 80 << 30
    frees = iter([10 << 30, 30 << 30, 70 << 30])  # the killed engine's processes exit; its memory comes back
    calls = []

    def probe(gpus):
        calls.append(list(gpus))
        free = next(frees)
        return [(free, total) for _ in gpus]

    waited = wait_for_gpu_memory((2, 3), 0.7, "engine 1", probe=probe, timeout_s=30, poll_s=0.01)
    assert calls == [[2, 3]] * 3 and waited >= 0.02
    with pytest.raises(SGLangLaunchError, match=r"engine 1: .*GPU 3: 10.0 of 80.0 GiB free"):
        wait_for_gpu_memory((3,), 0.7, "engine 1", probe=lambda g: [(10 << 30, total)], timeout_s=0.05, poll_s=0.01)
    assert wait_for_gpu_memory((), 0.7, "cpu engine", probe=lambda g: pytest.fail("probed")) == 0.0
