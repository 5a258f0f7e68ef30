"""`python -m flows.worker --pool kimi-process [prefect worker start options]`: a Prefect process
worker that stops cleanly on SIGTERM / SIGINT however it was started.

A worker launched in the background (`cmd &` in a script, some init systems) inherits SIGINT as
*ignored*; Prefect's worker turns SIGTERM into a SIGINT to itself, so such a worker ignores both and
never stops. Resetting the dispositions before exec'ing the worker restores Python's default handlers.
It also exports KIMI_PROJECT_DIR (this checkout) for prefect.yaml's pull step.
"""

from __future__ import annotations

import os
import signal
import sys

from kimi_pipeline.util.paths import PROJECT_ROOT


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # survives exec; Python then installs its own SIGINT handler
    os.environ.setdefault("KIMI_PROJECT_DIR", str(PROJECT_ROOT))
    if "--type" not in args and "-t" not in args:
        args = ["--type", "process", *args]
    os.execv(sys.executable, [sys.executable, "-m", "prefect", "worker", "start", *args])


if __name__ == "__main__":
    main()
