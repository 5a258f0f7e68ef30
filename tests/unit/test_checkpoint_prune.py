"""`checkpoint.keep_last` (issue 14 item 6): older complete iterations go, the tracker's never does."""

from __future__ import annotations

from kimi_pipeline.model.checkpoint_dirs import TRACKER, iteration_dir, prune_checkpoints


def _iters(root, steps):
    for s in steps:
        d = iteration_dir(root, s)
        d.mkdir(parents=True)
        (d / "common.pt").write_bytes(b"x")


def test_keep_last_prunes_old_iterations_only(tmp_path):
    _iters(tmp_path, [2, 4, 6, 8])
    (tmp_path / TRACKER).write_text("6\n")  # iter 8 is a save whose tracker never landed (crash): left alone
    assert prune_checkpoints(tmp_path, None) == []
    gone = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in gone) == ["iter_0000002"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000004", "iter_0000006", "iter_0000008"]
    assert prune_checkpoints(tmp_path, 1) == [iteration_dir(tmp_path, 4)]
    assert (iteration_dir(tmp_path, 6) / "common.pt").is_file()
