"""The entry of every weight-job rank: `python -m kimi_pipeline.weightjobs.rank {convert,verify,export} --job JOB.json`.

Why one thin entry: a helper process a library `spawn`s re-imports the rank's `__main__` module (megatron's
torch_dist writer started one per saving process, the Manager of its write-results queue, until
`model.megatron_train._write_results_in_process` handed it an in-process queue). With this module as `__main__`,
such a helper loads the standard library and the job plumbing only, not the model code, and it goes when its rank
goes. The rank bodies (`weightjobs.convert_rank`, `weightjobs.convert_verify`, `weightjobs.export_rank`) import everything at
their own module top; `rank_body` is the one place they are imported inside a function.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import is_permanent
from kimi_pipeline.util.lifetime import bind_to_parent, watch_parent

RANK_ENTRY = "kimi_pipeline.weightjobs.rank"
KINDS = ("convert", "verify", "export")
EXIT_PERMANENT = 3  # a rank's exit code when its error is permanent (bad input): retrying cannot help

if __name__ == "__mp_main__":  # a helper megatron spawned re-imports us: it goes when its rank goes
    watch_parent()


def rank_args(kind: str, job: str | Path) -> list[str]:
    """The arguments after `-m RANK_ENTRY` for one rank of a `kind` job."""
    return [kind, "--job", str(job)]


def rank_main(main: Callable[[], Any], report_dir: str | Path) -> None:
    """Run a worker's main; on failure write rank_<RANK>.error.json and exit 1 (3 = permanent)."""
    rank = int(os.environ.get("RANK", "0"))
    bind_to_parent()  # this rank and the file writers megatron forks die with their agent
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised as an exit code
        if isinstance(e, SystemExit) and not e.code:
            raise
        report = Path(report_dir)
        report.mkdir(parents=True, exist_ok=True)
        payload = {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "node": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))),
            "host": os.uname().nodename,
            "type": type(e).__name__,
            "message": str(e),
            "permanent": is_permanent(e),
            "time": time.time(),
            "traceback": traceback.format_exc()[-4000:],
        }
        tmp = report / f".rank_{rank}.error.json.tmp"
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(report / f"rank_{rank}.error.json")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_PERMANENT if payload["permanent"] else 1)
    # Done: every file this rank wrote is closed and its report renamed into place. Skip the interpreter's
    # teardown (measured ~2-3 s with a 1 GB model: gc of the model, megatron's result-queue manager shut
    # down through atexit); the spawned manager follows by its parent watch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(rank_fn: Callable[[dict[str, Any]], Any], job_path: Path) -> None:
    """One rank of a weight job (`weightjobs.rank`): `rank_fn(job)` under `rank_main` (this rank's error report
    on failure)."""

    job = json.loads(Path(job_path).read_text())
    rank_main(lambda: rank_fn(job), job["report_dir"])


def rank_body(kind: str) -> Callable[[dict[str, Any]], Any]:
    """The rank function of a job kind, imported here: the worker boundary (see the module docstring)."""
    if kind == "convert":
        from kimi_pipeline.weightjobs.convert_rank import convert_rank

        return convert_rank
    if kind == "verify":
        from kimi_pipeline.weightjobs.convert_verify import verify_rank

        return verify_rank
    if kind == "export":
        from kimi_pipeline.weightjobs.export_rank import export_rank

        return export_rank
    raise ValueError(f"unknown weight-job kind {kind!r}; one of {', '.join(KINDS)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=KINDS, help="convert (HF -> torch_dist), verify (the conversion), export (INT4)")
    ap.add_argument("--job", required=True, help="job JSON written by the stage that launched this job")
    args = ap.parse_args(argv)
    run_job(rank_body(args.kind), Path(args.job))


if __name__ == "__main__":  # torch_dist saving spawns processes: never run the job on import
    main()
