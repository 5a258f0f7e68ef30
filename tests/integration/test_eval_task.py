"""The `eval` Prefect task: a failed evaluation is retried on its own (training is not restarted) and
its result lands in eval.jsonl, the per-problem table and summary.json."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time

import pytest
from support.common import ROOT, TINY, assert_eval_agrees_with_its_problems

sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module", autouse=True)
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_eval_task_retries_until_the_engine_answers(tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from kimi_pipeline.util.net import free_port
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl.engine.model import EngineModel
    from kimi_pipeline.rl.engine.sampler import RolloutEngine
    from kimi_pipeline.rl.engine.server import EngineServer
    from tasks.train import eval_task

    run = tmp_path / "run"
    (run / "validate").mkdir(parents=True)
    shutil.copy(TINY / "aime-tiny.jsonl", run / "validate" / "eval.jsonl")
    recipe = load_recipe("tiny", ["eval.n_samples_per_prompt=2"])
    port = free_port()
    servers: list[EngineServer] = []

    server = EngineServer(RolloutEngine(EngineModel.from_pretrained(TINY / "model"), seed=0), port=port)

    def start_late() -> None:  # the engine comes up only after the first attempt has failed
        time.sleep(1.0)
        server.start()
        servers.append(server)

    @flow
    def one_eval():
        return eval_task(recipe, str(run), 20, [f"http://127.0.0.1:{port}"], str(TINY / "model"), return_state=True)

    starter = threading.Thread(target=start_late)
    starter.start()
    try:
        state = one_eval(return_state=True)
    finally:
        starter.join()
        for s in servers:
            s.stop()
    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
        (tr,) = [r for r in runs if r.name.startswith("eval-step-20")]
        history = [s.name for s in client.read_task_run_states(tr.id)]
    assert "Retrying" in history and history[-1] == "Completed", history
    (row,) = [json.loads(line) for line in (run / "eval" / "eval.jsonl").read_text().splitlines()]
    assert row["step"] == 20 and row["n"] == 2 and row["problems"] == sum(1 for _ in open(TINY / "aime-tiny.jsonl"))
    # the scores are what the per-problem table adds up to, and its counts agree with the recorded responses
    assert_eval_agrees_with_its_problems(row, run / "eval" / "step_0000020.json")
    (recorded,) = json.loads((run / "summary.json").read_text())["eval"]
    assert recorded == {k: row[k] for k in ("step", "avg_at_n", "pass_at_1", "pass_at_n", "maj_at_n")}
