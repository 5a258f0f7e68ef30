"""summary.md (`report/markdown.py`) reads as a summary: nested sections as nested bullets (not JSON cut at 120
characters), the served export and a health stop in the headline."""

from __future__ import annotations

from kimi_pipeline.report.markdown import render_summary


def test_nested_sections_are_bullets_and_the_headline_names_the_served_export_and_a_health_stop():
    summary = {
        "recipe": "tiny",
        "stages": {"train": {"status": "failed", "seconds": 12.0, "error": "health rule `collapse` stopped training"}},
        "train": {"steps": 9, "reward_first": 0.4, "reward_last": 0.1,
                  "health": {"collapse": {"setting": {"window": 1, "fraction": 1.0, "steps": 1},
                                          "warn_steps": [], "stop_step": 9},
                             "stop": {"rule": "collapse", "step": 9, "values": {"best": 0.8},
                                      "resume": "/r/train/checkpoints/iter_0000008"}}},
        "export": {"path": "/r/export", "int4_bytes": 10, "bf16_bytes": 40, "dequant_exact": True, "published": True,
                   "eval": {"avg_at_n": 0.8307, "training_avg_at_n": 0.832, "drop": 0.0013, "max_drop": 0.05}},
    }
    md = render_summary(summary)
    assert "- **health**: rule `collapse` stopped training at step 9; resume from " \
           "`/r/train/checkpoints/iter_0000008`" in md
    assert "- **export served**: avg@n 0.831 vs 0.832 in training (drop 0.0013); published: True" in md
    assert "- **health**:\n  - **collapse**:\n    - **setting**: " in md and "    - **stop_step**: 9" in md
    assert "  - **drop**: 0.0013" in md and "…" not in md
