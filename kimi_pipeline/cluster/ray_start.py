"""`python -m kimi_pipeline.cluster.ray_start ARGS`: Ray's own `ray start ARGS`, less two parts the pipeline never uses.

- The CLI's `serve` group. Ray's CLI module adds `ray serve` by importing `ray.serve.scripts` when it loads
  (ray/scripts/scripts.py:3011-3017, inside `try/except Exception`, logged at debug level). That import (ray.serve,
  pandas, fastapi) is about 0.9 of the 1.6 CPU-s a `ray start` costs (measured: `ray start --help` 1.6 CPU-s, 0.7
  with the group left out), paid for every node an embedded cluster starts. A None entry in `sys.modules` makes that
  one import raise ImportError (the documented meaning of a None entry), which Ray's CLI catches.
- The head's Ray Client server. `ray start --head` starts one whenever Python's grpc imports: its port defaults to
  10001 (scripts.py:919-921), and an explicit port must lie in 1024-65535 (_private/parameter.py:398-412), so no
  option turns it off. The pipeline never connects through Ray Client (`cluster.lifecycle.resolve_address` refuses
  ray:// addresses): the server would be one more process (~0.9 CPU-s to start) and one more open port. The CLI is
  told that Ray Client is not installed; the port then stays unset and the head starts without the server
  (_private/node.py:1657).

Every other command, option and process is Ray's, unchanged.
"""

from __future__ import annotations

import sys

sys.modules["ray.serve.scripts"] = None  # before Ray's CLI module loads: its `ray serve` group is then left out

import ray.scripts.scripts as ray_cli  # noqa: E402


def _ray_client_not_used() -> ImportError:
    return ImportError("Ray Client is not used by kimi-pipeline (ray:// addresses are refused)")


if __name__ == "__main__":
    ray_cli.get_ray_client_dependency_error = _ray_client_not_used
    sys.argv[0] = "ray"
    sys.argv.insert(1, "start")
    ray_cli.main()
