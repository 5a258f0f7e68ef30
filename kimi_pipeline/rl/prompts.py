"""Prompt stream for rollouts: validated rows → chat-templated token ids, in a seeded, resumable order.

The position (epoch, index) is part of every training checkpoint, so a resumed run draws exactly the
prompts an uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipeline.data.rows import as_messages
from kimi_pipeline.errors import PermanentError


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    label: str
    text: str
    source_line: int | None = None


def encode_prompt(tokenizer, prompt: Any, apply_chat_template: bool = True) -> tuple[str, list[int]]:
    """The exact token ids the policy sees (chat template + generation prompt, no extra BOS)."""
    if apply_chat_template:
        text = tokenizer.apply_chat_template(as_messages(prompt), tokenize=False, add_generation_prompt=True)
    else:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def load_prompts(path: str | Path, tokenizer, input_key: str = "prompt", label_key: str = "label",
                 apply_chat_template: bool = True) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise PermanentError(f"{path} not found: run the validate stage first (`kimi validate`)")
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        text, ids = encode_prompt(tokenizer, row[input_key], apply_chat_template)
        out.append(Prompt(ids, str(row[label_key]), text, row.get("_source_line")))
    if not out:
        raise PermanentError(f"{path}: no prompts (every row was quarantined?)")
    return out


class PromptStream:
    """Endless, epoch-shuffled prompts; `state()`/`restore()` make the order resumable."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True):
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Prompt]:
        batch = []
        while len(batch) < n:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.prompts[self._order[self.index]])
            self.index += 1
        return batch

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self.epoch)
