"""Stage `download` against a real (local) HTTP server speaking the Hugging Face Hub API.

huggingface_hub itself does the HTTP: repo_info with files metadata, snapshot_download, hf_hub_download. The
fake hub (tests/support/hub_server.py) records every request, so the tests check what reached the "hub" (token, re-fetches,
allow-patterns) as well as what landed on disk (manifest, commit, no token anywhere).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from kimi_pipeline.hub.fetch import DownloadError
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.stages.download import run as download  # the stage's body: the recipe's sections
from support.common import TINY
from support.hub_server import FakeHub, Repo, RepoFile

TOKEN = "hf_secret_token_123"
MODEL_REPO = "moonshotai/tiny-kimi"
DATA_REPO = "zhuzilin/tiny-dapo"
WEIGHTS = "model-00001-of-00001.safetensors"
MODEL_TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def weights_bytes(tmp_path_factory) -> bytes:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / WEIGHTS
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(16, 8, generator=g, dtype=torch.float32).to(torch.bfloat16),
            "model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
            "lm_head.weight": torch.randn(16, 8, generator=g),
        },
        str(path),
    )
    return path.read_bytes()


@pytest.fixture
def hub(monkeypatch, weights_bytes, tmp_path):
    """The fake hub, started, with huggingface_hub pointed at it (and never at Xet or the user's cache/token)."""
    from huggingface_hub import constants

    fake = FakeHub()
    model_files = {n: RepoFile((TINY / "model" / n).read_bytes()) for n in MODEL_TEXT_FILES}
    model_files[WEIGHTS] = RepoFile(weights_bytes, lfs=True)
    model_files["README.md"] = RepoFile(b"# tiny kimi\n")  # not in the default allow-patterns
    model_files["extra.bin"] = RepoFile(b"\0" * 4096, lfs=True)  # LFS, but not in the allow-patterns either
    fake.add_repo(Repo(MODEL_REPO, "model", model_files))
    fake.add_repo(
        Repo(
            DATA_REPO,
            "dataset",
            {
                "dapo-math-tiny.jsonl": RepoFile((TINY / "dapo-math-tiny.jsonl").read_bytes(), lfs=True),
                "aime-tiny.jsonl": RepoFile((TINY / "aime-tiny.jsonl").read_bytes()),
                "README.md": RepoFile(b"# tiny dapo\n"),
            },
        )
    )
    fake.start()
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    # huggingface_hub reads these at import time
    monkeypatch.setattr(constants, "ENDPOINT", fake.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)  # never send a token found on this machine
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    # huggingface_hub fetches its AI-agent-harness registry from the endpoint (no token) once a day, at the first
    # request of a process whose cache is stale; a fresh cached copy keeps the fake hub's log to our own requests
    registry = tmp_path / "hf-home" / ".agent_harnesses.json"
    registry.parent.mkdir(parents=True, exist_ok=True)
    registry.write_text(json.dumps({"standardEnvVars": [], "harnesses": {}}))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(registry))
    yield fake
    fake.stop()


def hub_recipe(base: Path, *extra: str):
    return load_recipe(
        "tiny",
        [
            f"paths.base_dir={base}",
            "hub.model.kind=hub",
            f"hub.model.repo_id={MODEL_REPO}",
            "hub.model.path=null",
            "data.train.kind=hub",
            f"data.train.repo_id={DATA_REPO}",
            "data.train.repo_type=dataset",
            "data.train.filename=dapo-math-tiny.jsonl",
            "data.train.path=null",
            "data.eval.kind=hub",
            f"data.eval.repo_id={DATA_REPO}",
            "data.eval.repo_type=dataset",
            "data.eval.filename=aime-tiny.jsonl",
            "data.eval.path=null",
            *extra,
        ],
    )


def model_dir(base: Path) -> Path:
    return base / "hub" / "models" / MODEL_REPO.replace("/", "--") / "main"


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def read_manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "download" / "manifest.json").read_text())


def test_fresh_download_verifies_against_hub_and_never_leaks_the_token(tmp_path, hub, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    base, run_dir = tmp_path / "base", tmp_path / "run"
    section = download(hub_recipe(base), run_dir, token=TOKEN)

    manifest = read_manifest(run_dir)
    model_repo, data_repo = hub.repos[("model", MODEL_REPO)], hub.repos[("dataset", DATA_REPO)]
    want_model = {n: model_repo.files[n].sha256 for n in (*MODEL_TEXT_FILES, WEIGHTS)}
    assert {k: v["sha256"] for k, v in manifest["model"]["files"].items()} == want_model
    assert {k: v["size"] for k, v in manifest["model"]["files"].items()} == {
        n: len(model_repo.files[n].data) for n in want_model
    }
    assert manifest["model"]["commit"] == model_repo.commit
    assert manifest["train"]["commit"] == manifest["eval"]["commit"] == data_repo.commit
    dapo = data_repo.files["dapo-math-tiny.jsonl"]
    assert manifest["train"]["files"] == {"dapo-math-tiny.jsonl": {"size": len(dapo.data), "sha256": dapo.sha256}}
    assert manifest["eval"]["files"]["aime-tiny.jsonl"]["sha256"] == data_repo.files["aime-tiny.jsonl"].sha256
    for name in want_model:  # the bytes on disk are the hub's
        assert hashlib.sha256((model_dir(base) / name).read_bytes()).hexdigest() == want_model[name]
    assert section["model"]["safetensors_files"] == 1 and section["refetched"] == []
    assert Path(section["train"]["path"]).read_bytes() == (TINY / "dapo-math-tiny.jsonl").read_bytes()

    # the token reached the hub on every request (metadata, listing, HEAD, GET) ...
    assert hub.requests, "nothing reached the fake hub"
    assert {r.authorization for r in hub.requests} == {f"Bearer {TOKEN}"}
    assert any(r.path == f"/api/models/{MODEL_REPO}/revision/main" and "blobs" in r.query for r in hub.requests)
    assert hub.gets(WEIGHTS) and hub.gets("dapo-math-tiny.jsonl") and hub.gets("aime-tiny.jsonl")

    # ... and nowhere else: not in any file written, not in the logs, not on stdout/stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in written)
    leaked = [p for p in written if TOKEN.encode() in p.read_bytes()]
    assert leaked == []
    assert caplog.records, "expected some log records at DEBUG level"
    assert TOKEN not in caplog.text
    out, err = capfd.readouterr()
    assert TOKEN not in out and TOKEN not in err


def test_corrupt_file_on_reuse_is_refetched(tmp_path, hub):
    base, run_dir = tmp_path / "base", tmp_path / "run"
    recipe = hub_recipe(base)
    download(recipe, run_dir, token=TOKEN)
    assert len(hub.gets(WEIGHTS)) == 1
    weights = model_dir(base) / WEIGHTS
    flip_byte(weights)  # in the tensor data: the header still parses, only the sha256 catches it

    section = download(recipe, run_dir, token=TOKEN)
    assert section["refetched"] == [f"model/{WEIGHTS}"]
    assert len(hub.gets(WEIGHTS)) == 2, [r.path for r in hub.requests]
    assert len(hub.gets("config.json")) == 1  # intact files are not downloaded again
    good = hub.repos[("model", MODEL_REPO)].files[WEIGHTS]
    assert weights.read_bytes() == good.data
    assert read_manifest(run_dir)["model"]["refetched"] == [WEIGHTS]
    assert read_manifest(run_dir)["model"]["files"][WEIGHTS]["sha256"] == good.sha256


def test_hub_serving_a_corrupt_copy_fails_naming_the_file(tmp_path, hub):
    hub.corrupt.add(WEIGHTS)
    base = tmp_path / "base"
    with pytest.raises(DownloadError) as e:
        download(hub_recipe(base), tmp_path / "run", token=TOKEN)
    msg = str(e.value)
    assert str(model_dir(base) / WEIGHTS) in msg
    assert "sha256" in msg and "after re-fetching" in msg
    assert len(hub.gets(WEIGHTS)) == 2  # the first download and the one re-fetch, then it gives up
    assert not (tmp_path / "run" / "download" / "manifest.json").exists()


def test_allow_patterns_are_respected(tmp_path, hub):
    base = tmp_path / "base"
    download(hub_recipe(base), tmp_path / "run", token=TOKEN)
    rels = [p.relative_to(model_dir(base)) for p in model_dir(base).rglob("*") if p.is_file()]
    got = {str(r) for r in rels if not any(part.startswith(".") for part in r.parts)}  # .cache/ is huggingface_hub's
    assert got == {*MODEL_TEXT_FILES, WEIGHTS}
    assert hub.gets("README.md") == [] and hub.gets("extra.bin") == []
    assert not any("README.md" in r.path or "extra.bin" in r.path for r in hub.requests if "/resolve/" in r.path)
    data_dir = base / "hub" / "datasets" / DATA_REPO.replace("/", "--") / "main"
    assert not (data_dir / "README.md").exists()
    manifest = read_manifest(tmp_path / "run")
    assert set(manifest["train"]["files"]) == {"dapo-math-tiny.jsonl"}
    assert set(manifest["eval"]["files"]) == {"aime-tiny.jsonl"}

    # explicit allow_patterns narrow it further (and the hub's metadata is filtered the same way)
    base2 = tmp_path / "base2"
    section = download(
        hub_recipe(base2, 'hub.model.allow_patterns=["*.json", "*.safetensors"]'), tmp_path / "run2", token=TOKEN
    )
    want = {"config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS}
    assert set(read_manifest(tmp_path / "run2")["model"]["files"]) == want
    assert not (model_dir(base2) / "chat_template.jinja").exists()
    assert section["model"]["safetensors_files"] == 1


def test_offline_reuse_uses_the_stored_manifest(tmp_path, hub):
    base = tmp_path / "base"
    download(hub_recipe(base), tmp_path / "run", token=TOKEN)
    hub.stop()
    n_requests = len(hub.requests)

    offline = hub_recipe(base, "hub.offline=true")
    section = download(offline, tmp_path / "run-offline")
    assert section["refetched"] == []
    manifest = read_manifest(tmp_path / "run-offline")
    assert manifest["model"]["commit"] == hub.repos[("model", MODEL_REPO)].commit
    assert manifest["model"]["files"][WEIGHTS]["sha256"] == hub.repos[("model", MODEL_REPO)].files[WEIGHTS].sha256
    assert len(hub.requests) == n_requests

    flip_byte(model_dir(base) / WEIGHTS)
    with pytest.raises(DownloadError) as e:
        download(offline, tmp_path / "run-offline2")
    assert str(model_dir(base) / WEIGHTS) in str(e.value)
    assert "sha256" in str(e.value) and "online" in str(e.value)


def test_offline_without_a_previous_download_says_so(tmp_path, hub):
    with pytest.raises(DownloadError, match="never downloaded"):
        download(hub_recipe(tmp_path / "base", "hub.offline=true"), tmp_path / "run")
    assert hub.requests == []


def test_unknown_repo_is_a_clear_error(tmp_path, hub):
    with pytest.raises(DownloadError) as e:
        recipe = hub_recipe(tmp_path / "base", "hub.model.repo_id=moonshotai/no-such-model")
        download(recipe, tmp_path / "run", token=TOKEN)
    msg = str(e.value)
    assert "moonshotai/no-such-model" in msg and "HF_TOKEN" in msg and "not found" in msg
    assert TOKEN not in msg
    assert [r.path for r in hub.requests] == ["/api/models/moonshotai/no-such-model/revision/main"]


def test_hub_unreachable_points_at_offline_mode(tmp_path, hub):
    hub.stop()
    with pytest.raises(DownloadError) as e:
        download(hub_recipe(tmp_path / "base"), tmp_path / "run", token=TOKEN)
    assert "hub.offline=true" in str(e.value) and "HF_ENDPOINT" in str(e.value)
