"""Rollout throughput: the embedded engine vs transformers `generate`, same model/prompts/settings, one run.

    .venv/bin/python bench/rollout.py [--prompts 32] [--n 8] [--max-new 16] [--repeats 3] [--threads 1]

Both sides sample the tiny recipe's workload: the first `--prompts` rows of data/tiny/dapo-math-tiny.jsonl
through the tokenizer's chat template, `--n` samples each, temperature 1, top-p 1, top-k off
(transformers defaults to top_k=50, so it is passed as 0), stop on `<|im_end|>`, at most `--max-new`
new tokens. Throughput counts generated tokens (up to and including the stop token) per second; the
sides alternate `--repeats` times and each keeps its best run. Both wall-clock and process CPU time are
reported; the ratio uses `--clock` (default cpu): with one intra-op thread the two agree on an idle
machine, and CPU time stays honest on a shared one, where wall time favours whichever side's shorter
runs happen to land in quiet moments. The last line is `rollout ratio=<engine ÷ generate>`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_pipeline.engine.model import EngineModel  # noqa: E402
from kimi_pipeline.engine.rollout_engine import RolloutEngine, SamplingParams  # noqa: E402
from kimi_pipeline.model.hf_model import build_hf_model, load_hf_model  # noqa: E402
from kimi_pipeline.model.tokenizer import load_tokenizer  # noqa: E402
from kimi_pipeline.recipes import load_recipe  # noqa: E402


def load_prompts(tokenizer, path: Path, count: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:count]
    out = []
    for row in rows:
        enc = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        out.append(list(enc["input_ids"] if not isinstance(enc, list) else enc))
    return out


def hf_generate(model, prompts: list[list[int]], n: int, max_new: int, eos: int, pad: int, seed: int) -> int:
    """One batched `generate` call over all prompts (left-padded), n return sequences each; returns tokens made."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=max_new, num_return_sequences=n, eos_token_id=eos, pad_token_id=pad)
    new = out[:, width:]
    # tokens up to and including the first eos of each row
    is_eos = new == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
    return int(first.sum())


def engine_generate(engine: RolloutEngine, prompts, n: int, max_new: int, eos: int, seed: int) -> int:
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new, stop_token_ids=(eos,),
                            seed=seed)
    return sum(len(c.output_ids) for c in engine.generate(prompts, n, params, return_routed_experts=True))


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="time base of the ratio")
    ap.add_argument("--model", default=str(ROOT / "data/tiny/model"),
                    help="HF checkpoint dir; 'random' builds the tiny recipe's model from a seed")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(ROOT / "data/tiny/model")
    if args.model == "random":
        hf = build_hf_model(load_recipe("tiny").model, seed=0)
    else:
        hf = load_hf_model(args.model)
    engine = RolloutEngine(EngineModel.from_hf_model(hf), seed=0)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = load_prompts(tokenizer, ROOT / "data/tiny/dapo-math-tiny.jsonl", args.prompts)
    print(f"workload: {len(prompts)} prompts x {args.n} samples, prompt len {min(map(len, prompts))}-"
          f"{max(map(len, prompts))}, max_new {args.max_new}, threads {args.threads}, model {args.model}")

    # warm-up both (allocator, lazy init), then alternate timed runs
    hf_generate(hf, prompts[:2], 2, 2, eos, pad, 0)
    engine_generate(engine, prompts[:2], 2, 2, eos, 0)
    best = {(side, clock): 0.0 for side in ("engine", "generate") for clock in ("wall", "cpu")}
    for rep in range(args.repeats):
        for side in ("generate", "engine"):
            w0, c0 = time.perf_counter(), time.process_time()
            if side == "engine":
                tokens = engine_generate(engine, prompts, args.n, args.max_new, eos, seed=rep)
            else:
                tokens = hf_generate(hf, prompts, args.n, args.max_new, eos, pad, seed=rep)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            best[side, "wall"] = max(best[side, "wall"], tokens / wall)
            best[side, "cpu"] = max(best[side, "cpu"], tokens / cpu)
            print(f"  run {rep} {side:8s}: {tokens} tokens, {wall:.3f} s wall ({tokens / wall:,.0f} tok/s), "
                  f"{cpu:.3f} s cpu ({tokens / cpu:,.0f} tok/s)")
    for clock in ("wall", "cpu"):
        print(f"{clock:4s}: transformers generate {best['generate', clock]:,.0f} tok/s, "
              f"embedded engine {best['engine', clock]:,.0f} tok/s, "
              f"ratio {best['engine', clock] / best['generate', clock]:.2f}")
    print(f"transformers generate: {best['generate', args.clock]:,.0f} tok/s ({args.clock})")
    print(f"embedded engine:       {best['engine', args.clock]:,.0f} tok/s ({args.clock})")
    ratio = best["engine", args.clock] / best["generate", args.clock]
    print(f"rollout ratio={ratio:.2f}")
    return ratio


if __name__ == "__main__":
    main()
