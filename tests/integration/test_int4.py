"""INT4: fake-quant + STE, compressed-tensors pack layout, the Kimi ignore list, the export directory,
reload parity with transformers + compressed-tensors, and QAT on a megatron-core model."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.common import TINY, experts_reached, qat_vs_quantized_weights

from kimi_pipeline.hf.int4 import (
    Int4ShapeError,
    dequantize_int4,
    fake_quant_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from kimi_pipeline.hf.int4_checkpoint import (
    KIMI_IGNORE,
    ExportError,
    export_int4,
    is_quantized,
    kimi_quantization_config,
)
from kimi_pipeline.hf.reader import INDEX_NAME, iter_stored_tensors

CPU = torch.device("cpu")

TINY_MODEL = TINY / "model"
def int4_args(group_size: int = 32):
    """compressed-tensors' own description of the scheme (as in Kimi-K2-Thinking's config)."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**kimi_quantization_config(group_size)["config_groups"]["group_0"]["weights"])


ROUTED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


# --------------------------------------------------------------------------- int4.py


@pytest.mark.parametrize("shape", [(4, 64), (3, 5, 96), (2, 20)])
def test_pack_unpack_round_trip(shape):
    """Round trip, and the fast 4-bit packer (multiple-of-8 rows) == compressed-tensors' pack_to_int32."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32
    assert packed.shape == (*shape[:-1], -(-shape[-1] // 8))
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(packed, q.shape), q)


def test_pack_layout_is_kimis():
    """Eight values per int32, offset +8, value j of a word in bits 4j..4j+3 (low nibble first)."""
    q = torch.tensor([[-7, -1, 0, 1, 7, -8, 3, 2, 5, -5, 0, 0, 0, 0, 0, 0]], dtype=torch.int8)
    words = pack_int4(q)[0].tolist()
    want = []
    for w in range(2):
        v = sum((int(q[0, 8 * w + j]) + 8) << (4 * j) for j in range(8))
        want.append(v - (1 << 32) if v >= 1 << 31 else v)  # as a signed int32
    assert words == want


def test_pack_matches_compressed_tensors_compressor():
    """Our quantize + pack == the library's own PackedQuantizationCompressor.compress on the same scale."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    q, scale = quantize_int4(w, 32)
    scheme = QuantizationScheme(targets=["Linear"], weights=int4_args(32))
    lib = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert torch.equal(lib["weight_packed"], pack_int4(q))
    back = PackedQuantizationCompressor.decompress(lib, scheme)["weight"]
    assert torch.equal(back, dequantize_int4(q, scale))


def test_quantize_scheme():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    w[0, :32] = 0.0  # an all-zero group: scale floor 1e-5, q = 0
    q, scale = quantize_int4(w, 32)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 7 and int(q.min()) >= -7
    assert scale.dtype == torch.bfloat16 and scale.shape == (8, 2)
    amax = w.view(8, 2, 32).abs().amax(-1)
    assert torch.equal(scale, (amax / 7).clamp_min(1e-5).to(torch.bfloat16))
    assert torch.equal(q[0, :32], torch.zeros(32, dtype=torch.int8))
    assert (q.view(8, 2, 32).abs().amax(-1)[1:] == 7).all()  # the group max lands on +-7
    fq = fake_quant_int4(w, 32)
    err = (fq - w).abs().view(8, 2, 32).amax(-1)
    assert (err <= scale.float() * 0.5 + amax * 2**-8).all()  # half a step (+ bf16 rounding of scale/product)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_equals_dequant_exactly(dtype):
    """What the trainer computes with is bit-for-bit what compressed-tensors decodes, in the trainer's dtype."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    w = (torch.randn(32, 128, generator=torch.Generator().manual_seed(3)) * 0.02).to(dtype)
    fq = fake_quant_int4(w, 32)
    q, scale = quantize_int4(w, 32)
    lib = dequantize(q, scale, args=int4_args(32))
    assert fq.dtype == dtype
    assert torch.equal(lib.to(dtype), fq)
    assert torch.equal(dequantize_int4(q, scale, dtype), fq)


def test_ste_gradient_is_the_linear_gradient_at_the_quantized_point():
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(24, 64, generator=g) * 0.1).requires_grad_()
    x, up = torch.randn(5, 64, generator=g), torch.randn(5, 24, generator=g)
    (torch.nn.functional.linear(x, fake_quant_int4(w, 32)) * up).sum().backward()
    w_q = fake_quant_int4(w.detach(), 32).requires_grad_()
    (torch.nn.functional.linear(x, w_q) * up).sum().backward()
    assert not torch.equal(w_q.detach(), w.detach())
    assert torch.equal(w.grad, w_q.grad)


def test_group_size_must_divide_input_dim():
    with pytest.raises(Int4ShapeError, match="group_size=32"):
        quantize_int4(torch.zeros(4, 48), 32)


# --------------------------------------------------------------------------- ignore list + export


def tiny_names() -> list[str]:
    return list(json.loads((TINY_MODEL / INDEX_NAME).read_text())["weight_map"])


def test_ignore_list_leaves_exactly_the_routed_experts():
    names = tiny_names()
    routed = {n for n in names if ROUTED.match(n)}
    assert len(routed) == 3 * 16 * 3  # 3 MoE layers x 16 experts x gate/up/down
    assert {n for n in names if is_quantized(n)} == routed
    # the ignore list is what keeps attention, shared experts, dense MLP and lm_head out
    without = {n for n in names if is_quantized(n, ignore=[])}
    for kind in ("self_attn.q_a_proj", "shared_experts.down_proj", "layers.0.mlp.gate_proj", "lm_head"):
        assert any(kind in n for n in without - routed), kind
    not_linear = [n for n in names if "norm" in n or "embed" in n or n.endswith("mlp.gate.weight")]
    assert not_linear and not any(is_quantized(n, ignore=[]) for n in not_linear)


def test_quantization_config_is_kimis_and_valid():
    from compressed_tensors.quantization import QuantizationConfig

    qc = kimi_quantization_config(32)
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == KIMI_IGNORE
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"], w["dynamic"]) == (
        4, "int", True, "group", 32, False)
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.config_groups["group_0"].targets == ["Linear"]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("int4") / "export"
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    info = export_int4(iter_stored_tensors(TINY_MODEL), cfg, TINY_MODEL, out, 32, max_shard_bytes=1 << 20)
    return out, info


def test_export_layout(tiny_export):
    out, info = tiny_export
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["quantization_config"] == kimi_quantization_config(32)
    assert cfg["torch_dtype"] == "bfloat16"
    index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) >= 2 and shards == sorted(p.name for p in out.glob("*.safetensors"))
    assert all(re.fullmatch(rf"model-0000\d-of-0000{len(shards)}\.safetensors", s) for s in shards)
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    stored = {}
    for s in shards:
        with safe_open(str(out / s), framework="pt") as f:
            for k in f.keys():
                assert index[k] == s
                stored[k] = f.get_tensor(k)
    assert set(stored) == set(index)
    src = dict(iter_stored_tensors(TINY_MODEL))
    for name, t in src.items():
        if ROUTED.match(name):
            p = name.removesuffix(".weight")
            assert name not in stored
            assert stored[p + ".weight_packed"].dtype == torch.int32
            assert stored[p + ".weight_packed"].shape == (t.shape[0], t.shape[1] // 8)
            assert stored[p + ".weight_scale"].dtype == torch.bfloat16
            assert stored[p + ".weight_scale"].shape == (t.shape[0], t.shape[1] // 32)
            assert stored[p + ".weight_shape"].tolist() == list(t.shape)
        elif name.endswith("e_score_correction_bias"):
            assert stored[name].dtype == torch.float32 and torch.equal(stored[name], t.float())
        else:
            assert stored[name].dtype == torch.bfloat16 and torch.equal(stored[name], t.to(torch.bfloat16))
    assert info.num_quantized == 144 and info.num_tensors == len(src)
    payload = sum(t.numel() * t.element_size() for t in stored.values())
    assert info.int4_bytes == payload
    assert info.bf16_bytes == sum(t.numel() * 2 for t in src.values())
    assert info.bf16_bytes / info.int4_bytes > 1.8  # experts are most of the tiny model


def test_export_is_atomic(tmp_path):
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    out = tmp_path / "export"
    out.mkdir()
    (out / "previous.txt").write_text("an earlier export")

    def broken():
        for i, item in enumerate(iter_stored_tensors(TINY_MODEL)):
            if i == 50:
                raise OSError("source went away")
            yield item

    with pytest.raises(OSError, match="went away"):
        export_int4(broken(), cfg, TINY_MODEL, out, 32, max_shard_bytes=1 << 18)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temp dir left behind
    assert [p.name for p in out.iterdir()] == ["previous.txt"]  # the old export untouched

    def dup():
        yield "model.norm.weight", torch.zeros(2)
        yield "model.norm.weight", torch.zeros(2)

    with pytest.raises(ExportError, match="given twice"):
        export_int4(dup(), cfg, None, out, 32)
    bad = [("model.layers.1.mlp.experts.0.gate_proj.weight", torch.zeros(4, 48))]
    with pytest.raises(Int4ShapeError, match="experts.0.gate_proj.weight: .*group_size=32"):
        export_int4(iter(bad), cfg, None, out, 32)


# --------------------------------------------------------------------------- verification


def test_dequant_exact_and_reload_parity(tiny_export):
    from kimi_pipeline.weightjobs.export_verify import check_reloaded_model, check_tensors, model_check_problems

    out, _ = tiny_export
    t = check_tensors(out, iter_stored_tensors(TINY_MODEL), 32)
    assert t.dequant_exact and t.others_exact and t.num_quantized == 144 and not t.mismatches
    r = check_reloaded_model(out, iter_stored_tensors(TINY_MODEL), 32)
    assert r["experts_equal"]
    assert r["logits_max_diff_exact"] <= 1e-4
    assert r["generated_tokens"] >= 1 and r["generation_matches_reference"]
    assert r["logits_reference"] == "hf-fake-quant-fp32" and r["logits_max_diff"] <= r["logits_tolerance"]
    assert model_check_problems(r) == []


def test_verification_catches_a_wrong_scale(tiny_export, tmp_path):
    """Corrupt one expert's scale: the tensor check and the reloaded model must both notice."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kimi_pipeline.weightjobs.export_verify import check_reloaded_model, check_tensors, model_check_problems

    src, _ = tiny_export
    out = tmp_path / "corrupt"
    shutil.copytree(src, out)
    target = "model.layers.2.mlp.experts.5.down_proj.weight_scale"
    shard = out / json.loads((out / INDEX_NAME).read_text())["weight_map"][target]
    tensors = load_file(shard)
    tensors[target] = tensors[target] * 2
    save_file(tensors, str(shard), metadata={"format": "pt"})
    t = check_tensors(out, iter_stored_tensors(TINY_MODEL), 32)
    assert not t.dequant_exact and t.mismatches == ["model.layers.2.mlp.experts.5.down_proj.weight"]
    r = check_reloaded_model(out, iter_stored_tensors(TINY_MODEL), 32)
    assert not r["experts_equal"]
    assert "reloaded expert weights differ from the fake-quant weights" in model_check_problems(r)


# --------------------------------------------------------------------------- QAT on megatron-core


@pytest.fixture(scope="module")
def megatron_pair():
    """Two identical single-rank tiny megatron models (CPU, gloo): `qat` and `ref`."""
    from kimi_pipeline.model.megatron_model import build_model
    from kimi_pipeline.model.parallel import destroy, init_distributed
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.recipes.layout import Layout

    spec = load_recipe("tiny").model
    init_distributed(Layout(), device=CPU)
    try:
        qat, ref = build_model(spec, Layout(), device=CPU), build_model(spec, Layout(), device=CPU)
        ref.load_state_dict(qat.state_dict())
        yield qat, ref
    finally:
        destroy()


def test_qat_wraps_only_routed_experts_and_keeps_parameters(megatron_pair):
    from kimi_pipeline.model.megatron_model import causal_forward
    from kimi_pipeline.model.qat import QATError, disable_int4_qat, enable_int4_qat

    model, _ = megatron_pair
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    tokens = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = causal_forward(model, tokens)
    names = enable_int4_qat(model, 32)
    assert enable_int4_qat(model, 32) == names  # idempotent
    want = {f"decoder.layers.{i}.mlp.experts" for i in (1, 2, 3)}  # each layer's stacked experts
    assert set(names) == want
    wrapped = {n for n, m in model.named_modules() if "forward" in m.__dict__}
    assert wrapped == want  # no attention, router, shared expert, dense MLP, embedding or output layer
    with torch.no_grad():
        quant = causal_forward(model, tokens)
    assert not torch.equal(plain, quant)
    # the Parameters are the same objects, unshadowed after the forward; state dict keys unchanged
    assert all(p is params[n] for n, p in model.named_parameters())
    experts = model.decoder.layers[1].mlp.experts
    assert "fc2_weight" not in experts.__dict__
    assert experts.fc2_weight is params["decoder.layers.1.mlp.experts.fc2_weight"]
    assert list(model.state_dict()) == keys
    disable_int4_qat(model)
    with torch.no_grad():
        assert torch.equal(causal_forward(model, tokens), plain)
    model.config.gradient_accumulation_fusion = True
    try:
        with pytest.raises(QATError, match="gradient_accumulation_fusion"):
            enable_int4_qat(model, 32)
    finally:
        model.config.gradient_accumulation_fusion = False
    with pytest.raises(QATError, match="not divisible by quant.group_size=48"):
        enable_int4_qat(model, 48)


def test_qat_forward_and_ste_grads_under_megatron_ddp(megatron_pair):
    """QAT model (in megatron DDP) == a model whose expert weights *are* the fake-quant values, in logits and
    in every gradient: the STE gives the plain linear's gradient at the quantized point, and it reaches
    DDP's main_grad buffers through the real Parameters."""
    model, ref = megatron_pair
    got, want, grads, experts = qat_vs_quantized_weights(model, ref, CPU)
    assert torch.equal(got, want)
    for n, (g, w) in grads.items():
        assert torch.equal(g, w), n
    # routed experts did receive (straight-through) gradients
    reached, total = experts_reached(grads[n][0] for n in experts)
    assert total == 2 * 3 * 16 and reached > 50, reached


def test_run_export_section(tmp_path):
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.weightjobs.int4_export import SECTION_FILE, run_export

    recipe = load_recipe("tiny")
    section = run_export(recipe.model, recipe.quant, tmp_path, lambda: iter_stored_tensors(TINY_MODEL),
                         model_dir=TINY_MODEL, checkpoint="data/tiny/model")
    out = Path(section["path"])
    assert out == tmp_path / "export" / "int4" and (out / "config.json").is_file()
    assert section["dequant_exact"] is True and section["experts_equal"] is True
    assert section["int4_bytes"] < section["bf16_bytes"] and section["compression"] > 1.8
    assert section["logits_max_diff_exact"] <= 1e-4 and section["generated_tokens"] >= 1
    assert section["logits_max_diff"] <= section["logits_tolerance"]
    assert json.loads((tmp_path / "export" / SECTION_FILE).read_text()) == section


def test_a_checkpoint_save_starts_no_helper_process(megatron_pair, tmp_path):
    """A synchronous torch_dist save collects its write results in this process: megatron's writer would otherwise
    spawn a Manager process for its results queue (a fresh interpreter per saving rank,
    `megatron_train._write_results_in_process`). The checkpoint still loads back bit for bit."""
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from kimi_pipeline.model.megatron_train import load_model_only, save_model_only

    qat, ref = megatron_pair
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert save_model_only(tmp_path / "ckpt", ref, step=3).name == "iter_0000003"
    started = []
    for p in psutil.Process().children(recursive=True):
        if p.pid not in before:
            with contextlib.suppress(psutil.NoSuchProcess):  # one that exited since the listing started nothing
                started.append(" ".join(p.cmdline()))
    assert not [c for c in started if "multiprocessing" in c], started
    assert type(filesystem_async._results_queue).__module__ == "queue"  # the in-process one, not a Manager proxy
    saved = {k: v.clone() for k, v in ref.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    assert load_model_only(tmp_path / "ckpt", ref) == 3
    for k, v in ref.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, saved[k]), k


@pytest.mark.slow  # a 4-rank distributed export plus the checkpoint model check in a child process
def test_stage_export_from_a_megatron_checkpoint(megatron_pair, tmp_path):
    """Trainer checkpoint (torch_dist) -> child process -> INT4 export whose logits match the megatron
    fake-quant forward; summary.json gains the export section; the cache key is the content hash."""
    from support.stages import run_stage

    from kimi_pipeline import stages
    from kimi_pipeline.model.hf_bridge import load_hf_tensors_into_model
    from kimi_pipeline.model.megatron_model import build_model
    from kimi_pipeline.model.megatron_train import save_model_only
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.recipes.layout import Layout
    from kimi_pipeline.stages import EXPORT
    from kimi_pipeline.weightjobs.int4_export import checkpoint_content_hash

    recipe = load_recipe("tiny", ["quant.int4_qat=true"])  # the QAT export path (the preset trains without QAT)
    src = dict(iter_stored_tensors(TINY_MODEL))
    model = build_model(recipe.model, Layout(), device=CPU, perform_initialization=False)
    load_hf_tensors_into_model(model, src.__getitem__, recipe.model, Layout())
    ckpt = tmp_path / "ckpt"
    save_model_only(ckpt, model, step=20)
    key = checkpoint_content_hash(ckpt)
    assert key == checkpoint_content_hash(ckpt, 20)

    run_dir = tmp_path / "run"
    (run_dir / "validate").mkdir(parents=True)  # the eval set the served export is scored on (the run's validated one)
    shutil.copy(TINY / "aime-tiny.jsonl", run_dir / "validate" / "eval.jsonl")
    section = run_stage(EXPORT, stages.export.run, recipe, run_dir, checkpoint_dir=ckpt, model_dir=TINY_MODEL,
                        timeout_s=450)  # < the test limit
    assert section["checkpoint"] == str(ckpt / "iter_0000020")
    # distributed: recipe.convert's 4 ranks (pp 2 x ep 2) each wrote the tensors they own ...
    assert section["ranks"] == 4 and len(section["peak_rss_mb_per_rank"]) == 4
    assert all(0 < mb < 4096 for mb in section["peak_rss_mb_per_rank"])
    written = sorted(p.name for p in Path(section["path"]).glob("*.safetensors"))
    assert section["shards"] == len(written) >= 4 and all(n.startswith("model-") for n in written)
    # ... and the result is, tensor for tensor, bit-identical to the single-process export of the same weights
    from kimi_pipeline.model.hf_bridge import export_hf_tensors
    from kimi_pipeline.weightjobs.int4_export import shard_bytes

    config = json.loads((TINY_MODEL / "config.json").read_text())
    single = export_int4(export_hf_tensors(model, recipe.model, Layout()), config, TINY_MODEL, tmp_path / "single",
                         32, max_shard_bytes=shard_bytes(recipe.model))
    dist_tensors, single_tensors = dict(iter_stored_tensors(section["path"])), dict(iter_stored_tensors(single.path))
    assert dist_tensors.keys() == single_tensors.keys() and len(dist_tensors) > 200
    for name, t in single_tensors.items():
        assert t.dtype == dist_tensors[name].dtype and torch.equal(t, dist_tensors[name]), name
    for f in ("config.json", "tokenizer.json"):
        assert (Path(section["path"]) / f).read_bytes() == (Path(single.path) / f).read_bytes()
    assert section["int4_bytes"] == single.int4_bytes and section["num_quantized"] == single.num_quantized
    assert section["dequant_exact"] and section["experts_equal"] and section["qat"]
    assert section["logits_reference"] == "trainer"
    assert section["logits_max_diff_parity"] <= 1e-3  # megatron fake-quant forward == HF fake-quant model
    assert section["logits_max_diff"] <= section["logits_tolerance"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["export"] == section and summary["stages"]["export"]["status"] == "completed"
    for k in ("path", "int4_bytes", "bf16_bytes", "logits_max_diff", "dequant_exact", "peak_rss_mb_per_rank"):
        assert k in summary["export"]

    from kimi_pipeline.report.stage_reports import export_report
    from tasks.export import export_key

    params = {"recipe": recipe, "run_dir": str(run_dir), "checkpoint_dir": str(ckpt), "step": None}
    task_key = export_key(None, params)
    assert "dequantized == fake-quant (exact) | **True**" in export_report(section)
    (ckpt / "iter_0000020" / "kimi_extra.json").write_text("{}")  # a new save id -> new key
    assert checkpoint_content_hash(ckpt) != key and export_key(None, params) != task_key
    _assert_served_scoring(recipe, section, run_dir)


def _assert_served_scoring(recipe, section: dict, run_dir: Path) -> None:
    """The export scored as it is served (`eval.served`): the embedded engine loads the INT4 directory from disk and
    scores the eval set at the exported step's seeds, the same numbers each time; with no training eval at that
    step the scores are recorded only; one more than `export.max_eval_drop` below fails permanently and leaves the
    export on disk marked unpublished; within the bound it is published again."""
    from kimi_pipeline.errors import PermanentError
    from kimi_pipeline.eval.served import UNPUBLISHED, ServedSections, publish_scored
    from kimi_pipeline.report.stage_reports import export_report
    from kimi_pipeline.report.summary import RunSummary

    served = section["eval"]
    assert served["engine"] == "embedded" and served["step"] == 20 and served["problems"] == 96, served
    assert 0 < served["avg_at_n"] <= served["pass_at_n"] <= 1 and served["drop"] is None and section["published"]
    assert "no training eval at step 20" in served["note"]
    unscored = {k: v for k, v in section.items() if k not in ("eval", "published")}
    marker, export = run_dir / "export" / "export.json", Path(section["path"])
    summary = RunSummary(run_dir)
    summary.upsert_row("eval", {"step": 20, "avg_at_n": served["avg_at_n"] + 0.5})  # training scored far higher
    with pytest.raises(PermanentError, match=r"0\.5000 below the training eval at step 20 .*marked unpublished"):
        publish_scored(ServedSections.of(recipe), dict(unscored), run_dir, 20)
    assert (export / UNPUBLISHED).is_file() and (export / "config.json").is_file()  # kept on disk, marked
    recorded = json.loads(marker.read_text())
    assert recorded["published"] is False and recorded["eval"]["avg_at_n"] == served["avg_at_n"]  # same seeds
    summary.upsert_row("eval", {"step": 20, "avg_at_n": served["avg_at_n"] + 0.01})
    again = publish_scored(ServedSections.of(recipe), dict(unscored), run_dir, 20)
    assert again["published"] and again["eval"]["drop"] == pytest.approx(0.01) and not (export / UNPUBLISHED).exists()
    assert json.loads(marker.read_text()) == again
    assert "| published | **True** |" in export_report(again)
