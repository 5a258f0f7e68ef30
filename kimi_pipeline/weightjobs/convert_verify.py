"""Verify a converted torch_dist checkpoint (`python -m kimi_pipeline.weightjobs.rank verify --job JOB.json`).

Runs as its own distributed job under a *different* parallel layout than the conversion wrote (for
small models one rank; otherwise the same world size split another way), so torch_dist resharding is
exercised. Each rank:
1. loads the checkpoint into its slice, and compares every parameter (and the router's expert bias)
   with a second slice filled straight from the HF source: exact equality required;
2. exports the slice back to HF names (the inverse mapping, as the weight bridge uses it) and compares
   each tensor bit for bit with the (dequantized) HF source: the round trip HF -> Megatron -> HF;
3. with `logits` (one rank, small models): runs megatron and transformers on the same tokens and
   records the largest logit difference against a stated tolerance.
Rank 0 also checks that the exported names cover every HF tensor of the model exactly once.
Results go to `verify_rank_<r>.json`; `summarize` folds them into the stage's verdict. The rank runs under the thin
entry `weightjobs.rank`, as the conversion's does.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.hf.reader import HFCheckpoint
from kimi_pipeline.model.device import job_device
from kimi_pipeline.model.hf_bridge import export_hf_tensors, load_hf_tensors_into_model
from kimi_pipeline.model.hf_model import load_hf_model
from kimi_pipeline.model.megatron_model import build_model, causal_forward, model_device
from kimi_pipeline.model.megatron_train import load_model_only
from kimi_pipeline.model.parallel import destroy, init_distributed, ranks
from kimi_pipeline.model.params import count_params
from kimi_pipeline.recipes.layout import Layout, LayoutError
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.weightjobs.convert_rank import poison_parameters
from kimi_pipeline.weightjobs.job_file import current_rss_mb, dtype_of, peak_rss_mb

# transformers vs megatron on the same weights: different kernels and summation order only.
LOGITS_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-1, "float16": 5e-2}
SMALL_MODEL_BYTES = 2 * 1024**3  # verify (and compare logits) on a single rank below this
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class ConversionVerifyError(PermanentError):
    """The converted checkpoint does not reproduce the HF source."""


@dataclass(frozen=True)
class Verification:
    """A conversion's verification as planned (`conversion.verification`): its job phase, the layout it reloads
    the checkpoint `ckpt` in, whether rank 0 compares logits (small models), the HF source `model_dir`, and `work`
    where a failed verdict is kept."""

    phase: Any  # job.JobPhase: the launcher side, not imported into the ranks that run this module
    layout: Layout
    logits: bool
    ckpt: Path
    model_dir: Path
    work: Path


def verification_section(check: Verification, done: Any) -> dict[str, Any]:
    """The verdict of the verification phase `done` (a `job.PhaseResult`) as the convert section's fields; raises
    ConversionVerifyError listing every tensor that differs (the whole verdict kept in WORK/verify_failed.json)."""
    verdict = summarize(done.reports, logits_expected=check.logits)
    section = {k: v for k, v in verdict.items() if k != "problems"}
    lay = check.layout
    section["verify_layout"] = {"world_size": lay.world_size, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep}
    section["verify_seconds"] = round(done.result.seconds, 3)
    if not verdict["verified"]:
        atomic_write_json(check.work / "verify_failed.json", verdict)
        raise ConversionVerifyError(f"converted checkpoint {check.ckpt} does not reproduce {check.model_dir}:\n  - "
                                    + "\n  - ".join(verdict["problems"]))
    return section


def model_bytes(spec: ModelSpec) -> int:
    """Parameter bytes of the model in its params dtype (for choosing the verification layout)."""
    return count_params(spec).total * dtype_of(spec.params_dtype).itemsize


def verify_layout(spec: ModelSpec, written, small: bool):
    """A layout unlike `written` that fits the model: one rank for small models, else same world, split differently."""
    if small:
        return Layout(world_size=1)
    world = written.world_size
    candidates = []
    for tp in (1, 2, 4, 8):
        for ep in (1, 2, 4, 8, 16, 32, 64):
            if (tp, ep) == (written.tp, written.ep):
                continue
            try:
                lay = Layout(world_size=world, tp=tp, pp=written.pp, ep=ep, etp=tp if ep == 1 else 1,
                             first_pp_stage_layers=written.first_pp_stage_layers, last_pp_stage_layers=written.last_pp_stage_layers)
                lay.check_model(spec)
            except LayoutError:
                continue
            # prefer changing both the TP and the EP split, then the larger EP (less memory per rank)
            candidates.append(((tp != written.tp) + (ep != written.ep), ep, -tp, lay))
    if not candidates:
        raise ConversionVerifyError(
            f"no other layout of {world} ranks fits the model for verification; set convert.verify=false "
            "to skip it explicitly, or change the conversion layout"
        )
    return max(candidates, key=lambda c: c[:3])[3]


def expected_hf_names(names: list[str], spec: ModelSpec) -> tuple[list[str], list[str]]:
    """(names the model maps, names it ignores): layers past num_layers are MTP heads, not converted."""
    keep, skip = [], []
    for n in names:
        m = _LAYER.search(n)
        (skip if m and int(m.group(1)) >= spec.num_layers else keep).append(n)
    return keep, skip


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def _megatron_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters + persistent float buffers (the router's expert bias); not token counters or TE extra state."""
    return {k: v for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not k.endswith("local_tokens_per_expert")}


def verify_rank(job: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    spec = ModelSpec.model_validate(job["model"])
    layout = Layout(**job["layout"])
    device = job_device(job["device"])
    init_distributed(layout, device=device)
    coords = ranks()
    reader = HFCheckpoint(job["model_dir"], text_config_key=job.get("text_config_key"))

    # 1. torch_dist reloaded under this layout == the same slice filled from HF
    model = build_model(spec, layout, device=device, perform_initialization=False)
    poison_parameters(model)
    load_model_only(job["ckpt_dir"], model)
    ref = build_model(spec, layout, device=device, perform_initialization=False)
    poison_parameters(ref)
    load_hf_tensors_into_model(ref, reader.get, spec, layout)
    got, want = _megatron_state(model), _megatron_state(ref)
    mismatches, max_diff = [], 0.0
    if set(got) != set(want):
        mismatches += [f"{k}: only in the torch_dist reload" for k in sorted(set(got) - set(want))]
        mismatches += [f"{k}: only in the HF-filled model" for k in sorted(set(want) - set(got))]
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.dtype != b.dtype or not torch.equal(a, b):
            d = _max_diff(a, b)
            max_diff = max(max_diff, d)
            mismatches.append(f"{k}: max |diff| {d:g} ({a.dtype} vs {b.dtype})")
    del ref, want
    t_compare = time.monotonic()

    # 2. round trip: exported HF tensors == HF source, bit for bit
    rt_max, rt_mismatches, exported = 0.0, [], []
    keep_for_logits = job.get("logits") and layout.world_size == 1
    export_state: dict[str, torch.Tensor] = {}
    # owned_only: each tensor is yielded once, by the rank that holds it (no broadcast of the whole model)
    for name, tensor in export_hf_tensors(model, spec, layout, owned_only=True):
        tensor = tensor.cpu()  # compared with the source as read, on the host
        exported.append(name)
        if name not in reader:
            rt_mismatches.append(f"{name}: exported but not in the HF source")
            continue
        src = reader.get(name).to(tensor.dtype)  # the loader casts the same way into each parameter's dtype
        if not torch.equal(tensor, src):
            d = _max_diff(tensor, src)
            rt_max = max(rt_max, d)
            rt_mismatches.append(f"{name}: max |diff| {d:g} ({tensor.dtype} vs {src.dtype})")
        if keep_for_logits:
            export_state[name] = tensor.contiguous()
    t_roundtrip = time.monotonic()

    report: dict[str, Any] = {
        **coords,
        "layout": dataclasses.asdict(layout),
        "compared": len(got),
        "max_abs_diff": max_diff,
        "mismatches": mismatches[:20],
        "n_mismatches": len(mismatches),
        "roundtrip_exported": exported,
        "roundtrip_max_abs_diff": rt_max,
        "roundtrip_mismatches": rt_mismatches[:20],
        "n_roundtrip_mismatches": len(rt_mismatches),
    }
    if coords["rank"] == 0:
        keep, skipped = expected_hf_names(reader.names(), spec)
        report["hf_names"] = keep
        report["hf_names_skipped"] = skipped

    # 3. logits parity (one rank holds the whole model)
    if keep_for_logits:
        report.update(logits_parity(model, spec, job, reader.format.kind, export_state))
    report["peak_rss_mb"] = round(peak_rss_mb(), 1)
    report["rss_end_mb"] = round(current_rss_mb(), 1)
    report["seconds"] = {"compare": round(t_compare - t0, 3), "roundtrip": round(t_roundtrip - t_compare, 3),
                         "total": round(time.monotonic() - t0, 3)}
    atomic_write_json(Path(job["report_dir"]) / f"verify_rank_{coords['rank']}.json", report)
    destroy()
    return report


def logits_parity(model, spec: ModelSpec, job: dict[str, Any], source_kind: str,
                  export_state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """transformers vs megatron logits on the same tokens. A quantized source is compared through its
    round-tripped (dequantized) export, which step 2 has shown equal to the dequantized source."""
    dtype = dtype_of(spec.params_dtype)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (2, min(32, spec.max_position_embeddings)), generator=g)
    with torch.no_grad():
        m_logits = causal_forward(model.eval(), tokens.to(model_device(model))).float().cpu()
        with tempfile.TemporaryDirectory(prefix="kimi-verify-") as tmp:
            if source_kind == "bf16":
                hf_dir, via = job["model_dir"], "source"
            else:
                save_file(export_state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
                atomic_write_json(Path(tmp) / "config.json", hf_config_dict(spec))
                hf_dir, via = tmp, "round-trip export (dequantized source)"
            hf = load_hf_model(hf_dir, dtype=dtype, text_config_key=job.get("text_config_key") if via == "source" else None)
            h_logits = hf(tokens).logits.float()
    diff = (m_logits - h_logits).abs().max().item()
    tol = LOGITS_TOLERANCE[spec.params_dtype]
    return {"logits_max_diff": diff, "logits_tolerance": tol, "logits_ok": diff <= tol, "logits_tokens": list(tokens.shape),
            "logits_hf_from": via, "logits_max_abs": h_logits.abs().max().item()}


def summarize(reports: list[dict[str, Any]], logits_expected: bool) -> dict[str, Any]:
    """Fold the per-rank verification reports into the stage verdict (raises nothing; see `problems`)."""
    problems: list[str] = []
    r0 = next((r for r in reports if r["rank"] == 0), None)
    if r0 is None:
        return {"verified": False, "problems": ["rank 0 wrote no verification report"]}
    for r in reports:
        problems += [f"rank {r['rank']}: {m}" for m in r["mismatches"]]
        problems += [f"rank {r['rank']} round trip: {m}" for m in r["roundtrip_mismatches"]]
    exported: dict[str, int] = {}
    for r in reports:
        for n in r["roundtrip_exported"]:
            exported[n] = exported.get(n, 0) + 1
    expected = set(r0["hf_names"])
    missing = sorted(expected - set(exported))
    dup = sorted(n for n, c in exported.items() if c > 1)
    if missing:
        problems.append(f"round trip: {len(missing)} HF tensors never exported, e.g. {missing[:5]}")
    if dup:
        problems.append(f"round trip: {len(dup)} HF tensors exported by several ranks, e.g. {dup[:5]}")
    out: dict[str, Any] = {
        "tensors_compared": sum(r["compared"] for r in reports),
        "max_abs_diff": max(r["max_abs_diff"] for r in reports),
        "roundtrip_tensors": len(exported),
        "roundtrip_max_abs_diff": max(r["roundtrip_max_abs_diff"] for r in reports),
        "roundtrip_exact": not missing and all(r["n_roundtrip_mismatches"] == 0 for r in reports),
        "hf_tensors": len(expected),
        "hf_tensors_skipped": r0.get("hf_names_skipped", []),
        "verify_peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in sorted(reports, key=lambda r: r["rank"])],
    }
    if "logits_max_diff" in r0:
        out.update({k: r0[k] for k in ("logits_max_diff", "logits_tolerance", "logits_hf_from", "logits_max_abs")})
        if not r0["logits_ok"]:
            problems.append(f"logits: max |megatron - transformers| = {r0['logits_max_diff']:g} > tolerance {r0['logits_tolerance']:g}")
    elif logits_expected:
        problems.append("logits parity was requested but not computed")
    else:
        out["logits_max_diff"] = None
    out["verified"] = not problems
    out["problems"] = problems[:20]
    return out
