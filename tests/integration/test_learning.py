"""The first run convinces: `kimi run` on the shipped tiny recipe (what `make run` does), end to end on a fixed
seed, learns its task and shows it live.

Asserts what a new user sees: one progress line per rollout and one per eval on the terminal, training reward
up by ≥ 0.25 (mean of the last 10 % of rollouts minus the first 10 %) and the held-out eval (≥ 64 problems,
disjoint from train by problem) up by ≥ 0.12 avg@n from step 0 — bars set with margin below the gains measured
under three CPU numerics paths (support/learning.py) — and the INT4 export, served from disk, scoring within
`export.max_eval_drop` of the last training eval. Runs the full recipe, not a shortened one: about 6 minutes
on 2 cores alone, about 11 beside the other test worker (each on its share of the cores).
"""

from __future__ import annotations

import json

import pytest

from support.learning import assert_learned_live, read_summary, run_tiny

pytestmark = pytest.mark.slow


@pytest.mark.timeout(2500)  # > run_tiny's 2400 s limit
def test_kimi_run_on_tiny_learns_and_shows_progress_live(tmp_path):
    from kimi_pipeline.recipes import load_recipe

    out, run_dir = run_tiny(tmp_path)
    summary = read_summary(run_dir)
    recipe = load_recipe("tiny")
    assert_learned_live(out, summary, recipe)
    # the INT4 export, served from disk by the embedded engine, scores within export.max_eval_drop of the training
    # eval at the same step (measured 2026-11-27: avg@8 0.831 served vs 0.832 in training, drop 0.0013)
    served = summary["export"]["eval"]
    assert summary["export"]["published"] and served["step"] == recipe.rollout.num_rollout, served
    assert served["drop"] <= served["max_drop"] == recipe.export.max_eval_drop, served
    assert summary["validate"]["contamination"]["overlap"] == 0
    # the shipped recipe's conversion: 4 rendezvous agents, verified exact (the served deployment runs use one node)
    assert summary["convert"]["nodes"] == recipe.convert.nodes == 4 and summary["convert"]["verified"] is True
    assert summary["convert"]["max_abs_diff"] == 0.0
    assert json.loads((run_dir / "validate" / "report.json").read_text())["eval"]["rows"] >= 64
