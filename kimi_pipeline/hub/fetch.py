"""Stage `download`: models and datasets from the HF hub or local directories, verified by manifest.

Hub sources are pinned to a revision, filtered by allow-patterns, resumed by huggingface_hub, and
checked against the hub's own LFS sha256s; a corrupt or truncated file is deleted and fetched again.
Local sources are never modified: a file that does not match its manifest (a shipped
`MANIFEST.sha256`, or the manifest recorded by an earlier attempt of this run) is reported by path.
The HF token comes from the caller (env or a Prefect Secret) and is never logged or written.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.config import (
    KIMI_MODEL_TYPES,
    quantization_config,
    shape_mismatches,
    text_config,
    vision_mismatches,
)
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.hub.manifest import (
    MANIFEST_NAMES,
    FileIssue,
    build_manifest,
    list_files,
    read_sha256sums,
    verify_files,
)
from kimi_pipeline.recipes.models import DataSpec, HubSpec, ModelSpec, Source
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.util.paths import resolve_path
from kimi_pipeline.util.redact import register_secret

log = logging.getLogger(__name__)

DEFAULT_MODEL_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py"]
HUB_MANIFEST = ".kimi-manifest.json"


class DownloadError(RuntimeError):
    """A source could not be fetched or verified; the message names the file and what to do."""


class LocalSourceError(DownloadError, PermanentError):
    """A local source is missing or corrupt: re-running cannot fix it."""


@dataclass
class Fetched:
    name: str
    root: Path  # directory holding the files
    files: dict[str, dict[str, Any]]  # relative path -> {size, sha256}
    source: str
    commit: str | None = None
    refetched: list[str] | None = None

    @property
    def bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "root": str(self.root),
            "commit": self.commit,
            "files": self.files,
            "bytes": self.bytes,
            "refetched": self.refetched or [],
        }


def resolve_token(explicit: str | None = None) -> str | None:
    """Explicit token (e.g. from a Prefect Secret, or the recipe's `hub.token`) > HF_TOKEN > HUGGING_FACE_HUB_TOKEN.
    Registered for redaction: an explicit one is in no env var that redaction reads."""
    token = explicit or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
    register_secret(token, "HF_TOKEN")
    return token


def _issues_text(issues: list[FileIssue]) -> str:
    return "\n".join(f"  - {i}" for i in issues)


# ---------------------------------------------------------------- local sources
def fetch_local(name: str, source: Source, base_dir: str, previous: dict | None, verify: str) -> Fetched:
    """`base_dir` (`paths.base_dir`): what a relative source path is relative to."""
    target = resolve_path(source.path or "", base_dir)
    if source.filename and target.is_dir():
        target = target / source.filename
    if not target.exists():
        raise LocalSourceError(
            f"{name}: local source {target} does not exist (recipe {source.describe()}). "
            "Fix the path in the recipe or stage the files there first."
        )
    root, rels = (target.parent, [Path(target.name)]) if target.is_file() else (target, None)
    if rels is None:
        rels = list_files(root, source.allow_patterns)
        if not rels:
            raise LocalSourceError(f"{name}: local directory {root} has no files matching {source.allow_patterns or '*'}")
    expected: dict[str, dict[str, Any]] | None = None
    origin = ""
    for mname in MANIFEST_NAMES:
        if (root / mname).is_file():
            sums = read_sha256sums(root / mname)
            expected = {r: {"size": None, "sha256": h} for r, h in sums.items() if Path(r) in set(rels)}
            origin = str(root / mname)
            break
    if expected is None and previous and previous.get("root") == str(root):
        expected = {k: v for k, v in previous["files"].items() if Path(k) in set(rels)}
        origin = "the manifest recorded by an earlier attempt of this run"
    if expected:
        issues = verify_files(root, expected, verify)
        if issues:
            raise LocalSourceError(
                f"{name}: {len(issues)} local file(s) do not match {origin}:\n{_issues_text(issues)}\n"
                "Local sources are never re-fetched: restore the file(s) (re-copy, `git checkout -- <file>`), "
                "or, if the change is intended, regenerate the manifest."
            )
    files = build_manifest(root, rels, verify)
    return Fetched(name, root, files, source.describe())


# ---------------------------------------------------------------- hub sources
def _network_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub 2.x talks httpx2 (1.x httpx): connection failures there are not OSErrors."""

    out: tuple[type[Exception], ...] = ()
    for mod in ("httpx2", "httpx"):
        try:
            out += (importlib.import_module(mod).TransportError,)
        except (ImportError, AttributeError):
            pass
    return out


def _hub_expected(api, source: Source, token: str | None, patterns: list[str] | None) -> tuple[dict, str | None]:
    """Expected size/sha256 per file from the hub's metadata (LFS files carry their sha256)."""

    info = api.repo_info(source.repo_id, revision=source.revision, repo_type=source.repo_type, files_metadata=True, token=token)
    out = {}
    for s in info.siblings or []:
        if patterns and not any(fnmatch.fnmatch(s.rfilename, p) for p in patterns):
            continue
        lfs = getattr(s, "lfs", None)
        sha = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
        out[s.rfilename] = {"size": s.size, "sha256": sha}
    return out, info.sha


def fetch_hub(name: str, source: Source, base_dir: str, token: str | None, offline: bool, verify: str) -> Fetched:
    if not source.repo_id:
        raise DownloadError(f"{name}: hub source needs repo_id")
    base = resolve_path(base_dir, base_dir)
    kind_dir = "datasets" if source.repo_type == "dataset" else "models"
    local_dir = base / "hub" / kind_dir / source.repo_id.replace("/", "--") / source.revision
    patterns = [source.filename] if source.filename else (source.allow_patterns or DEFAULT_MODEL_PATTERNS)
    stored_path = local_dir / HUB_MANIFEST
    stored = json.loads(stored_path.read_text()) if stored_path.is_file() else None
    commit = stored.get("commit") if stored else None
    refetched: list[str] = []
    try:
        if offline:
            if not stored:
                raise DownloadError(
                    f"{name}: offline and {source.describe()} was never downloaded to {local_dir}; "
                    "run once online (or copy the files there) first"
                )
            expected = stored["files"]
        else:
            api = HfApi()
            expected, commit = _hub_expected(api, source, token, patterns)
            if not expected:
                raise DownloadError(f"{name}: {source.describe()} has no files matching {patterns}")
            snapshot_download(
                repo_id=source.repo_id,
                revision=commit or source.revision,
                repo_type=source.repo_type,
                allow_patterns=patterns,
                local_dir=local_dir,
                token=token,
            )
        issues = verify_files(local_dir, expected, verify)
        if issues and not offline:
            for issue in issues:
                rel = str(issue.path.relative_to(local_dir))
                log.warning("%s: re-fetching %s (%s)", name, rel, issue.problem)
                issue.path.unlink(missing_ok=True)
                hf_hub_download(
                    repo_id=source.repo_id,
                    filename=rel,
                    revision=commit or source.revision,
                    repo_type=source.repo_type,
                    local_dir=local_dir,
                    token=token,
                    force_download=True,
                )
                refetched.append(rel)
            issues = verify_files(local_dir, expected, verify)
        if issues:
            raise DownloadError(
                f"{name}: {len(issues)} file(s) from {source.describe()} failed verification"
                f"{' after re-fetching' if refetched else ''}:\n{_issues_text(issues)}\n"
                + ("Go online to re-fetch them, or delete them and retry." if offline else "The hub copy may be changing; pin a commit in the recipe's revision.")
            )
    except RepositoryNotFoundError:
        raise DownloadError(
            f"{name}: {source.describe()} not found or not accessible; check repo_id/revision, and set HF_TOKEN "
            "(or the Prefect Secret 'hf-token') for gated repos"
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, *_network_errors()) as e:
        if isinstance(e, DownloadError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DownloadError(
            f"{name}: could not fetch {source.describe()} ({type(e).__name__}: {first}). "
            "Check the network / HF_ENDPOINT, or set hub.offline=true to use files already downloaded."
        ) from None
    files = build_manifest(local_dir, [Path(k) for k in expected], verify)
    for rel, meta in files.items():  # keep the hub's hash where it has one (identical when verified)
        meta["sha256"] = expected[rel].get("sha256") or meta["sha256"]
    atomic_write_json(stored_path, {"source": source.describe(), "commit": commit, "files": files})
    return Fetched(name, local_dir, files, source.describe(), commit=commit, refetched=refetched)


# ---------------------------------------------------------------- model checks
def weight_format(qc: dict[str, Any] | None) -> str:
    """bf16 / fp8 / int4 from a checkpoint's `quantization_config` (`hf_config.quantization_config`)."""
    qc = qc or {}
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        return "int4"
    return "bf16"


def inspect_model(fetched: Fetched, spec: ModelSpec, hub: HubSpec) -> dict[str, Any]:
    cfg_path = fetched.root / "config.json"
    if not cfg_path.is_file():
        raise LocalSourceError(f"model: {fetched.root} has no config.json; is {fetched.source} a model checkpoint?")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise LocalSourceError(f"model: {cfg_path} is not valid JSON ({e})") from None
    tcfg = text_config(config, hub.text_config_key)
    problems = shape_mismatches(spec, tcfg) + vision_mismatches(spec, config)
    if problems:
        raise LocalSourceError(
            f"model: {cfg_path} does not match the recipe's model shape (wrong repo or revision?):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    fmt = weight_format(quantization_config(config, hub.text_config_key))
    if fmt != hub.source_format:
        raise LocalSourceError(
            f"model: {cfg_path} holds {fmt} weights but the recipe says hub.source_format={hub.source_format}; "
            f"set hub.source_format={fmt} (the converter dequantizes fp8/int4 on the fly)"
        )
    model_type = tcfg.get("model_type", config.get("model_type"))
    n_weights = sum(1 for f in fetched.files if f.endswith(".safetensors"))
    if n_weights == 0:
        pickled = sorted(f for f in fetched.files if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
        raise LocalSourceError(
            f"model: {fetched.source} has no .safetensors weights"
            + (f" (only pickle-based {', '.join(pickled[:3])}, which this pipeline never loads)" if pickled else "")
            + "; use a safetensors checkpoint (or widen hub.model.allow_patterns to include *.safetensors)"
        )
    return {
        "model_type": model_type,
        "top_level_model_type": config.get("model_type"),
        "treated_as": "deepseek_v3" if model_type in KIMI_MODEL_TYPES else model_type,
        "format": fmt,
        "safetensors_files": n_weights,
        "language_model_prefix": HFLayout.of_config(config).prefix,
        "vision_params": spec.vision.num_params(spec.hidden_size) if spec.vision else 0,
    }


# ---------------------------------------------------------------- the stage
def run_download(hub: HubSpec, data: DataSpec, spec: ModelSpec, base_dir: str, run_dir: Path,
                 token: str | None = None) -> dict[str, Any]:
    """Fetch + verify every source (`hub`'s model and reference, `data`'s sets; relative local paths under
    `base_dir`, `paths.base_dir`), check the model against `spec`; write DIR/download/manifest.json; return the
    summary section."""
    run_dir = Path(run_dir)
    out_dir = run_dir / "download"
    manifest_path = out_dir / "manifest.json"
    previous = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    token = resolve_token(token or (hub.token.get_secret_value() if hub.token else None))
    offline = hub.offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true")
    sources: dict[str, Source] = {"model": hub.model, "train": data.train, "eval": data.eval}
    if hub.ref_model is not None:
        sources["ref_model"] = hub.ref_model
    fetched: dict[str, Fetched] = {}
    for name, src in sources.items():
        if src.kind == "local":
            fetched[name] = fetch_local(name, src, base_dir, previous.get(name), hub.verify)
        else:
            fetched[name] = fetch_hub(name, src, base_dir, token, offline, hub.verify)
        log.info("%s: %s -> %s (%d files, %d bytes)", name, src.describe(), fetched[name].root, len(fetched[name].files), fetched[name].bytes)
    model_info = inspect_model(fetched["model"], spec, hub)
    manifest = {name: f.to_json() for name, f in fetched.items()}
    manifest["model"]["info"] = model_info
    atomic_write_json(manifest_path, manifest)
    return {
        "manifest": str(manifest_path),
        "model": {"source": fetched["model"].source, "path": str(fetched["model"].root), "bytes": fetched["model"].bytes, **model_info},
        **{
            name: {"source": f.source, "path": str(f.root / next(iter(f.files))) if len(f.files) == 1 else str(f.root), "bytes": f.bytes}
            for name, f in fetched.items()
            if name != "model"
        },
        "refetched": sorted({f"{n}/{r}" for n, f in fetched.items() for r in (f.refetched or [])}),
    }


class StageOrderError(PermanentError):
    """A stage ran before the stage whose outputs it reads."""


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """DIR/download/manifest.json: what every later stage reads its inputs from."""
    p = Path(run_dir) / "download" / "manifest.json"
    if not p.is_file():
        raise StageOrderError(f"{p} not found: run the download stage first (`kimi download --run-dir {run_dir}`)")
    return json.loads(p.read_text())


def model_root(run_dir: str | Path) -> Path:
    """The downloaded model directory (config, tokenizer, weights) of a run."""
    return Path(read_manifest(run_dir)["model"]["root"])


def dataset_path(manifest: dict[str, Any], name: str) -> Path:
    """The single data file a download manifest recorded for `train` / `eval`."""
    entry = manifest[name]
    files = list(entry["files"])
    if len(files) != 1:
        raise DownloadError(f"{name}: expected one data file, the manifest lists {len(files)}: set `filename` in the recipe")
    return Path(entry["root"]) / files[0]
