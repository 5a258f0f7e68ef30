"""Secrets stay secret where a failed run's text leaves the flow's process (issue 40 item 5): a stage whose error
and partial section quote the hub token (from HF_TOKEN) and the W&B key (from the Prefect Secret block
`wandb-api-key`, in no env var) fails in a real Prefect flow with the failure hook of flow `kimi`. summary.json,
summary.md, FAILED.md, the webhook, the flow run's logs, its artifacts and the task's state message show
placeholders, never the values."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, task
from prefect.blocks.system import Secret
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.logging.handlers import APILogHandler
from support.prefect_home import migrated_test_harness

from flows.notify import FAILED_FILE, notify_failure
from kimi_pipeline.errors import SectionError
from kimi_pipeline.recipes import Recipe, load_recipe
from kimi_pipeline.report.markdown import write_summary_markdown
from kimi_pipeline.stages import Stage, StageReport
from kimi_pipeline.util import redact as redaction
from kimi_pipeline.util.redact import install_log_redaction
from support.webhook_server import webhook_receiver
from tasks.common import markdown_artifact, stage_task
from tasks.secrets import hf_token, wandb_key

HF = "SentinelHubToken-7d3b9e1f40"  # not `hf_`-shaped: only its value can find it
WANDB = "blockWandbKey-2a6c8e0f93"


def _refused(recipe: Recipe, run_dir: Path, token: str | None, key: str | None) -> dict[str, Any]:
    raise SectionError(f"hub answered 401 Unauthorized for token {token} (W&B key {key})",
                       {"detail": f"Authorization: Bearer {token}; W&B key {key}"})


REFUSED = Stage(name="download", reads=(), needs=(), outputs=(),
                report=StageReport(key="hub-refusal", render=lambda s: f"hub said: {s['detail']}", title="hub",
                                   failed_title="hub refused: {detail}"))


@task(name="download", retries=0, cache_policy=NO_CACHE, persist_result=False)
def refused_task(recipe: Recipe, run_dir: str) -> dict[str, Any]:
    with stage_task(REFUSED, recipe, run_dir) as record:  # as tasks/download.py
        return record(_refused(recipe, Path(run_dir), token=hf_token(), key=wandb_key()))


@flow(name="kimi-redaction", on_failure=[notify_failure])
def refused_flow(run_dir: str) -> None:
    install_log_redaction()  # as flow `kimi` does first
    try:
        refused_task(load_recipe("tiny"), run_dir)
    finally:
        markdown_artifact(write_summary_markdown(Path(run_dir)).read_text(), "run-summary", "summary")


@pytest.fixture
def redaction_state(monkeypatch):
    """The registry and the process's log-record factory as they were before the flow installed its own."""
    monkeypatch.setattr(redaction, "_registered", {})
    monkeypatch.setattr(redaction, "_logs_redacted", False)
    factory = logging.getLogRecordFactory()
    yield
    logging.setLogRecordFactory(factory)


@pytest.mark.slow
def test_a_failed_run_shows_no_secret_in_summary_failed_md_webhook_logs_or_artifacts(tmp_path, monkeypatch,
                                                                                     redaction_state):
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    with webhook_receiver() as (url, received), migrated_test_harness():
        monkeypatch.setenv("KIMI_NOTIFY_WEBHOOK", url)
        Secret(value=WANDB).save("wandb-api-key", overwrite=True)
        state = refused_flow(str(run_dir), return_state=True)
        flow_run_id = state.state_details.flow_run_id
        APILogHandler().flush()  # the flow run's log records are sent in batches: all of them, before they are read
        with get_client(sync_client=True) as c:
            logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            artifacts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
                any_=[flow_run_id])))
            task_runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    assert state.is_failed()
    texts = {
        "summary.json": (run_dir / "summary.json").read_text(),
        "summary.md": (run_dir / "summary.md").read_text(),
        FAILED_FILE: (run_dir / FAILED_FILE).read_text(),
        "webhook": json.dumps(received),
        "logs": "\n".join(lg.message for lg in logs),
        "artifacts": "\n".join(f"{a.key} {a.description} {json.dumps(a.data, default=str)}" for a in artifacts),
        "task state": "\n".join(str(t.state.message) for t in task_runs),
    }
    leaks = [where for where, text in texts.items() if HF in text or WANDB in text]
    assert leaks == [], leaks
    # each place did receive the failure, with the secrets' placeholders where they were
    quoted = "hub answered 401 Unauthorized for token <HF_TOKEN> (W&B key <WANDB_API_KEY>)"
    assert json.loads(texts["summary.json"])["stages"]["download"]["error"] == quoted
    for where in (FAILED_FILE, "webhook", "logs", "task state"):
        assert quoted in texts[where], (where, texts[where][-2000:])
    assert "hub refused: Authorization: Bearer <HF_TOKEN>; W&B key <WANDB_API_KEY>" in texts["artifacts"]
