"""Live progress lines: one per rollout (step/total, reward, solved groups, response length, s/step, ETA) and one
per eval (avg@n, pass@1, pass@n, maj@n); quiet silences them (the logger here; the `kimi train --quiet` command
for real, on a one-rollout run, in tests/integration/test_train.py)."""

from __future__ import annotations

import logging

import pytest

from kimi_pipeline.report import progress
from kimi_pipeline.report.progress import TrainProgress


def test_step_line_fields_and_eta_from_wall_time_per_rollout():
    now = [100.0]
    p = TrainProgress(total=60, start=10, clock=lambda: now[0])
    now[0] += 20.0  # 5 rollouts (11..15) in 20 s, evals included: 4 s per rollout, 45 left
    line = p.step_line({"step": 15, "reward_mean": 0.4567, "solved_group_fraction": 0.75, "response_len_mean": 8.25,
                        "step_seconds": 3.5})
    assert line == ("step 15/60  reward 0.457  solved groups 0.75  response 8.2 tok  3.50 s/step  ETA 3m00s")
    assert p.eta_seconds(10) is None and p.eta_seconds(15) == pytest.approx(180.0)
    now[0] += 7200
    assert p.step_line({"step": 16}).endswith("ETA 14h42m")  # 7220 s / 6 rollouts x 44 left


def test_eval_line():
    line = TrainProgress.eval_line(20, {"avg_at_n": 0.7125, "pass_at_1": 0.7125, "pass_at_n": 0.9, "maj_at_n": 0.75,
                                        "n": 8, "problems": 96})
    assert line == "eval at step 20: avg@8 0.713  pass@1 0.713  pass@8 0.900  maj@8 0.750 on 96 problems"


def test_lines_go_to_the_progress_logger_and_quiet_silences_them(caplog):
    p = TrainProgress(total=2)
    try:
        with caplog.at_level(logging.INFO, logger=progress.LOGGER_NAME):
            progress.set_quiet(False)
            p.log_step({"step": 1, "reward_mean": 0.5})
            p.log_eval(1, {"avg_at_n": 0.5, "pass_at_1": 0.5, "pass_at_n": 1.0, "maj_at_n": 0.5, "n": 2})
            p.log_eval(2, None)  # an eval task that returned nothing prints nothing
            progress.set_quiet(True)
            p.log_step({"step": 2, "reward_mean": 0.5})
    finally:
        progress.set_quiet(False)
    lines = [r.getMessage() for r in caplog.records if r.name == progress.LOGGER_NAME]
    assert len(lines) == 2 and lines[0].startswith("step 1/2") and lines[1].startswith("eval at step 1: avg@2 0.500")
