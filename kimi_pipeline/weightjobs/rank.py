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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_pipeline.util.lifetime import watch_parent
from kimi_pipeline.weightjobs.launch import run_job

RANK_ENTRY = "kimi_pipeline.weightjobs.rank"
KINDS = ("convert", "verify", "export")

if __name__ == "__mp_main__":  # a helper megatron spawned re-imports us: it goes when its rank goes
    watch_parent()


def rank_args(kind: str, job: str | Path) -> list[str]:
    """The arguments after `-m RANK_ENTRY` for one rank of a `kind` job."""
    return [kind, "--job", str(job)]


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
