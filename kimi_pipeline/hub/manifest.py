"""File manifests: sha256 + size per file, and re-verification that names the bad file.

A manifest is recorded the first time a source is fetched and checked every time it is reused, so a
corrupt or truncated shard is caught at download time, not as a NaN (or a missing expert) hours later.
"""

from __future__ import annotations

import fnmatch
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_pipeline.util.files import sha256_file, sha256_files

MANIFEST_NAMES = ("MANIFEST.sha256", "SHA256SUMS")


@dataclass(frozen=True)
class FileIssue:
    path: Path
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def list_files(root: Path, patterns: list[str] | None = None) -> list[Path]:
    """Files under root (relative), hidden files and our own manifests excluded."""

    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts) or rel.name in MANIFEST_NAMES:
            continue
        if patterns and not any(fnmatch.fnmatch(str(rel), pat) for pat in patterns):
            continue
        out.append(rel)
    return out


def build_manifest(root: Path, rel_paths: list[Path], mode: str = "sha256") -> dict[str, dict[str, Any]]:
    full = [root / r for r in rel_paths]
    digests = sha256_files(full) if mode == "sha256" else [None] * len(full)
    return {str(r): {"size": f.stat().st_size, "sha256": d} for r, f, d in zip(rel_paths, full, digests)}


def read_sha256sums(path: Path) -> dict[str, str]:
    """Parse a `sha256sum`-format file (`<hex>  <relative path>` per line)."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or len(parts[0]) != 64:
            raise ValueError(f"{path}:{n}: not a sha256sum line: {line[:80]!r}")
        out[parts[1].strip().lstrip("*")] = parts[0].lower()
    return out


def write_sha256sums(root: Path, files: dict[str, dict[str, Any]]) -> str:
    return "".join(f"{v['sha256']}  {k}\n" for k, v in sorted(files.items()))


def safetensors_issue(path: Path) -> str | None:
    """Cheap structural check of a .safetensors file: header parses and data length matches."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return "truncated: shorter than the 8-byte safetensors header length"
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * 1024 * 1024):
                return f"corrupt safetensors header length {n} (file is {size} bytes)"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"unreadable safetensors header ({e.__class__.__name__}: {e})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"truncated or padded: header says {8 + n + end} bytes, file has {size}"
    return None


def verify_files(root: Path, expected: dict[str, dict[str, Any]], mode: str = "sha256") -> list[FileIssue]:
    """Compare files under root with a manifest; returns one issue per bad file (missing, size, hash)."""
    issues: list[FileIssue] = []
    to_hash: list[tuple[str, Path, str]] = []
    for rel, meta in expected.items():
        p = root / rel
        if not p.is_file():
            issues.append(FileIssue(p, "missing"))
            continue
        size = p.stat().st_size
        if meta.get("size") is not None and size != meta["size"]:
            issues.append(FileIssue(p, f"size {size} bytes, expected {meta['size']} (truncated or changed)"))
            continue
        if p.suffix == ".safetensors" and (why := safetensors_issue(p)):
            issues.append(FileIssue(p, why))
            continue
        if mode == "sha256" and meta.get("sha256"):
            to_hash.append((rel, p, meta["sha256"]))
    for (rel, p, want), got in zip(to_hash, sha256_files([t[1] for t in to_hash])):
        if got != want:
            issues.append(FileIssue(p, f"sha256 {got[:12]}… does not match the manifest's {want[:12]}… (corrupt)"))
    return issues


def single_file_manifest(path: Path) -> dict[str, dict[str, Any]]:
    return {path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}}
