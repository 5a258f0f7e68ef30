"""The health rules (`rl.health_rules`) on synthetic rows: each rule fires at the step its definition says, names the
checkpoint from before the trouble, stays quiet when `off`, and judges a resumed run as an uninterrupted one."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest

from kimi_pipeline.recipes.models import HealthSpec
from kimi_pipeline.rl.health_rules import OK, STOP, WARN, HealthRules, HealthStop, health_markdown, health_section


def _rows(rewards, **extra):
    return [{"step": i + 1, "reward_mean": r, "mismatch_k3": 1e-9, "truncated_fraction": 0.0, "loss": 0.1,
             "grad_norm": 0.5, **{k: v[i] for k, v in extra.items()}} for i, r in enumerate(rewards)]


def _run(spec: HealthSpec, rows, saved=(), ckpt=Path("/ck")):
    """Judge `rows` in order; (verdict rows, the stop or None)."""
    rules, out = HealthRules(spec, ckpt, saved=lambda: list(saved)), []
    for row in rows:
        verdicts, stop = rules.judge(row)
        out.append(verdicts)
        if stop is not None:
            return out, stop
    return out, None


def test_mismatch_stops_after_k_consecutive_steps_above_the_bound_and_a_dip_resets_the_count():
    spec = HealthSpec(mismatch={"metric": "mismatch_k3", "max": 0.01, "steps": 3})
    k3 = [0.02, 0.02, 0.001, 0.02, 0.02, 0.02, 0.02]
    verdicts, stop = _run(spec, _rows([0.5] * 7, mismatch_k3=k3), saved=[2, 4])
    assert [v["health_mismatch"] for v in verdicts] == [WARN, WARN, OK, WARN, WARN, STOP]
    assert isinstance(stop, HealthStop) and stop.rule == "mismatch" and stop.step == 6
    assert stop.values["mismatch_k3"] == 0.02 and stop.resume == Path("/ck/iter_0000004")
    assert "step 6" in str(stop) and "iter_0000004" in str(stop) and "health.mismatch=off" in str(stop)
    stop.section = {"steps": 6}
    again = pickle.loads(pickle.dumps(stop))  # Prefect and Ray pickle exceptions
    assert str(again) == str(stop) and again.summary() == stop.summary() and again.section == {"steps": 6}


def test_collapse_stops_and_names_the_checkpoint_from_before_the_collapse_began():
    spec = HealthSpec(collapse={"window": 2, "fraction": 0.5, "steps": 3})
    rewards = [0.4, 0.6, 0.8, 0.8, 0.1, 0.1, 0.1, 0.1]
    # moving means (window 2, from step 2): .5 .7 .8 .45 .1 .1 .1; best before step 5 is 0.8: collapsed from step 6
    # (0.1 < 0.4), step 5's 0.45 is above half of 0.8; the third collapsed step is 8
    verdicts, stop = _run(spec, _rows(rewards), saved=[3, 5, 6, 7])
    assert [v["health_collapse"] for v in verdicts] == [OK, OK, OK, OK, OK, WARN, WARN, STOP]
    assert stop.rule == "collapse" and stop.step == 8 and stop.values["since_step"] == 6
    assert stop.resume == Path("/ck/iter_0000005")  # checkpoints 6 and 7 were written during the collapse


def test_non_finite_trainer_values_stop_at_once_and_without_a_checkpoint_say_so():
    rows = _rows([0.5, 0.5], loss=[0.1, math.nan])
    verdicts, stop = _run(HealthSpec(), rows)
    assert verdicts[-1]["health_nonfinite"] == STOP and stop.rule == "nonfinite" and stop.step == 2
    assert math.isnan(stop.values["loss"]) and stop.resume is None and "initial checkpoint" in str(stop)


def test_truncation_warns_and_never_stops():
    verdicts, stop = _run(HealthSpec(truncation={"max_fraction": 0.25}),
                          _rows([0.5] * 3, truncated_fraction=[0.1, 0.9, 1.0]))
    assert stop is None and [v["health_truncation"] for v in verdicts] == [OK, WARN, WARN]


@pytest.mark.parametrize("rule", ["mismatch", "collapse", "truncation", "nonfinite"])
def test_a_rule_set_off_never_judges(rule):
    rows = _rows([0.9, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                 mismatch_k3=[1.0] * 16, truncated_fraction=[1.0] * 16, loss=[math.inf] * 16)
    verdicts, _ = _run(HealthSpec(**{rule: "off"}), rows)  # judged until another rule stops the run
    assert all(v[f"health_{rule}"] == OK for v in verdicts)


def test_a_resumed_run_judges_as_the_uninterrupted_one():
    spec = HealthSpec(collapse={"window": 2, "fraction": 0.5, "steps": 3})
    rows = _rows([0.4, 0.6, 0.8, 0.8, 0.1, 0.1, 0.1, 0.1])
    whole, stop = _run(spec, rows)
    resumed = HealthRules(spec, Path("/ck"), saved=list)
    resumed.replay(rows[:6])  # the rows kept up to the checkpoint at step 6
    tail = [resumed.judge(r)[0] for r in rows[6:]]
    assert tail == whole[6:] and stop is not None


def test_the_summary_and_artifact_list_warnings_and_the_stop():
    spec = HealthSpec(truncation={"max_fraction": 0.25})
    rows = [{**r, **v} for r, v in zip(_rows([0.5] * 3, truncated_fraction=[0.1, 0.9, 0.2]),
                                       _run(spec, _rows([0.5] * 3, truncated_fraction=[0.1, 0.9, 0.2]))[0])]
    section = health_section(rows, spec)
    assert section["truncation"] == {"setting": {"max_fraction": 0.25}, "warn_steps": [2], "stop_step": None}
    assert section["nonfinite"]["setting"] == "stop"
    md = health_markdown({**section, "stop": {"rule": "collapse", "step": 9, "values": {}, "resume": "/ck/iter_1"}})
    assert "| truncation | max_fraction=0.25 | 2 | — |" in md and "Stopped by `collapse` at step 9" in md


def test_a_recipe_turns_rules_off_by_name():
    from kimi_pipeline.recipes import load_recipe

    recipe = load_recipe("tiny", overrides=["health.mismatch=off", "health.collapse.steps=7"])
    assert recipe.health.mismatch == "off" and recipe.health.collapse.steps == 7
    assert recipe.health.nonfinite == "stop" and recipe.health.truncation.max_fraction == 0.5
