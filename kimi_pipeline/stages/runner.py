"""The one runner of the DAG's stages: every stage is a `Stage` (declared in its own module of this package, beside
its `run` function) and runs inside `stage_run`, which owns what all of them share: the status and duration in
summary.json, the stage's section (also the partial one a failing stage carries), the stage's report for a caller
that publishes it (the Prefect tasks make it an artifact; the CLI prints the section), and a failing stage's error
with the secrets in its message redacted.

The runner does not call the stage: its caller does, by name, inside the block, so that a reader (or a type
checker) follows a task or a CLI command straight into the stage's code:

    with stage_run(CONVERT, recipe, run_dir) as record:
        return record(convert.run(recipe, run_dir))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import SectionError
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.summary import RunSummary, error_line
from kimi_pipeline.util.redact import redact_exception

Section = dict[str, Any]
# publish(report, section, failed): hands a stage's report and section to whoever shows it (a Prefect artifact)
Publish = Callable[["StageReport", Section, bool], None]
# record(section) -> section: what a `stage_run` block hands its stage's result to
Record = Callable[[Section], Section]


class Skipped(dict[str, Any]):
    """The section of a stage the recipe does not need (its `skipped` key says why), returned by the stage's own
    `run` so that a reader sees the decision where the work is: the runner records the stage as skipped, in no
    time, and publishes no report."""


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
    """One step of the DAG, declared once beside its work, `run(recipe, run_dir, ...) -> section` in the same
    module (`kimi_pipeline.stages.<name>.run`, called by name wherever the stage runs); the runner, the Prefect
    task, the flow and the CLI read this.

    - `reads`: the recipe sections the stage and what it calls read (what a reader needs to know; the Prefect
      task's cache key hashes those of them that decide its outputs). A stage that hands its components sections
      declares exactly what its code and the section records it builds read (`tests/unit/test_stage_contract.py`);
    - `needs`: the earlier stages whose outputs it reads;
    - `outputs`: files under the run dir a cached result needs (empty: the stage is never cached);
    - `report`: how its section reads for a person."""

    name: str
    reads: tuple[str, ...]
    needs: tuple[str, ...]
    outputs: tuple[str, ...]
    report: StageReport


@contextmanager
def stage_run(stage: Stage, recipe: Recipe, run_dir: str | Path, *, record_as: str | None = None,
              publish: Publish | None = None) -> Iterator[Record]:
    """Run the block as `stage` for `recipe` in `run_dir`: record it running, then completed (or failed with its
    error) with its duration, and the section the block hands to `record` (exactly once: a block that records
    nothing failed to say what it did); a failure that carries a partial section (`SectionError`) records that
    too, a `Skipped` section records the stage as skipped. `record_as`: where summary.json records this run
    (default: the stage's name; the train stage's debugging modes keep their own records). `publish` gets the
    stage's report (the Prefect tasks make it an artifact)."""
    name = record_as or stage.name
    summary = RunSummary(Path(run_dir), recipe.name)
    recorded: list[Section] = []

    def record(section: Section) -> Section:
        recorded.append(section)
        return section

    started = time.monotonic()
    summary.set_stage(name, "running")
    try:
        try:
            yield record
        except SectionError as e:
            summary.set_section(name, e.section)
            if publish and e.section and stage.report.failed_title:
                publish(stage.report, e.section, True)
            raise
        if len(recorded) != 1:
            raise RuntimeError(f"stage {name}: its block recorded {len(recorded)} sections, not one")
        section = recorded[0]
        summary.set_section(name, section)
    except BaseException as e:
        summary.set_stage(name, "failed", time.monotonic() - started, error=error_line(e))
        redact_exception(e)  # whoever shows it next (Prefect's state message, the CLI) reads the clean text
        raise
    if isinstance(section, Skipped):
        summary.set_stage(name, "skipped", 0.0, reason=section.get("skipped"))
        return
    summary.set_stage(name, "completed", time.monotonic() - started)
    if publish:
        publish(stage.report, section, False)
