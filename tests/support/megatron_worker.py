"""Multi-process entry point for the megatron tests: one process per rank (env RANK/WORLD_SIZE/...).

    python tests/support/megatron_worker.py <scenario> <out_dir> <json args>

Each rank writes `<out_dir>/<scenario>.rank<r>.json`; rank 0 also writes tensors as safetensors.
`launch()` starts the ranks as real OS processes on a free port (gloo, one thread each) and fails
with the ranks' stderr when any exits non-zero or the run exceeds its timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def launch(scenario: str, world: int, out_dir: Path, args: dict, timeout: float = 300,
           env: dict[str, str] | None = None) -> list[dict]:
    """Run `scenario` on `world` ranks (with `env` added to each rank's environment); returns every rank's JSON
    result."""
    from kimi_pipeline.util.net import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    logs = []
    for rank in range(world):
        rank_env = dict(os.environ)
        rank_env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
            PYTHONWARNINGS="ignore",
        )
        rank_env.update(env or {})
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, scenario, str(out_dir), json.dumps(args)],
            env=rank_env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        ))
    deadline = time.monotonic() + timeout
    failed = None
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            failed = f"timed out after {timeout}s"
            break
        bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad:
            failed = f"rank {bad[0]} exited with {procs[bad[0]].returncode}"
            break
        time.sleep(0.2)
    if failed:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    text = []
    for i, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- rank {i} ---\n" + log.read()[-4000:])
        log.close()
    if failed or any(p.returncode for p in procs):
        raise RuntimeError(f"{scenario} on {world} ranks failed: {failed or 'non-zero exit'}\n" + "\n".join(text))
    return [json.loads((out_dir / f"{scenario}.rank{r}.json").read_text()) for r in range(world)]


# --------------------------------------------------------------------------- scenarios (run inside ranks)


def _setup(args: dict):
    import torch

    from kimi_pipeline.model.parallel import init_distributed
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.recipes.layout import Layout

    recipe = load_recipe("tiny")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = Layout(world_size=world, tp=args.get("tp", 1), pp=args.get("pp", 1), cp=args.get("cp", 1), ep=args.get("ep", 1),
                    etp=args.get("etp", 1), sequence_parallel=args.get("sp", False))
    init_distributed(layout, device=torch.device("cpu"), seed=args.get("seed", 1234))
    torch.manual_seed(0)
    return recipe, layout


def _batch(spec, args: dict):
    import torch

    g = torch.Generator().manual_seed(args.get("data_seed", 7))
    tokens = torch.randint(0, spec.vocab_size, (args.get("batch", 8), args.get("seq", 24)), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _dp_slice(tokens, targets):
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = tokens.shape[0] // dp
    return tokens[r * n : (r + 1) * n], targets[r * n : (r + 1) * n]


def _nll_loss(logits, batch):
    from kimi_pipeline.model.vocab_parallel import logprobs_from_logits

    lp, _ = logprobs_from_logits(logits, batch["targets"])
    return -lp.sum(), lp.numel(), {"nll_sum": -lp.sum().detach(), "count": float(lp.numel())}


def _global_loss(out: list[dict]) -> float | None:
    """Token-mean NLL over all micro-batches and DP ranks (last pipeline stage), on every rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    s = torch.tensor([sum(float(o["nll_sum"]) for o in out), sum(o["count"] for o in out)], dtype=torch.float64)
    dist.all_reduce(s, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(s, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return float(s[0] / s[1])


def _micro(tokens, targets, n: int) -> list[dict]:
    per = max(1, tokens.shape[0] // n)
    return [{"tokens": tokens[i : i + per], "targets": targets[i : i + per]} for i in range(0, tokens.shape[0], per)]


def _hf_reader(path: str):
    """get(name) over a safetensors file or an HF checkpoint directory (index + shards)."""
    from safetensors import safe_open

    p = Path(path)
    if p.is_file():
        return safe_open(str(p), "pt").get_tensor
    index = json.loads((p / "model.safetensors.index.json").read_text())["weight_map"]
    handles = {f: safe_open(str(p / f), "pt") for f in set(index.values())}
    return lambda name: handles[index[name]].get_tensor(name)


def _export(chunks, spec, layout, out: Path) -> None:
    """Full HF-named tensors (collective); rank 0 writes them as safetensors."""
    from safetensors.torch import save_file

    from kimi_pipeline.model import hf_bridge

    tensors = {n: t.contiguous() for n, t in hf_bridge.export_hf_tensors(chunks, spec, layout)}
    if int(os.environ.get("RANK", "0")) == 0:
        save_file(tensors, str(out))


def _export_grads(chunks, spec, layout, out: Path) -> None:
    """The gradients megatron left in the DDP grad buffers (`main_grad`, after finalize_model_grads), HF-named
    and gathered like the weights (collective); rank 0 writes them. Buffers (the expert bias) keep their values."""
    import torch

    saved = []
    for chunk in chunks:
        for _, p in chunk.named_parameters():
            grad = getattr(p, "main_grad", None)
            saved.append((p, p.data))
            p.data = (torch.zeros_like(p) if grad is None else grad).to(p.dtype)
    try:
        _export(chunks, spec, layout, out)
    finally:
        for p, data in saved:
            p.data = data


def scenario_ops(out_dir: Path, args: dict) -> dict:
    """Run a list of operations on one trainable model; every rank returns the same record.

    ops: ["load_hf"], ["train", n], ["eval"], ["logprobs"], ["export", path], ["save", dir, step],
    ["load", dir] (model + optimizer + extra; reshards to this layout).
    """
    import torch

    from kimi_pipeline.model import hf_bridge
    from kimi_pipeline.model import megatron_train as mt

    recipe, layout = _setup(args)
    spec = recipe.model
    chunks, opt = mt.build_trainable(spec, layout, recipe.optimizer, device=torch.device("cpu"))
    full_tokens, full_targets = _batch(spec, args)
    micro = _micro(*_dp_slice(full_tokens, full_targets), args.get("micro", 1))
    rec: dict = {"losses": [], "grad_norms": [], "eval": [], "logprobs": [], "extra": []}
    for op, *a in args["ops"]:
        if op == "load_hf":
            hf_bridge.load_hf_tensors_into_model(chunks, _hf_reader(args["weights"]), spec, layout)
        elif op == "train":
            for _ in range(a[0]):
                out = mt.forward_backward(chunks, micro, _nll_loss, optimizer=opt)
                rec["losses"].append(_global_loss(out))
                ok, gn = mt.optimizer_step(opt)
                assert ok, "optimizer step skipped"
                rec["grad_norms"].append(gn)
        elif op == "eval":
            rec["eval"].append(_global_loss(mt.forward_backward(chunks, micro, _nll_loss, forward_only=True)))
        elif op == "logprobs":
            lp, ent = mt.token_logprobs(chunks, full_tokens, full_targets)
            rec["logprobs"].append([float(lp.double().mean()), float(ent.double().mean()), list(lp.shape)])
        elif op == "export":
            _export(chunks, spec, layout, Path(a[0]))
        elif op == "save":
            mt.save_checkpoint(a[0], a[1], chunks, opt, {"rollout": a[1], "data_pos": [1, 2], "layout": str(layout)})
        elif op == "load":
            rec["extra"].append(mt.load_checkpoint(a[0], chunks, opt))
        else:
            raise ValueError(op)
    return rec


def scenario_grpo_padded(out_dir: Path, args: dict) -> dict:
    """One GRPO optimizer step over uneven micro-batches (3 and 2 samples of different lengths, plus the
    zero-weight padding micro-batch a DP rank runs when it has no sample for a slot), built by the trainer's
    own collate / `padding_micro_batch` / `microbatch_loss`, unpadded at any PP; returns the grad norm and writes
    every parameter's gradient (HF names) to `grads.safetensors`."""
    import functools

    import torch

    from kimi_pipeline.model import hf_bridge
    from kimi_pipeline.model import megatron_train as mt
    from kimi_pipeline.model.host_syncs import HostSyncRecorder
    from kimi_pipeline.model.megatron_model import unwrap
    from kimi_pipeline.rl.policy import microbatch_loss
    from kimi_pipeline.rl.samples import Sample, collate, padding_micro_batch
    from kimi_pipeline.rl.step_metrics import settle

    recipe, layout = _setup(args)
    spec = recipe.model
    chunks, opt = mt.build_trainable(spec, layout, recipe.optimizer, device=torch.device("cpu"))
    hf_bridge.load_hf_tensors_into_model(chunks, _hf_reader(args["weights"]), spec, layout)
    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(5):
        response = torch.randint(3, spec.vocab_size, (4 + i,), generator=g).tolist()
        samples.append(Sample(prompt_ids=torch.randint(3, spec.vocab_size, (6,), generator=g).tolist(),
                              response_ids=response, rollout_logprobs=[-1.0] * len(response),
                              advantage=float(i) - 2.0))
    mbs = [collate([samples[i] for i in idx], idx, pad_id=0) for idx in ([0, 1, 2], [3, 4])] + [padding_micro_batch()]
    batches = [{"tokens": mb.tokens, "targets": mb.targets, "mask": mb.mask, "rollout_logprobs": mb.rollout_logprobs,
                "advantages": mb.advantages, "old_logprobs": mb.mask * -1.2, "rows": mb.rows} for mb in mbs]
    recorder = HostSyncRecorder()
    with recorder.recording():
        out = mt.forward_backward(chunks, batches, functools.partial(microbatch_loss, grpo=recipe.grpo), optimizer=opt)
    out = settle(out)
    _export_grads(chunks, spec, layout, out_dir / "grads.safetensors")  # per parameter, before the step clips them
    ok, grad_norm = mt.optimizer_step(opt)
    return {"ok": ok, "grad_norm": grad_norm, "rows": [mb.tokens.shape[0] for mb in mbs],
            "real_rows": sum(max((m.weight for m in o.values()), default=0.0) for o in out),
            "host_syncs": {"ours": [f"{h.op} at {h.where}" for h in recorder.ours()],
                           "megatron": sorted(f"{h.op} at {h.where}" for h in recorder.megatron()),
                           "moe_layers": sum(1 for m in unwrap(chunks[0]).modules() if type(m).__name__ == "MoELayer"),
                           "micro_batches": len(mbs)}}


def scenario_replay(out_dir: Path, args: dict) -> dict:
    """The trainer's (PolicyWorker's) per-token logprobs of rollout samples under routing replay, at the
    layout in args (tp, sp); every rank returns them."""
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker
    from kimi_pipeline.rl.samples import Sample

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    recipe = load_recipe("tiny", ["rollout.routing_replay=true", "quant.int4_qat=false", f"parallel.tp={args['tp']}",
                                  f"parallel.sequence_parallel={str(args['sp']).lower()}", f"cluster.gpus_per_node={world}",
                                  f"parallel.ep={args.get('ep', 1)}", f"parallel.etp={args.get('etp', 1)}"])
    worker = PolicyWorker(PolicySections.of(recipe), rank=rank, world_size=world,
                          master_port=int(os.environ["MASTER_PORT"]))
    worker.load(str(out_dir / "no-checkpoints"), args["model"])
    samples = [Sample(**s) for s in args["samples"]]
    return {"logprobs": worker._token_logprobs(worker.model, samples)}


def _fixed_rollout(vocab: int, groups: int = 4, per_group: int = 4) -> list:
    """A rollout of `groups` x `per_group` samples of different lengths, group-normalized advantages and
    rollout logprobs that are not the trainer's (TIS weights differ from 1): the same on every rank."""
    import torch

    from kimi_pipeline.rl.samples import Sample

    g = torch.Generator().manual_seed(13)
    samples = []
    for group in range(groups):
        rewards = torch.rand(per_group, generator=g).round()
        rewards[0] = 1.0 - rewards[1]  # every group has differing rewards
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for k in range(per_group):
            n = int(torch.randint(3, 11, (1,), generator=g))
            samples.append(Sample(prompt_ids=torch.randint(3, vocab, (int(torch.randint(5, 9, (1,), generator=g)),),
                                                           generator=g).tolist(),
                                  response_ids=torch.randint(3, vocab, (n,), generator=g).tolist(),
                                  rollout_logprobs=(-0.5 - 2.5 * torch.rand(n, generator=g)).tolist(),
                                  group=group, reward=float(rewards[k]), advantage=float(adv[k])))
    return samples


def _gather_dp_grads(chunks) -> None:
    """Make every rank's DDP grad buffers hold the full data-parallel-reduced gradient. With the distributed
    optimizer megatron reduce-scatters each bucket (param_and_grad_buffer.py `start_grad_sync`), so a rank
    holds only its shard of the reduced gradient; all-gathering the shards rebuilds what an all-reduce gives.
    The optimizer reads only its own shard, which this leaves as it was."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            for bucket in group.buckets:
                shards = shard_buffer(bucket.grad_data, size)
                mine = shards[group.intra_distributed_optimizer_instance_rank].clone()
                dist.all_gather(list(shards), mine, group=group.intra_distributed_optimizer_instance_group)


def scenario_grpo_dp(out_dir: Path, args: dict) -> dict:
    """One rollout of GRPO through the trainer itself: `PolicyWorker.train` on this DP rank's share of the
    recipe's split of a fixed rollout (2 optimizer steps of 8 samples, several micro-batches each, the KL
    term on). Before each optimizer step every parameter's gradient (HF names, full over DP) goes to
    `grads<k>.safetensors`; returns the rank's metrics with their reductions and the weights after the rollout."""

    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl import policy
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker
    from kimi_pipeline.rl.samples import share_rollout

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    recipe = load_recipe("tiny", [f"cluster.gpus_per_node={world}", "rollout.global_batch_size=8",
                                  "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.num_steps_per_rollout=2",
                                  "parallel.max_tokens_per_gpu=40", "grpo.use_kl_loss=true", "grpo.kl_loss_coef=0.05"])
    worker = PolicyWorker(PolicySections.of(recipe), rank=rank, world_size=world,
                          master_port=int(os.environ["MASTER_PORT"]))
    worker.load(str(out_dir / "no-checkpoints"), args["model"])
    shares, split = share_rollout(_fixed_rollout(recipe.model.vocab_size), recipe.rollout, recipe.parallel,
                                  recipe.data_parallel_size)
    real_step, steps = policy.optimizer_step, []  # patched where the trainer looks it up

    def step_after_export(optimizer, scheduler=None, **kw):  # the real step, after recording the gradients it applies
        _gather_dp_grads(worker.model)
        _export_grads(worker.model, recipe.model, worker.layout, out_dir / f"grads{len(steps)}.safetensors")
        steps.append(len(steps))
        return real_step(optimizer, scheduler, **kw)

    policy.optimizer_step = step_after_export
    try:
        metrics = worker.train(shares[worker._dp_rank()], 1)
    finally:
        policy.optimizer_step = real_step
    _export(worker.model, recipe.model, worker.layout, out_dir / "weights.safetensors")
    return {"metrics": {k: [float(v), getattr(v, "reduce", "mean"), getattr(v, "weight", 1.0)]
                        for k, v in metrics.items()},
            "dp": len(shares), "global_batch_size": split.global_batch_size, "steps": len(steps),
            "samples": len(shares[worker._dp_rank()].samples),
            "micro_batches": [len(step) for step in shares[worker._dp_rank()].steps]}


def scenario_cp(out_dir: Path, args: dict) -> dict:
    """Per-token logprobs/entropy through the trainer's `SeqLayout` (this CP rank's part of each sequence,
    padded [b, s] or THD-packed) and `batch_logprobs`, against the plain [b, s] computation, with gradients.
    The model is a position-wise stand-in (logits = table[token]): the attention that makes CP/THD real
    needs Transformer Engine. Also the loss denominators megatron sums over DP x CP."""
    import torch
    import torch.distributed as dist

    from kimi_pipeline.model import megatron_train as mt
    from kimi_pipeline.model.context_parallel import Packing, SeqLayout, batch_logprobs, cp_group, seq_multiple
    from kimi_pipeline.model.vocab_parallel import logprobs_from_logits

    _setup(args)
    cp, rank, group = cp_group()
    g = torch.Generator().manual_seed(11)
    b, s, v = 3, 8 * cp, 40
    lengths = (s, s - 3, 5)
    tokens = torch.randint(0, v, (b, s), generator=g)
    targets = torch.roll(tokens, -1, dims=1)
    table = torch.randn(v, v, generator=g)
    real = (torch.arange(s)[None] < torch.tensor(lengths)[:, None] - 1).float()  # positions with a real target
    weights = torch.randn(b, s, generator=g) * real
    out: dict = {}
    for name, packing in (("bshd", None), ("thd", Packing(lengths, s, seq_multiple(1, cp, False)))):
        ref = table.clone().requires_grad_()
        lp_ref, ent_ref = logprobs_from_logits(ref[tokens], targets)
        ((lp_ref * weights).sum() + (ent_ref * weights).sum()).backward()
        layout = SeqLayout(cp, rank, group, packing)
        tab = table.clone().requires_grad_()
        local_tokens, _ = layout.model_inputs(tokens, torch.arange(s).expand(b, s))
        lp, ent = batch_logprobs(tab[local_tokens], {"targets": targets, "seq_layout": layout})
        ((lp * weights).sum() + (ent * weights).sum()).backward()
        grad = tab.grad.clone()
        dist.all_reduce(grad, group=group)  # each CP rank's gradient covers its own positions
        out[name] = {"lp_diff": float(((lp - lp_ref) * real).abs().max()),
                     "ent_diff": float(((ent - ent_ref) * real).abs().max()),
                     "grad_diff": float((grad - ref.grad).abs().max()), "local_len": local_tokens.shape[1],
                     "shape": list(lp.shape)}
    _, denom, _ = mt._call_loss(lambda logits, batch: (logits.sum(), 5, {}), {}, rank, torch.zeros(1))
    out["denominator"] = int(denom)
    return out


class CollectiveRecorder:
    """Every torch.distributed call this rank makes while installed (the module attributes the code under test
    looks up), with the bytes it received: a broadcast's tensor on a non-source rank, (n - 1) / n of an
    all-gather's output, a recv's tensor, an object collective's pickled size is not counted (control only)."""

    CALLS = ("broadcast", "all_gather_into_tensor", "all_gather", "all_reduce", "reduce_scatter_tensor", "send",
             "recv", "isend", "irecv", "batch_isend_irecv", "gather_object", "all_gather_object",
             "broadcast_object_list", "barrier", "gather", "scatter")

    def __init__(self) -> None:
        self.calls: list[list] = []  # [name, group size, bytes received]
        self._saved: dict = {}

    def __enter__(self) -> CollectiveRecorder:
        import torch.distributed as dist

        for name in self.CALLS:
            fn = getattr(dist, name)
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        import torch.distributed as dist

        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            size = dist.get_world_size(group)
            me = dist.get_rank(group)
            got = 0
            if name == "broadcast":
                tensor = args[0]
                src = kwargs.get("group_src")
                if src is None:
                    src = kwargs.get("src", args[1] if len(args) > 1 else None)
                    src = dist.get_group_rank(group, src) if group is not None else src
                got = 0 if me == src else tensor.numel() * tensor.element_size()
            elif name == "all_gather_into_tensor":
                out = args[0]
                got = out.numel() * out.element_size() * (size - 1) // size
            elif name in ("recv", "irecv"):
                got = args[0].numel() * args[0].element_size()
            self.calls.append([name, size, got])
            return fn(*args, **kwargs)

        return recorded


def scenario_weight_sync(out_dir: Path, args: dict) -> dict:
    """Each sync of `args["paths"]` (name -> colocate, weight_sync, urls), one after the other from the same randomly
    initialised tiny model at this layout, to that path's engines: the colocated one (`weight_sync.updaters.
    GroupBuckets` with the embedded engine's shared-memory handoff), the non-colocated one (`PPStageSources`) or the
    disk fallback (`DiskCheckpoint`), each under its own recorder of every collective of the trainers' groups. One
    launch for all of them: the ranks' start (~4 CPU-s each, importing megatron) is paid once. Rank 0 also writes the
    trainer's HF tensors, exported by the conversion's own path (`model.hf_bridge.export_hf_tensors`), as the
    reference."""
    from types import SimpleNamespace

    import torch

    from kimi_pipeline.engine.client import Router
    from kimi_pipeline.hf.names import HFLayout
    from kimi_pipeline.model.hf_bridge import export_hf_tensors
    from kimi_pipeline.model.megatron_model import build_model
    from kimi_pipeline.weight_sync.updaters import (
        DiskCheckpoint,
        GroupBuckets,
        PPStageSources,
        SharedMemoryHandoff,
        SyncSections,
        choose_weight_sync,
    )

    recipe, layout = _setup(args)
    spec = recipe.model
    model = build_model(spec, layout, device=torch.device("cpu"))
    rank = int(os.environ["RANK"])
    reference = {n: t.contiguous() for n, t in export_hf_tensors([model], spec, layout)}
    if rank == 0:
        from safetensors.torch import save_file

        save_file(reference, str(out_dir / "reference.safetensors"))
    model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    results = {}
    for name, path in args["paths"].items():
        target = SyncSections(engine="embedded", weight_format="model", weight_sync=path["weight_sync"],
                              buffer_bytes=args["buffer"], group_size=32, gpus_per_engine=1,
                              colocate=path["colocate"])
        trainer = SimpleNamespace(target=target, spec=spec, model=[model], layout=layout, rank=rank,
                                  world_size=layout.world_size, qat=[], device=torch.device("cpu"),
                                  hf_layout=HFLayout(), sync_dir=lambda name=name: out_dir / f"weight-sync-{name}")
        router = Router(path["urls"], weight_transport="auto" if path["colocate"] else "distributed")
        sync = choose_weight_sync(trainer, router)
        if path["weight_sync"] == "disk":
            assert isinstance(sync, DiskCheckpoint), type(sync)
        elif path["colocate"]:
            assert isinstance(sync, GroupBuckets) and isinstance(sync.handoff, SharedMemoryHandoff), type(sync)
        else:
            assert isinstance(sync, PPStageSources), type(sync)
        try:
            with CollectiveRecorder() as recorder:
                metrics = sync.update("synced")
        finally:
            sync.close()
        schedule = sync.schedule
        results[name] = {
            "metrics": metrics, "calls": recorder.calls, "schedule_collectives": schedule.collectives(),
            "schedule_received": schedule.received_bytes(sync.groups.pp_rank),
            "schedule_buckets": len(schedule.buckets), "model_bytes": model_bytes, "pp_rank": sync.groups.pp_rank,
            "source": sync.groups.pp_stage_source, "debug_level": str(torch.distributed.get_debug_level())}
    return results


def main() -> None:
    scenario, out_dir, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    from kimi_pipeline.model import parallel

    result = SCENARIOS[scenario](out_dir, args)
    rank = int(os.environ.get("RANK", "0"))
    parallel.destroy()
    (out_dir / f"{scenario}.rank{rank}.json").write_text(json.dumps(result))


SCENARIOS = {"ops": scenario_ops, "grpo_padded": scenario_grpo_padded, "grpo_dp": scenario_grpo_dp,
             "replay": scenario_replay, "cp": scenario_cp, "weight_sync": scenario_weight_sync}


if __name__ == "__main__":
    main()
