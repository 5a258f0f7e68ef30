"""Issue 14 items 3 and 10: context parallelism and THD packing. Sequences are split megatron's load-balanced
way (2·CP chunks, rank r holds chunks r and 2·CP-1-r; packed sequences each on their own) and logprobs /
entropy are gathered back to the batch's [b, s] layout, gradients flowing to each rank's own positions.

What runs here: split/gather and pack/unpack round trips, and logprobs + gradients through a real gloo CP
group equal to the unsplit, unpacked ones (with a position-wise stand-in for the model). What needs
Transformer Engine (GPU): the model forward itself, since megatron's local DotProductAttention refuses
context_parallel_size > 1 and packed (THD) sequences; without TE the trainer keeps padded [b, s] and CP 1."""

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
def test_cp_split_and_thd_packing_give_the_unsplit_logprobs_and_gradients(tmp_path):
    """CP 2 over real gloo ranks (CP 4 took 4 processes on 2 cores; its chunking is covered above)."""
    from support.megatron_worker import launch

    cp = 2
    ranks = launch("cp", cp, tmp_path, {"cp": cp})
    s = 8 * cp
    for r, got in enumerate(ranks):
        for name in ("bshd", "thd"):
            x = got[name]
            assert x["shape"] == [3, s]  # back in the batch's [b, s] layout
            assert x["lp_diff"] < 1e-5 and x["ent_diff"] < 1e-5 and x["grad_diff"] < 1e-5, (name, x)
        assert got["bshd"]["local_len"] == s // cp  # each rank held 1/cp of every sequence
        # packed: the rows' own lengths (s, s-3, 5) padded to 2·cp each, not to s: fewer tokens than 3·s
        padded = sum(-(-n // (2 * cp)) * 2 * cp for n in (s, s - 3, 5))
        assert got["thd"]["local_len"] == padded // cp < 3 * s // cp
        # every CP rank computes the whole-sequence loss: only rank 0 counts its denominator
        assert got["denominator"] == (5 if r == 0 else 0)


def test_packing_round_trip_and_cu_seqlens():
    from kimi_pipeline.model.context_parallel import Packing

    p = Packing((5, 3, 8), width=8, multiple=4)
    t = torch.arange(24).view(3, 8)
    packed = p.pack(t)
    assert packed.shape == (1, 8 + 4 + 8)
    back = p.unpack(packed)
    for i, n in enumerate((8, 4, 8)):  # each row's padded length survives; beyond it zeros
        assert torch.equal(back[i, :n], t[i, :n]) and not back[i, n:].any()
    params = p.seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 5, 8, 16]
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 20] and params.max_seqlen_q == 8
    assert p.positions().tolist() == [list(range(8)) + list(range(4)) + list(range(8))]


def test_the_trainer_packs_only_for_transformer_engine_attention():
    from types import SimpleNamespace

    from kimi_pipeline.model.megatron_train import seq_layout

    batch = {"tokens": torch.zeros(2, 16, dtype=torch.long), "lengths": [16, 9]}
    te = SimpleNamespace(kimi_use_te=True, config=SimpleNamespace(sequence_parallel=False, tensor_model_parallel_size=1))
    local = SimpleNamespace(kimi_use_te=False, config=SimpleNamespace(sequence_parallel=False, tensor_model_parallel_size=1))
    assert seq_layout(te, batch).packing.lengths == (16, 9)
    assert seq_layout(local, batch).packing is None  # megatron's local attention has no THD
    assert seq_layout(te, {"tokens": batch["tokens"]}).packing is None  # no row lengths: nothing to pack
