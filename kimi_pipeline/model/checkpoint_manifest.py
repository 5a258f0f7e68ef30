"""What a training checkpoint holds, so a resume can trust it, and whether the disk can take the next one.

A save writes `kimi_manifest.json` into its iteration before the rename and the tracker: every file's size and
CRC-32, each rank hashing the files it wrote (`rank_files`: megatron's `__<rank>_<n>.distcp` and our
`rng_rank<rank>.json`), rank 0 the shared ones. A resume verifies the latest iteration (sizes of all files, each
rank the CRC of its share) and falls back to the newest one that verifies. CRC-32 (zlib, stdlib, GB/s) and not a
cryptographic hash: the threat is a torn or flipped byte on a bad disk, not tampering.

Pure file functions: the collectives around them (one gather per save, one per iteration verified) live in
`model.megatron_train`.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import zlib
from pathlib import Path

from kimi_pipeline.model.checkpoint_dirs import CheckpointError, iteration_dir, latest_step
from kimi_pipeline.util.files import atomic_write_json

MANIFEST = "kimi_manifest.json"
SPACE_MARGIN = 0.10  # free space asked for beyond the last save's size: the optimizer state grows little per save
_CHUNK = 16 << 20


class CheckpointSpaceError(CheckpointError):
    """The checkpoint disk cannot take the next save (checked before it, or ENOSPC during it): a retry would redo the
    rollouts since the last save and fail the same way, so it is permanent."""


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def entries(directory: Path, names: list[str]) -> dict[str, list[int]]:
    """{file name: [size, crc32]} of these files of `directory`."""
    return {n: [(directory / n).stat().st_size, crc32_file(directory / n)] for n in names}


def rank_files(directory: Path, rank: int) -> list[str]:
    """The files rank `rank` wrote into a torch_dist iteration: megatron's shards and our RNG state."""
    shards = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))
    rng = f"rng_rank{rank:05d}.json"
    return shards + ([rng] if (directory / rng).is_file() else [])


def shared_files(directory: Path, owned: set[str]) -> list[str]:
    """Files outside the ranks' shares (`owned`: the names they hashed; megatron's metadata, common state, our extra
    state): rank 0 hashes them."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in owned and p.name != MANIFEST)


def write_manifest(directory: Path, files: dict[str, list[int]]) -> None:
    atomic_write_json(directory / MANIFEST, {"files": dict(sorted(files.items())),
                                             "total_bytes": sum(size for size, _ in files.values())})


def read_manifest(directory: Path) -> dict | None:
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"files": None}


def verify_share(directory: Path, rank: int, world: int) -> list[str]:
    """This rank's part of checking an iteration against its manifest: every file's presence and size, and the CRC
    of every `world`-th file from `rank` on. Problems, or [] (an iteration saved before manifests: nothing to check)."""
    manifest = read_manifest(directory)
    if manifest is None:
        return []
    files = manifest.get("files")
    if not isinstance(files, dict):
        return [f"{directory / MANIFEST}: unreadable"]
    problems = []
    for i, (name, (size, crc)) in enumerate(sorted(files.items())):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, the save wrote {size}")
        elif i % world == rank and crc32_file(path) != crc:
            problems.append(f"{name}: CRC-32 differs from the save's (corrupt)")
    return problems


def resume_candidates(ckpt_dir: Path) -> list[int]:
    """Complete iterations a resume may load, newest first: the tracker's and the older finished ones (a `.tmp` of a
    save that never finished is not one)."""
    latest = latest_step(ckpt_dir)
    if latest is None:
        return []
    steps = {int(p.name[5:]) for p in Path(ckpt_dir).glob("iter_*")
             if p.is_dir() and p.name[5:].isdigit() and (p / "metadata.json").is_file()}
    return sorted((s for s in steps if s <= latest), reverse=True)


def last_save_bytes(ckpt_dir: Path) -> int | None:
    """The size of the newest checkpoint with a manifest (what the next save will need, give or take)."""
    for step in resume_candidates(ckpt_dir):
        manifest = read_manifest(iteration_dir(ckpt_dir, step))
        if manifest and isinstance(manifest.get("total_bytes"), int):
            return manifest["total_bytes"]
    return None


def space_problem(ckpt_dir: Path) -> str | None:
    """Why the next save would not fit, or None: the last save's size plus `SPACE_MARGIN` against the free space of
    the checkpoint directory's file system (nothing to compare before the first save)."""
    last = last_save_bytes(ckpt_dir)
    if last is None:
        return None
    need = int(last * (1 + SPACE_MARGIN))
    free = shutil.disk_usage(ckpt_dir).free
    if free >= need:
        return None
    return (f"{ckpt_dir}: the next checkpoint needs about {need / 2**30:.2f} GiB ({need} bytes: the last save's size + "
            f"{SPACE_MARGIN:.0%}) and the disk has {free / 2**30:.2f} GiB ({free} bytes) free: free space there, or "
            "set checkpoint.keep_last to delete older iterations, then retry")


def _chain(exc: BaseException | None) -> list[BaseException]:
    """`exc` and what it wraps: causes, contexts, and a torch DCP CheckpointException's per-rank failures
    (rank -> (exception, traceback)), outermost first."""
    seen: set[int] = set()
    out, todo = [], [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return out


def failure_line(exc: BaseException) -> str:
    """One line for a save's failure: the innermost OSError's message (the errno and the file) where there is one,
    found in the text where only that is left (megatron gathers the writers' failures pickled, which drops their
    causes), else the exception's first line."""
    chain = _chain(exc)
    os_errors = [e for e in chain if isinstance(e, OSError)]
    if os_errors:
        return f"{type(os_errors[-1]).__name__}: {os_errors[-1]}"[:400]
    quoted = [m for e in chain for m in re.findall(r"\[Errno \d+\][^\n]*", str(e))]
    if quoted:
        return f"OSError: {quoted[-1]}"[:400]
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def is_enospc(exc: BaseException | None) -> bool:
    """Whether a save's failure is a full disk, through the wrappers megatron and the writer processes put around
    the OSError (exception chains, a CheckpointException's per-rank failures, or only the message)."""
    return any((isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
               for e in _chain(exc))
