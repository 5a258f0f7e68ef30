"""The one runner of the DAG's stages: every stage is a `Stage` (declared in its own module of this package)
and runs through `run_stage`, which owns what all of them share: the status and duration in summary.json, the
stage's section (also the partial one a failing stage carries), the stage's report for a caller that
publishes it (the Prefect tasks make it an artifact; the CLI prints the section), and a failing stage's error
with the secrets in its message redacted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import SectionError
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.util.redact import redact_exception

Section = dict[str, Any]
# publish(report, section, failed): hands a stage's report and section to whoever shows it (a Prefect artifact)
Publish = Callable[["StageReport", Section, bool], None]


@dataclass(frozen=True)
class StageReport:
    """How a stage's section reads for a person: `render(section)` gives markdown (or table rows when `table`);
    `key` names the artifact in the Prefect UI; `title` / `failed_title` describe it (`{recipe}` = the recipe's
    name, other `{field}`s from the section)."""

    key: str
    render: Callable[[Section], Any]
    title: str
    failed_title: str | None = None  # None: a failed stage publishes no report
    table: bool = False


@dataclass(frozen=True)
class Stage:
    """One step of the DAG, declared once; the runner, the Prefect task, the flow and the CLI read this.

    - `reads`: the recipe sections the stage and what it calls read (what a reader needs to know; the Prefect
      task's cache key hashes those of them that decide its outputs). A stage that hands its components sections
      declares exactly what its code and the section records it builds read (`tests/unit/test_stage_contract.py`);
    - `needs`: the earlier stages whose outputs it reads;
    - `outputs`: files under the run dir a cached result needs (empty: the stage is never cached);
    - `run(recipe, run_dir, **inputs) -> section`: the work;
    - `skip(recipe) -> section | None`: the section of a recipe that does not need the stage (recorded as
      skipped, `run` not called);
    - `record_name(inputs)`: where summary.json records a run with these inputs (default: `name`; the train
      stage's debugging modes keep their own records)."""

    name: str
    run: Callable[..., Section]
    reads: tuple[str, ...]
    needs: tuple[str, ...]
    outputs: tuple[str, ...]
    report: StageReport
    skip: Callable[[Recipe], Section | None] = field(default=lambda recipe: None)
    record_name: Callable[[dict[str, Any]], str] | None = None  # summary.json's name for a run given these inputs


def run_stage(stage: Stage, recipe: Recipe, run_dir: str | Path, *, publish: Publish | None = None,
              **inputs: Any) -> Section:
    """Run `stage` for `recipe` in `run_dir`: record it running, then completed (or failed with its error) with
    its duration, and its section; a failure that carries a partial section (`SectionError`) records that too.
    `publish` gets the stage's report (the Prefect tasks make it an artifact)."""
    run_dir = Path(run_dir)
    name = stage.record_name(inputs) if stage.record_name else stage.name
    summary = RunSummary(run_dir, recipe.name)
    skipped = stage.skip(recipe)
    if skipped is not None:
        summary.set_stage(name, "skipped", 0.0, reason=skipped.get("skipped"))
        summary.set_section(name, skipped)
        return skipped
    try:
        with summary.stage(name):
            try:
                section = stage.run(recipe, run_dir, **inputs)
            except SectionError as e:
                summary.set_section(name, e.section)
                if publish and e.section and stage.report.failed_title:
                    publish(stage.report, e.section, True)
                raise
            summary.set_section(name, section)
    except BaseException as e:
        redact_exception(e)  # whoever shows it next (Prefect's state message, the CLI) reads the clean text
        raise
    if publish:
        publish(stage.report, section, False)
    return section
