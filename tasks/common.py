"""Shared task plumbing: retry policy, content-hash cache keys, output-presence checks (`cached`), artifacts (every
one redacted: the Prefect API stores them and the UI shows them to whoever can read the workspace)."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from prefect import Task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.tasks import exponential_backoff

from kimi_pipeline.errors import is_permanent
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.stages import Record, Stage, StageReport, stage_run
from kimi_pipeline.stages.runner import Publish
from kimi_pipeline.util.files import sha256_json
from kimi_pipeline.util.redact import redact, redact_data

P = ParamSpec("P")
R = TypeVar("R")

RETRIES = 3
RETRY_DELAYS = exponential_backoff(backoff_factor=5)


def retry_unless_permanent(task, task_run, state) -> bool:
    """Retry transient failures (network, lost node); never a bad recipe, bad data or corrupt local file."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - we are classifying it
        return not is_permanent(exc)
    return True


def cache_key(stage: str, *parts: Any) -> str:
    """Key from content hashes (never bare paths alone) + the stage name + a version of its logic."""
    return f"kimi-{stage}-v1-" + sha256_json(parts)


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def outputs_present(run_dir: str | Path, *relative: str) -> bool:
    """A cached result is only usable if the files it points at still exist."""
    return all((Path(run_dir) / r).exists() for r in relative)


def cached(task: Task[P, R], stage: Stage, run_dir: str | Path) -> Task[P, R]:
    """`task` whose cached result is used only while the `stage`'s outputs (paths relative to `run_dir`) all
    exist; otherwise it runs again and refreshes the cache entry."""
    return task.with_options(refresh_cache=not outputs_present(run_dir, *stage.outputs))


def publish_artifact(recipe: Recipe) -> Publish:
    """The stage runner's `publish` for a Prefect task: the stage's report as a markdown (or table) artifact."""

    def publish(report: StageReport, section: dict[str, Any], failed: bool) -> None:
        title = (report.failed_title if failed else report.title) or ""
        description = redact(title.format_map({**section, "recipe": recipe.name}))
        if report.table:
            create_table_artifact(redact_data(report.render(section)), key=report.key, description=description)
        else:
            markdown_artifact(report.render(section), report.key, description)

    return publish


def markdown_artifact(markdown: str, key: str, description: str) -> None:
    """A markdown artifact, redacted (every task's and the flow's)."""
    create_markdown_artifact(redact(markdown), key=key, description=redact(description))


def stage_task(stage: Stage, recipe: Recipe, run_dir: str | Path) -> AbstractContextManager[Record]:
    """What every stage task wraps the call of its stage's `run` in: the one runner (summary.json, timing, errors),
    the stage's report published as an artifact. The task calls the stage by name inside the block, so the way
    from the task to the stage's code is a call a reader can follow."""
    return stage_run(stage, recipe, run_dir, publish=publish_artifact(recipe))
