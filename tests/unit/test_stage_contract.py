"""One stage contract: every DAG stage is a `Stage` declared in its own module of `kimi_pipeline.stages`, and the
one runner (`run_stage`) records what every stage records: status and seconds, its section, the partial section a
failing stage carries, a skip, the debugging modes' own records, and the report handed to whoever publishes it."""

from __future__ import annotations

import importlib
import json

import pytest

from kimi_pipeline.errors import SectionError
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.recipes.recipe import Recipe
from kimi_pipeline.stages import DAG, STAGES, Stage, StageReport, run_stage


def test_each_stage_lives_in_its_own_module_and_declares_what_it_reads():
    assert STAGES == ("download", "validate", "convert", "cluster", "train", "export")
    sections = set(Recipe.model_fields)
    for position, stage in enumerate(DAG):
        module = importlib.import_module(f"kimi_pipeline.stages.{stage.name}")
        assert getattr(module, stage.name.upper()) is stage and stage.run is module.run
        assert set(stage.reads) <= sections, (stage.name, set(stage.reads) - sections)
        assert set(stage.needs) <= set(STAGES[:position]), f"{stage.name} needs a later stage: {stage.needs}"
        assert stage.report.key and callable(stage.report.render)


def _toy(run, **kw) -> Stage:
    return Stage(name="validate", run=run, reads=("data",), needs=(), outputs=(),
                 report=StageReport(key="toy", render=lambda s: f"rows: {s.get('rows')}", title="{recipe}: {rows} rows",
                                    failed_title="failed at {rows}"), **kw)


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_the_runner_records_status_seconds_section_and_publishes_the_report(tmp_path):
    published = []
    section = run_stage(_toy(lambda recipe, run_dir, rows: {"rows": rows}), load_recipe("tiny"), tmp_path, rows=7,
                        publish=lambda report, s, failed: published.append((report.key, report.render(s), failed)))
    summary = _summary(tmp_path)
    assert section == {"rows": 7} and summary["validate"] == {"rows": 7}
    assert summary["stages"]["validate"]["status"] == "completed" and summary["stages"]["validate"]["seconds"] >= 0
    assert published == [("toy", "rows: 7", False)]


def test_a_failure_carrying_its_section_is_recorded_and_reported(tmp_path):
    def run(recipe, run_dir):
        raise SectionError("3 bad rows", {"rows": 3, "bad": [1, 2, 3]})

    published = []
    with pytest.raises(SectionError, match="3 bad rows"):
        run_stage(_toy(run), load_recipe("tiny"), tmp_path, publish=lambda r, s, failed: published.append(failed))
    summary = _summary(tmp_path)
    assert (
        summary["stages"]["validate"]["status"] == "failed" and "3 bad rows" in summary["stages"]["validate"]["error"]
    )
    assert summary["validate"] == {"rows": 3, "bad": [1, 2, 3]} and published == [True]


def test_an_error_without_a_section_records_only_the_failure(tmp_path):
    def run(recipe, run_dir):
        raise RuntimeError("node lost")

    with pytest.raises(RuntimeError):
        run_stage(_toy(run), load_recipe("tiny"), tmp_path, publish=lambda *a: pytest.fail("nothing to publish"))
    summary = _summary(tmp_path)
    assert summary["stages"]["validate"]["status"] == "failed" and "validate" not in summary


def test_a_skip_and_a_debugging_mode_have_their_own_records(tmp_path):
    recipe = load_recipe("tiny")
    skipping = _toy(
        lambda recipe, run_dir: pytest.fail("a skipped stage does not run"),
        skip=lambda recipe: {"skipped": "not needed"},
    )
    assert run_stage(skipping, recipe, tmp_path) == {"skipped": "not needed"}
    assert _summary(tmp_path)["stages"]["validate"] == {"status": "skipped", "seconds": 0.0, "reason": "not needed"}
    modes = _toy(
        lambda recipe, run_dir, replay=None: {"replayed": replay is not None},
        record_name=lambda inputs: "replay" if inputs.get("replay") else "validate",
    )
    run_stage(modes, recipe, tmp_path, replay="rollouts")
    assert _summary(tmp_path)["replay"] == {"replayed": True}
