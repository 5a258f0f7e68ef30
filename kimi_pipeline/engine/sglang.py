"""SGLang rollout engines on GPU: one `python -m sglang.launch_server` per engine node, inside a Ray actor.

SGLang runs from its own interpreter (`sglang.python`; `make sglang-env` builds `.venv-sglang` from
`requirements-sglang.txt`), as one runs a database server: sglang 0.5.23 pins transformers==5.19.0,
compressed-tensors==0.18.0, tokenizers and torch exactly, while the trainer needs megatron-core, prefect and
newer transformers / compressed-tensors, so one environment cannot hold both. Nothing here imports sglang;
the server is a subprocess, driven over HTTP by the same EngineClient / Router as the embedded engine.

Flags come from the recipe's SGLangSpec under SGLang 0.5.23's names (`sglang/srt/arg_groups/fields/*.py`):
tp = GPUs per engine, ep, attention-DP width (`--attn-dp-size`; `--enable-dp-attention` is its deprecated
spelling, `arg_groups/parallel_hook.py:39-60`), moe-dense-tp / dp-lm-head, static memory fraction, decode
CUDA-graph batch sizes (`--cuda-graph-bs-decode`, `fields/exec_.py:640`), `--enable-memory-saver` when
colocated (release / resume memory around each train phase), `--enable-return-routed-experts` when routing
replay is on; an engine wider than a node spans `nnodes` nodes (node_rank / dist_init_addr).
`sglang_argcheck.py` parses these commands with SGLang's own `ServerArgs` parser.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kimi_pipeline.cluster.env import server_api_key
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.recipes.models import SGLangSpec
from kimi_pipeline.util.lifetime import die_with_parent
from kimi_pipeline.util.net import bind_host, free_port

SGLANG_ENV_VAR = "KIMI_SGLANG_PYTHON"
ARGCHECK_SCRIPT = Path(__file__).with_name("sglang_argcheck.py")


def sglang_python(spec: SGLangSpec) -> str:
    """The interpreter SGLang runs from: `sglang.python`, else $KIMI_SGLANG_PYTHON, else the `.venv-sglang`
    beside this environment (`make sglang-env`), else this interpreter (SGLang installed here by hand)."""
    if spec.python:
        return spec.python
    if os.environ.get(SGLANG_ENV_VAR):
        return os.environ[SGLANG_ENV_VAR]
    beside = Path(sys.prefix).parent / ".venv-sglang" / "bin" / "python"
    return str(beside) if beside.exists() else sys.executable


class SGLangLaunchError(RuntimeError):
    pass


def require_sglang(python: str) -> None:
    """Fail early, naming the fix, when `python` cannot import sglang (not minutes later inside the server)."""
    try:
        ok = subprocess.run([python, "-c", "import sglang"], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise PermanentError(
            f"rollout.engine=sglang: {python} cannot import sglang. Build SGLang's environment with "
            f"`make sglang-env` (requirements-sglang.txt), or point sglang.python / ${SGLANG_ENV_VAR} at an "
            "interpreter that has it")


def sglang_command(model_path: str | Path, spec: SGLangSpec, *, port: int, host: str | None = None,
                   gpus_per_node: int = 8, node_rank: int = 0, dist_init_addr: str | None = None,
                   base_gpu_id: int = 0, routing_replay: bool = False, seed: int = 0,
                   trust_remote_code: bool = False, memory_saver: bool = False, python: str | None = None,
                   extra_args: tuple[str, ...] = ()) -> list[str]:
    """The launch_server command line for one engine (node `node_rank` of it, when it spans nodes).
    `memory_saver`: colocated with the trainer, so the engine releases and resumes its GPU memory."""
    nnodes = max(1, -(-spec.gpus_per_engine // gpus_per_node))
    if nnodes > 1 and not dist_init_addr:
        raise PermanentError(
            f"sglang.gpus_per_engine={spec.gpus_per_engine} spans {nnodes} nodes of {gpus_per_node} GPUs: "
            "pass dist_init_addr (host:port of the engine's node 0)"
        )
    if spec.gpus_per_engine % spec.dp_size:
        raise PermanentError(f"sglang.dp_size={spec.dp_size} must divide sglang.gpus_per_engine={spec.gpus_per_engine}")
    cmd = [python or sglang_python(spec), "-m", "sglang.launch_server",
           "--model-path", str(model_path),
           "--host", host or spec.host,
           "--port", str(port),
           "--tp-size", str(spec.gpus_per_engine),
           "--ep-size", str(spec.ep_size),
           "--mem-fraction-static", str(spec.mem_fraction_static),
           "--random-seed", str(seed),
           "--base-gpu-id", str(base_gpu_id),
           "--skip-server-warmup"]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if spec.enable_dp_attention:  # the recipe's dp_size is the attention-DP width (the seeds' spelling)
        cmd += ["--attn-dp-size", str(spec.dp_size)]
    elif spec.dp_size > 1:  # data-parallel replicas inside one server
        cmd += ["--dp-size", str(spec.dp_size)]
    if spec.moe_dense_tp_size is not None:
        cmd += ["--moe-dense-tp-size", str(spec.moe_dense_tp_size)]
    if spec.enable_dp_lm_head:
        cmd.append("--enable-dp-lm-head")
    if spec.disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if spec.cuda_graph_bs:
        cmd += ["--cuda-graph-bs-decode", *map(str, spec.cuda_graph_bs)]
    if memory_saver:
        cmd.append("--enable-memory-saver")
    if routing_replay:
        cmd.append("--enable-return-routed-experts")
    if trust_remote_code:  # only when the recipe opts in (hub.trust_remote_code)
        cmd.append("--trust-remote-code")
    return cmd + list(extra_args)


class SGLangEngine:
    """Owns one SGLang server process (one node of an engine). The train stage runs it as a Ray actor where
    `rl/actor_layout.py` places it; the plain class also runs in-process (handy on a single GPU box)."""

    def __init__(self, model_path: str | Path, spec: SGLangSpec, *, port: int | None = None,
                 log_dir: str | Path | None = None, **command_kwargs):
        self.host = bind_host(command_kwargs.pop("host", None) or spec.host)
        self.port = port or free_port(self.host)
        self.node_rank = command_kwargs.get("node_rank", 0)
        self.command = sglang_command(model_path, spec, port=self.port, host=self.host, **command_kwargs)
        self.log_dir = Path(log_dir) if log_dir else None
        self.process: subprocess.Popen | None = None
        self._config_file: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get_url(self) -> str:  # Ray actors expose methods, not properties
        return self.url

    def start(self, timeout_s: float = 1800.0) -> str:
        """Launch and wait until /health_generate answers 200 (node 0); returns the server URL."""
        require_sglang(self.command[0])
        command = self.launch_command()
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"sglang-{self.port}-node{self.node_rank}.log", "ab")
        self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None,
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

    def launch_command(self) -> list[str]:
        """The planned command, plus (bound beyond loopback) the cluster's key: SGLang then checks
        `Authorization: Bearer` on every endpoint but /health* (sglang/srt/utils/auth.py)."""
        key = server_api_key(self.host)
        if not key:
            return list(self.command)
        return [*self.command, "--config", self._private_config({"api-key": key})]  # not on a command line (`ps`)

    def _private_config(self, values: dict[str, str]) -> str:
        """A 0600 YAML file of launch options for SGLang's `--config` (server_args.py:683-689 merges it before
        parsing), for options that must not show in the process table; removed when the server stops."""
        fd, path = tempfile.mkstemp(prefix="sglang-", suffix=".yaml")  # mkstemp: 0600, owned by us
        with os.fdopen(fd, "w") as f:
            json.dump(values, f)  # JSON is YAML
        self._config_file = path
        return path

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._config_file:
            Path(self._config_file).unlink(missing_ok=True)
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, 15)  # its own session: the server and its scheduler children
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()


PARSER_PATH_VAR = "KIMI_SGLANG_PARSER_PATH"  # a directory holding sglang (installed without its dependencies)


@dataclass(frozen=True)
class ParsedCommands:
    """SGLang's parser's verdict on launch commands: `errors[i]` is "" when command i parses. `version` is the
    sglang that parsed them; when no interpreter could import sglang, `version` is "" and `reason` says why."""

    version: str
    errors: tuple[str, ...] = ()
    reason: str = ""

    @property
    def checked(self) -> bool:
        return bool(self.version)


def parse_with_sglang(commands: list[list[str]], spec: SGLangSpec, timeout_s: float = 300.0) -> ParsedCommands:
    """Parse `commands` with the SGLang parser of `sglang.python`'s environment, or of the sglang found in
    $KIMI_SGLANG_PARSER_PATH (run by this interpreter: the CPU test set-up); one subprocess for all."""
    tries = [(sglang_python(spec), dict(os.environ))]
    if os.environ.get(PARSER_PATH_VAR):
        path = os.pathsep.join(p for p in (os.environ[PARSER_PATH_VAR], os.environ.get("PYTHONPATH")) if p)
        tries.append((sys.executable, {**os.environ, "PYTHONPATH": path}))
    reasons = []
    for python, env in tries:
        try:
            # -P: the script's own directory (this package's `sglang.py`) must not shadow sglang
            done = subprocess.run([python, "-P", str(ARGCHECK_SCRIPT)], input=json.dumps(commands), capture_output=True,
                                  text=True, env=env, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            reasons.append(f"{python}: {e}")
            continue
        if done.returncode == 0:
            out = json.loads(done.stdout)
            return ParsedCommands(out["version"], tuple(r["error"] for r in out["results"]))
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        reasons.append(f"{python}: {last}")
    return ParsedCommands("", reason="; ".join(reasons) + f" (make sglang-env, or set sglang.python / "
                                                           f"${PARSER_PATH_VAR})")
