"""Every CPU benchmark runs in the suite at its smallest sizes and ends with its `<name> ratio=<float>` line, so
none rots unnoticed (bench/weight_sync.py once failed on every run with SGLang's 400 and nobody saw). The numbers
are not judged here: speed goals live in the benchmarks' own runs (README's figures). bench/rollout.py runs in
tests/integration/test_engine.py; the bench/gpu_* ones need a GPU (`make gpu-check`)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out: each benchmark runs end to end (~5-20 s)

ROOT = Path(__file__).resolve().parents[2]
SMALLEST = {
    "int4": ["--experts", "1", "--rows", "64", "--cols", "256", "--repeats", "1"],
    "train_step": ["--steps", "1", "--batch", "4", "--threads", "1"],
    "convert": ["--gb", "0.005"],
    "weight_sync": ["--gb", "0", "--engine-gb", "0", "--repeat", "1"],
}


def test_every_cpu_benchmark_is_listed():
    benches = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"gpu_check", "gpu_common", "rollout"}
    assert {b for b in benches if not b.startswith("gpu_")} == set(SMALLEST)


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_the_benchmark_runs_and_ends_with_its_ratio(name):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *SMALLEST[name]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    m = re.fullmatch(rf"{name} ratio=([0-9.eE+-]+)", last)
    assert m, f"last line {last!r}"
    assert math.isfinite(float(m.group(1))) and float(m.group(1)) > 0
