"""A tiny Kimi-K2.5-shaped checkpoint pair, built from a tiny K2-shaped one: what the K2.5 recipe's dual checkpoint
looks like, small enough for the CPU tests.

Kimi-K2.5 ships as a multimodal model (`model_type: kimi_k25`, KimiK25ForConditionalGeneration): config.json nests
the language model under `text_config` and the MoonViT tower under `vision_config` (`vt_*` keys); the weights are
`language_model.model.*` / `language_model.lm_head.weight` beside `vision_tower.*` and `mm_projector.*`; processor
files ship beside the tokenizer. The recipe trains from two copies (seed: run-kimi-k25.sh): the INT4 actor (routed
experts compressed-tensors pack-quantized, the quantization_config in text_config with K2.5's ignore list) and a
BF16 reference. Here the reference is the unquantized copy (in the base's dtype), the actor its INT4 copy
(`hf.quantized_copy.write_quantized_checkpoint`), and the vision weights are seeded random bf16 tensors under the
real names and shapes (`recipes.models.VisionSpec.shapes`): nothing here runs them, every stage must carry them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.hf.names import LM_PREFIX_BY_MODEL_TYPE
from kimi_pipeline.hf.quantized_copy import write_quantized_checkpoint
from kimi_pipeline.hf.reader import iter_stored_tensors
from kimi_pipeline.hf.shipped_files import copy_model_files
from kimi_pipeline.hub.manifest import build_manifest, list_files, write_sha256sums
from kimi_pipeline.recipes.models import VisionSpec
from kimi_pipeline.util.files import atomic_write_json, atomic_write_text
from kimi_pipeline.util.shards import ShardWriter, finish_shards

MODEL_TYPE = "kimi_k25"
PREFIX = LM_PREFIX_BY_MODEL_TYPE[MODEL_TYPE]


@dataclass(frozen=True)
class TinyK25:
    actor: Path  # INT4 routed experts (the K2.5 recipe's hub.model)
    reference: Path  # unquantized (the recipe's hub.ref_model)


def vision_config(v: VisionSpec, text_hidden_size: int) -> dict[str, Any]:
    """config.json's `vision_config` of a K2.5 checkpoint with this tower (its remote code's `vt_*` key names)."""
    return {
        "patch_size": v.patch_size, "init_pos_emb_height": v.pos_emb_height, "init_pos_emb_width": v.pos_emb_width,
        "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "vt_num_attention_heads": v.num_attention_heads,
        "vt_num_hidden_layers": v.num_layers, "vt_hidden_size": v.hidden_size,
        "vt_intermediate_size": v.ffn_hidden_size, "merge_kernel_size": list(v.merge_kernel_size),
        "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
        "mm_hidden_size": v.hidden_size, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
        "text_hidden_size": text_hidden_size,
    }


def _processor_files(v: VisionSpec) -> dict[str, dict[str, Any]]:
    """The image processor's files a K2.5 checkpoint ships (carried, never read by text RL)."""
    pre = {"image_processor_type": "KimiK25ImageProcessor", "patch_size": v.patch_size,
           "merge_kernel_size": list(v.merge_kernel_size), "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
           "in_patch_limit": 16384, "patch_limit_on_one_side": 512}
    return {"preprocessor_config.json": pre, "processor_config.json": {"processor_class": "KimiK25Processor"}}


def build_tiny_k25(base: str | Path, out_dir: str | Path, vision: VisionSpec, *, seed: int = 0,
                   max_shard_bytes: int = 2 << 20) -> TinyK25:
    """`out_dir/reference` and `out_dir/actor` from the K2-shaped HF checkpoint `base` (its language model, tokenizer
    and chat template), each with a MANIFEST.sha256 the download stage verifies."""
    base, out_dir = Path(base), Path(out_dir)
    text = json.loads((base / "config.json").read_text())
    text.pop("quantization_config", None)
    ref = out_dir / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir(parents=True)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": MODEL_TYPE,
              "text_config": text, "vision_config": vision_config(vision, text["hidden_size"]),
              "media_placeholder_token_id": text["vocab_size"] - 1, "pad_token_id": text.get("pad_token_id", 0),
              "tie_word_embeddings": text.get("tie_word_embeddings", False),
              "torch_dtype": text.get("torch_dtype", "bfloat16")}
    writer = ShardWriter(ref, max_shard_bytes)
    writer.add_all((PREFIX + name, t) for name, t in iter_stored_tensors(base))
    g = torch.Generator().manual_seed(seed)
    for name, shape in vision.shapes(text["hidden_size"]).items():
        writer.add(name, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
    finish_shards(ref, writer.close())
    atomic_write_json(ref / "config.json", config)
    copy_model_files(base, ref)
    for name, content in _processor_files(vision).items():
        atomic_write_json(ref / name, content)
    actor = out_dir / "actor"
    shutil.rmtree(actor, ignore_errors=True)
    write_quantized_checkpoint(ref, actor, "int4")
    for d in (ref, actor):
        atomic_write_text(d / "MANIFEST.sha256", write_sha256sums(d, build_manifest(d, list_files(d, None))))
    return TinyK25(actor=actor, reference=ref)
