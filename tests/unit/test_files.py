"""util.files: a write is seen whole or not at all, with its permission bits from the start."""

from __future__ import annotations

import os
import stat

import pytest

from kimi_pipeline.util import files


def test_an_atomic_write_carries_its_mode_and_leaves_no_temp_file(tmp_path):
    script = files.atomic_write_text(tmp_path / "run.sh", "#!/bin/sh\nexit 0\n", mode=0o755)
    assert stat.S_IMODE(script.stat().st_mode) == 0o755 and os.access(script, os.X_OK)
    plain = files.atomic_write_text(tmp_path / "row.json", "{}\n")
    assert stat.S_IMODE(plain.stat().st_mode) == 0o600  # mkstemp's, unless a mode is asked for
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row.json", "run.sh"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp(tmp_path, monkeypatch):
    target = files.atomic_write_text(tmp_path / "section.json", "old\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        files.atomic_write_text(target, "new\n")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["section.json"]
