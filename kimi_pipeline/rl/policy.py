"""One trainer rank of the GRPO policy: megatron-core model + optimizer, train on rollout samples,
sync weights to the rollout engines, checkpoint and resume.

The driver runs one `PolicyWorker` per trainer rank (as Ray actors that together form one
torch.distributed job; gloo on CPU, nccl on GPU). Each rank receives only its data-parallel rank's share
of the rollout (`samples.share_rollout`, planned by the driver so micro-batch counts agree across ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.engine.client import Router
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.hf.reader import HFCheckpoint
from kimi_pipeline.model.context_parallel import batch_logprobs, seq_multiple
from kimi_pipeline.model.device import actor_gpu_index, resolve_device
from kimi_pipeline.model.hf_bridge import load_hf_tensors_into_model
from kimi_pipeline.model.megatron_model import build_model, unwrap
from kimi_pipeline.model.megatron_train import (
    build_trainable,
    forward_backward,
    load_checkpoint,
    load_model_only,
    lr_scheduler,
    micro_batch_logprobs,
    optimizer_step,
    require_finite_params,
    resume_step,
    save_checkpoint,
    seq_layout,
    state_tensors,
)
from kimi_pipeline.model.offload import PARTS, Offloaded
from kimi_pipeline.model.parallel import destroy, init_distributed
from kimi_pipeline.model.qat import enable_int4_qat
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import (
    ClusterSpec,
    GRPOSpec,
    HealthSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    QuantSpec,
    RolloutSpec,
)
from kimi_pipeline.rl.batching import split_micro_batches
from kimi_pipeline.rl.grpo import grpo_loss
from kimi_pipeline.rl.samples import MicroBatch, RankShare, Sample, collate, padding_micro_batch, response_values
from kimi_pipeline.rl.step_metrics import DeviceMetric, reduce_metrics, settle
from kimi_pipeline.weight_sync.policy_tensors import policy_tensors
from kimi_pipeline.weight_sync.updaters import SyncSections, choose_weight_sync

log = logging.getLogger(__name__)


def trainer_config_overrides(parallel: ParallelSpec, routing_replay: bool, device: torch.device) -> dict[str, Any]:
    """The recipe's megatron TransformerConfig settings beyond the model shape: routing replay, activation
    recompute, the MoE token dispatcher (flex/DeepEP only where it can run, else alltoall)."""
    out: dict[str, Any] = {}
    if routing_replay:
        out["moe_enable_routing_replay"] = True
    if parallel.recompute_granularity is not None:
        out.update(recompute_granularity=parallel.recompute_granularity, recompute_method=parallel.recompute_method,
                   recompute_num_layers=parallel.recompute_num_layers)
    if parallel.moe_token_dispatcher_type == "flex":
        reason = flex_dispatcher_refusal(parallel.tp * parallel.ep, device,
                                         importlib.util.find_spec("deep_ep") is not None)
        if reason is None:
            out.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
        else:
            log.warning("parallel.moe_token_dispatcher_type=flex: %s; using alltoall", reason)
    return out


def flex_dispatcher_refusal(tp_x_ep: int, device: torch.device, have_deep_ep: bool) -> str | None:
    """Why megatron's flex (DeepEP) token dispatcher cannot run here, or None when it can: it needs a GPU, the
    deep_ep package and more than one rank to dispatch over (`FlexTokenDispatcher.__init__` asserts
    TP x EP > 1, megatron/core/transformer/moe/token_dispatcher.py)."""
    if device.type != "cuda":
        return "DeepEP needs a GPU"
    if not have_deep_ep:
        return "DeepEP (deep_ep) is not installed"
    if tp_x_ep <= 1:
        return "TP x EP = 1: nothing to dispatch across (megatron asserts TP x EP > 1 for flex)"
    return None


def microbatch_loss(logits: torch.Tensor, batch: dict[str, Any], grpo, temperature: float = 1.0):
    """megatron's per-token-loss contract for one micro-batch: (loss sum, its denominator, metrics), each
    metric weighted by the micro-batch's real rows. `batch["rows"]` says how many rows are samples with response
    tokens (collate counts them on the host: counting the mask here would wait for the device); the others (a DP
    rank's zero-weight padding micro-batch, pipeline padding) add nothing: counted in the per-sample mean they
    would scale the gradient by real/padded rows."""

    lp, ent = batch_logprobs(logits, batch, temperature=temperature)
    rows = batch["rows"]
    if rows == 0:  # an all-padding micro-batch: no loss, but keep the graph connected for the pipeline
        return lp.sum() * 0.0, 0, {}
    old = batch["old_logprobs"]  # None: the weights are the rollout's, so this forward's own (PolicyWorker.train)
    loss, m = grpo_loss(lp, lp.detach() if old is None else old, batch["rollout_logprobs"], batch.get("ref_logprobs"),
                        ent, batch["advantages"], batch["mask"], grpo, rows=rows)
    # gradient of sum(loss_sum) / sum(denominator) over the step's micro-batches = the per-sample mean
    return loss * rows, rows, {k: dataclasses.replace(v, weight=rows) for k, v in m.items()}


@dataclass
class RoutingTally:
    """(response token, MoE layer) pairs whose trainer top-k expert set is the engine's (`same`) out of `pairs`,
    summed on the device over the forwards compared (`PolicyWorker._compare_routes`) at this rank's `routers`
    (megatron RouterReplay slots)."""

    routers: list
    same: torch.Tensor
    pairs: torch.Tensor

    def metrics(self) -> dict[str, DeviceMetric]:
        return {"routing_agreement": DeviceMetric(self.same / self.pairs.clamp_min(1))}


@dataclass(frozen=True)
class PolicySections:
    """The recipe sections a trainer rank reads (`PolicySections.of`; the trainer group and the tests build ranks
    from a recipe through it): `spec` the model it builds, `parallel` its process groups, `optimizer` / `grpo` /
    `quant` the update (QAT included), `rollout` the seed, schedule length, sampling temperature and routing
    replay, `cluster` its device and ranks per node, `health` whether a non-finite gradient norm or weight stops it
    (`health.nonfinite`), `target` the engines its weights go to, `text_config_key` where an HF starting checkpoint
    keeps its text config. The hub section stays on the driver: a rank never sees the token."""

    spec: ModelSpec
    parallel: ParallelSpec
    optimizer: OptimizerSpec
    grpo: GRPOSpec
    quant: QuantSpec
    rollout: RolloutSpec
    cluster: ClusterSpec
    health: HealthSpec
    target: SyncSections
    text_config_key: str | None

    @classmethod
    def of(cls, recipe: Recipe) -> PolicySections:
        return cls(recipe.model, recipe.parallel, recipe.optimizer, recipe.grpo, recipe.quant, recipe.rollout,
                   recipe.cluster, recipe.health, SyncSections.of(recipe), recipe.hub.text_config_key)


class PolicyWorker:
    def __init__(self, sections: PolicySections, *, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None, total_steps: int | None = None,
                 threads: int | None = None, local_gpu: int = 0):
        """One trainer rank reading `sections` (`PolicySections`).
        `local_gpu`: the node-local GPU the actor layout gave this rank (used as such when the actor picks
        its own GPU, colocated; otherwise Ray made exactly that GPU visible, as index 0)."""
        spec, parallel, optimizer, grpo = sections.spec, sections.parallel, sections.optimizer, sections.grpo
        quant, rollout, cluster, health = sections.quant, sections.rollout, sections.cluster, sections.health
        target, text_config_key = sections.target, sections.text_config_key
        self.spec, self.parallel, self.grpo, self.quant, self.rollout = spec, parallel, grpo, quant, rollout
        self.require_finite = health.nonfinite == "stop"  # no optimizer step or checkpoint takes NaN/inf
        self.target, self.text_config_key = target, text_config_key
        self.device = resolve_device(cluster.device, actor_gpu_index(local_gpu))
        if world_size > 1 or master_port is not None:
            per_node = min(world_size, cluster.gpus_per_node)  # ranks per node (GPUs, or CPU ranks)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % per_node),
                              LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)

        self.layout = Layout.from_parallel(parallel, world_size)
        self.world_size = world_size
        self.rank = init_distributed(self.layout, device=self.device, seed=rollout.seed)
        # the routers' RouterReplay slots serve replay and the agreement metric's recording alike
        overrides = trainer_config_overrides(parallel, rollout.returns_routed_experts, self.device)
        self.model, self.optimizer = build_trainable(spec, self.layout, optimizer, device=self.device, **overrides)
        total = total_steps or rollout.num_rollout * rollout.num_steps_per_rollout
        self.scheduler = lr_scheduler(self.optimizer, optimizer, total)
        self.qat: list[str] = []
        if quant.int4_qat:
            for m in self.model:
                self.qat += enable_int4_qat(m, quant.group_size)
        self.ref_model = None  # built on load() only when the KL term is on
        self.hf_layout = HFLayout()  # how the engines' checkpoint names the language model (set by load())
        self._sync = None  # this rank's weight updater (its engine client and shared-memory segment), kept across syncs
        # colocated: the state that sleeps on the host while the engines use the GPU (pinned where the device is an
        # accelerator: asynchronous copies need page-locked memory, which torch refuses without one)
        self._offload = Offloaded(self.device, self._state, pin_memory=self.device.type != "cpu")

    def _state(self) -> dict[str, list[torch.Tensor]]:
        return state_tensors(self.model, self.optimizer, [self.ref_model] if self.ref_model is not None else [])

    # ------------------------------------------------------------------ colocated memory handoff
    def sleep(self, parts: list[str]) -> dict[str, float]:
        """Hand these parts of the device state (`model.offload.PARTS`) to the colocated engines."""
        return {"offloaded_gb": self._offload.offload(parts) / 2**30}

    def wake(self, parts: list[str]) -> None:
        self._offload.reload(parts)

    def asleep(self) -> tuple[str, ...]:
        return self._offload.asleep

    def _require_awake(self, what: str, parts: tuple[str, ...] = PARTS) -> None:
        """A phase that reads state the handoff put to sleep is a bug in the step's order: fail, never read it."""
        if asleep := [p for p in parts if p in self._offload.asleep]:
            raise RuntimeError(f"trainer rank {self.rank}: {what} needs its {', '.join(asleep)} on {self.device}, "
                               "but they are asleep (colocated handoff out of order)")

    # ------------------------------------------------------------------ weights in
    def load(
        self, train_ckpt_dir: str, init_ckpt_dir: str, ref_ckpt_dir: str | None = None, hf_prefix: str = ""
    ) -> dict[str, Any] | None:
        """Resume from the latest training checkpoint, else start from the converted weights.

        `ref_ckpt_dir`: the KL reference's weights (the K2.5 recipe's BF16 copy, `hub.ref_model`; default: the
        starting weights). `hf_prefix`: where the base checkpoint, which the engines serve, keeps its language model
        (`hf.names.HFLayout`): weight sync sends the engines its names.
        Returns the checkpoint's extra state (data position, rollout step) or None for a fresh start.
        """

        extra = None
        self._ckpt_dir = train_ckpt_dir
        self.hf_layout = HFLayout(hf_prefix)
        step, skipped = resume_step(train_ckpt_dir)  # the newest that verifies (a corrupt latest is skipped)
        if step is not None:
            extra = load_checkpoint(train_ckpt_dir, self.model, self.optimizer, step=step)
            extra["skipped_checkpoints"] = skipped  # for the driver's log; not saved
            sched = extra.get("scheduler")
            if sched:
                self.scheduler.load_state_dict(sched)
        else:
            self._load_initial(self.model[0], Path(init_ckpt_dir))
        if self.grpo.use_kl_loss and self.grpo.kl_loss_coef > 0:
            self.ref_model = build_model(self.spec, self.layout, device=self.device)
            self._load_initial(self.ref_model, Path(ref_ckpt_dir or init_ckpt_dir))
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        return extra

    def _load_initial(self, model, init: Path) -> None:
        """The starting weights: a converted torch_dist checkpoint, or (bridge mode) the HF checkpoint itself,
        each rank reading only the tensors it owns (FP8/INT4 sources dequantized on the fly) under the names that
        checkpoint stores them by (its own config.json says which: K2.5's `language_model.` prefix)."""
        if not (init / "config.json").is_file():
            load_model_only(init, [model])
            return

        ckpt = HFCheckpoint(init, text_config_key=self.text_config_key)
        try:
            load_hf_tensors_into_model(unwrap(model), ckpt.get, self.spec, self.layout)
        finally:
            ckpt.close()

    # ------------------------------------------------------------------ training
    def _dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    def _collate(self, samples: list[Sample], mb: list[int]) -> MicroBatch:
        """Tensors of one micro-batch (positions in `samples`); an empty one is zero-weight padding."""

        lay = self.layout
        multiple = seq_multiple(lay.tp, lay.cp, lay.sequence_parallel)
        if mb:
            return collate([samples[i] for i in mb], mb, pad_id=0, pad_to_multiple=multiple).to(self.device)
        model = self.spec
        replay = self.rollout.routing_replay  # a rank with no sample of its own still replays (zero ids)
        return padding_micro_batch(
            0, (model.num_layers - model.first_k_dense, model.moe_router_topk) if replay else None, width=multiple
        ).to(self.device)

    def _moe_layer_slice(self) -> slice:
        """Which of the rollout's MoE layers (engine order) the routers of this pipeline stage are."""
        from megatron.core import parallel_state as ps

        spec = self.spec
        layers = self.layout.pp_stage_layers(spec.num_layers)
        pp = ps.get_pipeline_model_parallel_rank()
        start = sum(layers[:pp])
        moe = lambda lo, hi: sum(1 for i in range(lo, hi) if i >= spec.first_k_dense)  # noqa: E731
        first = moe(0, start)
        return slice(first, first + moe(start, start + layers[pp]))

    def _local_tokens(self, mb: MicroBatch, values: torch.Tensor | None = None) -> torch.Tensor:
        """The micro-batch's replay ids [b, s, layers, k] (or other per-position `values` [b, s, ...]) → the tokens
        this rank's routers see, in megatron's order: this rank's part under CP / packing (the forward step's own
        `seq_layout`), s-major, and under sequence parallelism this TP rank's slice of it."""
        from megatron.core import parallel_state as ps

        values = mb.routed_experts if values is None else values
        ids = seq_layout(self.model[0], {"tokens": mb.tokens, "lengths": mb.lengths}).local(values)
        ids = ids.transpose(0, 1).reshape(-1, *ids.shape[2:])
        tp = ps.get_tensor_model_parallel_world_size()
        if self.layout.sequence_parallel and tp > 1:
            chunk = ids.shape[0] // tp
            ids = ids[ps.get_tensor_model_parallel_rank() * chunk :][:chunk]
        return ids

    def _with_replay(self, mbs: list[MicroBatch], fn):
        """Run `fn` with routing replay: before each micro-batch's forward, its rollout expert ids are
        installed in megatron's RouterReplay (routing from the rollout, probabilities from the live router).
        With replay on, samples without expert ids are an error, never a silent fall back to live routing."""
        if not self.rollout.routing_replay:
            return fn()
        if any(mb.routed_experts is None for mb in mbs):
            raise PermanentError(
                "rollout.routing_replay is on but the rollout's samples carry no routed expert ids: the engine must "
                "return them (SGLang: --enable-return-routed-experts; requests ask with return_routed_experts); "
                "fix the engine launch or set rollout.routing_replay=false")
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers, queue, layers = self._routers(), list(mbs), self._moe_layer_slice()

        def install(_module, _args):
            ids = self._local_tokens(queue.pop(0))[:, layers]
            if ids.shape[1] != len(routers):
                raise PermanentError(f"routing replay: {ids.shape[1]} MoE layers of expert ids for this pipeline "
                                     f"stage's {len(routers)} routers (the rollout's model is not this model)")
            for i, router in enumerate(routers):  # megatron's set_replay_data, on this model's routers only
                router.set_target_indices(ids[:, i].contiguous())
                router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        handle = self.model[0].register_forward_pre_hook(install)
        try:
            return fn()
        finally:
            handle.remove()
            for router in routers:
                router.clear_indices()
                router.clear_router_replay_action()

    def _routers(self) -> list:
        """This model's RouterReplay slots, in layer order. Megatron keeps every slot of the process in one global
        list (`RouterReplay.global_router_replay_instances`) whose setters require one tensor per slot of every
        model built here, so replay and recording address this model's slots themselves."""
        return [m.router_replay for m in unwrap(self.model).modules() if getattr(m, "router_replay", None) is not None]

    def _routing_tally(self, mbs: list[MicroBatch]) -> RoutingTally | None:
        """A tally to compare routing into, or None where nothing is measured: routing replay on (replayed routing
        agrees by construction), `rollout.routing_agreement` off, a sample without the engine's ids, or a pipeline
        stage of dense layers only (no router: no metric from this rank, not a zero)."""
        if self.rollout.routing_replay or not self.rollout.routing_agreement or any(
                mb.routed_experts is None for mb in mbs):
            return None
        routers = self._routers()
        if not routers:  # a pipeline stage of dense layers only
            return None
        return RoutingTally(routers, torch.zeros((), device=self.device), torch.zeros((), device=self.device))

    @contextlib.contextmanager
    def _compare_routes(self, mbs: list[MicroBatch], tally: RoutingTally | None) -> Iterator[None]:
        """While the block runs the policy's forward over `mbs` (in that order: one forward of model[0] each), record
        the trainer's own routing and add to `tally` the (response token, MoE layer) pairs whose top-k expert set
        equals the engine's. Recording is megatron's own RouterReplay RECORD action (moe/router_replay.py
        `get_replay_topk`: the live top-k, kept per layer until the next forward), read when each micro-batch's
        forward returns (before its backward, whose recomputation records again). Device values: the metric is
        read back with the step's metrics. No tally (`_routing_tally`): nothing recorded."""
        if tally is None:
            yield
            return
        routers = tally.routers
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        queue, layers = list(mbs), self._moe_layer_slice()

        def compare(_module, _args, _output) -> None:
            mb = queue.pop(0)
            mine = torch.stack([r.get_recorded_indices() for r in routers], dim=1).sort(-1).values  # [t, L, k]
            theirs = self._local_tokens(mb)[:, layers].to(mine.device).sort(-1).values
            response = self._local_tokens(mb, mb.mask[:, :, None]).reshape(-1, 1).bool()  # [t, 1] positions scored
            agree = (mine == theirs).all(-1) & response  # [t, L]; masks, not indexing: no wait for the device
            tally.same = tally.same + agree.sum()
            tally.pairs = tally.pairs + response.sum() * agree.shape[1]

        for r in routers:
            r.set_router_replay_action(RouterReplayAction.RECORD)
        handle = self.model[0].register_forward_hook(compare)
        try:
            yield
        finally:
            handle.remove()
            for r in routers:
                r.clear_indices()
                r.clear_router_replay_action()

    def _logprobs(self, model_chunks, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Per-token logprobs [b, s] of every micro-batch (no grad, on every rank, 0 outside the response
        mask), all micro-batches in one forward schedule: pipelined at PP > 1, not one schedule each."""

        temperature = self.rollout.temperature or 1.0
        batches = [{"tokens": mb.tokens, "targets": mb.targets, "lengths": mb.lengths} for mb in mbs]
        lps = self._with_replay(mbs, lambda: micro_batch_logprobs(model_chunks, batches, temperature=temperature))
        return [lp * mb.mask for lp, mb in zip(lps, mbs)]

    def _token_logprobs(self, model_chunks, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token logprobs of each sample, in sample order (diagnostics and tests)."""

        micro_batches = split_micro_batches([s.num_tokens for s in samples], self.parallel.max_tokens_per_gpu, 1)
        mbs = [collate([samples[i] for i in mb], mb, pad_id=0).to(self.device) for mb in micro_batches.ranks[0] if mb]
        out: list[list[float]] = [[] for _ in samples]
        for mb, lp in zip(mbs, self._logprobs(model_chunks, mbs)):
            for row, i in enumerate(mb.index):
                out[i] = response_values(lp[row], samples[i])
        return out

    def train(self, share: RankShare, step: int) -> dict[str, float]:
        """One rollout of GRPO on this data-parallel rank's share: old (and reference) logprobs of its own
        samples in one forward schedule, then one optimizer step per global batch of the split."""

        if share.dp_rank != self._dp_rank():
            raise PermanentError(
                f"trainer rank {self.rank} is data-parallel rank {self._dp_rank()} but was handed "
                f"DP rank {share.dp_rank}'s samples: the actor layout and megatron disagree on rank order"
            )
        self._require_awake("training")
        t0 = time.perf_counter()
        temperature = self.rollout.temperature or 1.0
        samples = share.samples
        steps = [[self._collate(samples, mb) for mb in st] for st in share.steps]
        flat = [mb for st in steps for mb in st]
        # Old logprobs: until the first optimizer step the weights are the ones the rollout sampled, so that step's
        # micro-batches take their own training forward's logprobs, detached (`microbatch_loss`; verl's on-policy
        # case, workers/actor/dp_actor.py). Only the later steps' micro-batches need this no-grad forward, before
        # any update: one forward of the rollout's tokens saved per rollout, all of it at one step per rollout.
        later = flat[len(steps[0]):]
        tally = self._routing_tally(flat)  # routing compared in the forwards of the weights the rollout sampled
        with self._compare_routes(later, tally):
            old = [None] * len(steps[0]) + (self._logprobs(self.model, later) if later else [])
        ref = self._logprobs([self.ref_model], flat) if self.ref_model is not None else None
        reports: list[dict[str, DeviceMetric]] = []  # read back once, after the last optimizer step (settle)
        grad_norms, updated, tokens, j = [], 0, 0, 0

        def loss_fn(logits: torch.Tensor, batch: dict):
            return microbatch_loss(logits, batch, self.grpo, temperature)

        for n, mbs in enumerate(steps):
            batches = []
            for mb in mbs:
                d = {"tokens": mb.tokens, "targets": mb.targets, "lengths": mb.lengths, "mask": mb.mask,
                     "rows": mb.rows, "rollout_logprobs": mb.rollout_logprobs, "advantages": mb.advantages,
                     "old_logprobs": old[j]}
                if ref is not None:
                    d["ref_logprobs"] = ref[j]
                batches.append(d)
                j += 1
            with self._compare_routes(mbs, tally if n == 0 else None):
                outs = self._with_replay(mbs, lambda: forward_backward(self.model, batches, loss_fn,
                                                                        optimizer=self.optimizer))
            ok, grad_norm = optimizer_step(self.optimizer, self.scheduler, require_finite=self.require_finite)
            updated += int(ok)
            grad_norms.append(float(grad_norm or 0.0))
            reports.extend(outs)
            tokens += sum(samples[i].num_tokens for mb in mbs for i in mb.index)
        if tally is not None:  # every rank: its own MoE layers and tokens (the trainer group means over ranks)
            reports.append(tally.metrics())
        metrics: dict[str, float] = reduce_metrics(settle(reports))  # loss metrics: last pipeline stage only
        seconds = time.perf_counter() - t0
        metrics.update(grad_norm=sum(grad_norms) / max(len(grad_norms), 1), optimizer_steps=float(updated),
                       lr=float(self.optimizer.param_groups[0]["lr"]), train_seconds=seconds,
                       train_samples=float(len(samples)),  # this DP rank's share (mean over ranks in the row)
                       train_tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
        return metrics

    # ------------------------------------------------------------------ weights out
    def hf_tensors(self, fake_quant: bool | None = None):
        """Full HF-named tensors (collective; every rank must drain it), routed experts fake-quantized
        when QAT is on (unless `fake_quant=False`) so the engines sample from exactly the policy the
        trainer optimizes."""

        fq = self.qat if fake_quant is None else fake_quant
        return policy_tensors(self.model[0], self.spec, self.layout, dst=0,
                              qat_group_size=self.quant.group_size if fq else None)

    def sync_weights(self, engine_urls: list[str], version: str) -> dict[str, float]:
        """Make the engines serve the current weights as `version` (collective: every trainer rank calls it).
        The updater (`weight_sync.updaters`) is chosen once per set of engines and kept, with its client and
        shared-memory segment, across syncs."""

        self._require_awake("the weight sync", ("weights",))
        urls = [u.rstrip("/") for u in engine_urls]
        if self._sync is None or self._sync.router.urls != urls:
            self.release()
            m = self.spec
            # colocated: shared memory with the engine on this host; otherwise a process group (gloo / NCCL)
            router = Router(urls, num_layers=m.num_layers, topk=m.moe_router_topk, first_k_dense=m.first_k_dense,
                            weight_transport="auto" if self.target.colocate else "distributed",
                            group_backend="nccl" if self.device.type == "cuda" else "gloo")
            self._sync = choose_weight_sync(self, router)
        return self._sync.update(version)

    def sync_dir(self) -> Path:
        """Where the disk fallback writes synced weights: <checkpoint dir>/../weight-sync (shared storage)."""
        return Path(self._ckpt_dir).parent / "weight-sync"

    # ------------------------------------------------------------------ checkpoints
    def save(self, ckpt_dir: str, step: int, extra: dict[str, Any]) -> str:
        self._require_awake("a checkpoint save")
        if self.require_finite:
            require_finite_params(self.model)
        extra = {**extra, "scheduler": self.scheduler.state_dict()}
        return str(save_checkpoint(ckpt_dir, step, self.model, self.optimizer, extra))

    def pid(self) -> int:
        return os.getpid()

    def release(self) -> None:
        """Close the engine client (and remove its shared-memory segment); no collective, safe at teardown."""
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    def close(self) -> None:
        self.release()
        self._drop_router_slots()
        destroy()

    def _drop_router_slots(self) -> None:
        """Take this worker's RouterReplay slots (policy and reference model) out of megatron's process-wide list:
        a process that builds workers one after another (tests, `kimi eval`) would otherwise keep every one."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        models = [unwrap(self.model)] + ([unwrap(self.ref_model)] if self.ref_model is not None else [])
        mine = {id(m.router_replay) for model in models for m in model.modules()
                if getattr(m, "router_replay", None) is not None}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
