"""Conversion stage: HF safetensors -> Megatron torch_dist over N simulated nodes, verified.

Real torchrun agents, gloo, megatron-core and transformers throughout; the tiny checkpoint is built
randomly (norms and expert biases perturbed too, so a swapped mapping cannot hide behind ones/zeros).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kimi_pipeline.errors import is_permanent
from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.hf.quantized_copy import write_quantized_checkpoint
from kimi_pipeline.hf.reader import HFCheckpoint, HFCheckpointError
from kimi_pipeline.hf.source_formats import (
    Int4Dequantizer,
    QuantFormatError,
    dequant_fp8_block,
    detect_format,
    kimi_int4_quant_config,
    quantize_fp8_block,
    quantize_int4_packed,
)
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.weightjobs.conversion import (
    MARKER,
    TRACKER,
    ConvertSections,
    checkpoint_dir,
    completed,
    convert_dir,
    fingerprint,
    run_convert,
    source_manifest,
    verify_conversion,
)
from kimi_pipeline.weightjobs.convert_verify import ConversionVerifyError
from kimi_pipeline.weightjobs.commands import NodeCommand
from kimi_pipeline.weightjobs.launch import launch_local
from kimi_pipeline.weightjobs.outcome import WeightJobPermanentError
from kimi_pipeline.weightjobs.rank import RANK_ENTRY, rank_args

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- fixtures
def _tiny_recipe(**convert):
    r = load_recipe("tiny")
    if convert:
        r = r.model_copy(update={"convert": r.convert.model_copy(update=convert)})
    return r


def _two_nodes(**extra):
    """2 nodes x 1 rank, pp2: the cheaper layout for the tests that are not about the 4-node job."""
    return _tiny_recipe(nodes=2, gpus_per_node=1, tp=1, pp=2, ep=1, **extra)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random tiny checkpoint as Kimi ships it (per-expert names, several shards, kimi_k2 config)."""
    from kimi_pipeline.model.hf_model import build_hf_model, save_hf_model

    spec = load_recipe("tiny").model
    model = build_hf_model(spec, seed=7)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name:
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.01)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf_model(model, out, config=hf_config_dict(spec), tokenizer_dir=ROOT / "data" / "tiny" / "model",
                  max_shard_size="2MB")
    return out


@pytest.fixture(scope="module")
def converted(tiny_ckpt, tmp_path_factory) -> tuple[Path, dict]:
    """The tiny recipe's own conversion as the pipeline runs it: download (local source, manifest) ->
    the convert stage (4 nodes x 1 rank, pp2 x ep2, verified) -> summary.json."""
    from kimi_pipeline import stages
    from kimi_pipeline.stages import CONVERT, DOWNLOAD, prepare_run
    from support.stages import run_stage

    recipe = load_recipe("tiny", [f"hub.model.path={tiny_ckpt}"])
    run_dir = prepare_run(recipe, tmp_path_factory.mktemp("runs") / "run")
    run_stage(DOWNLOAD, stages.download.run, recipe, run_dir)
    section = run_stage(CONVERT, stages.convert.run, recipe, run_dir)
    return run_dir, section


# ---------------------------------------------------------------- source formats (no job)
def test_fp8_block_dequant_is_scale_times_value_per_block():
    w = torch.randn(200, 72) * 0.05  # partial blocks in both dims
    q, s = quantize_fp8_block(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 1)
    d = dequant_fp8_block(q, s, (128, 128))
    # by definition: block (i, j) = fp8 value * scale_inv[i, j]
    assert torch.equal(d[128:, :], q[128:, :].float() * s[1, 0])
    # e4m3 keeps 3 mantissa bits: error below 1/16 of each block's max
    assert (d - w).abs().max() <= w.abs().max() / 16
    with pytest.raises(QuantFormatError, match="weight_scale_inv has shape"):
        dequant_fp8_block(q, s[:1], (128, 128), "x.weight")


def test_int4_pack_quantized_dequant_via_compressed_tensors():
    w = torch.randn(64, 128) * 0.02
    packed = quantize_int4_packed(w, 32)
    assert packed["weight_packed"].dtype == torch.int32 and packed["weight_packed"].shape == (64, 16)
    assert packed["weight_scale"].shape == (64, 4)
    d = Int4Dequantizer(kimi_int4_quant_config(32)).dequant("model.layers.1.mlp.experts.0.up_proj", packed)
    assert d.shape == w.shape
    scale = packed["weight_scale"].float().repeat_interleave(32, 1)
    # symmetric 4-bit: values in [-8, 7]; |error| <= half a step, or the clipped top of the range
    assert ((d.float() - w).abs() <= scale * 0.5 + 1e-3 * w.abs().max()).float().mean() > 0.99
    assert (d.float() - w).abs().max() <= scale.max()


def test_detect_format_and_unsupported():
    assert detect_format({"torch_dtype": "bfloat16"}).kind == "bf16"
    fp8 = detect_format({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}})
    assert fp8.kind == "fp8" and fp8.details["weight_block_size"] == [128, 128]
    int4 = detect_format({"quantization_config": kimi_int4_quant_config(32)})
    assert int4.describe()["format"] == "int4" and int4.details["group_size"] == 32 and int4.details["num_bits"] == 4
    nested = detect_format({"text_config": {"quantization_config": kimi_int4_quant_config(32)}}, "text_config")
    assert nested.kind == "int4"
    with pytest.raises(QuantFormatError, match="quant_method='awq'"):
        detect_format({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(QuantFormatError, match="weight_block_size"):
        detect_format({"quantization_config": {"quant_method": "fp8"}})
    bad = kimi_int4_quant_config(32) | {"format": "marlin-24"}
    with pytest.raises(QuantFormatError, match="marlin-24"):
        detect_format({"quantization_config": bad})


# ---------------------------------------------------------------- the reader (no job)
def test_reader_reads_only_what_is_asked(tiny_ckpt):
    from kimi_pipeline.hf.names import all_hf_names

    spec = load_recipe("tiny").model
    r = HFCheckpoint(tiny_ckpt)
    assert r.format.kind == "bf16" and len(r.files()) > 2
    assert sorted(r.names()) == sorted(all_hf_names(spec))
    t = r.get("model.layers.2.mlp.experts.5.down_proj.weight")
    assert t.shape == (spec.hidden_size, spec.moe_ffn_hidden_size)
    st = r.stats()
    assert st == {"tensors_read": 1, "bytes_read": t.numel() * 4, "files_opened": 1, "files_total": len(r.files())}


def test_reader_names_missing_and_corrupt_shards(tiny_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.3.mlp.experts.1.up_proj.weight"
    shard = bad / index[name]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(HFCheckpointError, match=f"{shard.name}.*corrupt or truncated"):
        HFCheckpoint(bad).get(name)
    shard.unlink()
    with pytest.raises(HFCheckpointError, match=f"{shard.name}: missing"):
        HFCheckpoint(bad).get(name)
    with pytest.raises(HFCheckpointError, match="not in the checkpoint index"):
        HFCheckpoint(bad).get("model.layers.9.mlp.experts.0.up_proj.weight")
    (bad / "model.safetensors.index.json").unlink()
    with pytest.raises(HFCheckpointError, match="neither model.safetensors.index.json"):
        HFCheckpoint(bad)


# Quantization error bounds, relative to a tensor's largest magnitude: e4m3 keeps 3 mantissa bits
# (half a step <= 1/16); symmetric int4 with scale = group max / 7.5 errs by at most half a step (1/15),
# plus the bf16 rounding of the scale.
TOLERANCE = {"fp8": 1 / 16, "int4": 0.08}
QUANTIZED = {"fp8": 176, "int4": 144}  # all 4x5 attention + 3 dense + 3x3 shared + 144 expert Linears / experts only


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_quantized_sources_dequantize_within_the_quantization_error(tiny_ckpt, tmp_path, kind):
    src = HFCheckpoint(tiny_ckpt)
    q = HFCheckpoint(write_quantized_checkpoint(tiny_ckpt, tmp_path / kind, kind))
    assert q.format.kind == kind and sorted(q.names()) == sorted(src.names())
    quantized = 0
    for name in src.names():
        a, b = src.get(name), q.get(name, torch.float32)
        err = (a - b).abs().max().item()
        if err > a.abs().max().item() * 2**-8:  # more than bf16 rounding: this tensor was quantized
            quantized += 1
            assert err <= TOLERANCE[kind] * a.abs().max().item(), name
    assert quantized == QUANTIZED[kind]


def test_quantized_copy_keeps_the_source_shards_and_names_a_corrupt_one(tiny_ckpt, tmp_path):
    q = write_quantized_checkpoint(tiny_ckpt, tmp_path / "int4", "int4")
    assert len(list(q.glob("*.safetensors"))) == len(list(tiny_ckpt.glob("*.safetensors"))) > 1
    bad, shard = _with_truncated_shard(tiny_ckpt, tmp_path / "bad")
    with pytest.raises(HFCheckpointError, match=f"{shard.name}.*corrupt or truncated"):
        write_quantized_checkpoint(bad, tmp_path / "from-bad", "int4")


# ---------------------------------------------------------------- layouts and commands
def test_verify_layout_differs_from_the_written_one():
    from kimi_pipeline.recipes.layout import Layout
    from kimi_pipeline.weightjobs.convert_verify import SMALL_MODEL_BYTES, model_bytes, verify_layout

    tiny = load_recipe("tiny")
    assert model_bytes(tiny.model) < SMALL_MODEL_BYTES
    assert verify_layout(tiny.model, Layout.from_convert(tiny.convert), small=True).world_size == 1
    k2 = load_recipe("kimi-k2-instruct")
    written = Layout.from_convert(k2.convert)
    v = verify_layout(k2.model, written, small=model_bytes(k2.model) < SMALL_MODEL_BYTES)
    assert v.world_size == written.world_size == 32 and (v.tp, v.ep) != (written.tp, written.ep)
    assert v.pp == written.pp and v.first_pp_stage_layers == written.first_pp_stage_layers


def test_scale_out_command_is_one_torchrun_per_node():
    cmd = NodeCommand("kimi_pipeline.weightjobs.convert_rank", ("--job", "/shared/run/convert/work/job.json"), 4, 8).scale_out()
    assert "--nnodes=4" in cmd and "--nproc-per-node=8" in cmd
    assert "--master-addr=$MASTER_ADDR" in cmd and "--node-rank=$NODE_RANK" in cmd
    assert cmd.endswith("-m kimi_pipeline.weightjobs.convert_rank --job /shared/run/convert/work/job.json")


# ---------------------------------------------------------------- the 4-node job
def _tree_state(root: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime) of every file and directory under `root`: any write, replacement or removal shows."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.slow
def test_tiny_four_node_conversion_is_exact(converted, tiny_ckpt):
    run_dir, s = converted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stages"]["convert"]["status"] == "completed" and summary["convert"] == s
    ckpt = checkpoint_dir(run_dir)
    assert (ckpt / TRACKER).read_text().strip() == "0" and (ckpt / "iter_0000000" / "metadata.json").is_file()
    assert not list(ckpt.parent.glob("torch_dist.tmp-*"))
    assert s["nodes"] == 4 and s["layout"] == {"tp": 1, "pp": 2, "ep": 2, "etp": 1}
    assert s["verified"] is True and s["max_abs_diff"] == 0.0
    assert s["roundtrip_exact"] is True and s["roundtrip_max_abs_diff"] == 0.0
    assert s["roundtrip_tensors"] == s["hf_tensors"] == len(HFCheckpoint(tiny_ckpt).names())
    assert s["verify_layout"]["world_size"] == 1  # reloaded under another layout than pp2 x ep2
    assert s["logits_max_diff"] is not None and s["logits_max_diff"] <= s["logits_tolerance"] == 1e-3
    assert s["source_format"] == "bf16" and s["bytes"] > 0 and s["seconds"] > 0
    assert len(s["peak_rss_mb_per_rank"]) == 4 and all(x > 0 for x in s["peak_rss_mb_per_rank"])
    # each rank read its pipeline stage and its expert half only: never the whole model
    assert max(s["bytes_read_per_rank"]) < 0.5 * s["bytes"]
    reports = [json.loads(p.read_text()) for p in sorted((run_dir / "convert" / "work" / "reports").glob("rank_*.json"))]
    assert sorted((r["pp"], r["ep"]) for r in reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # a finished conversion of the same source + recipe is reused, not redone: the recorded section comes
    # back and nothing under DIR/convert is written, replaced or removed (no job, no verification launched)
    before = _tree_state(convert_dir(run_dir))
    # fingerprint from the files themselves: same hashes
    again = run_convert(ConvertSections.of(_tiny_recipe()), run_dir, tiny_ckpt)
    assert again == {**json.loads((convert_dir(run_dir) / MARKER).read_text())["section"], "reused": True}
    assert again == {**s, "reused": True}
    assert _tree_state(convert_dir(run_dir)) == before
    # ... but not for another recipe section (here: the conversion layout)
    other = fingerprint(ConvertSections.of(_tiny_recipe(ep=1)), source_manifest(tiny_ckpt))
    assert completed(run_dir) is not None and completed(run_dir, other) is None


def test_task_cache_key_follows_content_not_paths(tmp_path):
    from tasks.convert import convert_key

    def key(sha: str, **convert) -> str:
        (tmp_path / "download").mkdir(exist_ok=True)
        manifest = {"model": {"root": "/anywhere", "files": {"model.safetensors": {"size": 1, "sha256": sha}}}}
        (tmp_path / "download" / "manifest.json").write_text(json.dumps(manifest))
        return convert_key(None, {"recipe": _tiny_recipe(**convert), "run_dir": str(tmp_path)})

    assert key("a") == key("a") != key("b")
    assert key("a") != key("a", ep=1) and key("a") != key("a", verify=False)


@pytest.mark.slow
def test_reload_under_tp2_matches_the_source(converted, tiny_ckpt, tmp_path):
    """The pp2 x ep2 checkpoint, resharded into TP2 x expert-TP2 (2 ranks): every tensor and the round trip exact."""
    from kimi_pipeline.recipes.layout import Layout
    from kimi_pipeline.weightjobs.convert_verify import summarize
    from kimi_pipeline.weightjobs.job_file import write_job_file

    run_dir, _ = converted
    layout = Layout(world_size=2, tp=2, etp=2)  # experts split along expert-TP too
    reports = tmp_path / "reports"
    job = write_job_file(tmp_path / "verify.json", model=load_recipe("tiny").model, layout=layout, device="cpu",
                         model_dir=tiny_ckpt,
                         out_dir=checkpoint_dir(run_dir), ckpt_dir=checkpoint_dir(run_dir), report_dir=reports, logits=False)
    done = launch_local(NodeCommand(RANK_ENTRY, tuple(rank_args("verify", job)), 1, 2), work_dir=tmp_path,
                        report_dir=reports, name="verify-tp2", timeout=300)
    assert done.ok, done
    rs = [json.loads(p.read_text()) for p in sorted(reports.glob("verify_rank_*.json"))]
    assert sorted(r["tp"] for r in rs) == [0, 1]
    v = summarize(rs, logits_expected=False)
    assert v["verified"], v["problems"]
    assert v["max_abs_diff"] == 0.0 and v["roundtrip_exact"] and v["roundtrip_tensors"] == v["hf_tensors"]


def _tampered_copy(src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None], names: list[str]) -> Path:
    """A copy of the HF checkpoint `src` in which `change` edits tensors `names` in place (same names,
    shapes and shards; the index untouched): what the converter would have produced with a wrong mapping."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {index[n] for n in names}
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(dst / shard), "pt") as f:
            for n in f.keys():
                tensors[n], where[n] = f.get_tensor(n), shard
    before = {n: tensors[n].clone() for n in names}
    change(tensors)
    assert all(not torch.equal(tensors[n], before[n]) for n in names)  # the edit really changed each tensor
    for shard in shards:
        save_file({n: t.contiguous() for n, t in tensors.items() if where[n] == shard}, str(dst / shard),
                  metadata={"format": "pt"})
    return dst


def _swap(a: str, b: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(t: dict[str, torch.Tensor]) -> None:
        t[a], t[b] = t[b], t[a]

    return change


def _one_ulp(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(t: dict[str, torch.Tensor]) -> None:
        w = t[name].clone()
        w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(float("inf"), dtype=w.dtype))
        t[name] = w

    return change


GATE, UP = "model.layers.3.mlp.experts.0.gate_proj.weight", "model.layers.3.mlp.experts.0.up_proj.weight"
KV_A = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
TAMPER = {
    # gate and up exchanged: the classic fused-fc1 mapping bug (same shapes, both in the last pipeline stage)
    "swapped": ([GATE, UP], _swap(GATE, UP)),
    # one element of one tensor off by one float32 ulp: verification is exact, not within a tolerance
    "perturbed": ([KV_A], _one_ulp(KV_A)),
}


@pytest.mark.slow
@pytest.mark.parametrize("tamper", sorted(TAMPER))
def test_verification_catches_a_swapped_or_perturbed_tensor(converted, tiny_ckpt, tmp_path, tamper):
    """Negative control for the stage's verification: the tiny conversion (verified against its source) checked
    against a source that differs in a swapped pair / one perturbed tensor fails, naming exactly those tensors."""
    run_dir, s = converted
    assert s["verified"] is True  # the same checkpoint against the untouched source
    names, change = TAMPER[tamper]
    bad = _tampered_copy(tiny_ckpt, tmp_path / "hf", change, names)
    work = tmp_path / "work"
    with pytest.raises(ConversionVerifyError) as info:
        verify_conversion(ConvertSections.of(load_recipe("tiny")), bad, checkpoint_dir(run_dir), work, timeout=300)
    msg = str(info.value)
    assert msg.startswith(f"converted checkpoint {checkpoint_dir(run_dir)} does not reproduce {bad}")
    for n in names:  # the round trip HF -> Megatron -> HF names each changed tensor
        assert re.search(rf"round trip: {re.escape(n)}: max \|diff\| [0-9.e+-]+", msg), msg
    assert set(re.findall(r"round trip: (model\.\S+):", msg)) == set(names), msg  # and nothing else
    # the reload compared with the HF-filled model: the megatron parameter(s) holding them
    want = "linear_fc1" if tamper == "swapped" else "linear_kv_down_proj"  # kv_a_proj_with_mqa's megatron name
    mismatched = re.findall(r"rank 0: (\S+): max \|diff\|", msg)
    assert mismatched and all(want in m for m in mismatched), msg
    verdict = json.loads((work / "verify_failed.json").read_text())
    assert verdict["verified"] is False and not verdict["roundtrip_exact"] and verdict["max_abs_diff"] > 0


# ---------------------------------------------------------------- quantized sources end to end
def _load_converted(ckpt: Path, spec) -> dict[str, torch.Tensor]:
    """HF-named tensors of a torch_dist checkpoint, loaded on one rank in a fresh process."""
    code = (
        "import sys, torch; from safetensors.torch import save_file\n"
        "from kimi_pipeline.recipes.models import ModelSpec\n"
        "from kimi_pipeline.model.parallel import init_distributed, destroy\nfrom kimi_pipeline.recipes.layout import Layout\n"
        "from kimi_pipeline.model.megatron_model import build_model\n"
        "from kimi_pipeline.model.megatron_train import load_model_only\n"
        "from kimi_pipeline.model.hf_bridge import export_hf_tensors\n"
        "if __name__ == '__main__':\n"
        "    spec = ModelSpec.model_validate_json(open(sys.argv[1]).read()); lay = Layout()\n"
        "    init_distributed(lay, device=torch.device('cpu')); m = build_model(spec, lay, device=torch.device('cpu')); load_model_only(sys.argv[2], m)\n"
        "    save_file({n: t.contiguous() for n, t in export_hf_tensors(m, spec, lay)}, sys.argv[3]); destroy()\n"
    )
    out = ckpt.parent / "export.safetensors"
    spec_file = ckpt.parent / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    subprocess.run([sys.executable, "-c", code, str(spec_file), str(ckpt), str(out)], check=True, env=env,
                   cwd=ROOT, timeout=120, capture_output=True)  # with the conversion, inside the per-test 600 s
    from safetensors.torch import load_file

    return load_file(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_quantized_source_converts_close_to_the_bf16_source(tiny_ckpt, tmp_path, kind):
    qdir = write_quantized_checkpoint(tiny_ckpt, tmp_path / kind, kind)
    run_dir = tmp_path / "run"
    # one job: conversion, then verification
    s = run_convert(ConvertSections.of(_two_nodes()), run_dir, qdir, timeout=200)
    assert s["source_format"] == kind and s["source"]["format"] == kind
    # exact against the dequantized source (the stage's own verification) ...
    assert s["verified"] and s["max_abs_diff"] == 0.0 and s["roundtrip_exact"]
    assert s["logits_hf_from"].startswith("round-trip") and s["logits_max_diff"] <= s["logits_tolerance"]
    # ... and within the quantization error of the original weights
    spec = load_recipe("tiny").model
    got = _load_converted(checkpoint_dir(run_dir), spec)
    src = HFCheckpoint(tiny_ckpt)
    assert sorted(got) == sorted(src.names())
    for name in src.names():
        a = src.get(name)
        assert (got[name].float() - a).abs().max() <= TOLERANCE[kind] * a.abs().max() + 1e-6, name


# ---------------------------------------------------------------- failures
def _with_truncated_shard(src: Path, dst: Path) -> tuple[Path, Path]:
    """A copy of `src` whose shard holding a last-pipeline-stage expert is cut to 1000 bytes."""
    import shutil

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / index["model.layers.3.mlp.experts.0.down_proj.weight"]  # read by the last pipeline stage
    shard.write_bytes(shard.read_bytes()[:1000])
    return dst, shard


@pytest.mark.slow
def test_corrupt_shard_fails_naming_the_file_and_rank(tiny_ckpt, tmp_path):
    bad, shard = _with_truncated_shard(tiny_ckpt, tmp_path / "bad")
    with pytest.raises(WeightJobPermanentError) as info:
        run_convert(ConvertSections.of(_two_nodes()), tmp_path / "run", bad, source_files={}, timeout=300)
    msg = str(info.value)
    assert shard.name in msg and "corrupt or truncated" in msg
    assert "rank 1 (node 1) failed: HFCheckpointError" in msg
    assert is_permanent(info.value)  # the Prefect task does not retry it
    assert completed(tmp_path / "run") is None and not checkpoint_dir(tmp_path / "run").exists()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Waits on states are bounded well inside pytest's per-test --timeout=600 (pyproject.toml), so that a hang
# reports what it was waiting for: reaching the save, then the re-run (SAVE_WAIT_S + 20 + RERUN_TIMEOUT_S).
SAVE_WAIT_S = 300
RERUN_TIMEOUT_S = 240


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else "(no log)"


@pytest.mark.slow
def test_interrupted_conversion_is_never_taken_as_complete(tiny_ckpt, tmp_path):
    run_dir = tmp_path / "run"
    code = (
        "import sys\nfrom pathlib import Path\nfrom kimi_pipeline.recipes import load_recipe\n"
        "from kimi_pipeline.weightjobs.conversion import ConvertSections, run_convert\n"
        "if __name__ == '__main__':\n"
        "    r = load_recipe('tiny')\n"
        "    r = r.model_copy(update={'convert': r.convert.model_copy(update=dict(nodes=2, pp=2, ep=1, verify=False))})\n"
        "    run_convert(ConvertSections.of(r), Path(sys.argv[1]), Path(sys.argv[2]))\n"
    )
    log_path = tmp_path / "launcher.log"
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir), str(tiny_ckpt)], cwd=ROOT,
                                stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True)
    out = run_dir / "convert"
    deadline = time.monotonic() + SAVE_WAIT_S
    tree: dict[int, psutil.Process] = {}  # only this launcher's own process tree is inspected and killed
    try:  # SIGKILL the launcher (its agents run in sessions of their own) while the ranks save their shards
        while not list(out.glob("torch_dist.tmp-*/iter_*")):
            if proc.poll() is not None:
                pytest.fail(f"the conversion exited ({proc.returncode}) before it could be interrupted:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"no rank began saving (torch_dist.tmp-*/iter_*) within {SAVE_WAIT_S} s:\n{_tail(log_path)}")
            tree.update((c.pid, c) for c in _descendants(proc.pid))
            time.sleep(0.05)
        tree.update((c.pid, c) for c in _descendants(proc.pid))  # agents, ranks, megatron's writers
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own session
        proc.wait()
    assert tree, "no process of the conversion was seen"
    _, alive = psutil.wait_procs(list(tree.values()), timeout=20)
    alive = [p for p in alive if _running(p)]
    assert not alive, f"outlived the killed launcher: {[(p.pid, p.cmdline()[-3:]) for p in alive]}"
    assert completed(run_dir) is None and not (checkpoint_dir(run_dir) / TRACKER).exists()
    # a stale torch_dist without tracker (an older crash) does not count either
    checkpoint_dir(run_dir).mkdir()
    (checkpoint_dir(run_dir) / "iter_0000000").mkdir()
    r = _two_nodes(verify=False)
    s = run_convert(ConvertSections.of(r), run_dir, tiny_ckpt, timeout=RERUN_TIMEOUT_S)
    assert "reused" not in s and s["verified"] is False and s["verify_skipped"]
    assert (checkpoint_dir(run_dir) / TRACKER).is_file() and not list(out.glob("torch_dist.tmp-*"))
    assert completed(run_dir)["path"] == str(checkpoint_dir(run_dir))


def test_bridge_mode_skips_the_stage(tmp_path):
    from kimi_pipeline import stages
    from kimi_pipeline.stages import CONVERT
    from support.stages import run_stage

    r = load_recipe("kimi-k2.5")
    assert r.convert.mode == "bridge"
    section = run_stage(CONVERT, stages.convert.run, r, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"]["convert"]["status"] == "skipped" and section["mode"] == "bridge"
    assert not (tmp_path / "convert").exists()


@pytest.mark.slow  # two torchrun launches (~10 s)
def test_launcher_relaunches_when_the_rendezvous_port_is_taken(tmp_path, monkeypatch):
    """Another process grabs the port between picking it and node 0 listening: relaunch on a new one."""
    import socket

    from kimi_pipeline.weightjobs import launch

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picked: list[int] = []
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: picked.append(taken if not picked else real()) or picked[-1])
    try:
        res = launch_local(NodeCommand("platform", (), 2, 1), work_dir=tmp_path, report_dir=tmp_path / "r",
                           name="probe", timeout=120, grace=5)
    finally:
        squatter.close()
    assert len(picked) == 2 and picked[0] == taken  # the first launch failed on the taken port
    assert res.ok and res.nodes == 2 and f"--master-port={picked[1]}" in res.commands[0]


def _job_processes(cluster) -> dict[int, tuple[psutil.Process, str]]:
    """(process, command line) of the NodeAgent actors, torchrun agents and ranks of *this* cluster: LocalCluster
    marks every process it starts (KIMI_RAY_CLUSTER_ID=<its uuid>, inherited by raylets, workers and what they
    spawn), so another run's cluster on the same host is never looked at."""
    out = {}
    for p in cluster.processes():
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if "NodeAgent" in cmd or RANK_ENTRY in cmd:
            out[p.pid] = (p, cmd)
    return out


class _Sampler:
    """Records this cluster's job processes while a conversion runs (they live for seconds only)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.seen: dict[int, tuple[psutil.Process, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            self.seen.update(_job_processes(self.cluster))

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def saw(self, what: str) -> int:
        return sum(what in cmd for _, cmd in self.seen.values())


def _assert_all_gone(cluster, seen: dict[int, tuple[psutil.Process, str]], wait_s: float = 30.0) -> None:
    """Every process in `seen`, and every job process of the cluster now, exits within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [(p.pid, cmd) for p, cmd in {**seen, **_job_processes(cluster)}.values() if _running(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"still running {wait_s:.0f} s after the job: {left}"


@pytest.mark.slow
def test_conversion_runs_one_agent_per_node_of_a_ray_cluster(tiny_ckpt, tmp_path):
    """Issue 15 item 2: with cluster.address the stage starts one torchrun agent per Ray node itself
    (STRICT_SPREAD over a simulated 4-node cluster), streams their logs, names the node and rank of a
    failure, and leaves no agent actor or placement group behind. Only this test's own cluster's
    processes are inspected (see `_job_processes`)."""
    import ray

    from kimi_pipeline.cluster.readiness import connected
    from kimi_pipeline.cluster.local import LocalCluster, NodeSpec

    specs = [NodeSpec(num_cpus=1, resources={f"node_{i}": 1.0}, object_store_bytes=80 * 2**20, log_monitor=i == 0,
                      autoscaler_monitor=False) for i in range(4)]
    cluster = LocalCluster.start(tmp_path / "ray", specs[0], specs[1:])
    try:
        recipe = load_recipe("tiny", [f"cluster.address={cluster.address}"])  # convert: 4 nodes x 1 rank, pp2 x ep2
        with _Sampler(cluster) as ok_run:
            s = run_convert(ConvertSections.of(recipe), tmp_path / "run", tiny_ckpt, source_files={}, verify=False,
                            timeout=180)
        assert s["launcher"] == "ray" and len(set(s["placement"])) == 4  # four distinct Ray nodes
        logs = tmp_path / "run" / "convert" / "work" / "logs"
        assert all((logs / f"convert.node{i}.log").stat().st_size > 0 for i in range(4))  # streamed back
        assert (checkpoint_dir(tmp_path / "run") / TRACKER).is_file()

        bad, shard = _with_truncated_shard(tiny_ckpt, tmp_path / "bad")
        with _Sampler(cluster) as failed_run, pytest.raises(WeightJobPermanentError) as info:
            run_convert(ConvertSections.of(recipe), tmp_path / "run2", bad, source_files={}, verify=False,
                        timeout=180)
        msg = str(info.value)
        assert re.search(r"rank [23] \(node [23]\) failed: HFCheckpointError", msg) and shard.name in msg
        with connected(cluster.address):
            assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
        # the filter does find the job's processes while they run: 4 agent actors, their torchrun agents and ranks
        assert ok_run.saw("NodeAgent") == 4 and ok_run.saw(RANK_ENTRY) >= 4, ok_run.seen
        assert failed_run.saw("NodeAgent") == 4, failed_run.seen
        _assert_all_gone(cluster, {**ok_run.seen, **failed_run.seen})  # agent actors, torchrun agents and ranks
    finally:
        cluster.stop()


@pytest.mark.slow
def test_the_printed_per_node_command_really_joins(tiny_ckpt, tmp_path):
    """convert.launcher=manual (clusters without Ray): the stage writes the per-node command (fixed port, the
    job and its output kept in place) and waits; running it on every "node" completes the stage."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recipe = _two_nodes(verify=False, launcher="manual", master_port=port)
    result: dict = {}

    def stage_thread() -> None:
        try:
            result["section"] = run_convert(ConvertSections.of(recipe), tmp_path / "run", tiny_ckpt, source_files={},
                                            timeout=300)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            result["error"] = e

    # bounded waits, together inside pytest's per-test --timeout=600: script 120 s, nodes 300 s, stage 120 s
    stage = threading.Thread(target=stage_thread, daemon=True)
    stage.start()
    script = tmp_path / "run" / "convert" / "work" / "convert.run-on-every-node.sh"
    deadline = time.monotonic() + 120
    while not script.is_file():
        assert stage.is_alive(), f"the stage ended without writing {script.name}: {result}"
        assert time.monotonic() < deadline, f"the stage wrote no {script.name} in 120 s"
        time.sleep(0.1)
    text = script.read_text()
    assert f"--master-port={port}" in text and "--node-rank=$NODE_RANK" in text and "--master-addr=$MASTER_ADDR" in text
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    nodes = [subprocess.Popen(["sh", str(script)], env={**env, "NODE_RANK": str(i)}, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for i in range(2)]
    try:
        assert [p.wait(timeout=300) for p in nodes] == [0, 0]
    finally:  # on a failure, what this test started and only that (each "node" in a session of its own)
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    stage.join(timeout=120)
    assert not stage.is_alive(), "both nodes finished, but the stage was still waiting 120 s later"
    assert "error" not in result, result["error"]
    section = result["section"]
    assert section["launcher"] == "manual" and (checkpoint_dir(tmp_path / "run") / TRACKER).is_file()
    assert completed(tmp_path / "run")["path"] == str(checkpoint_dir(tmp_path / "run"))
