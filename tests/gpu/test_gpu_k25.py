"""Kimi-K2.5's layout on one GPU: the tiny K2.5 INT4 actor (`language_model.` prefix, vision tower and projector)
bridge-loaded into a megatron model on CUDA, the INT4 export of a checkpoint that GPU wrote, and its weights synced in
SGLang's INT4 format under K2.5's names into an engine on the GPU. The GPU twin of tests/integration/test_k25.py's
engine and export claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.gpu import TINY_MODEL, deterministic_kernels, off_device

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    from kimi_pipeline.data.tiny_k25 import build_tiny_k25
    from kimi_pipeline.recipes.models import VisionSpec

    vision = VisionSpec(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, pos_emb_height=4,
                        pos_emb_width=4)
    return build_tiny_k25(TINY_MODEL, tmp_path_factory.mktemp("k25"), vision, seed=3)


def test_k25_bridge_load_export_and_int4_sync_on_a_gpu(cuda, one_gpu_rank, k25, tmp_path):
    import torch
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.hf.int4_checkpoint import export_int4
    from kimi_pipeline.hf.names import HFLayout
    from kimi_pipeline.hf.reader import HFCheckpoint, iter_stored_tensors
    from kimi_pipeline.model.hf_bridge import load_hf_tensors_into_model
    from kimi_pipeline.model.megatron_model import build_model
    from kimi_pipeline.model.megatron_train import save_model_only
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.stages import EXPORT
    from kimi_pipeline.weight_sync.formats import to_engine_format
    from kimi_pipeline.weight_sync.policy_tensors import policy_tensors
    from kimi_pipeline.weightjobs.int4_export import shard_bytes

    recipe = load_recipe("tiny", ["quant.int4_qat=true", "cluster.device=cuda", "convert.nodes=1",
                                  "convert.gpus_per_node=1", "convert.pp=1", "convert.ep=1"])
    model = build_model(recipe.model, one_gpu_rank, device=cuda, perform_initialization=False)
    actor = HFCheckpoint(k25.actor)
    load_hf_tensors_into_model(model, actor.get, recipe.model, one_gpu_rank)  # bridge: read under the prefix
    assert off_device(model, cuda) == []

    # the export of a checkpoint this GPU wrote: the source's names, its vision tensors bit for bit, and the language
    # model bit for bit what exporting the actor's own (dequantized) tensors gives, with no GPU or megatron between
    ckpt = tmp_path / "ckpt"
    save_model_only(ckpt, model, step=2)
    section = run_stage(EXPORT, stages.export.run, recipe, tmp_path / "run", checkpoint_dir=ckpt, model_dir=k25.actor,
                        timeout_s=600)
    assert section["dequant_exact"] and section["others_exact"] and section["experts_equal"], section
    got, src = dict(iter_stored_tensors(section["path"])), dict(iter_stored_tensors(k25.actor))
    assert got.keys() == src.keys()
    other = [n for n in src if n.startswith(("vision_tower.", "mm_projector."))]
    assert other and section["carried_tensors"] == len(other)
    assert all(got[n].dtype == src[n].dtype and torch.equal(got[n], src[n]) for n in other)
    config = json.loads((k25.actor / "config.json").read_text())
    direct = export_int4(((n, actor.get(n, torch.float32)) for n in actor.names()), config, k25.actor,
                         tmp_path / "direct", 32, max_shard_bytes=shard_bytes(recipe.model))
    want = dict(iter_stored_tensors(direct.path))
    differ = [n for n, t in want.items() if t.dtype != got[n].dtype or not torch.equal(t, got[n])]
    assert want.keys() == got.keys() and differ == [], differ[:10]
    cfg = json.loads((Path(section["path"]) / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and "quantization_config" in cfg["text_config"]

    # weight sync as SGLang gets it (INT4 packed, K2.5's names, CUDA tensors) into a GPU engine serving the K2.5
    # checkpoint: it serves exactly what an engine loading the export serves
    synced = EngineModel.from_pretrained(k25.actor, device=cuda)
    exported = EngineModel.from_pretrained(section["path"], device=cuda)
    layout = HFLayout.of_dir(k25.actor)
    sent = list(layout.stored_items(to_engine_format(policy_tensors(model, recipe.model, one_gpu_rank), "int4", 32)))
    assert all(n.startswith("language_model.") for n, _ in sent)
    # computed on the GPU; only compressed-tensors' weight_shape is made on the host (the CUDA-IPC bucket moves it)
    assert all(t.is_cuda for n, t in sent if not n.endswith(".weight_shape"))
    synced.load_weights(sent)
    synced.finish_update()
    ids = torch.tensor([[1, 5, 9, 17, 33, 60, 7, 8]], device=cuda)
    with deterministic_kernels():
        assert torch.equal(synced.prefill(ids, all_logits=True)[0], exported.prefill(ids, all_logits=True)[0])
