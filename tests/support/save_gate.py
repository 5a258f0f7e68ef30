"""Holds a trainer in the middle of megatron's checkpoint write, so a test can SIGKILL it exactly there.

Installed in every worker of a test's Ray cluster by Ray's `worker_process_setup_hook` (see test_train.py's
`ray_local`); it does nothing until armed. Armed by a file `<$KIMI_TEST_SAVE_GATE>/arm` naming a step: the
process that fsyncs a shard file of that step's checkpoint — megatron's torch_dist writer syncs each
`*.distcp` it writes (megatron/core/dist_checkpointing/strategies/filesystem_async.py, `write_preloaded_data`)
— records its pid in `<gate>/held-<pid>` and sleeps. At that point the shard is on disk but megatron's
metadata, our rename of `iter_N.tmp` into place and the tracker are not: a kill there is a kill mid-save.

A file `<gate>/enospc` naming a step makes that fsync fail instead, as a full disk does (OSError ENOSPC), in every
writer of that step's shards.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

GATE_ENV = "KIMI_TEST_SAVE_GATE"


def install() -> None:
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return
    real_fsync = os.fsync

    def fsync(fd) -> None:
        real_fsync(fd)
        arm, full = Path(gate) / "arm", Path(gate) / "enospc"
        if not arm.is_file() and not full.is_file():
            return
        try:
            path = Path(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"))
        except OSError:
            return
        if full.is_file() and path.suffix == ".distcp" and path.parent.name == f"iter_{int(full.read_text()):07d}.tmp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        if not arm.is_file():
            return
        if path.suffix == ".distcp" and path.parent.name == f"iter_{int(arm.read_text()):07d}.tmp":
            tmp = Path(gate) / f"writing-{os.getpid()}"  # whole before `held-` appears: the test reads it at once
            tmp.write_text(str(path))
            tmp.rename(Path(gate) / f"held-{os.getpid()}")
            while True:  # until the test's SIGKILL
                time.sleep(1)

    os.fsync = fsync
