"""The tiny base policy: a short, seeded supervised warm-up so GRPO starts with non-zero reward.

Measured: GRPO from a random init gets exactly 0 reward on the tiny task (no sample ever produces a
well-formed `\\boxed{}`), so there is no signal to learn from. 120 supervised steps on correct answers
teach the format and part of the task: ≈0.45 reward at temperature 1 (measured: 60 steps ≈0.2, after which
GRPO climbed too slowly for the tiny run's budget; 150 steps ≈0.6, leaving too little room). It is
deliberately under-trained: the RL run must have room to improve. The result ships in data/tiny/model
(rebuilt by `kimi data make-tiny`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kimi_pipeline.data.rows import as_messages
from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.model.hf_model import build_hf_model, save_hf_model
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes.models import ModelSpec


def target_response(label: str) -> str:
    """What the warm-up teaches: the DAPO answer line, nothing else (short rollouts)."""
    return f"Answer: \\boxed{{{label}}}"


@dataclass(frozen=True)
class WarmStartConfig:
    seed: int = 0
    steps: int = 120
    batch_size: int = 64
    lr: float = 3e-3


def _encode(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    prompt = tokenizer.apply_chat_template(as_messages(row["prompt"]), tokenize=False, add_generation_prompt=True)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(target_response(row["label"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p_ids, r_ids


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) + len(r) for p, r in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        seq = p + r
        tokens[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(r)
    return tokens, labels


def warm_start(spec: ModelSpec, tokenizer_dir: Path, train_rows: list[dict], cfg: WarmStartConfig = WarmStartConfig()):
    """Train a fresh model of `spec` on correct answers; deterministic for a seed on one thread."""
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_hf_model(spec, seed=cfg.seed).train()
    rng = random.Random(cfg.seed)
    examples = [_encode(tokenizer, row) for row in train_rows]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    losses = []
    for _ in range(cfg.steps):
        tokens, labels = _batch(rng.sample(examples, cfg.batch_size), tokenizer.pad_token_id)
        out = model(input_ids=tokens, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
    return model.eval(), losses


def write_warm_start(out_dir: Path, spec: ModelSpec, train_rows: list[dict], cfg: WarmStartConfig = WarmStartConfig()) -> list[float]:
    """Warm-start and save next to the tokenizer in `out_dir` (sharded safetensors + index, Kimi config)."""
    torch.set_num_threads(1)  # bit-reproducible on a given machine
    model, losses = warm_start(spec, out_dir, train_rows, cfg)
    tmp = out_dir.with_name(out_dir.name + ".weights")
    save_hf_model(model, tmp, config=hf_config_dict(spec), max_shard_size="4MB")
    for f in tmp.iterdir():
        f.replace(out_dir / f.name)
    tmp.rmdir()
    return losses
