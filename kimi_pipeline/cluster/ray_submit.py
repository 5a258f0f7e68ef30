"""`ray job submit` for users who run the pipeline as a Ray job on an existing cluster.

The entrypoint runs on the head node with RAY_ADDRESS set to the cluster, so the recipe gets
`cluster.address=auto`. It must name the venv's interpreter by absolute path: inside a job, a bare
`python` resolves to the system interpreter, which has neither Ray's pinned version nor this project.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path


def ray_submit_command(
    recipe: str,
    dashboard: str = "http://127.0.0.1:8265",
    overrides: Sequence[str] = (),
    python: str | None = None,
    no_wait: bool = False,
) -> list[str]:
    """argv for `ray job submit` running `kimi run --recipe RECIPE` against the job's cluster."""
    py = python or sys.executable  # not resolved: the venv's bin/python symlink is what selects the venv
    ray_cli = Path(py).with_name("ray")
    ray = [str(ray_cli)] if ray_cli.is_file() else [py, "-m", "ray.scripts.scripts"]
    sets = [a for o in ["cluster.address=auto", *overrides] for a in ("--set", o)]
    return [
        *ray, "job", "submit", "--address", dashboard, *(["--no-wait"] if no_wait else []), "--",
        py, "-m", "kimi_pipeline.cli", "run", "--recipe", recipe, *sets,
    ]


def ray_submit_text(recipe: str, dashboard: str = "http://127.0.0.1:8265", overrides: Sequence[str] = ()) -> str:
    """The same command as one shell line (for docs and `kimi cluster job-command`)."""
    return shlex.join(ray_submit_command(recipe, dashboard, overrides))
