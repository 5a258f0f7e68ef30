"""Train tokens/s of the megatron-core trainer step vs a plain transformers + torch AdamW step.

Both run the tiny recipe's model from the same weights on the same right-padded batch (a rollout-sized
batch: 64 samples of prompt + response) for the same number of steps: forward, token-mean NLL
backward, clip, Adam. The trainer path is the one GRPO uses (megatron DDP + distributed optimizer,
per-token-loss schedule, vocab-parallel logprobs); the baseline is what a hand-written loop would do
(`torch.optim.AdamW(model.parameters())`, torch's defaults). A detail line also times the baseline with
torch's fused CPU AdamW, which the trainer uses on CPU.

    .venv/bin/python bench/train_step.py [--steps 8] [--batch 64] [--threads N]

`--threads` defaults to the cores of this machine: the tiny run's trainer actor uses them all.
Last line: `train_step ratio=<megatron tokens/s ÷ transformers tokens/s>`.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

CPU = torch.device("cpu")


def _batch(vocab: int, batch: int, prompt: int, response: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt + response // 2, prompt + response + 1, (batch,), generator=g)
    width = int(lengths.max())
    tokens = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width))
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, prompt - 1 : n - 1] = 1.0
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    return tokens, targets, mask, int(lengths.sum())


def megatron_steps(recipe, tokens, targets, mask, steps: int) -> float:
    from kimi_pipeline.hf.reader import iter_stored_tensors
    from kimi_pipeline.model.hf_bridge import load_hf_tensors_into_model
    from kimi_pipeline.model.megatron_model import unwrap
    from kimi_pipeline.model.megatron_train import build_trainable, forward_backward, optimizer_step
    from kimi_pipeline.model.parallel import destroy, init_distributed
    from kimi_pipeline.model.vocab_parallel import logprobs_from_logits
    from kimi_pipeline.recipes.layout import Layout

    layout = Layout()
    init_distributed(layout, device=CPU)
    try:
        model, opt = build_trainable(recipe.model, layout, recipe.optimizer, device=CPU)
        hf = dict(iter_stored_tensors("data/tiny/model"))
        load_hf_tensors_into_model(unwrap(model[0]), hf.__getitem__, recipe.model, layout)

        def loss_fn(logits, batch):
            lp, _ = logprobs_from_logits(logits, batch["targets"], with_entropy=False)
            m = batch["mask"]
            return -(lp * m).sum(), m.sum().to(torch.int), {}

        batch = {"tokens": tokens, "targets": targets, "mask": mask}
        forward_backward(model, [batch], loss_fn, optimizer=opt)  # warm-up
        optimizer_step(opt)
        t0 = time.perf_counter()
        for _ in range(steps):
            forward_backward(model, [batch], loss_fn, optimizer=opt)
            optimizer_step(opt)
        return time.perf_counter() - t0
    finally:
        destroy()


def transformers_steps(recipe, tokens, targets, mask, steps: int, fused: bool | None = None) -> float:
    from kimi_pipeline.model.hf_model import load_hf_model

    model = load_hf_model("data/tiny/model", dtype=torch.float32).train()
    o = recipe.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay, fused=fused)

    def step() -> None:
        logits = model(input_ids=tokens).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        opt.step()

    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from kimi_pipeline.recipes import load_recipe

    recipe = load_recipe("tiny")
    tokens, targets, mask, real = _batch(recipe.model.vocab_size, args.batch, 22, 8)
    hf_s = transformers_steps(recipe, tokens, targets, mask, args.steps)
    fused_s = transformers_steps(recipe, tokens, targets, mask, args.steps, fused=True)
    mg_s = megatron_steps(recipe, tokens, targets, mask, args.steps)
    hf_tps, mg_tps = real * args.steps / hf_s, real * args.steps / mg_s
    print(f"batch {args.batch} samples, {real} tokens/step, {args.steps} steps, {args.threads} thread(s)")
    print(f"transformers + torch AdamW:         {hf_s / args.steps * 1000:8.1f} ms/step  {hf_tps:10.0f} tok/s")
    print(f"transformers + fused AdamW (detail): {fused_s / args.steps * 1000:7.1f} ms/step  "
          f"{real * args.steps / fused_s:10.0f} tok/s")
    print(f"megatron-core DDP + dist. Adam:     {mg_s / args.steps * 1000:8.1f} ms/step  {mg_tps:10.0f} tok/s")
    print(f"train_step ratio={mg_tps / hf_tps:.3f}")


if __name__ == "__main__":
    main()
