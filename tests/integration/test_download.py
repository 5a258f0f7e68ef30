"""Stage `download`: manifests, corruption detection by path, shape checks against the recipe."""

from __future__ import annotations

import json
import struct

import pytest

from kimi_pipeline.hub.fetch import DownloadError, LocalSourceError
from kimi_pipeline.hub.manifest import build_manifest, list_files, safetensors_issue, verify_files
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.stages import DOWNLOAD
from kimi_pipeline.stages.download import run as download  # the stage's body: the recipe's sections
from support.common import tiny_overrides
from support.stages import run_stage


def flip_byte(path, offset=10):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_tiny_download_records_manifest(tmp_path, tiny_copy):
    r = load_recipe("tiny", tiny_overrides(tiny_copy))
    section = run_stage(DOWNLOAD, download, r, tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "download" / "manifest.json").read_text())
    assert set(manifest) == {"model", "train", "eval"}
    assert section["model"]["model_type"] == "kimi_k2" and section["model"]["treated_as"] == "deepseek_v3"
    for meta in manifest["model"]["files"].values():
        assert len(meta["sha256"]) == 64 and meta["size"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stages"]["download"]["status"] == "completed"
    assert summary["download"]["train"]["bytes"] > 0


def test_flipped_byte_in_shipped_file_is_reported_by_path(tmp_path, tiny_copy):
    flip_byte(tiny_copy / "dapo-math-tiny.jsonl")
    r = load_recipe("tiny", tiny_overrides(tiny_copy))
    with pytest.raises(LocalSourceError) as e:
        download(r, tmp_path / "run")
    assert str(tiny_copy / "dapo-math-tiny.jsonl") in str(e.value) and "sha256" in str(e.value)


def test_flipped_byte_detected_on_reuse_without_shipped_manifest(tmp_path, tiny_copy):
    (tiny_copy / "model" / "MANIFEST.sha256").unlink()
    r = load_recipe("tiny", tiny_overrides(tiny_copy))
    download(r, tmp_path / "run")  # records the manifest
    flip_byte(tiny_copy / "model" / "tokenizer.json", 100)
    with pytest.raises(LocalSourceError, match="tokenizer.json: sha256"):
        download(r, tmp_path / "run")


def test_truncated_file_and_summary_marks_failure(tmp_path, tiny_copy):
    p = tiny_copy / "model" / "tokenizer.json"
    p.write_bytes(p.read_bytes()[:-50])
    r = load_recipe("tiny", tiny_overrides(tiny_copy))
    with pytest.raises(LocalSourceError, match="tokenizer.json"):
        run_stage(DOWNLOAD, download, r, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stages"]["download"]["status"] == "failed"
    assert "tokenizer.json" in summary["stages"]["download"]["error"]


def test_missing_source_and_shape_mismatch(tmp_path, tiny_copy):
    r = load_recipe("tiny", [*tiny_overrides(tiny_copy), f"hub.model.path={tmp_path / 'nope'}"])
    with pytest.raises(LocalSourceError, match="does not exist"):
        download(r, tmp_path / "run")
    r = load_recipe("tiny", [*tiny_overrides(tiny_copy), "model.hidden_size=256"])
    with pytest.raises(LocalSourceError, match=r"hidden_size: checkpoint has 128, recipe model.hidden_size=256"):
        download(r, tmp_path / "run2")
    r = load_recipe("tiny", [*tiny_overrides(tiny_copy), "hub.source_format=fp8"])
    with pytest.raises(LocalSourceError, match="hub.source_format=bf16"):
        download(r, tmp_path / "run3")


def _write_safetensors(path, n=64):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.arange(n, dtype=torch.float32)}, str(path))


def test_safetensors_structure_check(tmp_path):
    p = tmp_path / "model-00001-of-00001.safetensors"
    _write_safetensors(p)
    assert safetensors_issue(p) is None
    files = build_manifest(tmp_path, list_files(tmp_path))
    p.write_bytes(p.read_bytes()[:-8])
    assert "truncated" in safetensors_issue(p)
    issues = verify_files(tmp_path, files)
    assert len(issues) == 1 and issues[0].path == p
    p.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert "header length" in safetensors_issue(p)


def test_offline_hub_source_without_download_is_clear(tmp_path):
    r = load_recipe("kimi-k2-thinking", [f"paths.base_dir={tmp_path}", "hub.offline=true"])
    pinned = r.hub.model.revision  # the preset pins a commit (trust_remote_code)
    with pytest.raises(DownloadError, match=f"offline and hf://moonshotai/Kimi-K2-Thinking@{pinned} was never downloaded"):
        download(r, tmp_path / "run")


def test_cli_stage_errors_are_messages_not_tracebacks(tmp_path):
    from typer.testing import CliRunner

    from kimi_pipeline.cli import app

    res = CliRunner().invoke(app, ["download", "--run-dir", str(tmp_path / "r"), "--set", f"hub.model.path={tmp_path / 'x'}"])
    assert res.exit_code == 1 and "does not exist" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["validate", "--run-dir", str(tmp_path / "r2")])
    assert res.exit_code == 1 and "run the download stage first" in res.output


def test_model_without_safetensors_is_refused(tmp_path, tiny_copy):
    """Only pickle-based weights (pytorch_model.bin) → refused by name; nothing ever unpickles them."""
    from kimi_pipeline.data.tiny_assets import write_manifests

    model = tiny_copy / "model"
    for f in model.glob("model*.safetensors*"):
        f.unlink()
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    write_manifests(tiny_copy)
    r = load_recipe("tiny", tiny_overrides(tiny_copy))
    with pytest.raises(LocalSourceError, match=r"no \.safetensors weights \(only pickle-based pytorch_model\.bin"):
        download(r, tmp_path / "run")
