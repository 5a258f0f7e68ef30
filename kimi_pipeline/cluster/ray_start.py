"""`python -m kimi_pipeline.cluster.ray_start ARGS`: Ray's own `ray start ARGS`, less three parts the pipeline never uses.

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
- The head's dashboard process when the dashboard is off. `ray start --head --include-dashboard false` still starts
  `dashboard/dashboard.py` with only its usage-stats module and no frontend (_private/services.py:1381-1387), waits
  for it to write its address to the GCS (services.py:1400-1422), then records an empty dashboard URL
  (services.py:1490-1494, node.py:1351-1356). That module only reports usage statistics, which every cluster the
  pipeline starts turns off (`cluster.env.ray_env`: RAY_USAGE_STATS_ENABLED=0): the process is ~0.9 CPU-s and a
  wait on every head's start for nothing. With the dashboard off the head records the same empty URL and starts
  no such process; with it on (`kimi cluster up`, CUDA runs, KIMI_RAY_DASHBOARD=1) Ray's own start runs unchanged.

Every other command, option and process is Ray's, unchanged.
"""

from __future__ import annotations

import sys

sys.modules["ray.serve.scripts"] = None  # before Ray's CLI module loads: its `ray serve` group is then left out

import ray._private.node as ray_node  # noqa: E402
import ray._private.ray_constants as ray_constants  # noqa: E402
import ray.scripts.scripts as ray_cli  # noqa: E402

_start_api_server = ray_node.Node.start_api_server


def _ray_client_not_used() -> ImportError:
    return ImportError("Ray Client is not used by kimi-pipeline (ray:// addresses are refused)")


def _api_server_only_with_dashboard(node: ray_node.Node, *, include_dashboard: bool | None,
                                    raise_on_failure: bool) -> None:
    """Ray's `Node.start_api_server` when the dashboard is on (or left to Ray's default); with it off, only what
    Ray's own start leaves behind for drivers: an empty dashboard URL, on the node and in the GCS."""
    if include_dashboard is not False:
        _start_api_server(node, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)
        return
    node._webui_url = ""
    node.get_gcs_client().internal_kv_put(b"webui:url", b"", True, ray_constants.KV_NAMESPACE_DASHBOARD)


if __name__ == "__main__":
    ray_cli.get_ray_client_dependency_error = _ray_client_not_used
    ray_node.Node.start_api_server = _api_server_only_with_dashboard
    sys.argv[0] = "ray"
    sys.argv.insert(1, "start")
    ray_cli.main()
