"""Kimi-K2.5 as it ships, at tiny size: a multimodal checkpoint (`kimi_k25`, text_config + vision_config, the language
model under `language_model.`, a MoonViT tower and projector, processor files) in the recipe's two copies, the INT4
actor and the unquantized reference (`kimi_pipeline.data.tiny_k25`).

The module runs the pipeline on it: download -> validate -> convert (bridge: nothing to convert) -> train with the KL
term on, the reference loaded from its own copy -> the INT4 export, which must be the source checkpoint with its
language model trained: the same tensor names, the vision tensors and processor files byte for byte, K2.5's
quantization config. Also: the same checkpoint converted to torch_dist exactly as K2 is, engines that load it and
refuse a name without the prefix, and a reference that is not the actor's refused naming the first tensor that differs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.common import TINY, TRAIN_SET, tiny_overrides

from kimi_pipeline.data.tiny_k25 import build_tiny_k25
from kimi_pipeline.hf.reader import HFCheckpoint, HFCheckpointError, iter_stored_tensors
from kimi_pipeline.recipes.models import VisionSpec

pytestmark = pytest.mark.slow

VISION = VisionSpec(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, patch_size=14,
                    pos_emb_height=4, pos_emb_width=4, merge_kernel_size=(2, 2))
OTHER_PARTS = ("vision_tower.", "mm_projector.")


def _vision_set() -> list[str]:
    v = VISION.model_dump(mode="json")
    return [f"model.vision.{k}={json.dumps(x)}" for k, x in v.items()]


def k25_overrides(pair) -> list[str]:
    return [f"hub.model.path={pair.actor}", "hub.ref_model.kind=local", f"hub.ref_model.path={pair.reference}",
            "hub.source_format=int4", "hub.text_config_key=text_config", "convert.mode=bridge",
            "grpo.use_kl_loss=true", "grpo.kl_loss_coef=0.01", *_vision_set()]


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    root = tmp_path_factory.mktemp("k25")
    tiny = root / "tiny"
    shutil.copytree(TINY, tiny)
    return tiny, build_tiny_k25(tiny / "model", root / "k25", VISION, seed=3)


def _recipe(tiny: Path, pair, extra: list[str] = ()):
    from kimi_pipeline.recipes import load_recipe

    return load_recipe("tiny", tiny_overrides(tiny) + TRAIN_SET + k25_overrides(pair) + list(extra))


def _stored(path: Path) -> dict[str, tuple[str, bytes]]:
    """Every stored tensor of a checkpoint: (dtype, sha256 of its bytes)."""
    out = {}
    for name, t in iter_stored_tensors(path):
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[name] = (str(t.dtype), hashlib.sha256(data).hexdigest())
    return out


# ---------------------------------------------------------------- the checkpoint as K2.5 ships it
def test_the_tiny_k25_checkpoint_is_shaped_like_kimi_k25(k25):
    tiny, pair = k25
    for d in (pair.actor, pair.reference):
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
        assert cfg["text_config"]["model_type"] == "kimi_k2" and cfg["vision_config"]["vt_hidden_size"] == 32
        names = set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])
        assert "language_model.model.embed_tokens.weight" in names and "language_model.lm_head.weight" in names
        assert not any(n.startswith(("model.", "lm_head")) for n in names)
        assert {n for n in names if n.startswith(OTHER_PARTS)} == set(VISION.shapes(128))
        assert (d / "preprocessor_config.json").is_file() and (d / "chat_template.jinja").is_file()
    qc = json.loads((pair.actor / "config.json").read_text())["text_config"]["quantization_config"]
    assert "re:.*vision_tower.*" in qc["ignore"] and "re:.*mm_projector.*" in qc["ignore"]
    reader, base = HFCheckpoint(pair.actor), HFCheckpoint(tiny / "model")
    assert reader.prefix == "language_model." and reader.format.kind == "int4"
    assert reader.names() == base.names()  # the language model, under the table's names
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert reader.shape(name) == base.shape(name) == tuple(base.get(name).shape)
    assert torch.equal(HFCheckpoint(pair.reference).get(name), base.get(name))


def test_a_config_that_disagrees_with_its_index_is_refused(k25, tmp_path):
    """The prefix comes from the config's model_type and is checked against the index: a K2.5 config over K2-named
    weights (a text-only extraction with the wrong config) fails naming where the embeddings are."""
    tiny, pair = k25
    bad = tmp_path / "mixed"
    shutil.copytree(tiny / "model", bad)
    shutil.copy2(pair.actor / "config.json", bad / "config.json")
    with pytest.raises(HFCheckpointError, match=r"puts the language model under 'language_model\.'.*under ''"):
        HFCheckpoint(bad)


def test_download_checks_the_vision_tower_against_the_recipe(k25, tmp_path):
    from kimi_pipeline.hub.fetch import LocalSourceError
    from kimi_pipeline import stages
    from kimi_pipeline.stages import DOWNLOAD, prepare_run
    from support.stages import run_stage

    tiny, pair = k25
    for extra, problem in (
        (["model.vision.num_layers=3"], "vision_config.vt_num_hidden_layers: checkpoint has 2, recipe "
                                        "model.vision.num_layers=3"),
        (["model.vision=null"], "the checkpoint ships a vision tower, but the recipe has no model.vision"),
    ):
        recipe = _recipe(tiny, pair, extra)
        with pytest.raises(LocalSourceError, match=problem):
            run_stage(DOWNLOAD, stages.download.run, recipe,
                      prepare_run(recipe, tmp_path / extra[0].replace("=", "-")))


def test_engines_load_k25_and_refuse_language_weights_without_its_prefix(k25):
    from kimi_pipeline.engine.model import EngineModel, EngineWeightError

    tiny, pair = k25
    engine, base = EngineModel.from_pretrained(pair.reference), EngineModel.from_pretrained(tiny / "model")
    ids = torch.tensor([[1, 5, 9, 17, 33, 60]])
    assert torch.equal(engine.prefill(ids, all_logits=True)[0], base.prefill(ids, all_logits=True)[0])
    w = base.embed.clone() * 0.5
    engine.load_weights([("language_model.model.embed_tokens.weight", w),
                         ("vision_tower.encoder.final_layernorm.weight", torch.zeros(32))])  # the tower: not served
    assert torch.equal(engine.embed, w)
    with pytest.raises(EngineWeightError, match="under 'language_model.'; send 'language_model.model.norm.weight'"):
        engine.load_weights([("model.norm.weight", torch.ones(128))])


def test_k25_converts_to_torch_dist_exactly_as_k2(k25, tmp_path):
    from kimi_pipeline import stages
    from kimi_pipeline.stages import CONVERT, DOWNLOAD, prepare_run
    from support.stages import run_stage

    tiny, pair = k25
    recipe = _recipe(tiny, pair, ["convert.mode=torch_dist", "hub.source_format=bf16",
                                  f"hub.model.path={pair.reference}", "grpo.use_kl_loss=false",
                                  "grpo.kl_loss_coef=0"])
    run = prepare_run(recipe, tmp_path / "run")
    run_stage(DOWNLOAD, stages.download.run, recipe, run)
    s = run_stage(CONVERT, stages.convert.run, recipe, run)
    assert s["verified"] is True and s["max_abs_diff"] == 0.0
    assert s["roundtrip_exact"] is True and s["roundtrip_tensors"] == len(HFCheckpoint(tiny / "model").names())


def test_a_reference_that_is_not_the_actors_is_refused_naming_the_first_tensor(k25, tmp_path):
    from safetensors.torch import save_file

    from kimi_pipeline import stages
    from kimi_pipeline.stages import DOWNLOAD, prepare_run
    from support.stages import run_stage
    from kimi_pipeline.stages.train import ReferenceMismatchError, reference_weights

    tiny, pair = k25
    ref = tmp_path / "ref"
    shutil.copytree(pair.reference, ref)
    (ref / "MANIFEST.sha256").unlink()
    index = json.loads((ref / "model.safetensors.index.json").read_text())
    victim = "language_model.model.layers.2.mlp.experts.5.up_proj.weight"
    shard = ref / index["weight_map"][victim]
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[victim] = tensors[victim][:, :96].contiguous()  # another model's expert width
    save_file(tensors, str(shard))
    recipe = _recipe(tiny, pair, [f"hub.ref_model.path={ref}"])
    run = prepare_run(recipe, tmp_path / "run")
    run_stage(DOWNLOAD, stages.download.run, recipe, run)
    with pytest.raises(ReferenceMismatchError, match=rf"{victim}: shape \[64, 96\] in the reference, \[64, 128\]"):
        reference_weights(recipe, run)


# ---------------------------------------------------------------- the pipeline on it
@pytest.fixture(scope="module")
def ray_local():
    import ray

    from kimi_pipeline.cluster.lifecycle import export_driver_env

    export_driver_env("token")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pipeline(k25, ray_local, tmp_path_factory):
    """download -> validate -> convert (bridge) -> train 2 steps (KL on) -> export, as the flow runs them."""
    from kimi_pipeline import stages
    from kimi_pipeline.stages import CONVERT, DOWNLOAD, EXPORT, TRAIN, VALIDATE, prepare_run
    from support.stages import run_stage

    tiny, pair = k25
    recipe = _recipe(tiny, pair, ["rollout.num_rollout=2"])
    run = prepare_run(recipe, tmp_path_factory.mktemp("k25run") / "run")
    download = run_stage(DOWNLOAD, stages.download.run, recipe, run)
    run_stage(VALIDATE, stages.validate.run, recipe, run)
    convert = run_stage(CONVERT, stages.convert.run, recipe, run)
    train = run_stage(TRAIN, stages.train.run, recipe, run)
    export = run_stage(EXPORT, stages.export.run, recipe, run, checkpoint_dir=Path(train["checkpoint_dir"]),
                       timeout_s=600)
    return pair, run, {"download": download, "convert": convert, "train": train, "export": export}


def test_download_records_the_prefix_and_the_vision_tower(pipeline):
    pair, run, s = pipeline
    model = s["download"]["model"]
    assert model["language_model_prefix"] == "language_model." and model["format"] == "int4"
    assert model["vision_params"] == VISION.num_params(128) > 0
    assert s["download"]["ref_model"]["path"] == str(pair.reference)
    assert s["convert"].get("skipped") or s["convert"].get("mode") == "bridge", s["convert"]


def test_training_takes_the_reference_from_its_own_copy(pipeline):
    from kimi_pipeline.report.metrics_log import read_jsonl

    pair, run, s = pipeline
    rows = read_jsonl(run / "train" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # at step 1 the policy is the actor as loaded: a reference loaded from the actor would give KL exactly 0; the
    # unquantized copy differs from the INT4 actor by its quantization error
    assert rows[0]["kl"] > 0 and all(r["kl"] > 0 for r in rows)
    # the engine serves the weights the trainer sent under K2.5's names (a name it would not load is an error, never
    # skipped), in the actor checkpoint's dtype: bf16 sampling against the fp32 trainer, so TIS is 1 within bf16
    for r in rows:
        assert abs(r["tis_mean"] - 1) < 0.01 and abs(r["tis_min"] - 1) < 0.1 and abs(r["tis_max"] - 1) < 0.1, r


def test_the_export_is_the_source_checkpoint_with_its_language_model_trained(pipeline):
    pair, run, s = pipeline
    e = s["export"]
    out = Path(e["path"])
    assert e["dequant_exact"] and e["others_exact"] and e["experts_equal"], e
    assert e["logits_max_diff"] <= e["logits_tolerance"]
    got, src = _stored(out), _stored(pair.actor)
    assert got.keys() == src.keys()  # the same tensor names as the source: vision, projector, packed experts
    other = [n for n in src if n.startswith(OTHER_PARTS)]
    assert len(other) == len(VISION.shapes(128)) == e["carried_tensors"]
    assert all(got[n] == src[n] for n in other)  # byte-identical (same dtype and bytes)
    trained = [n for n in src if n.startswith("language_model.") and got[n] != src[n]]
    assert len(trained) > 100, "the language model is the trained one"
    cfg, base = json.loads((out / "config.json").read_text()), json.loads((pair.actor / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["vision_config"] == base["vision_config"]
    assert cfg["text_config"]["quantization_config"]["ignore"] == base["text_config"]["quantization_config"]["ignore"]
    assert "quantization_config" not in cfg  # one copy, where K2.5 keeps it
    for f in ("preprocessor_config.json", "processor_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (pair.actor / f).read_bytes(), f
        assert f in e["carried_files"]


def test_the_exports_ignore_list_covers_what_is_stored_unquantized_and_never_contradicts_the_files():
    """A base whose ignore list misses its vision parts or names `lm_head` bare (in front of K2.5's prefix) gets the
    missing modules added; a Linear stored packed that the list ignores is refused (an engine would misread it)."""
    from kimi_pipeline.hf.int4_checkpoint import ExportError, check_config_agrees, ignore_covering, is_quantized
    from kimi_pipeline.hf.names import HFLayout

    layout = HFLayout("language_model.")
    stored = ["language_model.lm_head.weight", "language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed",
              "language_model.model.layers.1.mlp.experts.0.up_proj.weight_scale",
              "language_model.model.layers.1.self_attn.o_proj.weight", "language_model.model.norm.weight",
              "vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.encoder.blocks.0.norm0.weight",
              "mm_projector.proj.0.weight"]
    bare = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
    covered = ignore_covering(bare, stored, layout)
    assert covered == bare + ["re:^mm_projector\\..*", "re:^vision_tower\\..*", "language_model.lm_head"]
    check_config_agrees(stored, covered)
    assert not is_quantized("vision_tower.encoder.blocks.0.wqkv.weight", covered)
    with pytest.raises(ExportError, match=r"experts\.0\.up_proj\.weight_packed: stored packed, but .* says not"):
        check_config_agrees(stored, covered + ["re:.*experts.*"])
