"""SGLang rollout engines on GPU: one `python -m sglang.launch_server` per engine, inside a Ray actor.

GPU-only and an optional extra (sglang pins its own CUDA torch): nothing here imports sglang; the
server is a subprocess, and the pipeline drives it over HTTP with the same EngineClient / Router as
the embedded engine. Weight sync to SGLang goes through `update_weights_from_disk` (an HF checkpoint
on shared storage): SGLang's /update_weights_from_tensor unpickles its payload, and we never send pickles.

Flags come from the recipe's SGLangSpec the way the upstream recipes set them: tp = GPUs per engine,
ep / dp / dp-attention / moe-dense-tp / dp-lm-head, static memory fraction, CUDA-graph batch sizes;
`--enable-return-routed-experts` when routing replay is on; an engine wider than a node spans
`nnodes` nodes (node_rank / dist_init_addr, as SGLang's multi-node launch expects).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.recipes.models import SGLangSpec
from kimi_pipeline.util.lifetime import die_with_parent
from kimi_pipeline.util.net import free_port


class SGLangLaunchError(RuntimeError):
    pass


def sglang_command(model_path: str | Path, spec: SGLangSpec, *, port: int, host: str | None = None,
                   gpus_per_node: int = 8, node_rank: int = 0, dist_init_addr: str | None = None,
                   base_gpu_id: int = 0, routing_replay: bool = False, seed: int = 0,
                   trust_remote_code: bool = False, python: str = sys.executable,
                   extra_args: tuple[str, ...] = ()) -> list[str]:
    """The launch_server command line for one engine (node `node_rank` of it, when it spans nodes)."""
    nnodes = max(1, -(-spec.gpus_per_engine // gpus_per_node))
    if nnodes > 1 and not dist_init_addr:
        raise PermanentError(
            f"sglang.gpus_per_engine={spec.gpus_per_engine} spans {nnodes} nodes of {gpus_per_node} GPUs: "
            "pass dist_init_addr (host:port of the engine's node 0)"
        )
    if spec.gpus_per_engine % spec.dp_size:
        raise PermanentError(f"sglang.dp_size={spec.dp_size} must divide sglang.gpus_per_engine={spec.gpus_per_engine}")
    cmd = [python, "-m", "sglang.launch_server",
           "--model-path", str(model_path),
           "--host", host or spec.host,
           "--port", str(port),
           "--tp-size", str(spec.gpus_per_engine),
           "--ep-size", str(spec.ep_size),
           "--dp-size", str(spec.dp_size),
           "--mem-fraction-static", str(spec.mem_fraction_static),
           "--random-seed", str(seed),
           "--base-gpu-id", str(base_gpu_id),
           "--skip-server-warmup"]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if spec.enable_dp_attention:
        cmd.append("--enable-dp-attention")
    if spec.moe_dense_tp_size is not None:
        cmd += ["--moe-dense-tp-size", str(spec.moe_dense_tp_size)]
    if spec.enable_dp_lm_head:
        cmd.append("--enable-dp-lm-head")
    if spec.disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if spec.cuda_graph_bs:
        cmd += ["--cuda-graph-bs", *map(str, spec.cuda_graph_bs)]
    if routing_replay:
        cmd.append("--enable-return-routed-experts")
    if trust_remote_code:  # only when the recipe opts in (hub.trust_remote_code)
        cmd.append("--trust-remote-code")
    return cmd + list(extra_args)


class SGLangEngine:
    """Owns one SGLang server process (one node of an engine). The train stage runs it as a Ray actor where
    `rl/launch.py` places it; the plain class also runs in-process (handy on a single GPU box)."""

    def __init__(self, model_path: str | Path, spec: SGLangSpec, *, port: int | None = None,
                 log_dir: str | Path | None = None, **command_kwargs):
        self.host = command_kwargs.pop("host", None) or spec.host
        self.port = port or free_port(self.host)
        self.node_rank = command_kwargs.get("node_rank", 0)
        self.command = sglang_command(model_path, spec, port=self.port, host=self.host, **command_kwargs)
        self.log_dir = Path(log_dir) if log_dir else None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get_url(self) -> str:  # Ray actors expose methods, not properties
        return self.url

    def start(self, timeout_s: float = 1800.0) -> str:
        """Launch and wait until /health_generate answers 200 (node 0); returns the server URL."""
        import httpx

        try:
            import sglang  # noqa: F401  (fail early with a useful message, not inside the subprocess)
        except ImportError:
            raise PermanentError(
                "rollout.engine=sglang needs the GPU extra: pip install 'kimi-pipeline[sglang]'") from None
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"sglang-{self.port}-node{self.node_rank}.log", "ab")
        self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT if out else None,
                                        env={**os.environ}, start_new_session=True,
                                        # SIGTERM when the trainer dies: sglang then stops its own schedulers
                                        preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        if self.node_rank != 0:
            return self.url
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SGLangLaunchError(
                    f"sglang server exited with {self.process.returncode}: {' '.join(self.command)}")
            try:
                if httpx.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise SGLangLaunchError(f"sglang server at {self.url} not healthy after {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, 15)  # its own session: the server and its scheduler children
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()
