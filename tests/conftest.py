"""Test environment: Prefect home in a temp dir, analytics off, no network for the hub."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_HOME = tempfile.mkdtemp(prefix="kimi-test-prefect-")
os.environ["PREFECT_HOME"] = _HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
for var in ("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "OPEN_TRAINING_INT4_GROUP_SIZE"):
    os.environ.pop(var, None)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "data" / "tiny"


@pytest.fixture
def tiny_copy(tmp_path: Path) -> Path:
    """A writable copy of data/tiny (tests corrupt or edit it)."""
    dst = tmp_path / "tiny"
    shutil.copytree(TINY, dst)
    return dst


def tiny_overrides(data_dir: Path) -> list[str]:
    return [
        f"hub.model.path={data_dir / 'model'}",
        f"data.train.path={data_dir / 'dapo-math-tiny.jsonl'}",
        f"data.eval.path={data_dir / 'aime-tiny.jsonl'}",
    ]
