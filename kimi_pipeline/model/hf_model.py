"""The HF side of the model: transformers' DeepSeek-V3 implementation, loaded strictly.

Kimi ships `model_type: kimi_k2` (K2.5: `kimi_k25` with the text model under `text_config`), which
transformers does not know. Worse, loading such a directory with DeepseekV3ForCausalLM leaves every
routed expert randomly initialised with only a load report (measured), so loading here rewrites the
type to `deepseek_v3` the way upstream converters do and fails on any missing or unexpected key.
On disk experts are `mlp.experts.{e}.{gate,up,down}_proj.weight`; in memory transformers fuses them,
so converters read the safetensors files, never `state_dict()`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.config import hf_config_dict, text_config
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.hf.shipped_files import copy_tokenizer_files
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json

# Keys of config.json that describe the checkpoint's storage, not the architecture.
_STORAGE_KEYS = {"model_type", "quantization_config", "architectures", "auto_map", "transformers_version"}


class HFModelError(PermanentError):
    pass


def _torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json (directory or the file itself)."""
    path = Path(model_dir)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise HFModelError(f"{path}: config.json not found; point hub.model at a checkpoint directory")
    return json.loads(path.read_text())


def deepseek_config(config: dict[str, Any] | str | Path, text_config_key: str | None = None):
    """A transformers DeepseekV3Config from a Kimi/DeepSeek-V3 config.json (dict or directory); a multimodal
    config (K2.5) gives its language model's."""
    from transformers import DeepseekV3Config

    if not isinstance(config, dict):
        config = read_config(config)
    cfg = text_config(config, text_config_key)
    kwargs = {k: v for k, v in cfg.items() if k not in _STORAGE_KEYS}
    kwargs.setdefault("dtype", cfg.get("torch_dtype", "bfloat16"))
    kwargs.pop("torch_dtype", None)
    return DeepseekV3Config(**kwargs)


def build_hf_model(spec: ModelSpec, seed: int = 0, attn_implementation: str = "eager"):
    """A freshly initialised DeepseekV3ForCausalLM of the recipe's shape (deterministic for a seed)."""
    from transformers import DeepseekV3ForCausalLM

    cfg = deepseek_config(hf_config_dict(spec))
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(_torch_dtype(spec.params_dtype))
    return model.eval()


def load_hf_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    text_config_key: str | None = None,
    attn_implementation: str = "eager",
):
    """Load a checkpoint directory with transformers, refusing partial loads (missing/unexpected keys)."""
    cfg = deepseek_config(model_dir, text_config_key)
    return load_strict(model_dir, cfg, dtype or cfg.dtype, attn_implementation)


def load_strict(model_dir: str | Path, cfg, dtype: torch.dtype, attn_implementation: str = "eager",
                what: str = "checkpoint"):
    """DeepseekV3ForCausalLM of the language model in `model_dir`, loaded strictly: any missing, unexpected or
    misshapen language-model key is an error. A multimodal checkpoint (K2.5) loads with its prefix mapped away
    (transformers' `key_mapping`); its other parts (vision tower, projector) are the only keys left unused."""
    from transformers import DeepseekV3ForCausalLM

    model_dir = Path(model_dir)
    layout = HFLayout.of_dir(model_dir)
    mapping = {f"^{re.escape(layout.prefix)}": ""} if layout.prefix else None
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        model_dir,
        config=cfg,
        dtype=dtype,
        attn_implementation=attn_implementation,
        output_loading_info=True,
        trust_remote_code=False,
        use_safetensors=True,  # never fall back to unpickling pytorch_model.bin
        key_mapping=mapping,
    )
    other_parts = lambda k: bool(layout.prefix) and not layout.misplaced(k) and layout.logical(k) is None  # noqa: E731
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys") or [] if not other_parts(k)]
    bad = {k: sorted(v)[:5] for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise HFModelError(
            f"{model_dir}: {what} does not match its config ({bad}); the directory is incomplete, "
            "from another model, or quantized — convert or re-download it"
        )
    return model.eval()


def save_hf_model(model, out_dir: str | Path, *, config: dict[str, Any], tokenizer_dir: str | Path | None = None,
                  max_shard_size: str = "4MB") -> Path:
    """Write a sharded safetensors checkpoint + index atomically, with `config` (Kimi's model_type) as config.json.

    transformers un-fuses the experts on save, so the files carry the per-expert names Kimi ships.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)
    (tmp / "generation_config.json").unlink(missing_ok=True)
    atomic_write_json(tmp / "config.json", config)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
