"""Pipeline parallelism pads micro-batches to one shape; the padding rows must not change the loss or its
gradient (issue 14 item 4: they scaled the gradient by real/padded rows, 0.6 for 3 real rows of 5)."""

from __future__ import annotations

import pytest
import torch

from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.rl.step_metrics import settle
from kimi_pipeline.rl.policy import microbatch_loss

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def single_process():
    """The logprob reduction runs over megatron's TP group: one gloo rank."""
    from kimi_pipeline.model import parallel

    parallel.init_distributed(parallel.Layout(), device=CPU, seed=3)
    yield
    parallel.destroy()


def _batch(rows: int, T: int, V: int, g: torch.Generator) -> tuple[torch.Tensor, dict]:
    logits = torch.randn(rows, T, V, generator=g)
    mask = (torch.rand(rows, T, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    batch = {"targets": torch.randint(0, V, (rows, T), generator=g), "mask": mask,
             "old_logprobs": -torch.rand(rows, T, generator=g), "rollout_logprobs": -torch.rand(rows, T, generator=g),
             "advantages": torch.randn(rows, generator=g), "rows": rows}
    return logits, batch


def _pad(logits: torch.Tensor, batch: dict, rows: int) -> tuple[torch.Tensor, dict]:
    def pad(t, value=0):
        out = torch.full((rows, *t.shape[1:]), value, dtype=t.dtype)
        out[: t.shape[0]] = t
        return out

    return pad(logits), {k: v if k == "rows" else pad(v) for k, v in batch.items()}


def test_padding_rows_change_neither_loss_nor_gradient():
    grpo = load_recipe("tiny", ["grpo.use_tis=true"]).grpo
    g = torch.Generator().manual_seed(0)
    logits, batch = _batch(3, 7, 11, g)
    plain = logits.clone().requires_grad_(True)
    loss, rows, m = microbatch_loss(plain, batch, grpo)
    loss.backward()
    padded_logits, padded_batch = _pad(logits, batch, 5)
    padded = padded_logits.clone().requires_grad_(True)
    ploss, prows, pm = microbatch_loss(padded, padded_batch, grpo)
    ploss.backward()
    assert rows == prows == 3
    m, pm = settle([m, pm])
    torch.testing.assert_close(ploss, loss)
    torch.testing.assert_close(padded.grad[:3], plain.grad)
    assert padded.grad[3:].abs().max() == 0
    for key in ("pg_loss", "ppo_kl", "clip_fraction", "tis_mean", "tis_min", "tis_max"):
        assert pm[key] == m[key], key  # metrics are means over real samples only


def test_an_all_padding_micro_batch_contributes_nothing():
    grpo = load_recipe("tiny").grpo
    logits, batch = _batch(2, 5, 7, torch.Generator().manual_seed(1))
    batch["mask"].zero_()
    batch["rows"] = 0
    x = logits.clone().requires_grad_(True)
    loss, rows, m = microbatch_loss(x, batch, grpo)
    loss.backward()
    assert rows == 0 and float(loss) == 0.0 and x.grad.abs().max() == 0
