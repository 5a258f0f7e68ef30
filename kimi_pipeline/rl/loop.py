"""The GRPO driver: rollout → reward → advantages → train → weight sync → checkpoint → eval.

Runs in the stage's process and drives Ray actors: the trainer ranks (`PolicyWorker`, one
torch.distributed job) and the rollout engines (embedded HTTP engines on CPU, SGLang servers on GPU),
all talked to through one client. Every random choice is seeded by (recipe seed, step), and a
checkpoint carries the data position, so a retried stage resumes from its latest checkpoint and
ends with the same metrics as an uninterrupted run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.cluster.placement import create_placement_groups, remove_placement_groups
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.model.tokenizer import decode_responses, load_tokenizer
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.report.metrics import MetricsLog, first_last_mean, open_wandb, read_jsonl
from kimi_pipeline.report.progress import TrainProgress
from kimi_pipeline.rl.launch import LaunchPlan, check_launch, engine_options, plan_launch, trainer_options
from kimi_pipeline.rl.prompts import Prompt, PromptStream, load_prompts
from kimi_pipeline.rl.samples import Sample, share_rollout

log = logging.getLogger(__name__)

class TrainingError(RuntimeError):
    """A transient training failure (lost actor, engine down): the stage retry resumes from the checkpoint."""


@dataclass
class TrainPaths:
    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"


def rollout_seed(recipe: Recipe, step: int) -> int:
    return recipe.rollout.seed * 1_000_003 + step


# --------------------------------------------------------------------------- actors


def _cpu_threads(recipe: Recipe, ranks_per_node: int) -> int:
    if recipe.cluster.device == "cuda":
        return 1
    cores = recipe.cluster.cpus_per_node or os.cpu_count() or 1
    return max(1, cores // max(1, ranks_per_node))


class EngineActor:
    """An embedded rollout engine serving SGLang's HTTP API from a Ray actor."""

    def __init__(self, model_dir: str, seed: int, host: str = "127.0.0.1", device: str | None = None):
        from kimi_pipeline.rl.engine.model import EngineModel
        from kimi_pipeline.rl.engine.sampler import RolloutEngine
        from kimi_pipeline.rl.engine.server import EngineServer

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = EngineModel.from_pretrained(model_dir, device=device)
        self.server = EngineServer(RolloutEngine(model, seed=seed), host, 0, None, model_dir)
        self._url = self.server.start()

    def url(self) -> str:
        return self._url

    def stop(self) -> None:
        self.server.stop()


def _free_port_on(pg, bundle: int) -> tuple[str, int]:
    """(IP, free port) of the node holding `bundle`: rendezvous addresses must be free where they are bound."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from kimi_pipeline.util.net import free_port

    @ray.remote(num_cpus=0.01)
    def probe() -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port("")

    if ray.is_initialized() and len(ray.nodes()) > 1:
        return ray.get(probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle)).remote())
    return "127.0.0.1", free_port()


def _start_engines(recipe: Recipe, plan: LaunchPlan, pgs: dict, model_dir: Path, ray) -> tuple[list, list[str]]:
    """One actor per engine node process, where the launch plan puts it; returns (actors, node-0 URLs)."""
    threads = _cpu_threads(recipe, 1)
    if recipe.rollout.engine != "sglang":  # the embedded engine (CPU, or a single GPU)
        engines = [ray.remote(EngineActor).options(**engine_options(plan, recipe, pgs, e.id, 0, threads)).remote(
            str(model_dir), recipe.rollout.seed, recipe.sglang.host) for e in plan.engines]
        return engines, ray.get([e.url.remote() for e in engines])
    from kimi_pipeline.rl.engine.sglang import SGLangEngine

    actors, heads = [], []
    for e in plan.engines:
        slot = plan.placement.engines[e.id]
        addr = None
        if len(e.nodes) > 1:  # SGLang's multi-node rendezvous on the engine's node 0
            ip, port = _free_port_on(pgs[slot.group], slot.bundles[0])
            addr = f"{ip}:{port}"
        for n in e.nodes:
            actor = ray.remote(SGLangEngine).options(**engine_options(plan, recipe, pgs, e.id, n.node_rank, threads))
            a = actor.remote(str(model_dir), recipe.sglang, gpus_per_node=recipe.cluster.gpus_per_node,
                             node_rank=n.node_rank, dist_init_addr=addr, base_gpu_id=n.base_gpu_id,
                             routing_replay=recipe.rollout.routing_replay, seed=recipe.rollout.seed,
                             trust_remote_code=recipe.hub.trust_remote_code)
            actors.append(a)
            if n.node_rank == 0:
                heads.append(a)
    starts = [a.start.remote() for a in actors]
    ray.get(starts)
    return actors, ray.get([a.get_url.remote() for a in heads])


def _start_trainers(recipe: Recipe, plan: LaunchPlan, pgs: dict, ray) -> list:
    """One actor per trainer rank in its node's bundle; MASTER_ADDR is rank 0's node (bundle 0)."""
    from kimi_pipeline.rl.policy import PolicyWorker

    world = recipe.cluster.world_size
    addr, port = _free_port_on(pgs["trainer"], plan.master_addr_node)
    threads = _cpu_threads(recipe, recipe.cluster.gpus_per_node)
    data = recipe.model_dump(mode="json", exclude={"hub": {"token"}})
    return [ray.remote(PolicyWorker).options(**trainer_options(plan, recipe, pgs["trainer"], rank, threads)).remote(
        data, rank, world, addr, port) for rank in range(world)]


def _merge_rank_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Mean over ranks that report a metric (loss metrics come from the last pipeline stage only)."""
    keys = {k for r in results for k in r}
    return {k: sum(r[k] for r in results if k in r) / sum(1 for r in results if k in r) for k in keys}


def _train(workers: list, plan: LaunchPlan, samples: list[Sample], recipe: Recipe, step: int, ray) -> dict[str, float]:
    """Each DP rank's share of the rollout goes into the object store once; every trainer rank of that DP rank
    reads it there (the samples are not serialized into 256 actor calls)."""
    shares, split = share_rollout(samples, recipe)
    refs = [ray.put(s) for s in shares]
    metrics = _merge_rank_metrics(ray.get([w.train.remote(refs[plan.ranks[i].dp], step)
                                           for i, w in enumerate(workers)]))
    if split.trimmed:
        log.info("step %d: %d samples past the last full global batch (%d) not trained", step + 1,
                 len(split.trimmed), split.global_batch_size)
    return {**metrics, "global_batch_size": float(split.global_batch_size),
            "samples_trimmed": float(len(split.trimmed))}


# --------------------------------------------------------------------------- rollout


def generate_groups(client, tokenizer, reward, prompts: list[Prompt], recipe: Recipe, seed: int,
                    first_group: int = 0) -> list[list[Sample]]:
    """n samples per prompt from the engines, graded; one list of samples per prompt (a group)."""
    from kimi_pipeline.rl.engine.sampler import SamplingParams

    ro = recipe.rollout
    params = SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                            max_new_tokens=ro.max_response_len, seed=seed)
    n = ro.n_samples_per_prompt
    completions = client.generate([p.ids for p in prompts], n=n, params=params,
                                  return_routed_experts=ro.routing_replay)
    texts = decode_responses(tokenizer, [c.output_ids for c in completions])
    rewards = reward.score(texts, [p.label for p in prompts for _ in range(n)])
    groups: list[list[Sample]] = []
    for g, p in enumerate(prompts):
        group = []
        for j in range(n):
            i = g * n + j
            c = completions[i]
            group.append(Sample(prompt_ids=list(c.prompt_ids), response_ids=list(c.output_ids),
                                rollout_logprobs=list(c.logprobs), label=p.label, group=first_group + g,
                                reward=float(rewards[i]), finish_reason=c.finish_reason, response_text=texts[i],
                                routed_experts=c.routed_experts))
        groups.append(group)
    return groups


def rollout(client, tokenizer, reward, stream: PromptStream, recipe: Recipe, step: int) -> tuple[list[Sample], dict]:
    """One rollout's samples with group-normalized advantages (dynamic sampling when the recipe asks)."""
    from kimi_pipeline.rl.grpo import group_advantages

    ro = recipe.rollout
    t0 = time.perf_counter()
    if ro.dynamic_sampling:
        from kimi_pipeline.rl.sampling import collect_groups

        per_draw = ro.over_sampling_batch_size or ro.rollout_batch_size
        seen: list[Sample] = []  # every sample drawn: the policy's reward, not the filtered batch's

        def draw(d: int) -> list[list[Sample]]:
            drawn = generate_groups(client, tokenizer, reward, stream.take(per_draw), recipe,
                                    rollout_seed(recipe, step) * 31 + d, first_group=d * per_draw)
            seen.extend(s for g in drawn for s in g)
            return drawn

        kept, _surplus, report = collect_groups(draw, target=ro.rollout_batch_size,
                                                max_draws=ro.dynamic_sampling_max_draws,
                                                rewards_of=lambda grp: [s.reward for s in grp])
        groups, extra = kept, {"dynamic_kept_groups": float(report.kept), "dynamic_dropped_groups": float(report.dropped),
                               "dynamic_draws": float(report.draws)}
        if not groups:  # every group was all-right or all-wrong: nothing to learn from this rollout
            groups = generate_groups(client, tokenizer, reward, stream.take(ro.rollout_batch_size), recipe,
                                     rollout_seed(recipe, step))
    else:
        groups = generate_groups(client, tokenizer, reward, stream.take(ro.rollout_batch_size), recipe,
                                 rollout_seed(recipe, step))
        seen, extra = [], {}
    gen_seconds = time.perf_counter() - t0
    samples = [s for g in groups for s in g]
    seen = seen or samples
    rewards = torch.tensor([s.reward for s in samples])
    if ro.dynamic_sampling:
        extra["reward_trained_mean"] = float(rewards.mean())
    seen_rewards = torch.tensor([s.reward for s in seen])
    adv = group_advantages(rewards, ro.n_samples_per_prompt)
    for s, a in zip(samples, adv.tolist()):
        s.advantage = float(a)
    n = ro.n_samples_per_prompt
    lengths = [len(s.response_ids) for s in seen]
    out_tokens = sum(lengths)
    seen_groups = seen_rewards.view(-1, n)
    metrics = {
        "reward_mean": float(seen_rewards.mean()),  # over every sample drawn (dynamic sampling keeps a subset)
        "reward_std": float(seen_rewards.std()) if len(seen_rewards) > 1 else 0.0,
        "solved_group_fraction": float((seen_groups.max(dim=1).values > 0.5).float().mean()),
        "all_solved_group_fraction": float((seen_groups.min(dim=1).values > 0.5).float().mean()),
        "response_len_mean": out_tokens / len(seen),
        "response_len_max": float(max(lengths)),
        "truncated_fraction": sum(s.finish_reason == "length" for s in seen) / len(seen),
        "rollout_seconds": gen_seconds,
        "rollout_tokens_per_s": out_tokens / gen_seconds if gen_seconds > 0 else 0.0,
        "samples": float(len(samples)),
        "samples_drawn": float(len(seen)),
        "reward_timeouts": float(reward.last_stats.as_dict().get("timeouts", 0)),
        **extra,
    }
    return samples, metrics


# --------------------------------------------------------------------------- the loop


def stage_error(e: Exception) -> Exception:
    """What the stage raises for a failure inside the actors or engines: a PermanentError (bad model, bad
    recipe, a 400 from an engine) stays permanent even when Ray wraps it, so the task does not retry what a
    retry cannot fix; anything else (a lost actor, node or engine) is a retryable TrainingError."""
    from kimi_pipeline.rl.engine.client import EngineRequestError

    if isinstance(e, PermanentError):
        return e
    cause = getattr(e, "cause", None)  # Ray's RayTaskError carries the actor's own exception
    if isinstance(cause, PermanentError):
        return PermanentError(f"{type(cause).__name__} in a training actor: {cause}")
    what = "rollout engine" if isinstance(e, EngineRequestError) else "training actors"
    first = _first_line(e)  # for an actor's exception: Ray's "ray::Actor.method() (pid=…)" line …
    if cause is not None:  # … and the actor's own message
        first = f"{first}: {_first_line(cause)}"
    return TrainingError(f"{what} failed ({type(e).__name__}): {first}; a retry resumes from the latest checkpoint")


def _first_line(e: BaseException) -> str:
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # Ray colours its lines
    return text.splitlines()[0][:300] if text else ""


def _require_healthy_cluster(recipe: Recipe, address: str | None, timeout_s: float = 60.0) -> None:
    """Actors on a cluster that lost a node would wait forever for resources: check first, fail clearly
    (a transient error: the task retry waits again, e.g. for the node to come back)."""
    from kimi_pipeline.cluster.health import Requirements, wait_until_healthy

    import ray

    wait_until_healthy(address or ray.get_runtime_context().gcs_address, Requirements.from_recipe(recipe),
                       timeout_s=timeout_s, progress=log.info)



def run_training(
    recipe: Recipe,
    run_dir: Path,
    *,
    init_checkpoint: Path,
    model_dir: Path,
    ray_address: str | None = None,
    evaluate: Callable[[int, list[str]], dict[str, Any]] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train `recipe.rollout.num_rollout` rollouts (resuming from DIR/train/checkpoints); return the summary section.

    `evaluate(step, engine_urls)` is called at step 0 of a fresh run, every `eval.interval` steps and at
    the end (the task layer makes each one a retried Prefect task). `stop_after` ends early (tests).
    """
    import ray

    from kimi_pipeline.model.checkpoint_dirs import prune_checkpoints
    from kimi_pipeline.rl.engine.client import EngineRequestError, Router
    from kimi_pipeline.reward import AnswerGrader

    paths = TrainPaths(Path(run_dir) / "train")
    paths.root.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(model_dir, recipe.hub.trust_remote_code)
    train_file = Path(run_dir) / "validate" / "train.jsonl"
    stream = PromptStream(load_prompts(train_file, tokenizer, recipe.data.input_key, recipe.data.label_key,
                                       recipe.data.apply_chat_template), recipe.rollout.seed, recipe.rollout.shuffle)
    if not ray.is_initialized():
        if ray_address is None:
            raise PermanentError("no Ray cluster: run the cluster stage first (or pass --ray-address)")
        ray.init(address=ray_address, log_to_driver=False)
    _require_healthy_cluster(recipe, ray_address)
    total = recipe.rollout.num_rollout
    wandb_run = open_wandb(None, f"{recipe.name}-{Path(run_dir).name}", recipe.model_dump(mode="json",
                                                                                          exclude={"hub": {"token"}}))
    metrics_log = MetricsLog(paths.metrics, tensorboard_dir=paths.tensorboard, wandb_run=wandb_run)
    engines, workers, router, pgs = [], [], None, {}
    reward = AnswerGrader(recipe.rollout.rm_type, recipe.rollout.thinking, strict=recipe.rollout.reward_strict)
    try:
        plan = plan_launch(recipe, str(model_dir))
        check_launch(plan)
        pgs = create_placement_groups(plan.placement)
        engines, urls = _start_engines(recipe, plan, pgs, model_dir, ray)
        workers = _start_trainers(recipe, plan, pgs, ray)
        extras = ray.get([w.load.remote(str(paths.checkpoints), str(init_checkpoint)) for w in workers])
        extra = extras[0] or {}
        start = int(extra.get("step", 0))
        if extra:
            stream.restore(extra["data"])
            metrics_log.truncate_after(start)
            log.info("resumed from %s at step %d", paths.checkpoints, start)
        ray.get([w.sync_weights.remote(urls, str(start)) for w in workers])
        m = recipe.model
        router = Router(urls, num_layers=m.num_layers, topk=m.moe_router_topk, first_k_dense=m.first_k_dense,
                        server_concurrency=recipe.sglang.server_concurrency)
        progress = TrainProgress(total, start)
        if evaluate and start == 0:
            progress.log_eval(0, evaluate(0, urls))
        progress.start_clock()
        end = total if stop_after is None else min(total, stop_after)
        for step in range(start, end):
            t0 = time.perf_counter()
            samples, row = rollout(router, tokenizer, reward, stream, recipe, step)
            train = _train(workers, plan, samples, recipe, step, ray)
            sync = _merge_rank_metrics(ray.get([w.sync_weights.remote(urls, str(step + 1)) for w in workers]))
            row = {"step": step + 1, **row, **train, **sync, "step_seconds": time.perf_counter() - t0}
            metrics_log.log(row)
            progress.log_step(row)
            done = step + 1
            if done % recipe.checkpoint.save_interval == 0 or done == total:
                state = {"step": done, "data": stream.state()}
                ray.get([w.save.remote(str(paths.checkpoints), done, state) for w in workers])
                prune_checkpoints(paths.checkpoints, recipe.checkpoint.keep_last)
            if on_step:
                on_step(row)
            if evaluate and (done % recipe.eval.interval == 0 or done == total):
                progress.log_eval(done, evaluate(done, urls))
    except (ray.exceptions.RayError, EngineRequestError) as e:
        err = stage_error(e)
        if err is e:
            raise
        raise err from e
    finally:
        if router is not None:
            router.close()
        reward.close()
        metrics_log.close()
        try:  # let live trainers remove their shared-memory segments before they are killed
            ray.get([w.release.remote() for w in workers], timeout=10)
        except Exception:  # noqa: BLE001 - best effort: dead actors' segments go with the next run's sweep
            pass
        for a in workers + engines:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - best effort: the actor may already be gone
                pass
        remove_placement_groups(pgs)  # a retry in this driver must find the bundles free again
    rows = read_jsonl(paths.metrics)
    first, last = first_last_mean(rows, "reward_mean")
    from kimi_pipeline.model.checkpoint_dirs import iteration_dir, latest_step

    ckpt_step = latest_step(paths.checkpoints)
    return {
        "steps": len(rows),
        "reward_first": first,
        "reward_last": last,
        "checkpoint": str(iteration_dir(paths.checkpoints, ckpt_step)) if ckpt_step is not None else None,
        "checkpoint_dir": str(paths.checkpoints),
        "checkpoint_step": ckpt_step,
        "metrics": str(paths.metrics),
        "seconds_per_step": sum(r.get("step_seconds", 0) for r in rows) / max(len(rows), 1),
    }
