"""Test environment: Prefect home in a temp dir, analytics off, no network for the hub. Shared helpers live in
tests/support/ (`pythonpath = ["tests"]` in pyproject.toml); unit/ and integration/ hold the tests."""

from __future__ import annotations

import atexit
import os
import random
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import torch

# A test process that runs megatron in-process (trainer workers, models, exports) runs it as the pipeline's CPU ranks
# and actors do (megatron_compat.CPU_ENV through rl/actor_layout.py and weightjobs/commands.py): dynamo off, set
# before this package's model code is imported (model/megatron_import.py), so megatron's fused functions run eagerly
# instead of being compiled by inductor in each test process (the in-process megatron tests: 59 s -> 16 s).
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from kimi_pipeline.engine.key import KEY_FILE_VAR, KEY_VAR
from kimi_pipeline.util.prefect_env import configure_prefect_env
from kimi_pipeline.util.threads import usable_cpus
from support.common import TINY
from support.cpu_report import CpuSampler
from support.prefect_home import remove_template, template_dir

# Several xdist workers share the box: each worker, and every process its tests start (runs, Ray actors, ranks),
# computes on its share of the cores (`OMP_NUM_THREADS`, which the pipeline honours: util/threads.py:cpu_threads).
# Two workers at two threads each on 2 cores ran a tiny GRPO step in 18-20 s instead of 4 (OpenMP teams spinning
# for descheduled peers). One process (TEST_WORKERS=0) keeps every core.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // _WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

_HOME = tempfile.mkdtemp(prefix="kimi-test-prefect-")
os.environ["PREFECT_HOME"] = _HOME
# removed as this process exits: registered before Prefect is imported, so after Prefect's own exit handlers (atexit
# runs last-registered first), which stop its ephemeral server and flush logs into this home
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.pop("PREFECT_API_URL", None)
template_dir()  # named here, in the controller first: xdist workers inherit it and share one migrated database
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
configure_prefect_env()  # the same Prefect settings `kimi run` uses (ephemeral server start-up timeout among them)
# SGLang's parser on CPU (`make sglang-parser`; `make test` sets this too): tests/integration/test_sglang.py
os.environ.setdefault("KIMI_SGLANG_PARSER_PATH", str(Path(__file__).resolve().parents[1] / ".cache" / "sglang-parser"))
for var in ("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "OPEN_TRAINING_INT4_GROUP_SIZE"):
    os.environ.pop(var, None)
# the engine key of the session, as a run's driver has one: the engines, clients, helper processes and Ray clusters
# the tests start inherit it (`kimi_pipeline.engine.key`)
os.environ.pop(KEY_FILE_VAR, None)
os.environ[KEY_VAR] = secrets.token_hex(32)


@pytest.fixture(autouse=True)
def _session_engine_key():
    """A test that runs the train loop points this process at its run's key file (`use_run_key`): the next test
    gets the session's key back."""
    saved = {v: os.environ.get(v) for v in (KEY_VAR, KEY_FILE_VAR)}
    yield
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.fixture
def tiny_copy(tmp_path: Path) -> Path:
    """A writable copy of data/tiny (tests corrupt or edit it)."""
    dst = tmp_path / "tiny"
    shutil.copytree(TINY, dst)
    return dst


_CPU_SAMPLER = pytest.StashKey[CpuSampler]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """`--cpu-report`: the sampler runs in the controller only (xdist workers are among what it measures)."""
    if session.config.getoption("--cpu-report") and not hasattr(session.config, "workerinput"):
        session.config.stash[_CPU_SAMPLER] = CpuSampler().start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop Prefect's default ephemeral server (one a test's trailing log or event flush started) while pytest's
    captured streams are still open: Prefect's own atexit stop logs to the captured stderr its console handler
    was bound to, after pytest has closed it, and prints a 'Logging error' traceback at the end of a green run.
    The controller also removes the session's migrated Prefect database (support/prefect_home.py)."""
    server = sys.modules.get("prefect.server.api.server")  # absent: no test started Prefect (the GPU image has none)
    if server is not None:
        server.SubprocessASGIServer().stop()  # the default (port None) server; a no-op when none was started
    if not hasattr(session.config, "workerinput"):
        remove_template()  # every worker has ended


# The suite's heaviest files, slowest first: seconds of each under two workers (a clean clone, 2-core Intel Xeon,
# 2026-11-27). `make test TEST_WORKERS=2` hands whole files to its workers in collection order (pytest-xdist's
# `--dist loadfile --no-loadscope-reorder`): the long ones start first and the many short ones fill in after them
# (longest first), so no worker ends alone on a 10-minute file. Files not listed keep pytest's order, after these.
# An order dependency this order met once (fixed): on the worker that ran test_gpu_install_resolves, 17 later tests
# that import megatron failed in setuptools' distutils shim, because that test imported pip's internals in-process
# (found with `pytest -p no:xdist tests/integration/test_gpu_install_resolves.py tests/unit/test_device.py`).
HEAVIEST_FIRST = (
    "test_deployment.py",  # 732: `kimi serve` and four served runs
    "test_reliability.py",  # 441, +300 with the Ray-head loss, -50 since it shares a run dir with the kill -9
    "test_train.py",  # 708
    "test_learning.py",  # 584: the full tiny run
    "test_convert.py",  # 521
    "test_rehearse.py",  # 428: the simulated 32 x 8 cluster
    "test_cluster.py",  # 306
    "test_megatron_model.py",  # 162
    "test_tiny_assets.py",  # 147
    "test_weight_sync.py",  # 125
    "test_gpu_install_resolves.py",  # 118: pip resolutions (network waits)
    "test_sglang.py",  # 109
    "test_k25.py",  # 105
    "test_preflight.py",  # 99
    "test_int4.py",  # 89
    "test_flow.py",  # 66
    "test_benches.py",  # 65
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", action="store_true",
                     help="print the session's CPU by kind of process at the end (support/cpu_report.py): Ray's "
                          "daemons, each actor class, weight-job ranks, kimi commands, Prefect servers, pytest workers")
    parser.addoption("--test-order", default="default", metavar="ORDER",
                     help="default | reversed (files in reverse, each file's tests in reverse) | shuffle:SEED (files "
                          "and the tests in each shuffled): proves no test depends on another having run first")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`: two workers), heaviest files first (HEAVIEST_FIRST); a stable sort, so each
    file's tests stay together and in order. One process (`TEST_WORKERS=0`) keeps pytest's order. `--test-order`
    reverses or shuffles files and the tests within each (a file's tests stay together: xdist hands out files)."""
    order = config.getoption("--test-order")
    if order != "default":
        files: dict[Path, list[pytest.Item]] = {}
        for item in items:
            files.setdefault(item.path, []).append(item)
        groups = list(files.values())
        if order == "reversed":
            groups = [g[::-1] for g in groups[::-1]]
        elif order.startswith("shuffle:"):
            rng = random.Random(order.split(":", 1)[1])
            rng.shuffle(groups)
            for g in groups:
                rng.shuffle(g)
        else:
            raise pytest.UsageError(f"--test-order {order!r}: use default, reversed or shuffle:SEED")
        items[:] = [item for g in groups for item in g]
    elif hasattr(config, "workerinput"):  # an xdist worker
        rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    _ending_last(items)


def _ending_last(items: list[pytest.Item]) -> None:
    """Each file's tests marked `ends_shared` (they end a resource the file's other tests share, and prove something
    about it after its use) after that file's others, in every order; files and the rest keep their order."""
    first: dict[Path, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (first[item.path], item.get_closest_marker("ends_shared") is not None))


GPU_TESTS = Path(__file__).resolve().parent / "gpu"  # skipped without CUDA, by tests/gpu/conftest.py


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """A skip's reason as pytest records it (longrepr: path, line, "Skipped: reason")."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: the line comes after `-ra`'s short summary
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config):
    """One line at the end of every run: how many tests were skipped, tests/gpu's (no CUDA here) counted, every
    other one named with its reason, so a green run cannot hide a skipped headline test."""
    result = yield
    gpu: dict[str, str] = {}
    others: dict[str, str] = {}
    for report in terminalreporter.stats.get("skipped", []):
        path = Path(config.rootpath, report.nodeid.split("::")[0]).resolve()
        (gpu if path.is_relative_to(GPU_TESTS) else others)[report.nodeid] = _skip_reason(report)
    gpu_part = f"tests/gpu: {len(gpu)}" + (" — " + "; ".join(sorted(set(gpu.values()))) if gpu else "")
    others_part = f"{len(others)} — " + "; ".join(f"{nodeid} ({why})" for nodeid, why in others.items()) \
        if others else "none"
    terminalreporter.write_line(f"skipped: {len(gpu) + len(others)} ({gpu_part}); others: {others_part}")
    sampler = config.stash.get(_CPU_SAMPLER, None)
    if sampler is not None:
        sampler.stop()
        for line in sampler.table():
            terminalreporter.write_line(line)
        every_kind = Path(config.rootpath, ".cache", "cpu-by-kind.txt")  # every kind, not the first 25 alone
        every_kind.parent.mkdir(exist_ok=True)
        every_kind.write_text("\n".join(sampler.table(top=None)) + "\n")
        terminalreporter.write_line(f"every kind: {every_kind.relative_to(config.rootpath)}")
    return result
