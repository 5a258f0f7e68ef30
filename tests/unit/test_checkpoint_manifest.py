"""Checkpoint manifests and the disk checks around a save (issue 40 item 6), on files only: the training runs that
fill a disk and corrupt a shard are in tests/integration/test_train.py."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest

from kimi_pipeline.model import checkpoint_manifest as cm
from kimi_pipeline.model.checkpoint_dirs import TRACKER


def _iteration(root, step: int, world: int = 2):
    d = root / f"iter_{step:07d}"
    d.mkdir(parents=True)
    for r in range(world):
        (d / f"__{r}_0.distcp").write_bytes(bytes([r]) * 1000)
        (d / f"rng_rank{r:05d}.json").write_text("{}")
    for name in (".metadata", "common.pt", "metadata.json", "kimi_extra.json"):
        (d / name).write_text(name)
    files = {}
    for r in range(world):
        files |= cm.entries(d, cm.rank_files(d, r))
    cm.write_manifest(d, {**files, **cm.entries(d, cm.shared_files(d, set(files)))})
    (root / TRACKER).write_text(f"{step}\n")
    return d


def test_the_manifest_holds_every_file_and_each_rank_checks_its_share(tmp_path):
    d = _iteration(tmp_path, 2)
    manifest = cm.read_manifest(d)
    assert sorted(manifest["files"]) == sorted(p.name for p in d.iterdir() if p.name != cm.MANIFEST)
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in d.iterdir() if p.name != cm.MANIFEST)
    assert cm.verify_share(d, 0, 2) == [] and cm.verify_share(d, 1, 2) == []
    shard = d / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[500] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(data))
    found = cm.verify_share(d, 0, 2) + cm.verify_share(d, 1, 2)  # exactly one rank's share holds the shard
    assert found == ["__1_0.distcp: CRC-32 differs from the save's (corrupt)"]
    shard.write_bytes(bytes(data[:10]))  # torn: every rank sees the size
    assert all("__1_0.distcp: 10 bytes, the save wrote 1000" in cm.verify_share(d, r, 2) for r in range(2))
    shard.unlink()
    assert "__1_0.distcp: missing" in cm.verify_share(d, 0, 2)


def test_resume_candidates_are_finished_iterations_up_to_the_tracker_newest_first(tmp_path):
    _iteration(tmp_path, 2)
    _iteration(tmp_path, 4)
    (tmp_path / "iter_0000006.tmp").mkdir()  # a save that never finished
    _iteration(tmp_path, 8).joinpath("metadata.json").unlink()  # no megatron metadata: not complete
    (tmp_path / TRACKER).write_text("4\n")
    assert cm.resume_candidates(tmp_path) == [4, 2]


def test_the_free_space_check_asks_for_the_last_save_plus_a_margin(tmp_path, monkeypatch):
    assert cm.space_problem(tmp_path) is None  # before the first save: nothing to compare
    d = _iteration(tmp_path, 2)
    size = cm.read_manifest(d)["total_bytes"]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 0, int(size * 1.05)))
    problem = cm.space_problem(tmp_path)
    assert problem and f"({int(size * 1.1)} bytes" in problem and f"({int(size * 1.05)} bytes) free" in problem
    assert "checkpoint.keep_last" in problem and str(tmp_path) in problem
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 0, size * 2))
    assert cm.space_problem(tmp_path) is None


def test_enospc_is_recognised_through_the_wrappers_of_a_save():
    class CheckpointException(Exception):  # torch DCP's: rank -> (exception, traceback)
        def __init__(self, failures):
            super().__init__("write")
            self.failures = failures

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise RuntimeError("Worker failure") from full
    except RuntimeError as e:
        wrapped = e
    assert cm.is_enospc(full) and cm.is_enospc(wrapped)
    assert cm.is_enospc(CheckpointException({3: (wrapped, "traceback")}))
    assert cm.is_enospc(RuntimeError("[Errno 28] No space left on device: '/ckpt/__0_0.distcp'"))
    assert not cm.is_enospc(CheckpointException({0: (OSError(errno.EIO, "I/O error"), "tb")}))
    assert not cm.is_enospc(None)
    # the line a user reads: the OSError inside, with its file, not the wrappers' tracebacks
    assert cm.failure_line(CheckpointException({3: (wrapped, "traceback")})) == \
        "OSError: [Errno 28] No space left on device"
    assert cm.failure_line(ValueError("bad\nsecond line")) == "ValueError: bad"
    gathered = RuntimeError("Worker failure: [Errno 28] No space left on device: '/ckpt/__0_1.distcp'")  # pickled
    assert cm.failure_line(CheckpointException({0: (gathered, "tb")})) == \
        "OSError: [Errno 28] No space left on device: '/ckpt/__0_1.distcp'"


@pytest.mark.parametrize("text", ["", "not json"])
def test_an_unreadable_manifest_fails_verification(tmp_path, text):
    d = _iteration(tmp_path, 2)
    (d / cm.MANIFEST).write_text(text)
    assert cm.verify_share(d, 0, 1) == [f"{d / cm.MANIFEST}: unreadable"]
