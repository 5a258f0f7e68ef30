"""`kimi plan`: does a recipe's layout fit a GPU kind, and how long will a step take?

`make_plan` never raises on a bad layout: an impossible one is an answer (`fits: false` with the reason),
because the point is to find that out before a 256-GPU job does. With `--nodes` below the recipe's, data
parallel shrinks first, then pipeline parallel (to a size that still splits the layers); TP, CP and EP are
left alone (change them with --set).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from kimi_pipeline.cli_recipes import RECIPE_HELP, SET_HELP, recipe_or_problems
from kimi_pipeline.engine.rollout_engine import MEMORY_TAGS
from kimi_pipeline.engine.sglang import releases_cuda_graphs, sglang_env
from kimi_pipeline.model.params import count_params
from kimi_pipeline.plan.hardware import GPU, GPUS, get_gpu
from kimi_pipeline.plan.memory import (
    GIB,
    EngineMemory,
    MemoryAssumptions,
    PlanLayout,
    PPStageMemory,
    engine_memory,
    host_memory,
    layout_from_recipe,
    pp_stage_layers_or_guess,
    train_pp_stages,
)
from kimi_pipeline.plan.residency import RESIDENT
from kimi_pipeline.plan.timing import TimeAssumptions, step_time, workload
from kimi_pipeline.recipes.checks import PipelineSplitError, check_recipe, pipeline_layers
from kimi_pipeline.recipes.load import RecipeError
from kimi_pipeline.recipes.recipe import Recipe

# Recipe problems that decide whether the layout can run at all (the rest are reported as warnings).
BLOCKING_PREFIXES = ("parallel.", "cluster.", "sglang.", "model.", "rollout.engine")

PEAK_ASSUMPTION = (
    "colocated, in the order the train loop runs it (rl/handoff.py, slime/miles order): SGLang releases weights, "
    "KV cache and CUDA graphs (release_memory_occupation; the graphs because the server runs with "
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, engine/sglang.py) while the actor trains; the actor sleeps (GPU state "
    "copied to host) while SGLang generates; for the weight sync SGLang resumes its weights only and the actor "
    "keeps only its weights on the GPU, gathering buckets through the sync buffer. Peak = max(train, rollout, "
    "weight_sync) + a residual (CUDA contexts, NCCL buffers, fragmentation) resident in every phase."
)


# --------------------------------------------------------------------------------------------------
# layout for a node count


def _split_for(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int | None, int | None] | None:
    """First/last stage sizes making `num_layers` split over `pp` stages; the recipe's own when valid."""
    candidates: list[tuple[int | None, int | None]] = [(first, last), (None, None), (None, last)]
    for f, l in candidates:
        try:
            pipeline_layers(num_layers, pp, f, l)
            return f, l
        except PipelineSplitError:
            continue
    best: tuple[tuple[int, int], int] | None = None
    for l in range(1, num_layers):
        try:
            split = pipeline_layers(num_layers, pp, None, l)
        except PipelineSplitError:
            continue
        key = (max(split), l)  # most even split, then the lighter last stage (it also holds lm_head)
        if best is None or key < best[0]:
            best = (key, l)
    return (None, best[1]) if best else None


def _try_layout(base: PlanLayout, num_layers: int, nodes: int) -> PlanLayout | None:
    world = nodes * base.gpus_per_node
    for pp in range(base.pp, 0, -1):
        mp = base.tp * pp * base.cp
        if world % mp:
            continue
        dp = world // mp
        if (base.tp * base.cp * dp) % (base.ep * base.etp):
            continue
        if pp == base.pp:
            split = (base.first, base.last)
        else:
            split = _split_for(num_layers, pp, base.first if pp > 1 else None, base.last if pp > 1 else None)
        if split is None:
            continue
        return PlanLayout(nodes, base.gpus_per_node, base.tp, pp, base.cp, base.ep, base.etp, dp, *split)
    return None


def fit_layout(r: Recipe, nodes: int | None) -> tuple[PlanLayout, list[str], str | None]:
    """(layout, notes, problem): the recipe's layout, or one rescaled to `nodes` (DP first, then PP)."""
    base = layout_from_recipe(r)
    if nodes is None or nodes == base.nodes:
        return base, [], None
    lay = _try_layout(base, r.model.num_layers, nodes)
    if lay is None:
        world = nodes * base.gpus_per_node
        need = next((n for n in range(1, 4097) if _try_layout(base, r.model.num_layers, n)), None)
        need_s = f"at least {need} node(s) are needed" if need else "no node count works"
        return base, [], (
            f"{nodes} node(s) x {base.gpus_per_node} GPUs = {world} GPUs cannot hold the layout: one pipeline stage "
            f"needs TP x CP x DP GPUs with TP x CP = {base.tp}x{base.cp} = {base.tp * base.cp} and EP x expert-TP = "
            f"{base.ep * base.etp} dividing it, even at PP=1; the plan only shrinks DP and PP, so {need_s} "
            f"(or lower parallel.tp/cp/ep with --set). Memory below is for the recipe's own {base.nodes}-node layout."
        )
    notes = [f"cluster.nodes {base.nodes} -> {nodes} ({lay.world} GPUs)"]
    if lay.dp != base.dp:
        notes.append(f"data parallel {base.dp} -> {lay.dp}")
    if lay.pp != base.pp:
        split, _ = pp_stage_layers_or_guess(r.model.num_layers, lay)
        notes.append(f"pipeline parallel {base.pp} -> {lay.pp} (layers per stage {split})")
    return lay, notes, None


def _apply_layout(r: Recipe, lay: PlanLayout) -> Recipe:
    r2 = r.model_copy(deep=True)
    r2.cluster.nodes = lay.nodes
    r2.parallel.pp = lay.pp
    r2.parallel.dp = None
    r2.parallel.decoder_first_pipeline_num_layers = lay.first
    r2.parallel.decoder_last_pipeline_num_layers = lay.last
    return r2


# --------------------------------------------------------------------------------------------------
# the plan


def _gb(x: float) -> float:
    return round(x / GIB, 2)


def _phases(r: Recipe, st: PPStageMemory, eng: EngineMemory, ma: MemoryAssumptions) -> dict[str, dict[str, float]]:
    """Bytes per component in each phase of an RL step, on one GPU of the given stage. Colocated, each phase holds
    what `plan.residency.RESIDENT` says the train loop keeps on the GPU then (engine memory tags, trainer parts)."""
    residual = {"residual": ma.residual_gb * GIB}
    trainer = {"weights": {"weights": st.weights}, "grads": {"grads": st.grads},
               "optimizer": {"optimizer": st.optimizer_gpu}}
    buffer = float(r.rollout.update_weight_buffer_size)
    if r.rollout.engine != "sglang":  # the embedded engine generates with the actor's own weights
        state = {k: v for part in trainer.values() for k, v in part.items()}
        phases = {"train": {**state, "activations": st.activations}, "rollout": state, "weight_sync": dict(state)}
    else:
        engine = {"weights": {"sglang_weights": eng.weights},
                  "kv_cache": {"sglang_kv_cache": eng.kv_cache, "sglang_workspace": ma.sglang_workspace_gb * GIB},
                  "cuda_graph": {"cuda_graphs": eng.cuda_graphs}}
        if r.cluster.colocate:
            # graphs are released only where the server's environment (what engine/sglang.py starts it with) says
            # so (SGLANG_MEMORY_SAVER_CUDA_GRAPH); otherwise they stay on the GPU in every phase
            kept = () if releases_cuda_graphs(sglang_env({}, memory_saver=True)) else ("cuda_graph",)
            phases = {}
            for phase, (tags, parts) in RESIDENT.items():
                held = (*tags, *(t for t in kept if t not in tags))
                phases[phase] = {k: v for t in held for k, v in engine[t].items()}
                phases[phase].update({k: v for p in parts for k, v in trainer[p].items()})
        else:  # each side on its own GPUs; the actor stays awake and gathers buckets
            awake = {k: v for part in trainer.values() for k, v in part.items()}
            phases = {"rollout": {k: v for t in MEMORY_TAGS for k, v in engine[t].items()}, "train": dict(awake),
                      "weight_sync": dict(awake)}
        phases["train"]["activations"] = st.activations
        phases["weight_sync"]["weight_sync_buffer"] = buffer
    return {name: {**phases[name], **residual} for name in ("train", "rollout", "weight_sync")}


# KV cache is elastic (sized to fill mem_fraction_static), so it is never named the largest consumer.
ELASTIC = ("sglang_kv_cache",)


def _memory_reasons(r: Recipe, gpu: GPU, phases: dict[str, dict[str, float]], peak_phase: str, pp_rank: int,
                    largest: str, eng: EngineMemory, host: float, host_cap: float) -> list[str]:
    """Why the memory does not fit (empty when it does)."""
    out = []
    peak, cap = sum(phases[peak_phase].values()), gpu.mem_gb * GIB
    if peak > cap:
        out.append(
            f"peak {_gb(peak)} GB per GPU in the {peak_phase} phase (PP stage {pp_rank}) exceeds the {gpu.key} "
            f"{_gb(cap)} GB; largest consumer {largest} = {_gb(phases[peak_phase][largest])} GB"
        )
    if r.rollout.engine == "sglang":
        full_seq = r.rollout.max_prompt_len + r.rollout.max_response_len
        if eng.weights >= eng.static_budget:
            out.append(
                f"SGLang weights {_gb(eng.weights)} GB per GPU exceed mem_fraction_static x GPU = "
                f"{_gb(eng.static_budget)} GB: no room for a KV cache (raise sglang.mem_fraction_static, "
                "gpus_per_engine or ep_size)"
            )
        elif eng.kv_tokens_per_gpu < full_seq:
            out.append(
                f"SGLang KV cache holds {eng.kv_tokens_per_gpu} tokens per DP rank, fewer than one "
                f"{full_seq}-token sequence (max_prompt_len + max_response_len)"
            )
    if host > host_cap:
        out.append(f"host RAM {_gb(host)} GB per node exceeds {_gb(host_cap)} GB")
    return out


def make_plan(r: Recipe, gpu: GPU, nodes: int | None = None, ta: TimeAssumptions | None = None,
              ma: MemoryAssumptions | None = None) -> dict[str, Any]:
    """The full plan as a JSON-able dict; an impossible layout gives fits=False with the reason."""
    ta, ma = ta or TimeAssumptions(), ma or MemoryAssumptions()
    pc = count_params(r.model)
    lay, notes, layout_problem = fit_layout(r, nodes)
    r_eff = _apply_layout(r, lay) if notes else r
    problems = [str(p) for p in check_recipe(r_eff)]
    blocking = [p for p in problems if p.startswith(BLOCKING_PREFIXES)]
    warnings = [p for p in problems if p not in blocking]
    split, _ = pp_stage_layers_or_guess(r.model.num_layers, lay)  # check_recipe already reports a split that fails
    if r.cluster.device != "cuda":
        warnings.append(f"the recipe runs on {r.cluster.device}; these are what its layout would need on {gpu.key}")

    wl = workload(r_eff, ta)
    micro = wl.microbatches(r_eff, lay)
    pp_stages = train_pp_stages(r_eff, pc, lay, micro, ma)
    eng = engine_memory(r_eff, pc, gpu, ma)
    per_pp_stage = [_phases(r_eff, st, eng, ma) for st in pp_stages]
    worst = max(
        range(len(pp_stages)),
        key=lambda i: (max(sum(ph.values()) for ph in per_pp_stage[i].values()), sum(per_pp_stage[i]["train"].values())),
    )
    st, phases = pp_stages[worst], per_pp_stage[worst]
    totals = {name: sum(ph.values()) for name, ph in phases.items()}
    peak_phase = max(totals, key=lambda k: totals[k])
    peak = totals[peak_phase]
    cap = gpu.mem_gb * GIB
    fixed = {k: v for k, v in phases[peak_phase].items() if k not in ELASTIC}
    largest = max(fixed, key=lambda k: fixed[k])

    hosts = [host_memory(r_eff, s, lay, ma) for s in pp_stages]
    host = max(hosts, key=lambda h: h["total"])
    host_cap = (r.cluster.memory_gb_per_node or gpu.host_ram_gb) * GIB
    node_shard = lay.gpus_per_node * max(s.optimizer_shard_params for s in pp_stages)
    timing = step_time(r_eff, pc, lay, gpu, ta, node_shard, eng.weights)

    reasons = ([layout_problem] if layout_problem else []) + [f"recipe check: {p}" for p in blocking]
    reasons += _memory_reasons(r_eff, gpu, phases, peak_phase, worst, largest, eng, host["total"], host_cap)
    fits = not reasons
    headroom = cap - peak
    reason = "; ".join(reasons) if reasons else (
        f"peak {_gb(peak)} of {_gb(cap)} GB per GPU ({peak_phase} phase, PP stage {worst}), headroom "
        f"{_gb(headroom)} GB; host {_gb(host['total'])} of {_gb(host_cap)} GB per node"
    )

    gpu_mem = {
        "weights": st.weights, "grads": st.grads, "optimizer": st.optimizer_gpu, "activations": st.activations,
        "weight_sync_buffer": float(r_eff.rollout.update_weight_buffer_size), "sglang_weights": eng.weights,
        "sglang_vision_weights": eng.vision_weights, "sglang_kv_cache": eng.kv_cache, "cuda_graphs": eng.cuda_graphs,
        "sglang_workspace": phases["rollout"].get("sglang_workspace", 0.0), "residual": ma.residual_gb * GIB,
        "total_train": totals["train"], "total_rollout": totals["rollout"],
        "total_weight_sync": totals["weight_sync"], "peak": peak, "capacity": cap,
    }
    assumptions: dict[str, Any] = {
        **ta.as_dict(),
        "decode_tok_s": timing["decode_tok_s_per_engine"],
        **{k: v for k, v in ma.__dict__.items()},
        "memory_units": "GiB (2**30 bytes)",
        "peak_model": PEAK_ASSUMPTION,
        "tokens_per_gpu_per_microbatch": r_eff.parallel.max_tokens_per_gpu,
        "microbatches_per_step_per_dp_rank": micro,
        "rollout_weight_format": {"routed_experts": eng.formats[0], "other_linears": eng.formats[1]},
        "kv_cache_dtype": "bf16",
        "cuda_graph_bs": eng.graph_bs if r_eff.sglang.cuda_graph_bs else "SGLang default (~[1,2,4,8,16..256 step 8])",
        "host_ram_gb_per_node": _gb(host_cap),
        "optimizer_dtypes": "fp32 master, exp_avg, exp_avg_sq (precision-aware defaults)",
    }
    return {
        "recipe": r.name,
        "gpu": gpu.as_dict(),
        "layout": {**lay.as_dict(), "layers_per_stage": split, "adjusted": bool(notes), "notes": notes},
        "params_total": pc.total,
        "params_active": pc.active,
        "params": {
            "total": pc.total, "active": pc.active, "active_matmul": pc.active_matmul,
            "routed_experts": pc.routed_experts, "per_gpu_train": round(st.params_per_gpu),
            # the vision tower + projector of a multimodal model (K2.5): held by the engines, never trained
            "vision": r_eff.model.vision.num_params(r_eff.model.hidden_size) if r_eff.model.vision else 0,
        },
        "fits": fits,
        "reason": reason,
        "largest_consumer": largest,
        "peak_phase": peak_phase,
        "headroom_gb": _gb(headroom),
        "gpu_mem_gb": {k: _gb(v) for k, v in gpu_mem.items()},
        "phases_gb": {name: {k: _gb(v) for k, v in ph.items()} for name, ph in phases.items()},
        "stages": [
            {"stage": s.pp_rank, "layers": s.layers, "params_per_gpu": round(s.params_per_gpu),
             "train_gb": _gb(sum(per_pp_stage[s.pp_rank]["train"].values()))}
            for s in pp_stages
        ],
        "sglang": {
            "attn_tp": eng.attn_tp, "kv_bytes_per_token": eng.kv_bytes_per_token,
            "kv_tokens_per_gpu": eng.kv_tokens_per_gpu, "static_budget_gb": _gb(eng.static_budget),
        },
        "host_mem_gb": {k: _gb(v) for k, v in host.items()} | {"capacity": _gb(host_cap)},
        "step_seconds_estimate": round(timing["step_s"], 1),
        "timing": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in timing.items()},
        "assumptions": assumptions,
        "problems": problems,
        "warnings": warnings,
    }


def failed_plan(name: str, gpu: GPU, reason: str) -> dict[str, Any]:
    """The answer when no recipe could be built (an invalid --set value): fits=False, numbers null."""
    return {
        "recipe": name, "gpu": gpu.as_dict(), "layout": None, "params_total": None, "params_active": None,
        "fits": False, "reason": reason, "largest_consumer": None, "peak_phase": None, "headroom_gb": None,
        "gpu_mem_gb": {}, "host_mem_gb": {}, "step_seconds_estimate": None, "assumptions": {},
        "problems": [reason], "warnings": [],
    }


# --------------------------------------------------------------------------------------------------
# CLI


def _render(plan: dict[str, Any]) -> None:
    con = Console()
    gpu = plan["gpu"]
    con.print(f"[bold]kimi plan[/bold] {plan['recipe']} on {gpu['name']} ({gpu['mem_gb']:.1f} GB, "
              f"{gpu['bf16_tflops']:.0f} TFLOPS bf16)")
    lay = plan.get("layout")
    if lay:
        con.print(f"layout: {lay['nodes']} x {lay['gpus_per_node']} GPUs, TP {lay['tp']} PP {lay['pp']} CP {lay['cp']} "
                  f"EP {lay['ep']} ETP {lay['etp']} DP {lay['dp']} (expert-DP {lay['expert_dp']}), layers/stage "
                  f"{lay['layers_per_stage']}")
        for n in lay["notes"]:
            con.print(f"  adjusted: {n}")
    if plan["params_total"] is not None:
        vision = plan["params"]["vision"]
        con.print(f"params: {plan['params_total'] / 1e9:,.2f} B total, {plan['params_active'] / 1e9:,.2f} B active"
                  + (f"; vision tower + projector {vision / 1e9:,.2f} B (held by the engines: "
                     f"{plan['gpu_mem_gb']['sglang_vision_weights']} GB of sglang_weights; not trained)" if vision else ""))
        t = Table(title="GPU memory per GPU (GB = GiB), most-loaded PP stage")
        t.add_column("component")
        for ph in plan["phases_gb"]:
            t.add_column(ph, justify="right")
        comps = list(dict.fromkeys(k for ph in plan["phases_gb"].values() for k in ph))
        for c in comps:
            t.add_row(c, *(f"{ph.get(c, 0.0):.2f}" if c in ph else "" for ph in plan["phases_gb"].values()))
        t.add_row("[bold]total", *(f"[bold]{sum(ph.values()):.2f}" for ph in plan["phases_gb"].values()))
        con.print(t)
        h = Table(title="host RAM per node (GB)")
        h.add_column("component")
        h.add_column("GB", justify="right")
        for k, v in plan["host_mem_gb"].items():
            h.add_row(k, f"{v:.1f}")
        con.print(h)
        tm = plan["timing"]
        s = Table(title="time per RL step (one rollout)")
        s.add_column("part")
        s.add_column("seconds", justify="right")
        for k in ("rollout_s", "train_s", "optimizer_s", "weight_sync_s", "step_s"):
            s.add_row(k, f"{tm[k]:.1f}")
        con.print(s)
        con.print(f"train {tm['train_pflop_per_step']:.1f} PFLOP/step, rollout {tm['rollout_tokens_per_step']:,.0f} "
                  f"tokens/step over {tm['engines']} engine(s)")
        _print_sync(con, tm["weight_sync"])
        con.print("[bold]assumptions[/bold]")
        for k, v in plan["assumptions"].items():
            con.print(f"  {k}: {v}", markup=False)
    for w in plan.get("warnings", []):
        con.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    verdict = "[bold green]FITS" if plan["fits"] else "[bold red]DOES NOT FIT"
    con.print(f"{verdict}[/] largest consumer: {plan['largest_consumer']}, headroom {plan['headroom_gb']} GB")
    con.print(plan["reason"], markup=False)


def _print_sync(con: Console, ws: dict[str, Any]) -> None:
    """The weight sync's model: what each GPU receives through which group, the collectives, the seconds."""
    gib = 2**30
    anchors = ws["anchor_s"]
    if ws.get("unmodelled"):
        con.print(f"weight sync: {ws['unmodelled']}; disk fallback {ws['disk_fallback_s']:.0f} s", markup=False)
        return
    groups = ", ".join(f"{g} {v / gib:,.0f} GiB at {ws['links_gb_s'][g]:g} GiB/s"
                       for g, v in ws["received_bytes_by_group"].items() if v)
    con.print(f"weight sync: {ws['colocated_s']:.1f} s colocated ({ws['engine_bytes'] / 2**30:,.0f} GiB as "
              f"{ws['engine_format']}, {ws['buckets']} buckets: each GPU receives "
              f"{ws['received_bytes_per_gpu'] / gib:,.0f} GiB [{groups or 'nothing'}] in {ws['network_s']:.1f} s, "
              f"{ws['collectives_per_sync']} collectives per rank, + engine copy {ws['copy_s']:.1f} s + per-bucket "
              f"{ws['bucket_overhead_s']:.1f} s); non-colocated {ws['distributed_s']:.1f} s (stage gathers "
              f"{ws['distributed_gather_s']:.1f} s + sends {ws['distributed_send_s']:.1f} s); disk fallback "
              f"{ws['disk_fallback_s']:.0f} s. Measured by the recipes' framework for a 1 T Kimi on H100: "
              f"{anchors['rdma_p2p']} s RDMA P2P, {anchors['nccl_broadcast']} s NCCL broadcast", markup=False)


def plan_command(
    recipe: str = typer.Argument("tiny", help=RECIPE_HELP),
    gpu: str = typer.Option("h100", "--gpu", help=f"GPU kind: {', '.join(GPUS)}"),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="plan for this many nodes (shrinks DP, then PP)"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    json_out: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    mfu: float = typer.Option(0.25, "--mfu", min=1e-3, max=1.0, help="assumed model FLOPs utilisation"),
    decode_tok_s: Optional[float] = typer.Option(
        None, "--decode-tok-s", min=1e-3, help="assumed decode tokens/s per engine (default: per-GPU figure x GPUs/engine)"
    ),
    mean_response_frac: float = typer.Option(
        0.5, "--mean-response-frac", min=0.0, max=1.0, help="mean response length as a fraction of max_response_len"
    ),
    seq_tok_s: float = typer.Option(40.0, "--seq-tok-s", min=1e-3, help="assumed decode tokens/s of one sequence"),
) -> None:
    """Memory and time model of a recipe's layout: does it fit, what is the largest consumer, how long a step takes."""
    try:
        g = get_gpu(gpu)
    except KeyError as e:
        raise typer.BadParameter(str(e.args[0]), param_hint="--gpu") from None
    ta = TimeAssumptions(mfu=mfu, decode_tok_s=decode_tok_s, mean_response_frac=mean_response_frac, seq_tok_s=seq_tok_s)
    r = recipe_or_problems(recipe, set_, check=False)
    if isinstance(r, RecipeError):
        plan = failed_plan(recipe, g, str(r))
    else:
        try:
            plan = make_plan(r, g, nodes, ta)
        except Exception as e:  # noqa: BLE001 - a plan must answer, never crash
            plan = failed_plan(r.name, g, f"could not model this layout: {type(e).__name__}: {e}")
    if json_out:
        typer.echo(json.dumps(plan, indent=2, default=str))
    else:
        _render(plan)
