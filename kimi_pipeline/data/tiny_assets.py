"""Builds everything the tiny recipe reads from data/tiny (no network): the synthetic DAPO/AIME-format
sets, the tokenizer, the model's config.json and the warm-started base policy. Deterministic, so the
shipped files can be re-derived and checked (`kimi data make-tiny --check`)."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kimi_pipeline.data.synthetic import MathGenConfig, generate, write_tiny_datasets
from kimi_pipeline.data.tiny_tokenizer import train_tiny_tokenizer
from kimi_pipeline.data.warm_start import write_warm_start
from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.hub.manifest import build_manifest, list_files, write_sha256sums
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json, atomic_write_text


def tokenizer_corpus(cfg: MathGenConfig) -> list[str]:
    train, evals = generate(cfg)
    texts = []
    for row in train + evals:
        p = row["prompt"]
        texts.append(p if isinstance(p, str) else " ".join(m["content"] for m in p))
        texts.append(f"The answer is \\boxed{{{row['label']}}}. Answer: \\boxed{{{row['label']}}}")
    texts += ["user assistant system tool", "Solve the following math problem step by step."] * 32
    return texts


def build_tiny_assets(out_dir: Path, model: ModelSpec, cfg: MathGenConfig = MathGenConfig()) -> dict[str, Path]:
    out_dir = Path(out_dir)
    paths = write_tiny_datasets(out_dir, cfg)
    model_dir = out_dir / "model"
    train_tiny_tokenizer(tokenizer_corpus(cfg), model_dir, vocab_size=min(360, model.vocab_size))
    atomic_write_json(model_dir / "config.json", hf_config_dict(model))
    write_warm_start(model_dir, model, generate(cfg)[0])
    paths["model"] = model_dir
    write_manifests(out_dir)
    return paths


# The warm start trains for 120 steps: a GEMM that rounds differently on another CPU (MKL picks kernels per
# vendor and ISA) grows into 0.1-sized weight differences (measured: an Intel-built data/tiny vs a rebuild on
# AMD EPYC). Pinned: MKL's conditional-numerical-reproducibility "COMPATIBLE" path, ATen's AVX2 kernels and
# one thread, so any x86-64 machine with AVX2 rebuilds the same bytes.
REPRODUCIBLE_ENV = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1"}


def build_tiny_assets_reproducibly(out_dir: Path, timeout_s: float = 1800) -> None:
    """`build_tiny_assets` for the tiny recipe in a fresh process under REPRODUCIBLE_ENV (the settings must be
    in place before torch and MKL initialise, hence the subprocess)."""
    env = {**os.environ, **REPRODUCIBLE_ENV}
    out = subprocess.run([sys.executable, "-m", "kimi_pipeline.data.tiny_assets", str(out_dir)], env=env,
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"building the tiny assets failed:\n{out.stderr[-3000:]}")


# How far a base policy rebuilt under other CPU numerics may score from the shipped one (absolute, on the 96 tiny
# eval problems). Measured on an AMD EPYC box by rebuilding under MKL_CBWR x ATEN_CPU_CAPABILITY x threads settings
# (COMPATIBLE/avx2/1 reproduces the shipped bytes; AUTO/default/1, AVX2/avx2/1, AUTO/avx512/1, COMPATIBLE/default/2
# do not): avg@8 0.543 shipped vs 0.473-0.520 rebuilt (gap <= 0.070), greedy 0.521 vs 0.510-0.594 (gap <= 0.073).
# Twice the largest gap; a policy with a scrambled output layer is ~0.5 away (tests/integration/test_tiny_assets.py).
BASE_POLICY_TOLERANCE = {"avg_at_n": 0.15, "greedy": 0.15}
WEIGHT_FILES = ("model/*.safetensors", "model/model.safetensors.index.json", "model/MANIFEST.sha256")


@dataclass(frozen=True)
class BuildComparison:
    """A fresh build against the shipped assets: files whose bytes differ, the trained weights apart.

    Data, tokenizer and config are pure functions of the seeds and must match byte for byte on any CPU. The base
    policy is trained (120 warm-start steps): a GEMM that MKL or ATen rounds differently on another vendor's CPU
    grows into different weights, so its files (and the manifest that hashes them) are judged by behaviour."""

    differs: tuple[str, ...]  # not the weights: any entry is a real difference
    weights_differ: tuple[str, ...]  # weight files (and their manifest) whose bytes differ


def compare_builds(fresh: Path, shipped: Path) -> BuildComparison:
    fresh, shipped = Path(fresh), Path(shipped)
    differs, weights = [], []
    for path in sorted(p for p in fresh.rglob("*") if p.is_file()):
        rel = path.relative_to(fresh)
        if (shipped / rel).is_file() and filecmp.cmp(path, shipped / rel, shallow=False):
            continue
        (weights if any(rel.match(w) for w in WEIGHT_FILES) else differs).append(str(rel))
    return BuildComparison(tuple(differs), tuple(weights))


def write_manifests(out_dir: Path) -> None:
    """MANIFEST.sha256 in data/tiny and data/tiny/model: the download stage verifies local sources against them."""
    out_dir = Path(out_dir)
    for root, patterns in ((out_dir, ["*.jsonl"]), (out_dir / "model", None)):
        files = build_manifest(root, list_files(root, patterns))
        atomic_write_text(root / "MANIFEST.sha256", write_sha256sums(root, files))


if __name__ == "__main__":  # `python -m kimi_pipeline.data.tiny_assets OUT_DIR` (see build_tiny_assets_reproducibly)
    from kimi_pipeline.recipes import load_recipe

    build_tiny_assets(Path(sys.argv[1]), load_recipe("tiny", check=False).model)
