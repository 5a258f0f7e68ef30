"""Issue 42 item 1 on a GPU: the trainer's GRPO micro-batches (bf16, every loss term on) under CUDA's own sync
check (`torch.cuda.set_sync_debug_mode`), and under the recorder the CPU suite uses: every wait the CUDA runtime
reports comes from a megatron file listed in `model/host_syncs.MEGATRON_SYNCS`, and the recorder finds none of
ours. The CPU twin is tests/integration/test_host_syncs.py."""

from __future__ import annotations

import warnings

import pytest

from support.common import one_grpo_step

pytestmark = pytest.mark.gpu


def _caller() -> str:
    """Where a synchronizing call was made: the first frame outside torch, the recorder and this test, and the
    torch function the recorder was passing through when it happened (its `func`), if any."""
    import os
    import sys

    import torch

    skip = (os.path.dirname(torch.__file__), "warnings.py", "test_gpu_host_syncs.py", "host_syncs.py",
            "megatron_compat.py")
    frame, through, where = sys._getframe(1), None, "?"
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith("host_syncs.py") and through is None and "func" in frame.f_locals:
            through = getattr(frame.f_locals["func"], "__qualname__", str(frame.f_locals["func"]))
        if where == "?" and not any(part in name for part in skip):
            where = f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return where + (f" (through {through})" if through else "")


def test_a_bf16_grpo_step_on_the_gpu_waits_only_where_megatron_must(cuda, monkeypatch):
    import torch

    from kimi_pipeline.model.host_syncs import HostSyncRecorder, megatrons
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl import policy as policy_module

    recipe = load_recipe("tiny", ["cluster.device=cuda", "model.params_dtype=bfloat16", "grpo.use_tis=true",
                                  "grpo.use_kl_loss=true", "grpo.kl_loss_coef=0.01", "grpo.entropy_coef=0.001",
                                  "rollout.num_steps_per_rollout=1", "rollout.rollout_batch_size=4",
                                  "rollout.n_samples_per_prompt=4"])
    recorder, waits = HostSyncRecorder(), []
    real = policy_module.forward_backward

    def show(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" in str(message):
            waits.append(f"synchronizing call at {_caller()}")

    def recorded(model, batches, loss_fn, **kwargs):
        torch.cuda.synchronize(cuda)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with recorder.recording():
                    return real(model, batches, loss_fn, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(policy_module, "forward_backward", recorded)
    metrics = one_grpo_step(recipe, cuda)
    assert metrics["optimizer_steps"] == 1
    assert recorder.ours() == [], recorder.summary()
    print("CUDA's sync check in the micro-batches:\n" + ("\n".join(waits) or "no synchronizing call"))
    assert [x for x in waits if not megatrons(x)] == [], "\n".join(waits)
