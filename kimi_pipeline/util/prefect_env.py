"""The Prefect settings every in-process run uses, as environment defaults (no Prefect import: tests and GPU
machines without Prefect set them too)."""

from __future__ import annotations

import os
from pathlib import Path

from kimi_pipeline.util.paths import PROJECT_ROOT


def configure_prefect_env(project_root: Path | None = None) -> None:
    """In-process Prefect: project-local PREFECT_HOME, analytics off; ephemeral API unless one is set."""

    root = project_root or PROJECT_ROOT
    os.environ.setdefault("PREFECT_HOME", str(root / ".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "true")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "kimi_pipeline")
    # Prefect waits 20 s for its ephemeral server; a fresh PREFECT_HOME runs its database migrations first,
    # measured at 17.7 s on an idle 2-core box (CI, loaded, took longer and failed `kimi run`).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
