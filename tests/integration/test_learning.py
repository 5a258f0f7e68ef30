"""The first run convinces: `kimi run` on the shipped tiny recipe (what `make run` does), end to end on a fixed
seed, learns its task and shows it live.

Asserts what a new user sees: one progress line per rollout and one per eval on the terminal, training reward
up by ≥ 0.3 (mean of the last 10 % of rollouts minus the first 10 %) and the held-out eval (≥ 64 problems,
disjoint from train by problem) better at the end than at step 0. Runs the full recipe, not a shortened one:
about 5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.common import ROOT

pytestmark = pytest.mark.slow


def _kimi() -> list[str]:
    exe = Path(sys.executable).with_name("kimi")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "kimi_pipeline.cli"]


@pytest.mark.timeout(1800)
def test_kimi_run_on_tiny_learns_and_shows_progress_live(tmp_path):
    from kimi_pipeline.recipes import load_recipe

    recipe = load_recipe("tiny")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "COLUMNS": "200"}
    proc = subprocess.run([*_kimi(), "run", "--run-dir", str(run_dir)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1700)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    total = recipe.rollout.num_rollout
    steps = re.findall(rf"step +(\d+)/{total}  reward (\d\.\d+)  solved groups \d\.\d+  response [\d.]+ tok  "
                       rf"[\d.]+ s/step  ETA \S+", out)
    assert [int(s) for s, _ in steps] == list(range(1, total + 1)), out[-3000:]
    evals = re.findall(r"eval at step (\d+): avg@(\d+) (\d\.\d+)  pass@1 \d\.\d+  pass@\d+ \d\.\d+", out)
    expected_evals = [0] + [s for s in range(1, total + 1) if s % recipe.eval.interval == 0 or s == total]
    assert [int(s) for s, _, _ in evals] == expected_evals

    summary = json.loads((run_dir / "summary.json").read_text())
    train, ev = summary["train"], summary["eval"]
    assert summary["validate"]["contamination"]["overlap"] == 0 and len(ev) == len(expected_evals)
    assert json.loads((run_dir / "validate" / "report.json").read_text())["eval"]["rows"] >= 64
    assert train["reward_last"] - train["reward_first"] >= 0.3, train
    assert ev[-1]["avg_at_n"] > ev[0]["avg_at_n"], ev
    # the terminal showed the same numbers the summary records
    assert float(evals[-1][2]) == pytest.approx(ev[-1]["avg_at_n"], abs=5e-4)
