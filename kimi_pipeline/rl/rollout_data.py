"""Rollouts saved to disk and read back: what `rollout.save_data` writes and `kimi train --replay-rollouts DIR` trains on.

The recipes' framework debugs a trainer problem without paying for rollouts again (`--save-debug-rollout-data`,
`--load-debug-rollout-data`); this is the same for our samples. Each step's rollout is a pair under
`DIR/train/rollouts/`:

- `step_0000001.safetensors`: every number the trainer reads, concatenated over the samples with offsets (token
  ids int64, engine log-probs, rewards and advantages float64 so the floats come back exactly, routed experts
  int16 when the engine returned them);
- `step_0000001.json`: per sample the label, finish reason and response text, and the rollout's metrics. Written
  last: a step whose JSON exists is complete.

safetensors, not pickle: a rollout directory may come from another machine, and reading it must not run code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.recipes.models import ModelSpec, ParallelSpec, RolloutSpec
from kimi_pipeline.rl.samples import Sample, share_rollout
from kimi_pipeline.util.files import atomic_write_bytes, atomic_write_json

FORMAT = 1


class RolloutDataError(PermanentError):
    """A saved rollout that is missing, incomplete or does not fit the recipe (the message names the file)."""


def step_stem(step: int) -> str:
    """The files of rollout `step` (1-based, as the metrics rows count steps)."""
    return f"step_{step:07d}"


def _concat(rows: list, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one flat tensor and int64 offsets [len(rows) + 1]."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    flat = [torch.as_tensor(np.asarray(r), dtype=dtype) for r in rows if len(r)]
    return (torch.cat(flat) if flat else torch.zeros(0, dtype=dtype)), offsets


def save_rollout(directory: Path, step: int, samples: list[Sample], metrics: dict[str, float]) -> Path:
    """Write rollout `step` (its samples with their advantages, and its metrics); returns the JSON path."""
    tensors: dict[str, torch.Tensor] = {}
    for name, rows, dtype in (("prompt_ids", [s.prompt_ids for s in samples], torch.int64),
                              ("response_ids", [s.response_ids for s in samples], torch.int64),
                              ("rollout_logprobs", [s.rollout_logprobs for s in samples], torch.float64)):
        tensors[name], tensors[f"{name}_offsets"] = _concat(rows, dtype)
    tensors["rewards"] = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    tensors["advantages"] = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    tensors["groups"] = torch.tensor([s.group for s in samples], dtype=torch.int64)
    if samples and all(s.routed_experts is not None for s in samples):
        tensors["routed_experts"], tensors["routed_experts_offsets"] = _concat(
            [s.routed_experts for s in samples], torch.int16)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / f"{step_stem(step)}.safetensors", save(tensors))
    meta = {"format": FORMAT, "step": step, "metrics": metrics,
            "samples": [{"label": s.label, "finish_reason": s.finish_reason, "response_text": s.response_text}
                        for s in samples]}
    return atomic_write_json(directory / f"{step_stem(step)}.json", meta)


def load_rollout(directory: Path, step: int) -> tuple[list[Sample], dict[str, float]]:
    """Rollout `step` as saved: (samples, metrics). Errors name the file and what to do."""
    meta_path, data_path = (directory / f"{step_stem(step)}{ext}" for ext in (".json", ".safetensors"))
    if not meta_path.is_file():
        saved = sorted(p.stem for p in directory.glob("step_*.json")) if directory.is_dir() else []
        raise RolloutDataError(
            f"{meta_path}: no saved rollout for step {step} (saved: {_span(saved)}); record one with "
            f"`--set rollout.save_data=true`, or replay fewer steps (rollout.num_rollout)")
    try:
        meta = json.loads(meta_path.read_text())
        tensors = load_file(data_path)
    except (OSError, ValueError, SafetensorError) as e:
        raise RolloutDataError(f"{data_path if meta_path.exists() else meta_path}: unreadable saved rollout "
                               f"({type(e).__name__}: {e}); record it again") from None
    if meta.get("format") != FORMAT or meta.get("step") != step:
        raise RolloutDataError(f"{meta_path}: format {meta.get('format')} step {meta.get('step')}, expected format "
                               f"{FORMAT} step {step}")

    def rows(name: str) -> list:
        flat, offsets = tensors[name], tensors[f"{name}_offsets"].tolist()
        return [flat[a:b] for a, b in zip(offsets, offsets[1:])]

    try:
        prompts, responses, logprobs = rows("prompt_ids"), rows("response_ids"), rows("rollout_logprobs")
        experts = rows("routed_experts") if "routed_experts" in tensors else [None] * len(prompts)
        per_sample = meta["samples"]
        rewards, advantages, groups = (tensors[k].tolist() for k in ("rewards", "advantages", "groups"))
    except KeyError as e:
        raise RolloutDataError(f"{data_path}: tensor or field {e} missing; record the rollout again") from None
    if not len(prompts) == len(responses) == len(logprobs) == len(per_sample) == len(rewards):
        raise RolloutDataError(f"{data_path}: {len(prompts)} prompts, {len(responses)} responses, {len(rewards)} "
                               f"rewards and {len(per_sample)} sample records do not match")
    samples = [Sample(prompt_ids=p.tolist(), response_ids=r.tolist(), rollout_logprobs=lp.tolist(), label=m["label"],
                      group=g, reward=rw, advantage=adv, finish_reason=m["finish_reason"],
                      response_text=m["response_text"], routed_experts=None if ex is None else ex.numpy())
               for p, r, lp, ex, m, rw, adv, g in zip(prompts, responses, logprobs, experts, per_sample, rewards,
                                                       advantages, groups)]
    return samples, meta["metrics"]


def check_fits(samples: list[Sample], path: Path, vocab_size: int, routing_replay: bool, moe_layers: int,
               topk: int) -> None:
    """A saved rollout the recipe's model can train on: token ids inside its vocabulary, and routed experts of its
    shape when the recipe replays routing."""
    top = max((max(s.tokens) for s in samples if s.tokens), default=-1)
    if top >= vocab_size:
        raise RolloutDataError(f"{path}: token id {top} is outside model.vocab_size={vocab_size}: recorded with "
                               f"another model?")
    if routing_replay:
        if any(s.routed_experts is None for s in samples):
            raise RolloutDataError(f"{path}: no routed experts saved, but rollout.routing_replay=true; record with "
                                   f"routing replay on, or replay with --set rollout.routing_replay=false")
        shape = samples[0].routed_experts.shape[1:]
        if tuple(shape) != (moe_layers, topk):
            raise RolloutDataError(f"{path}: routed experts of {tuple(shape)} (MoE layers, top-k), the model has "
                                   f"({moe_layers}, {topk})")


def _span(stems: list[str]) -> str:
    return f"{stems[0]} … {stems[-1]}" if len(stems) > 1 else (stems[0] if stems else "none")


class SavedRollouts:
    """Rollouts read from a directory instead of generated: the replay side of `run_training`. Each step's shares
    go to the trainer ranks through the object store, as the rollout manager's do."""

    urls: list[str] = []  # no engines: nothing takes weights or evaluates

    def __init__(self, directory: Path, spec: ModelSpec, rollout: RolloutSpec, parallel: ParallelSpec, dp: int) -> None:
        """Checked against the model (`spec`) and routing replay (`rollout`); split as the rollout manager splits
        (`rollout`, `parallel`, `dp` data-parallel ranks: `samples.share_rollout`)."""
        self.directory, self.spec, self.rollout, self.parallel, self.dp = Path(directory), spec, rollout, parallel, dp
        if not self.directory.is_dir():
            raise RolloutDataError(f"{self.directory}: no such rollout directory (a run's train/rollouts, written "
                                   f"with rollout.save_data=true)")

    def take(self, step: int) -> tuple[list, dict[str, Any], int]:
        """(one object-store reference per data-parallel rank, the rollout's metrics as recorded, 0 restarts)."""
        samples, metrics = load_rollout(self.directory, step + 1)
        model = self.spec
        check_fits(samples, self.directory / f"{step_stem(step + 1)}.safetensors", model.vocab_size,
                   self.rollout.routing_replay, model.num_layers - model.first_k_dense, model.moe_router_topk)
        shares, _ = share_rollout(samples, self.rollout, self.parallel, self.dp)
        return [ray.put(s) for s in shares], metrics, 0

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rollout side: the directory (a resume replays from the step it saved)."""
        return {"replayed_from": str(self.directory)}

    def settle(self, version: str) -> None:
        """No engines to bring back."""
