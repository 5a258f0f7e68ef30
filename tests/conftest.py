"""Test environment: Prefect home in a temp dir, analytics off, no network for the hub."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kimi_pipeline.cli import configure_prefect_env

_HOME = tempfile.mkdtemp(prefix="kimi-test-prefect-")
os.environ["PREFECT_HOME"] = _HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
configure_prefect_env()  # the same Prefect settings `kimi run` uses (ephemeral server start-up timeout among them)
for var in ("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "OPEN_TRAINING_INT4_GROUP_SIZE"):
    os.environ.pop(var, None)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "data" / "tiny"


# Runs whose metrics are compared bit for bit (kill -9 + retry vs an uninterrupted run) use one intra-op thread
# per process: a multi-threaded CPU reduction may split work differently from one process to the next, and
# on the tiny model a 1e-7 difference can flip a near-tied expert choice (CI saw two runs differ at step 1).
REPRODUCIBLE = ["cluster.cpus_per_node=1"]


def assert_same_rows(got: list[dict], expected: list[dict], resumed_after: int) -> None:
    """Metrics rows equal, or a failure naming the first step/keys that differ and whether that step ran
    before the checkpoint the retry resumed from (then the runs themselves are not reproducible)."""
    for g, e in zip(got, expected):
        diff = sorted((k, g.get(k), e.get(k)) for k in set(g) | set(e) if g.get(k) != e.get(k))
        if diff:
            where = (f"before the step-{resumed_after} checkpoint the retry resumed from: two uninterrupted "
                     "processes already disagree (not a resume bug)" if g["step"] <= resumed_after
                     else f"after resuming from the step-{resumed_after} checkpoint")
            pytest.fail(f"step {g['step']} differs {where}: (key, got, expected) {diff[:10]}")
    assert [r["step"] for r in got] == [r["step"] for r in expected]


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
