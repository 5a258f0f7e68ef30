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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kimi_pipeline.engine.key import engine_api_key
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.recipes.models import SGLangSpec
from kimi_pipeline.util.lifetime import die_with_parent
from kimi_pipeline.util.net import bind_host, free_port
from kimi_pipeline.util.secret_env import without_secrets

SGLANG_ENV_VAR = "KIMI_SGLANG_PYTHON"
ARGCHECK_SCRIPT = Path(__file__).with_name("sglang_argcheck.py")

# With --enable-memory-saver, SGLang releases its CUDA graphs' memory only when this is set (sglang 0.5.23
# model_executor/runner_backend/cuda_graph_dedup_mixin.py:307-311, breakable_cuda_graph_backend.py:86): colocated
# engines get it, and `kimi plan` counts graph memory as released only where `releases_cuda_graphs` says so.
MEMORY_SAVER_CUDA_GRAPH = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"
# What the seeds' launcher sets that SGLang's side of a run uses: the long NCCL timeout of a 1 T-parameter
# weight-update group broadcast (seed 001, NCCL_TIMEOUT=3600).
SEED_SGLANG_ENV = {"NCCL_TIMEOUT": "3600"}
# The trainer's environment, never SGLang's: its interpreter's packages (a PYTHONPATH from the trainer's venv puts
# transformers >= 5.23 and compressed-tensors 0.20 before SGLang's pins), megatron's CUDA queue setting, torch.compile
# off, the trainer's process-group and QAT variables, and secrets SGLang has no use for (the model is on local
# disk: no hub token; no W&B).
TRAINER_ONLY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "TORCHDYNAMO_DISABLE",
                    "CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RANK",
                    "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                    "OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "OPEN_TRAINING_INT4_GROUP_SIZE")
TRAINER_ONLY_PREFIXES = ("WANDB_",)


def sglang_env(base: Mapping[str, str], *, memory_saver: bool) -> dict[str, str]:
    """The environment of an SGLang server process: `base` (the engine actor's) without the trainer's variables and
    the flow's secrets, plus the seeds' SGLang-side variables, the hub kept offline (the model is a local
    directory), and, colocated, the memory saver's CUDA-graph switch."""
    env = {k: v for k, v in without_secrets(base).items()
           if k not in TRAINER_ONLY_ENV and not k.startswith(TRAINER_ONLY_PREFIXES)}
    env.update(SEED_SGLANG_ENV)
    env["HF_HUB_OFFLINE"] = "1"
    if memory_saver:
        env[MEMORY_SAVER_CUDA_GRAPH] = "1"
    else:
        env.pop(MEMORY_SAVER_CUDA_GRAPH, None)
    return env


def releases_cuda_graphs(env: Mapping[str, str]) -> bool:
    """Whether an SGLang server started with `env` (and --enable-memory-saver) frees its CUDA graphs on
    /release_memory_occupation (SGLang reads the variable with get_bool_env_var: "1"/"true")."""
    return env.get(MEMORY_SAVER_CUDA_GRAPH, "").lower() in ("1", "true")


def sglang_python(sglang: SGLangSpec) -> str:
    """The interpreter SGLang runs from: `sglang.python`, else $KIMI_SGLANG_PYTHON, else the `.venv-sglang`
    beside this environment (`make sglang-env`), else this interpreter (SGLang installed here by hand)."""
    if sglang.python:
        return sglang.python
    if os.environ.get(SGLANG_ENV_VAR):
        return os.environ[SGLANG_ENV_VAR]
    beside = Path(sys.prefix).parent / ".venv-sglang" / "bin" / "python"
    return str(beside) if beside.exists() else sys.executable


class SGLangLaunchError(RuntimeError):
    pass


# (free bytes, total bytes) of each of these node-local GPUs
MemoryProbe = Callable[[Sequence[int]], list[tuple[int, int]]]


def nvidia_smi_memory(gpus: Sequence[int]) -> list[tuple[int, int]]:
    """Free and total memory of node-local GPUs (indexes as this process sees them, through CUDA_VISIBLE_DEVICES),
    from nvidia-smi: no CUDA context is created in the engine actor, which must leave the GPU to SGLang."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    ids = ",".join(visible[g] if g < len(visible) else str(g) for g in gpus)
    out = subprocess.run(["nvidia-smi", "-i", ids, "--query-gpu=memory.free,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60, check=True)
    rows = [line.split(",") for line in out.stdout.strip().splitlines()]
    return [(int(free) << 20, int(total) << 20) for free, total in rows]


def wait_for_gpu_memory(gpus: Sequence[int], fraction: float, what: str, *, probe: MemoryProbe | None = None,
                        timeout_s: float = 300.0, poll_s: float = 2.0) -> float:
    """Wait until each GPU in `gpus` has `fraction` of its memory free; returns the seconds waited.

    SGLang sizes its static memory from the memory free when it starts (KV budget = free - free_at_start x
    (1 - mem_fraction_static), sglang 0.5.23 mem_cache/kv_cache_configurator.py:2990-3007; "Not enough memory",
    model_executor/pool_configurator.py:94-99): an engine restarted while its killed predecessor's processes still
    hold their GPU memory fails or comes up with a starved KV cache. No GPUs (CPU): nothing to wait for. Past
    `timeout_s`: SGLangLaunchError naming the engine and each GPU's free memory."""
    if not gpus:
        return 0.0
    probe = probe or nvidia_smi_memory
    t0 = time.monotonic()
    while True:
        memory = probe(gpus)
        short = [(g, free, total) for g, (free, total) in zip(gpus, memory) if free < fraction * total]
        if not short:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= timeout_s:
            detail = ", ".join(f"GPU {g}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
                               for g, free, total in short)
            raise SGLangLaunchError(
                f"{what}: its GPUs did not get {fraction:.0%} of their memory back within {timeout_s:.0f} s "
                f"({detail}); the previous engine's processes may still hold it (nvidia-smi lists them)")
        time.sleep(poll_s)


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


def sglang_command(model_path: str | Path, sglang: SGLangSpec, *, port: int, host: str | None = None,
                   gpus_per_node: int = 8, node_rank: int = 0, dist_init_addr: str | None = None,
                   base_gpu_id: int = 0, routing_replay: bool = False, seed: int = 0,
                   trust_remote_code: bool = False, memory_saver: bool = False, python: str | None = None,
                   extra_args: tuple[str, ...] = ()) -> list[str]:
    """The launch_server command line for one engine (node `node_rank` of it, when it spans nodes).
    `memory_saver`: colocated with the trainer, so the engine releases and resumes its GPU memory."""
    nnodes = max(1, -(-sglang.gpus_per_engine // gpus_per_node))
    if nnodes > 1 and not dist_init_addr:
        raise PermanentError(
            f"sglang.gpus_per_engine={sglang.gpus_per_engine} spans {nnodes} nodes of {gpus_per_node} GPUs: "
            "pass dist_init_addr (host:port of the engine's node 0)"
        )
    if sglang.gpus_per_engine % sglang.dp_size:
        raise PermanentError(f"sglang.dp_size={sglang.dp_size} must divide sglang.gpus_per_engine={sglang.gpus_per_engine}")
    cmd = [python or sglang_python(sglang), "-m", "sglang.launch_server",
           "--model-path", str(model_path),
           "--host", host or sglang.host,
           "--port", str(port),
           "--tp-size", str(sglang.gpus_per_engine),
           "--ep-size", str(sglang.ep_size),
           "--mem-fraction-static", str(sglang.mem_fraction_static),
           "--random-seed", str(seed),
           "--base-gpu-id", str(base_gpu_id),
           "--skip-server-warmup"]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if sglang.enable_dp_attention:  # the recipe's dp_size is the attention-DP width (the seeds' spelling)
        cmd += ["--attn-dp-size", str(sglang.dp_size)]
    elif sglang.dp_size > 1:  # data-parallel replicas inside one server
        cmd += ["--dp-size", str(sglang.dp_size)]
    if sglang.moe_dense_tp_size is not None:
        cmd += ["--moe-dense-tp-size", str(sglang.moe_dense_tp_size)]
    if sglang.enable_dp_lm_head:
        cmd.append("--enable-dp-lm-head")
    if sglang.disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if sglang.cuda_graph_bs:
        cmd += ["--cuda-graph-bs-decode", *map(str, sglang.cuda_graph_bs)]
    if memory_saver:
        cmd.append("--enable-memory-saver")
    if routing_replay:
        cmd.append("--enable-return-routed-experts")
    if trust_remote_code:  # only when the recipe opts in (hub.trust_remote_code)
        cmd.append("--trust-remote-code")
    return cmd + list(extra_args)


def _has_nvidia_smi() -> bool:
    return shutil.which("nvidia-smi") is not None


class SGLangEngine:
    """Owns one SGLang server process (one node of an engine). The train stage runs it as a Ray actor where
    `rl/actor_layout.py` places it; the plain class also runs in-process (handy on a single GPU box)."""

    def __init__(self, model_path: str | Path, sglang: SGLangSpec, *, port: int | None = None,
                 log_dir: str | Path | None = None, **command_kwargs):
        self.host = bind_host(command_kwargs.pop("host", None) or sglang.host)
        self.port = port or free_port(self.host)
        self.node_rank = command_kwargs.get("node_rank", 0)
        self.memory_saver = bool(command_kwargs.get("memory_saver", False))
        self.mem_fraction_static = sglang.mem_fraction_static
        per_node = command_kwargs.get("gpus_per_node", 8)
        base = command_kwargs.get("base_gpu_id", 0)
        self.gpus = tuple(range(base, base + min(sglang.gpus_per_engine, per_node)))  # node-local GPUs it drives
        self.command = sglang_command(model_path, sglang, port=self.port, host=self.host, **command_kwargs)
        self.log_dir = Path(log_dir) if log_dir else None
        self.process: subprocess.Popen | None = None
        self._config_file: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get_url(self) -> str:  # Ray actors expose methods, not properties
        return self.url

    def start(self, timeout_s: float = 1800.0, memory_probe: MemoryProbe | None = None,
              memory_timeout_s: float = 300.0) -> str:
        """Launch and wait until /health_generate answers 200 (node 0); returns the server URL. First waits
        (bounded) until its GPUs hold the free memory SGLang's start-up check needs (`wait_for_gpu_memory`): a
        restarted engine may come up before the killed one's processes gave theirs back."""
        require_sglang(self.command[0])
        if self.gpus and (memory_probe is not None or _has_nvidia_smi()):
            wait_for_gpu_memory(self.gpus, self.mem_fraction_static,
                                f"SGLang engine at {self.url} (node rank {self.node_rank}, GPUs {list(self.gpus)})",
                                probe=memory_probe, timeout_s=memory_timeout_s)
        command = self.launch_command()
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"sglang-{self.port}-node{self.node_rank}.log", "ab")
        self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None,
                                        env=sglang_env(os.environ, memory_saver=self.memory_saver),
                                        start_new_session=True,
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
        """The planned command, plus the run's engine key (`engine.key`), on loopback too: SGLang then checks
        `Authorization: Bearer` on every endpoint but /health* (sglang/srt/utils/auth.py)."""
        return [*self.command, "--config", self._private_config({"api-key": engine_api_key()})]  # not in `ps`

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


def parse_with_sglang(commands: list[list[str]], sglang: SGLangSpec, timeout_s: float = 300.0) -> ParsedCommands:
    """Parse `commands` with the SGLang parser of `sglang.python`'s environment, or of the sglang found in
    $KIMI_SGLANG_PARSER_PATH (run by this interpreter: the CPU test set-up); one subprocess for all."""
    tries = [(sglang_python(sglang), without_secrets())]
    if os.environ.get(PARSER_PATH_VAR):
        path = os.pathsep.join(p for p in (os.environ[PARSER_PATH_VAR], os.environ.get("PYTHONPATH")) if p)
        tries.append((sys.executable, {**without_secrets(), "PYTHONPATH": path}))
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
