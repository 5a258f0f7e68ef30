"""The `eval` Prefect task: a failed evaluation is retried on its own (training is not restarted) and
its result lands in eval.jsonl, the per-problem table and summary.json."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from support.common import ROOT, TINY, assert_eval_agrees_with_its_problems

# `make test-fast` leaves it out: an engine process and Prefect's ephemeral server (~15 s)
pytestmark = pytest.mark.slow

sys.path.insert(0, str(ROOT))

from prefect import flow  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId  # noqa: E402
from support.prefect_home import migrated_test_harness  # noqa: E402

from kimi_pipeline.engine.client import EngineRequestError  # noqa: E402
from kimi_pipeline.engine.model import EngineModel  # noqa: E402
from kimi_pipeline.engine.rollout_engine import RolloutEngine  # noqa: E402
from kimi_pipeline.engine.server import EngineServer  # noqa: E402
from kimi_pipeline.recipes import load_recipe  # noqa: E402
from kimi_pipeline.util.net import free_port  # noqa: E402
from tasks.common import retry_unless_permanent  # noqa: E402
from tasks.train import eval_task  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def prefect_server():
    with migrated_test_harness():
        yield


def test_eval_task_retries_until_the_engine_answers(tmp_path):
    run = tmp_path / "run"
    (run / "validate").mkdir(parents=True)
    shutil.copy(TINY / "aime-tiny.jsonl", run / "validate" / "eval.jsonl")
    recipe = load_recipe("tiny", ["eval.n_samples_per_prompt=2"])
    port = free_port()
    server = EngineServer(RolloutEngine(EngineModel.from_pretrained(TINY / "model"), seed=0), port=port)
    failures: list[BaseException] = []

    def engine_up_once_the_first_attempt_failed(task, task_run, state) -> bool:
        """The task's own retry condition, called by Prefect when an attempt has failed and before it schedules
        the retry: the engine starts here, so the first attempt always meets no engine and the retry always
        meets a running one, whatever the machine's speed (no wall-clock window between the two)."""
        failures.append(state.result(raise_on_failure=False))
        retry = retry_unless_permanent(task, task_run, state)
        if retry and len(failures) == 1:
            server.start()
        return retry

    eval_until_up = eval_task.with_options(retry_condition_fn=engine_up_once_the_first_attempt_failed)

    @flow
    def one_eval():
        return eval_until_up(recipe, str(run), 20, [f"http://127.0.0.1:{port}"], str(TINY / "model"),
                             return_state=True)

    try:
        state = one_eval(return_state=True)
    finally:
        server.stop()
    # exactly one failed attempt, and it failed because no engine answered (a transient error: retried)
    assert len(failures) == 1 and isinstance(failures[0], EngineRequestError), failures
    assert "ConnectError" in str(failures[0]) and f":{port}/" in str(failures[0]), failures[0]
    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
        (tr,) = [r for r in runs if r.name.startswith("eval-step-20")]
        history = [s.name for s in client.read_task_run_states(tr.id)]
    assert "Retrying" in history and history[-1] == "Completed", history
    assert tr.run_count == 2, tr.run_count  # the failed attempt + the retry that found the engine
    (row,) = [json.loads(line) for line in (run / "eval" / "eval.jsonl").read_text().splitlines()]
    assert row["step"] == 20 and row["n"] == 2 and row["problems"] == sum(1 for _ in open(TINY / "aime-tiny.jsonl"))
    # the scores are what the per-problem table adds up to, and its counts agree with the recorded responses
    assert_eval_agrees_with_its_problems(row, run / "eval" / "step_0000020.json")
    (recorded,) = json.loads((run / "summary.json").read_text())["eval"]
    assert recorded == {k: row[k] for k in ("step", "avg_at_n", "pass_at_1", "pass_at_n", "maj_at_n")}
