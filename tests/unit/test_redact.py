"""Secrets stay secret (issue 40 item 5): what leaves a process as text is redacted (summary.json, log records with
their tracebacks, a failing stage's exception), and the processes a run starts get no secret they do not use."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest

from kimi_pipeline.cluster.env import ray_env
from kimi_pipeline.cluster.local import LocalCluster
from kimi_pipeline.engine.sglang import sglang_env
from kimi_pipeline.errors import SectionError
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.stages import Stage, StageReport, stage_run
from kimi_pipeline.util import redact as redaction
from kimi_pipeline.util.redact import install_log_redaction, redact, redact_exception, register_secret
from kimi_pipeline.util.secret_env import without_secrets

HF = "SentinelHubToken-4f7a9c2e81"  # not `hf_`-shaped: only its value can find it
BLOCK = "blockSecretValue-93c1d7e0aa"  # a Prefect Secret block's value: in no env var


@pytest.fixture
def secrets(monkeypatch):
    """HF_TOKEN in the env and a registered secret (as tasks/secrets.py registers a block's value); the registry and
    the log-record factory are restored afterwards."""
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setattr(redaction, "_registered", {})
    monkeypatch.setattr(redaction, "_logs_redacted", False)
    factory = logging.getLogRecordFactory()
    register_secret(BLOCK, "WANDB_API_KEY")
    yield
    logging.setLogRecordFactory(factory)


def test_values_and_credential_shapes_are_redacted_and_checksums_kept(secrets):
    commit, digest = "0123456789abcdef0123456789abcdef01234567", "ab" * 32
    text = (f"401 for {HF} (key {BLOCK}); hf_abcdefghijklmnopqrstuvwxyz0123 env HUGGING_FACE_HUB_TOKEN=other-value "
            f"{{'RAY_AUTH_TOKEN': 'deadbeef'}} Authorization: Bearer abcdefghij0123456789; revision {commit} "
            f"sha256 {digest}; short x")
    assert redact(text) == (
        "401 for <HF_TOKEN> (key <WANDB_API_KEY>); <hf-token> env HUGGING_FACE_HUB_TOKEN=<HUGGING_FACE_HUB_TOKEN> "
        "{'RAY_AUTH_TOKEN': '<RAY_AUTH_TOKEN>'} Authorization: Bearer <redacted>; "
        f"revision {commit} sha256 {digest}; short x")
    assert redact(redact(text)) == redact(text)
    register_secret("abc", "TOO_SHORT")  # would redact ordinary words
    assert redact("abc") == "abc"


def test_log_records_and_their_tracebacks_are_redacted_for_handlers_added_later(secrets):
    install_log_redaction()
    install_log_redaction()  # idempotent: one factory
    out = io.StringIO()
    handler = logging.StreamHandler(out)  # added after the install, like Prefect's and Ray's handlers
    logger = logging.getLogger("kimi_pipeline.test_redact")
    logger.addHandler(handler)
    try:
        logger.warning("hub refused %s", HF)
        try:
            raise RuntimeError(f"W&B refused key {BLOCK}")
        except RuntimeError:
            logger.exception("upload failed")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "hub refused <HF_TOKEN>" in text and "RuntimeError: W&B refused key <WANDB_API_KEY>" in text, text
    assert HF not in text and BLOCK not in text


PROBE = Stage(name="download", reads=(), needs=(), outputs=(),
              report=StageReport(key="probe", render=lambda s: str(s), title="probe", failed_title="probe failed"))


def _refused(recipe, run_dir):
    """A stage's work that fails quoting secrets, in its message and in the partial section it carries."""
    raise SectionError(f"hub said 401 to token {HF}", {"detail": f"key {BLOCK}"})


def test_a_failing_stage_records_and_raises_its_error_redacted(tmp_path, secrets):
    recipe = load_recipe("tiny")
    published = []
    with pytest.raises(SectionError) as raised:
        with stage_run(PROBE, recipe, tmp_path, publish=lambda r, section, failed: published.append(section)) as record:
            record(_refused(recipe, tmp_path))
    summary = (tmp_path / "summary.json").read_text()
    data = json.loads(summary)
    assert data["stages"]["download"]["error"] == "hub said 401 to token <HF_TOKEN>"
    assert data["download"] == {"detail": "key <WANDB_API_KEY>"}
    assert HF not in summary and BLOCK not in summary
    assert str(raised.value) == "hub said 401 to token <HF_TOKEN>"  # what Prefect's state message and the CLI show
    assert published  # the section reaches the publisher (tasks/common.py redacts the artifact it makes)


def test_an_exception_chain_is_redacted_where_its_message_is_its_arguments(secrets):
    class Custom(Exception):
        def __str__(self) -> str:
            return "built elsewhere"

    try:
        try:
            raise OSError(2, f"no such file: /cache/{HF}")
        except OSError as inner:
            raise ValueError(f"fetch failed with {BLOCK}") from inner
    except ValueError as e:
        redact_exception(e)
        assert str(e) == "fetch failed with <WANDB_API_KEY>" and "<HF_TOKEN>" in str(e.__cause__)
    custom = Custom(HF)
    assert redact_exception(custom).args == (HF,)  # left alone: its text is redacted where it is written


def test_processes_a_run_starts_get_no_flow_secret(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", HF)
    monkeypatch.setenv("WANDB_API_KEY", BLOCK)
    monkeypatch.setenv("KIMI_NOTIFY_WEBHOOK", "https://hooks.example.com/services/T0/B0/secret")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-cluster-token-0123")
    flow_only = {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "KIMI_NOTIFY_WEBHOOK"}
    cluster = LocalCluster(tmp_path, {"env": ray_env(tmp_path, "token"), "marker": "m"})
    for env in (cluster.process_env({"EXTRA": "1"}), without_secrets(), sglang_env(os.environ, memory_saver=False)):
        assert not flow_only & set(env), flow_only & set(env)
    env = cluster.process_env({"EXTRA": "1"})
    assert env["RAY_AUTH_TOKEN"] == "ray-cluster-token-0123"  # token auth: every Ray process needs it
    assert env["EXTRA"] == "1" and env["RAY_AUTH_MODE"] == "token" and "PATH" in env
