"""Arms `support.save_gate` in every Python process of a `kimi run` a test starts with this directory on PYTHONPATH.

`kimi run` starts its own Ray cluster, so the `worker_process_setup_hook` test_train.py's clusters use cannot reach its
actors; Python's `site` imports `sitecustomize` at start-up from any directory on sys.path, and the run's actors get
the driver's sys.path as their PYTHONPATH (kimi_pipeline/rl/actor_layout.py `worker_env`). The gate does nothing
unless $KIMI_TEST_SAVE_GATE names a directory with an `arm` or `enospc` file in it.
"""

import importlib.util
import os
from pathlib import Path

if os.environ.get("KIMI_TEST_SAVE_GATE"):  # loaded by path: the tests' `support` package stays off the run's sys.path
    _spec = importlib.util.spec_from_file_location("kimi_test_save_gate", Path(__file__).parents[1] / "save_gate.py")
    _gate = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_gate)
    _gate.install()
