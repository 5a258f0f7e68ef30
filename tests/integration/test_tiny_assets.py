"""The shipped tiny assets against a fresh build (`kimi data make-tiny --check`), on any CPU.

Data, tokenizer and config are byte-identical on every x86-64 machine. The base policy is trained (120 warm-start
steps): on another CPU vendor MKL/ATen round some GEMMs differently and the weights drift, so the check compares
how the policy behaves (the pipeline's step-0 eval and a greedy pass on the tiny eval set) within a tolerance
measured across CPU numerics settings; a policy that really behaves differently fails it.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kimi_pipeline.cli import app
from kimi_pipeline.data.tiny_assets import BASE_POLICY_TOLERANCE
from kimi_pipeline.eval.record import EvalSections, base_policy_scores
from kimi_pipeline.recipes import load_recipe
from support.common import TINY

pytestmark = pytest.mark.slow


def test_shipped_tiny_assets_match_a_fresh_build():
    res = CliRunner().invoke(app, ["data", "make-tiny", "--check", "--out", str(TINY)])
    assert res.exit_code == 0, res.output
    assert "shipped tiny assets match a fresh build" in res.output


def test_a_base_policy_that_behaves_differently_is_outside_the_tolerance(tmp_path):
    """The behaviour gate can fail: the shipped policy with its output layer scrambled (the same architecture and
    files, a policy that no longer solves the task) scores outside BASE_POLICY_TOLERANCE of the shipped one."""
    recipe, eval_file = load_recipe("tiny"), TINY / "aime-tiny.jsonl"
    broken = tmp_path / "model"
    shutil.copytree(TINY / "model", broken)
    for shard in broken.glob("*.safetensors"):
        tensors = load_file(shard)
        if "lm_head.weight" in tensors:
            w = tensors["lm_head.weight"]
            tensors["lm_head.weight"] = w[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))]
            save_file(tensors, shard, metadata={"format": "pt"})
    shipped = base_policy_scores(EvalSections.of(recipe), TINY / "model", eval_file, tmp_path / "eval-shipped")
    scrambled = base_policy_scores(EvalSections.of(recipe), broken, eval_file, tmp_path / "eval-broken")
    assert shipped["problems"] >= 64
    assert any(abs(scrambled[k] - shipped[k]) > tol for k, tol in BASE_POLICY_TOLERANCE.items()), (shipped, scrambled)
