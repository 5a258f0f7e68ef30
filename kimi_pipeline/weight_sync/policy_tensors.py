"""The one way trained weights leave megatron as HF-named tensors, per rank.

Three readers use it: weight sync (the live trainer), eval of a torch_dist checkpoint, and the INT4
export (one process per rank, each writing the tensors it owns). `checkpoint_model` builds this
rank's slice of the model and loads its part of a torch_dist checkpoint (megatron reshards: the layout
need not be the one that saved it); `policy_tensors` streams the slice out under HF names, either the
tensors this rank is the designated source of (`owned_only`), or all of them on one rank (`dst`), with
the routed experts fake-quantized when the policy trains with INT4 QAT, so engines and evaluations see
exactly the weights the trainer optimizes. Buckets for transport are cut by the consumer
(`weight_sync.buckets`, `weight_sync.push.chunk_named_tensors`, `util.shards.ShardWriter`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from kimi_pipeline.model.hf_bridge import export_hf_tensors
from kimi_pipeline.model.megatron_model import build_model
from kimi_pipeline.model.megatron_train import load_model_only
from kimi_pipeline.model.parallel import destroy, init_distributed
from kimi_pipeline.model.qat import fake_quant_hf_tensors
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ModelSpec


def policy_tensors(model, spec: ModelSpec, layout: Layout, *, qat_group_size: int | None = None,
                   dst: int | None = None, owned_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of this rank's model slice (collective: every rank drains it).

    qat_group_size: fake-quantize the routed experts with this group size (the policy trains with QAT);
    None streams the stored weights (what the INT4 export quantizes itself).
    """
    named = export_hf_tensors(model, spec, layout, dst=dst, owned_only=owned_only)
    if qat_group_size:
        named = fake_quant_hf_tensors(named, qat_group_size)
    return named


@contextlib.contextmanager
def checkpoint_model(spec: ModelSpec, checkpoint_dir: str | Path, step: int | None = None,
                     layout: Layout | None = None, *, device: torch.device) -> Iterator[tuple[object, Layout, int]]:
    """(model slice on `device`, layout, step) of a torch_dist checkpoint for this rank; process groups set up
    here and torn down on exit. Without a layout this process is a one-rank world."""

    layout = layout or Layout()
    init_distributed(layout, device=device)
    try:
        layout.check_model(spec)
        # every value comes from the checkpoint: no random init
        model = build_model(spec, layout, device=device, perform_initialization=False)
        step = load_model_only(checkpoint_dir, model, step)
        yield model, layout, step
    finally:
        destroy()
