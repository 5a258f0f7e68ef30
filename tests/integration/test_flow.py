"""The Prefect flow `kimi` in-process against a real (temporary) Prefect server: summary contract,
cache hit on re-run, cache miss after a data change, failure states."""

from __future__ import annotations

import json
import sys

import pytest
from support.common import ONE_NODE_WEIGHT_JOBS, ROOT, tiny_overrides

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out: Prefect flows over a tiny run (~15 s of set-up)

sys.path.insert(0, str(ROOT))

from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId  # noqa: E402
from support.prefect_home import migrated_test_harness  # noqa: E402

from flows.kimi import kimi  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def prefect_server():
    with migrated_test_harness():
        yield


def task_states(flow_state) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
        )
    return {tr.name.rsplit("-", 1)[0]: tr.state.name for tr in runs}


def run(run_dir, overrides, until="convert"):
    return kimi(recipe="tiny", overrides=overrides, run_dir=str(run_dir), until=until, return_state=True)


@pytest.mark.slow
def test_flow_summary_cache_hit_and_miss(tmp_path, tiny_copy):
    overrides = tiny_overrides(tiny_copy) + ONE_NODE_WEIGHT_JOBS  # the caches' claim, not the conversion's layout
    run_dir = tmp_path / "run"
    first = run(run_dir, overrides)
    assert first.is_completed(), first
    assert task_states(first) == {"download": "Completed", "validate": "Completed", "convert": "Completed"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["recipe"] == "tiny"
    for stage in ("download", "validate", "convert"):
        assert summary["stages"][stage]["status"] == "completed"
    assert summary["convert"]["verified"] is True and summary["convert"]["max_abs_diff"] == 0.0
    for stage in ("cluster", "train", "export"):
        assert summary["stages"][stage]["status"] == "skipped"
        assert isinstance(summary["stages"][stage]["seconds"], float)
    assert summary["validate"]["rows"] == 844 and summary["validate"]["bad_rows"] == 0
    assert summary["validate"]["contamination"]["overlap"] == 0
    assert (run_dir / "summary.md").read_text().startswith("# Run summary: tiny")
    assert (run_dir / "recipe.yaml").is_file()

    second = run(run_dir, overrides)
    assert second.is_completed()
    assert task_states(second) == {"download": "Cached", "validate": "Cached", "convert": "Cached"}

    # a data change: append a new valid row (and refresh the shipped manifest, as `kimi data make-tiny` would)
    from kimi_pipeline.data.tiny_assets import write_manifests

    with open(tiny_copy / "dapo-math-tiny.jsonl", "a") as f:
        f.write(json.dumps({"prompt": [{"role": "user", "content": "What is 11-4?"}], "label": "7"}) + "\n")
    write_manifests(tiny_copy)
    third = run(run_dir, overrides)
    assert third.is_completed()
    # the model did not change: its conversion is still valid
    assert task_states(third) == {"download": "Completed", "validate": "Completed", "convert": "Cached"}
    assert json.loads((run_dir / "summary.json").read_text())["validate"]["rows"] == 845

    # outputs deleted behind the cache's back: the stage runs again instead of trusting a stale result
    (run_dir / "validate" / "train.jsonl").unlink()
    fourth = run(run_dir, overrides)
    assert task_states(fourth)["validate"] == "Completed"
    assert (run_dir / "validate" / "train.jsonl").is_file()


@pytest.mark.slow
def test_flow_fails_clearly_on_bad_data_without_retrying(tmp_path, tiny_copy):
    with open(tiny_copy / "aime-tiny.jsonl", "a") as f:
        f.write("this is not json\n")
    from kimi_pipeline.data.tiny_assets import write_manifests

    write_manifests(tiny_copy)
    run_dir = tmp_path / "run"
    state = run(run_dir, tiny_overrides(tiny_copy))
    assert state.is_failed()
    # bad data is permanent: the validate task ran once (3 retries are allowed for transient failures), its
    # history has no retry, and the flow run itself ran once
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        runs = [tr for tr in client.read_task_runs(flow_run_filter=this_run) if tr.name.rsplit("-", 1)[0] == "validate"]
        assert len(runs) == 1, [tr.name for tr in runs]
        history = [s.name for s in client.read_task_run_states(runs[0].id)]
        flow_run_count = client.read_flow_run(flow_run_id).run_count
    assert runs[0].state.name == "Failed" and runs[0].run_count == 1, (runs[0].state.name, runs[0].run_count)
    assert not {"AwaitingRetry", "Retrying"} & set(history) and history[-1] == "Failed", history
    assert flow_run_count == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stages"]["validate"]["status"] == "failed"
    rows = len((tiny_copy / "aime-tiny.jsonl").read_text().splitlines())
    assert f"eval: 1/{rows} rows bad" in summary["stages"]["validate"]["error"]
    quarantine = (run_dir / "validate" / "quarantine-eval.jsonl").read_text().splitlines()
    assert json.loads(quarantine[0])["reasons"][0].startswith("not valid JSON")


def test_until_marks_later_stages_skipped(tmp_path, tiny_copy):
    state = kimi(recipe="tiny", overrides=tiny_overrides(tiny_copy), run_dir=str(tmp_path / "r"), until="download",
                 return_state=True)
    assert state.is_completed()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["stages"]["validate"]["status"] == "skipped"


def test_hf_token_from_prefect_secret_block(monkeypatch):
    from prefect.blocks.system import Secret

    from tasks.secrets import hf_token

    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert hf_token() is None
    Secret(value="hf_from_block_123").save("hf-token", overwrite=True)
    assert hf_token() == "hf_from_block_123"
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert hf_token() == "hf_from_env"
