"""The files a HF checkpoint directory ships beside its weights (tokenizer, chat template, processor and
generation configs, remote code): what a writer of a new checkpoint (the INT4 export, a quantized copy, a saved
model) carries over from its base."""

from __future__ import annotations

import shutil
from pathlib import Path

from kimi_pipeline.util.shards import INDEX_NAME

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# Files of a checkpoint directory that `copy_model_files` leaves to the writer of the new one.
_NOT_CARRIED = {"config.json", INDEX_NAME, "MANIFEST.sha256"}


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """The tokenizer files a checkpoint directory ships (those present in `src_dir`)."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(dst_dir) / name)
            copied.append(name)
    return copied


def copy_model_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Every file a checkpoint ships beside its weights (tokenizer, chat template, processor and preprocessor
    configs, generation config, remote code), copied as is: not config.json and the index, which a writer of a new
    checkpoint writes itself, nor the sha256 manifest of the source's files or hidden bookkeeping."""
    copied = []
    for src in sorted(Path(src_dir).iterdir()):
        if src.is_file() and not src.name.startswith(".") and src.suffix != ".safetensors" \
                and src.name not in _NOT_CARRIED:
            shutil.copy2(src, Path(dst_dir) / src.name)
            copied.append(src.name)
    return copied
