"""Issue 14 item 3: context parallelism. Sequences are split megatron's load-balanced way (2·CP chunks,
rank r holds chunks r and 2·CP-1-r) and logprobs / entropy are gathered back to whole sequences, with
gradients flowing to each rank's own positions only.

What runs here: the split/gather round trip, and logprobs + gradients of CP-split logits over a real gloo
CP group equal to the unsplit ones. What needs Transformer Engine (GPU): the model forward itself, since
megatron's local DotProductAttention refuses context_parallel_size > 1."""

from __future__ import annotations

import pytest
import torch

from kimi_pipeline.model.context_parallel import cp_positions, cp_split, cp_unsplit, seq_multiple


def test_load_balanced_chunks():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="multiple of 2 x context parallel"):
        cp_positions(6, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_then_unsplit_is_exact(cp):
    g = torch.Generator().manual_seed(cp)
    tokens = torch.randint(0, 1000, (3, 16 * cp), generator=g)
    ids = torch.randint(0, 64, (3, 16 * cp, 5, 4), generator=g)  # routing replay ids [b, s, layers, k]
    for t in (tokens, ids):
        parts = [cp_split(t, cp, r) for r in range(cp)]
        assert all(p.shape[1] == t.shape[1] // cp for p in parts)
        assert torch.equal(cp_unsplit(parts), t)
    # every position is held by exactly one rank
    held = torch.cat([cp_positions(16 * cp, cp, r) for r in range(cp)]).sort().values
    assert torch.equal(held, torch.arange(16 * cp))


def test_sequence_multiple_covers_cp_chunks_and_sequence_parallel():
    assert seq_multiple(tp=8, cp=4, sequence_parallel=True) == 64  # the presets: TP8 SP, CP4
    assert seq_multiple(tp=8, cp=1, sequence_parallel=True) == 8
    assert seq_multiple(tp=8, cp=4, sequence_parallel=False) == 8
    assert seq_multiple(tp=1, cp=1, sequence_parallel=False) == 1


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_logprobs_and_gradients_equal_the_unsplit_ones(tmp_path, cp):
    from megatron_worker import launch

    ranks = launch("cp", cp, tmp_path, {"cp": cp})
    for r, got in enumerate(ranks):
        assert got["local_len"] == 8  # each rank held 1/cp of the sequence
        assert got["lp_diff"] < 1e-6 and got["ent_diff"] < 1e-6 and got["grad_diff"] < 1e-6, got
        # every CP rank computes the whole-sequence loss: only rank 0 counts its denominator
        assert got["denominator"] == (5 if r == 0 else 0)
