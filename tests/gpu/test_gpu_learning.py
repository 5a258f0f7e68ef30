"""The tiny recipe on one GPU: `kimi run --set cluster.device=cuda`, the trainer and the embedded engine colocated
on the same GPU (the tiny preset's `cluster.colocate: true`, one trainer rank), learns as it does on CPU. The GPU
twin of tests/integration/test_learning.py, with the same assertions: one progress line per rollout and per eval,
training reward up by >= 0.3 (last 10 % of rollouts minus the first 10 %), held-out eval better at the end.

`cluster.device=cuda` is honoured or the run fails: the trainer and engine resolve their device with
`kimi_pipeline.model.device.resolve_device`, which raises rather than fall back to the CPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.common import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _kimi() -> list[str]:
    exe = Path(sys.executable).with_name("kimi")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "kimi_pipeline.cli"]


@pytest.mark.timeout(1800)
def test_kimi_run_on_tiny_with_one_gpu_learns(tmp_path):
    from kimi_pipeline.recipes import load_recipe

    overrides = ["cluster.device=cuda"]
    recipe = load_recipe("tiny", overrides)
    assert recipe.cluster.colocate and recipe.cluster.world_size == 1  # trainer and engine share the one GPU
    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "COLUMNS": "200"}
    cmd = [*_kimi(), "run", "--run-dir", str(run_dir)] + [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert resolved["cluster"]["device"] == "cuda"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["cluster"]["gpus"] >= 1, summary["cluster"]
    assert all(s["status"] == "completed" for s in summary["stages"].values()), summary["stages"]

    total = recipe.rollout.num_rollout
    steps = re.findall(rf"step +(\d+)/{total}  reward (\d\.\d+)  solved groups \d\.\d+  response [\d.]+ tok  "
                       rf"[\d.]+ s/step  ETA \S+", out)
    assert [int(s) for s, _ in steps] == list(range(1, total + 1)), out[-3000:]
    evals = re.findall(r"eval at step (\d+): avg@(\d+) (\d\.\d+)  pass@1 \d\.\d+  pass@\d+ \d\.\d+", out)
    expected_evals = [0] + [s for s in range(1, total + 1) if s % recipe.eval.interval == 0 or s == total]
    assert [int(s) for s, _, _ in evals] == expected_evals

    train, ev = summary["train"], summary["eval"]
    assert len(ev) == len(expected_evals)
    assert train["reward_last"] - train["reward_first"] >= 0.3, train
    assert ev[-1]["avg_at_n"] > ev[0]["avg_at_n"], ev
    assert float(evals[-1][2]) == pytest.approx(ev[-1]["avg_at_n"], abs=5e-4)
