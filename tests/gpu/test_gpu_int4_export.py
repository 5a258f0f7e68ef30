"""INT4 export from a checkpoint a GPU wrote: a megatron model on CUDA (the tiny checkpoint's weights) saved as
torch_dist, then the export stage (`stages.export.run` in `stage_run(EXPORT, …)`, one rank in the convert layout,
`cluster.device=cuda`)
writes Kimi's compressed-tensors INT4 directory from it. The GPU twin of tests/integration/test_int4.py's
`test_stage_export_from_a_megatron_checkpoint`, with a stronger reference: the export must equal, tensor for
tensor and bit for bit, the single-process export of the HF source files themselves (the weights went
HF -> CUDA model -> torch_dist -> export unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.gpu import TINY_MODEL, off_device, tiny_hf_tensors

pytestmark = pytest.mark.gpu


def test_int4_export_of_a_cuda_written_checkpoint(cuda, one_gpu_rank, tmp_path):
    import torch
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.hf.int4_checkpoint import export_int4
    from kimi_pipeline.hf.reader import iter_stored_tensors
    from kimi_pipeline.model.hf_bridge import load_hf_tensors_into_model
    from kimi_pipeline.model.megatron_model import build_model
    from kimi_pipeline.model.megatron_train import save_model_only
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.stages import EXPORT
    from kimi_pipeline.weightjobs.int4_export import shard_bytes

    # the QAT export path (fake-quant trainer forward as the logits reference), on one GPU rank
    recipe = load_recipe("tiny", ["quant.int4_qat=true", "cluster.device=cuda", "convert.nodes=1",
                                  "convert.gpus_per_node=1", "convert.pp=1", "convert.ep=1"])
    model = build_model(recipe.model, one_gpu_rank, device=cuda, perform_initialization=False)
    load_hf_tensors_into_model(model, tiny_hf_tensors().__getitem__, recipe.model, one_gpu_rank)
    assert off_device(model, cuda) == []
    ckpt = tmp_path / "ckpt"
    save_model_only(ckpt, model, step=20)  # written from CUDA tensors

    run_dir = tmp_path / "run"
    section = run_stage(EXPORT, stages.export.run, recipe, run_dir, checkpoint_dir=ckpt, model_dir=TINY_MODEL,
                        timeout_s=600)
    assert section["checkpoint"] == str(ckpt / "iter_0000020") and section["ranks"] == 1
    assert section["dequant_exact"] and section["experts_equal"] and section["qat"]
    assert section["num_quantized"] == 144  # 3 MoE layers x 16 experts x gate/up/down
    assert section["logits_max_diff_parity"] <= 1e-3  # megatron fake-quant forward == HF fake-quant model
    assert section["logits_max_diff"] <= section["logits_tolerance"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["export"] == section and summary["stages"]["export"]["status"] == "completed"

    # bit for bit what exporting the HF source files gives, with no GPU and no megatron in between
    config = json.loads((TINY_MODEL / "config.json").read_text())
    direct = export_int4(iter_stored_tensors(TINY_MODEL), config, TINY_MODEL, tmp_path / "direct", 32,
                         max_shard_bytes=shard_bytes(recipe.model))
    got, want = dict(iter_stored_tensors(section["path"])), dict(iter_stored_tensors(direct.path))
    assert got.keys() == want.keys() and len(got) > 200
    differ = [n for n, t in want.items() if t.dtype != got[n].dtype or not torch.equal(t, got[n])]
    assert differ == [], differ[:10]
    assert (Path(section["path"]) / "config.json").read_bytes() == (Path(direct.path) / "config.json").read_bytes()
    assert section["int4_bytes"] == direct.int4_bytes
