"""Path resolution shared by every stage: `{base_dir}` expansion, project-relative paths, run dirs."""

from __future__ import annotations

import re
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(value: str | Path, base_dir: str | Path = "runs") -> Path:
    """Expand `{base_dir}` and `~`; relative paths are taken from the working directory when they
    exist there, else from the project root (so a Prefect worker started elsewhere finds data/)."""
    text = str(value)
    if "{base_dir}" in text:
        text = text.replace("{base_dir}", str(resolve_path(base_dir, "runs")))
    p = Path(text).expanduser()
    if p.is_absolute():
        return p
    cwd_candidate = Path.cwd() / p
    if cwd_candidate.exists():
        return cwd_candidate.resolve()
    proj = PROJECT_ROOT / p
    return proj.resolve() if proj.exists() else cwd_candidate.resolve()


def new_run_dir(base_dir: str | Path, recipe_name: str) -> Path:
    """A fresh `<base_dir>/<time>-<recipe>` directory, created here and never an existing one: two runs of a recipe
    started in the same second get `…-<recipe>` and `…-<recipe>-2` (mkdir is atomic, so the race has one winner)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", recipe_name)
    base = resolve_path(base_dir)
    base.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = base / (f"{stamp}-{safe}" if n == 1 else f"{stamp}-{safe}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{base}: 9999 run directories named {stamp}-{safe}-N already exist")
