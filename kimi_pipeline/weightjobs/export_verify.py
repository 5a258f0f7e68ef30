"""Check an INT4 export the way an inference engine will read it.

1. Tensor level (streams; runs at any scale): every packed expert, decompressed by compressed-tensors'
   own `PackedQuantizationCompressor`, equals `fake_quant_int4(trainer weight)` bit for bit — in the
   trainer's dtype, which is possible because fake-quant rounds to the bf16 scale grid (int4.py);
   every other tensor equals the trainer's rounded to its storage dtype.
2. Model level (CPU, when the model fits in memory): the directory reloads with transformers +
   compressed-tensors (config rewritten kimi_k2 -> deepseek_v3, no missing/unexpected keys), its
   in-memory experts equal the fake-quant weights, its logits match (a) an fp32 HF model built from
   exactly the tensors the export should decode to (pins packing + loader; ~1e-6) and (b) the
   trainer's fake-quant forward (bf16 storage of the non-expert weights is the difference), and it
   generates.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kimi_pipeline.errors import PermanentError, SectionError
from kimi_pipeline.hf.config import quantization_config, text_config, with_quantization_config
from kimi_pipeline.hf.int4 import fake_quant_int4
from kimi_pipeline.hf.int4_checkpoint import KEEP_FP32, ExportInfo, is_quantized, kimi_quantization_config
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.hf.reader import StoredTensors
from kimi_pipeline.model.hf_model import deepseek_config, load_hf_model, load_strict
from kimi_pipeline.model.qat import fake_quant_hf_tensors
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes.models import ModelSpec, QuantSpec
from kimi_pipeline.util.files import atomic_write_json

EXACT_REF_TOL = 1e-4  # fp32 reload vs fp32 model of the same decoded weights: only summation order differs
# HF (transformers) vs trainer (megatron) forward of the same weights: summation order only (fp32 measured ~4e-7).
PARITY_TOL_BY_DTYPE = {"float32": 1e-3, "bfloat16": 1e-1, "float16": 5e-2}
PARITY_TOL = PARITY_TOL_BY_DTYPE["float32"]
DEFAULT_PROMPTS = ("What is 3+4?", "Compute 2+5.")

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


class ExportVerificationError(SectionError):
    """The export's tensors or logits do not match its checkpoint; `section` carries the verdict."""


class ExportInputError(PermanentError):
    """What the export was given cannot be exported (no checkpoint at that step, no base config.json)."""


@dataclass
class TensorCheck:
    dequant_exact: bool = True
    others_exact: bool = True
    num_quantized: int = 0
    num_other: int = 0
    mismatches: list[str] = field(default_factory=list)


def _scheme(quantization_config: dict[str, Any]):
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(quantization_config)
    return next(iter(qc.config_groups.values()))


def check_tensors(export_dir: str | Path, trainer_tensors: Iterable[tuple[str, torch.Tensor]],
                  group_size: int, *, weight_map: dict[str, str] | None = None,
                  layout: HFLayout | None = None) -> TensorCheck:
    """Stage 1: decompress each packed expert with compressed-tensors and compare with fake-quant exactly.

    trainer_tensors: the language model's, under the names table's names; they are looked up under the export's
    stored names (`layout`, default: the export config's). weight_map: where each stored tensor is (default: the
    export's index) — a rank of the distributed export checks its own shards before the index and config exist.
    """
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    export_dir = Path(export_dir)
    if weight_map is None:
        config = json.loads((export_dir / "config.json").read_text())
        qconfig, layout = quantization_config(config), layout or HFLayout.of_config(config)
    else:
        qconfig, layout = kimi_quantization_config(group_size), layout or HFLayout()
    scheme = _scheme(qconfig)
    reader = StoredTensors(export_dir, weight_map)

    def stored(name: str) -> torch.Tensor:
        name = layout.stored(name)
        if name not in reader:
            raise ExportVerificationError(f"{export_dir}: tensor {name} missing from the export")
        return reader.get(name)

    out = TensorCheck()
    for name, t in trainer_tensors:
        t = t.cpu()  # the trainer's tensor (on its device) compared with the export as read, on the host
        if is_quantized(name):
            prefix = name.removesuffix(".weight")
            parts = {k: stored(f"{prefix}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape")}
            deq = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
            fq = fake_quant_int4(t.detach(), group_size)
            ok = deq.shape == fq.shape and torch.equal(deq.to(fq.dtype), fq) and torch.equal(fq.to(deq.dtype), deq)
            out.num_quantized += 1
            if not ok:
                out.dequant_exact = False
                out.mismatches.append(name)
        else:
            got = stored(name)
            want = t
            if t.is_floating_point():
                want = t.to(torch.float32 if name.endswith(KEEP_FP32) else torch.bfloat16)
            out.num_other += 1
            if got.dtype != want.dtype or not torch.equal(got, want):
                out.others_exact = False
                out.mismatches.append(name)
    reader.close()
    return out


def load_int4_model(export_dir: str | Path, dtype: torch.dtype = torch.float32):
    """The export loaded with transformers + compressed-tensors (dequantized), strictly, as `dtype`.

    Every stored value (bf16 / fp32 / dequantized bf16) is exact in fp32, so `.to(fp32)` adds no error.
    """
    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    cfg = deepseek_config(config)
    cfg.quantization_config = quantization_config(config)
    return load_strict(export_dir, cfg, dtype, what="INT4 export (loaded with compressed-tensors)").to(dtype)


def expert_weights_equal(model, fq_tensors: dict[str, torch.Tensor]) -> bool:
    """In-memory fused experts (gate_up_proj [E, 2F, H] = gate‖up, down_proj [E, H, F]) == fake-quant weights."""
    state = model.state_dict()
    layers = sorted({int(n.split(".")[2]) for n in fq_tensors if ".mlp.experts." in n})
    for i in layers:
        p = f"model.layers.{i}.mlp.experts"
        n_exp = len({n.split(".")[5] for n in fq_tensors if n.startswith(p + ".")})
        gate_up = torch.stack([
            torch.cat([fq_tensors[f"{p}.{e}.gate_proj.weight"], fq_tensors[f"{p}.{e}.up_proj.weight"]])
            for e in range(n_exp)
        ])
        down = torch.stack([fq_tensors[f"{p}.{e}.down_proj.weight"] for e in range(n_exp)])
        for got, want in ((state[f"{p}.gate_up_proj"], gate_up), (state[f"{p}.down_proj"], down)):
            if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
                return False
    return True


def reference_model(export_dir: Path, fq_tensors: dict[str, torch.Tensor], *, as_stored: bool):
    """An unquantized fp32 HF model of the fake-quant tensors: `as_stored` rounds every non-expert weight
    to its export dtype (exactly what the export should decode to); otherwise full precision (the
    trainer stand-in when no trainer forward is given)."""
    def value(n: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        if as_stored and not (n.endswith(KEEP_FP32) or is_quantized(n)):
            t = t.to(torch.bfloat16)
        return t.float().contiguous()

    tmp = Path(tempfile.mkdtemp(prefix="kimi-int4-ref-"))
    try:
        save_file({n: value(n, t) for n, t in fq_tensors.items()}, str(tmp / "model.safetensors"))
        config = text_config(json.loads((export_dir / "config.json").read_text()))  # the language model alone
        (tmp / "config.json").write_text(json.dumps(with_quantization_config(config, None, "float32")))
        return load_hf_model(tmp, dtype=torch.float32)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prompt_ids(tokenizer, prompts: Iterable[str]) -> list[torch.Tensor]:
    out = []
    for p in prompts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_tensors="pt", return_dict=True)
        out.append(enc["input_ids"])
    return out


@torch.no_grad()
def check_reloaded_model(export_dir: str | Path, trainer_tensors: Iterable[tuple[str, torch.Tensor]], group_size: int, *,
                reference_logits: LogitsFn | None = None, prompts: Iterable[str] = DEFAULT_PROMPTS,
                max_new_tokens: int = 8, parity_tol: float = PARITY_TOL) -> dict[str, Any]:
    """Stage 2: reload, compare experts and logits, generate.

    `reference_logits` maps input ids [1, T] to the trainer's fake-quant logits [1, T, V]; without it
    the fp32 HF model of the trainer tensors (fake-quant experts, full-precision rest) stands in.
    Logit differences are split so that each has its own meaning and gate:
      exact   export vs an fp32 model of exactly the values it should decode to  (<= EXACT_REF_TOL)
      storage that model vs the same with full-precision non-expert weights     (bf16 storage; reported)
      parity  full-precision HF model vs the trainer forward                      (<= parity_tol)
    and `logits_max_diff` (export vs trainer) is gated by their sum of allowances.
    """

    export_dir = Path(export_dir)
    # the trainer's tensors (on its device) compared with the reloaded export on the host, as check_export_tensors does
    fq = {n: t.cpu() for n, t in fake_quant_hf_tensors(trainer_tensors, group_size)}
    model = load_int4_model(export_dir)
    experts_equal = expert_weights_equal(model, {n: t for n, t in fq.items() if is_quantized(n)})
    as_stored = reference_model(export_dir, fq, as_stored=True)
    full = reference_model(export_dir, fq, as_stored=False)
    tok = load_tokenizer(export_dir)
    ids = prompt_ids(tok, prompts)
    d = {"exact": 0.0, "storage": 0.0, "parity": 0.0, "total": 0.0}
    agree = positions = 0
    for x in ids:
        got, stored, hf = model(x).logits.float(), as_stored(x).logits.float(), full(x).logits.float()
        trainer = reference_logits(x).float() if reference_logits is not None else hf
        pairs = (("exact", got, stored), ("storage", stored, hf), ("parity", hf, trainer), ("total", got, trainer))
        for k, a, b in pairs:
            d[k] = max(d[k], (a - b).abs().max().item())
        agree += int((got.argmax(-1) == trainer.argmax(-1)).sum())
        positions += got.shape[1]
    tolerance = EXACT_REF_TOL + d["storage"] + (parity_tol if reference_logits is not None else 0.0)
    gen = model.generate(ids[0], max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None,
                         pad_token_id=tok.pad_token_id)
    gen_ref = as_stored.generate(ids[0], max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None,
                                 pad_token_id=tok.pad_token_id)
    new = gen[0, ids[0].shape[1]:]
    return {
        "experts_equal": experts_equal,
        "logits_reference": "trainer" if reference_logits is not None else "hf-fake-quant-fp32",
        "logits_max_diff": d["total"],
        "logits_tolerance": tolerance,
        "logits_max_diff_exact": d["exact"],
        "logits_max_diff_storage": d["storage"],
        "logits_max_diff_parity": d["parity"] if reference_logits is not None else None,
        "top1_agreement": agree / max(1, positions),
        "generated_tokens": int(new.numel()),
        "generated_text": tok.decode(new, skip_special_tokens=False),
        "generation_matches_reference": bool(torch.equal(gen, gen_ref)),
    }


def model_check_problems(result: dict[str, Any], parity_tol: float = PARITY_TOL) -> list[str]:
    """What in a check_reloaded_model result fails its gate (empty = pass)."""
    out = []
    if not result["experts_equal"]:
        out.append("reloaded expert weights differ from the fake-quant weights")
    if result["logits_max_diff_exact"] > EXACT_REF_TOL:
        out.append(f"export logits differ from its decoded weights' by {result['logits_max_diff_exact']:.3g} "
                   f"> {EXACT_REF_TOL} (packing or loader mismatch)")
    parity = result.get("logits_max_diff_parity")
    if parity is not None and parity > parity_tol:
        out.append(f"HF model of the trainer tensors differs from the trainer forward by {parity:.3g} > {parity_tol} "
                   "(Megatron->HF conversion mismatch)")
    if result["logits_max_diff"] > result["logits_tolerance"]:
        out.append(f"export vs trainer logits {result['logits_max_diff']:.3g} > "
                   f"tolerance {result['logits_tolerance']:.3g}")
    if result["generated_tokens"] < 1:
        out.append("the reloaded export generated no tokens")
    return out


def check_model_into(section: dict[str, Any], spec: ModelSpec, quant: QuantSpec, out: Path, tensors,
                     reference_logits: LogitsFn | None, parity_tol: float | None = None) -> None:
    """Model-level check (reload, logits, generate) merged into `section`, its failures into `problems`."""
    parity_tol = PARITY_TOL_BY_DTYPE.get(spec.params_dtype, PARITY_TOL) if parity_tol is None else parity_tol
    result = check_reloaded_model(out, tensors, quant.group_size, reference_logits=reference_logits,
                                  parity_tol=parity_tol)
    section.update(result)
    gate = model_check_problems(result, parity_tol)
    if not quant.int4_qat:
        # Trained without fake-quant: INT4 is post-training quantization here, so the export is
        # *expected* to differ from the trainer's forward; only the decode-exactness gates apply.
        gate = [p for p in gate if not p.startswith(("export vs trainer", "HF model of the trainer"))]
        section["note"] = "quant.int4_qat is off: logits_max_diff is post-training quantization error"
    if gate:
        section["problems"] = section.get("problems", []) + gate


def export_section(quant: QuantSpec, info: ExportInfo, tensors: TensorCheck, checkpoint: str | None) -> dict[str, Any]:
    """The export stage's section: what was written (format, sizes, compression) and the tensor-level verdict."""
    section: dict[str, Any] = {
        "path": info.path,
        "format": "compressed-tensors pack-quantized int4",
        "group_size": quant.group_size,
        "checkpoint": checkpoint,
        **{k: v for k, v in info.as_dict().items() if k != "path"},
        "compression": round(info.bf16_bytes / info.int4_bytes, 3),
        "dequant_exact": tensors.dequant_exact,
        "others_exact": tensors.others_exact,
        "qat": quant.int4_qat,
    }
    if tensors.mismatches:
        section["problems"] = [f"{n}: stored tensor differs from the trainer's" for n in tensors.mismatches[:5]]
    return section


def finish_export(section: dict[str, Any], checked: dict[str, Any], marker: Path, seconds: float) -> dict[str, Any]:
    """The section with the model-level check's fields (`checked`), gated on every problem found: a failed export
    raises ExportVerificationError carrying it; a passed one is written to `marker` last (its presence marks a
    finished export)."""
    problems = section.pop("problems", []) + checked.pop("problems", [])
    section.update(checked, **({"problems": problems} if problems else {}))
    section["seconds"] = round(seconds, 2)
    if problems:
        raise ExportVerificationError(f"INT4 export {section['path']} failed verification: " + "; ".join(problems),
                                      section)
    atomic_write_json(marker, section)
    return section
