"""Loading a checkpoint's tokenizer without tripping over `model_type: kimi_k2`.

AutoTokenizer first resolves the model config, which fails for `kimi_k2` (transformers does not
know it). A directory with a `tokenizer.json` is loaded as a fast tokenizer directly; Kimi's own
tiktoken tokenizer is remote code and loads only when the recipe opts in (`hub.trust_remote_code`).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


class TokenizerLoadError(RuntimeError):
    pass


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    if not (path / "tokenizer_config.json").is_file():
        raise TokenizerLoadError(f"{path}: no tokenizer.json or tokenizer_config.json; is this a model directory?")
    if not trust_remote_code:
        raise TokenizerLoadError(
            f"{path}: the tokenizer is remote code (Kimi's tiktoken tokenizer). Set hub.trust_remote_code=true "
            "in the recipe if you trust this repository's code."
        )
    log.warning("loading tokenizer from %s with trust_remote_code=True (recipe opt-in)", path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)

