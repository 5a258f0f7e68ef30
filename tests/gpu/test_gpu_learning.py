"""The tiny recipe on one GPU: `kimi run --set cluster.device=cuda`, the trainer and the embedded engine colocated
on the same GPU (the tiny preset's `cluster.colocate: true`, one trainer rank), learns as it does on CPU. The GPU
twin of tests/integration/test_learning.py, with the same assertions: one progress line per rollout and per eval,
training reward up by >= REWARD_GAIN and the held-out eval by >= EVAL_GAIN (support/learning.py, measured on CPU).

`cluster.device=cuda` is honoured or the run fails: the trainer and engine resolve their device with
`kimi_pipeline.model.device.resolve_device`, which raises rather than fall back to the CPU.
"""

from __future__ import annotations

import pytest
import yaml

from support.learning import assert_learned_live, read_summary, run_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.timeout(1800)
def test_kimi_run_on_tiny_with_one_gpu_learns(tmp_path):
    from kimi_pipeline.recipes import load_recipe

    overrides = ["cluster.device=cuda"]
    recipe = load_recipe("tiny", overrides)
    assert recipe.cluster.colocate and recipe.cluster.world_size == 1  # trainer and engine share the one GPU
    out, run_dir = run_tiny(tmp_path, overrides)
    resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert resolved["cluster"]["device"] == "cuda"
    summary = read_summary(run_dir)
    assert summary["cluster"]["gpus"] >= 1, summary["cluster"]
    assert all(s["status"] == "completed" for s in summary["stages"].values()), summary["stages"]
    assert_learned_live(out, summary, recipe)
