"""bench/gpu_check.py's own parsing and report writing, on fabricated inputs (no GPU): a pytest JUnit XML with
every outcome, benchmark outputs with and without their `<name> ratio=<x>` line, and the two report files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4" time="12.5">
<testcase classname="tests.gpu.test_gpu_megatron" name="test_bf16_trainer_lives_on_the_gpu_and_its_loss_falls"
 time="3.210" />
<testcase classname="tests.gpu.test_gpu_parity" name="test_megatron_and_transformers_agree_in_bf16_on_the_gpu"
 time="1.5"><failure message="AssertionError: mean |diff| 0.3 | worst tokens [4.0]">Traceback ...</failure>
</testcase>
<testcase classname="tests.gpu.test_gpu_engine" name="test_x" time="0.1"><error message="fixture 'cuda' failed" />
</testcase>
<testcase classname="tests.gpu.test_gpu_learning" name="test_kimi_run_on_tiny_with_one_gpu_learns" time="0.0">
<skipped type="pytest.skip" message="needs CUDA: run `make gpu-check` on a GPU machine">skip</skipped></testcase>
</testsuite></testsuites>
"""

ROLLOUT_OUT = """gpu_rollout: NVIDIA H100 80GB HBM3, torch 2.14.1+cu128
size 0.5b: 0.55 B params (0.17 B active), 256 rows (32 prompts x 8), prompt 64 tokens, up to 128 new tokens
  run 0 engine: 32768 tokens in 2.00 s (16,384 tok/s)
  embedded engine:   16,384 tok/s; CUDA graphs: not used (0 captures, 0 replays: every decode step ran eagerly)
size 0.5b: engine / transformers generate ratio 3.40 (goal >= 3: met)
size 2.5b: engine / transformers generate ratio 2.70 (goal >= 3: NOT met)
gpu_rollout ratio=2.70"""


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENV = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1, "capability": "9.0"}],
       "gpu": "NVIDIA H100 80GB HBM3", "driver": "570.86.15", "driver_source": "nvidia-smi", "cuda_runtime": "12.8",
       "python": "3.12.3", "torch": "2.14.1+cu128", "megatron_core": "0.16.1", "transformers": "5.23.0",
       "transformer_engine": "absent", "sglang": "0.5.23"}


def test_junit_outcomes_are_read_per_test(gpu_check, tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    cases = gpu_check.parse_junit(xml)
    assert [(c["id"].split("::")[1], c["outcome"]) for c in cases] == [
        ("test_bf16_trainer_lives_on_the_gpu_and_its_loss_falls", "passed"),
        ("test_megatron_and_transformers_agree_in_bf16_on_the_gpu", "failed"),
        ("test_x", "error"),
        ("test_kimi_run_on_tiny_with_one_gpu_learns", "skipped"),
    ]
    assert cases[0]["id"] == "tests.gpu.test_gpu_megatron::test_bf16_trainer_lives_on_the_gpu_and_its_loss_falls"
    assert cases[0]["seconds"] == 3.21 and cases[1]["message"].startswith("AssertionError: mean |diff| 0.3")
    assert cases[3]["message"].startswith("needs CUDA")
    assert gpu_check.count_outcomes(cases) == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}


def test_ratio_is_the_last_named_ratio_line(gpu_check):
    lines = ROLLOUT_OUT.splitlines()
    assert gpu_check.parse_ratio(lines, "gpu_rollout") == 2.70  # not a per-size line
    assert gpu_check.parse_ratio(lines, "gpu_train") is None
    assert gpu_check.parse_ratio(["gpu_train: needs CUDA (no GPU here); run `make gpu-check` on a GPU machine"],
                                 "gpu_train") is None
    assert gpu_check.parse_ratio(["gpu_train ratio=1.80", "gpu_train ratio=1.62"], "gpu_train") == 1.62
    assert gpu_check.parse_ratio(["gpu_train ratio=nan?"], "gpu_train") is None


def test_tests_section_fails_on_failures_and_on_nothing_passing(gpu_check, tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    failing = gpu_check.tests_section(gpu_check.parse_junit(xml), 1, 12.5, "pytest -m gpu tests/gpu", ["E boom"])
    assert not failing["ok"] and failing["problems"] == ["1 failed, 1 errors"] and failing["output_tail"] == ["E boom"]
    passing = [{"id": "m::t", "outcome": "passed", "seconds": 1.0, "message": ""}]
    assert gpu_check.tests_section(passing, 0, 1.0, "pytest", [])["ok"]
    skipped = [{"id": "m::t", "outcome": "skipped", "seconds": 0.0, "message": "needs CUDA"}]
    assert gpu_check.tests_section(skipped, 0, 1.0, "pytest", [])["problems"] == ["no GPU test passed (all skipped?)"]
    assert gpu_check.tests_section([], 4, 1.0, "pytest", [])["problems"] == ["pytest wrote no test results (exit 4)"]


def test_report_files_are_written_atomically_with_every_result(gpu_check, tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    tests = gpu_check.tests_section(gpu_check.parse_junit(xml), 1, 12.5, "pytest -m gpu tests/gpu", [])
    benches = [gpu_check.bench_section("gpu_rollout", "bench/gpu_rollout.py", 3.0, 0, ROLLOUT_OUT.splitlines(), 95.0),
               gpu_check.bench_section("gpu_train", "bench/gpu_train.py", 1.5, 1, ["Traceback", "OOM"], 3.0)]
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu-check.json").write_text("{an older report}")
    report = gpu_check.build_report(ENV, tests, benches)
    json_path, md_path = gpu_check.write_report(report, out)
    assert (json_path, md_path) == (out / "gpu-check.json", out / "gpu-check.md")
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu-check.md"]  # no temp files left

    data = json.loads(json_path.read_text())
    assert data["ok"] is False and data["environment"] == ENV
    assert [(c["outcome"]) for c in data["tests"]["cases"]] == ["passed", "failed", "error", "skipped"]
    rollout, train = data["benchmarks"]
    assert (rollout["ratio"], rollout["met"], rollout["returncode"]) == (2.7, False, 0)
    assert "size 0.5b: engine / transformers generate ratio 3.40 (goal >= 3: met)" in rollout["detail"]
    assert not any(line.startswith("  run ") for line in rollout["detail"])  # per-run lines stay in the terminal
    assert (train["ratio"], train["met"], train["returncode"]) == (None, False, 1)

    md = md_path.read_text()
    assert md.startswith("# GPU check: FAILED")
    assert "| driver | 570.86.15 (nvidia-smi) |" in md and "| Transformer Engine | absent |" in md
    assert "| `tests.gpu.test_gpu_parity::test_megatron_and_transformers_agree_in_bf16_on_the_gpu` | failed |" in md
    assert "mean \\|diff\\| 0.3 \\| worst" in md  # table cells escape pipes
    assert "| `bench/gpu_rollout.py` | 2.70 | >= 3 | NO | 0 | 95.0 |" in md
    assert "| `bench/gpu_train.py` | none | >= 1.5 | NO | 1 | 3.0 |" in md
    assert "CUDA graphs: not used" in md


def test_no_cuda_exits_1_naming_what_is_missing(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "preflight", lambda: ["torch 2.13.0+cpu sees no CUDA device (CUDA build: none)"])
    monkeypatch.setattr(gpu_check, "run_tests", lambda *a: pytest.fail("must not run tests without CUDA"))
    assert gpu_check.main(["--out", "/nonexistent/never-written"]) == 1
    err = capsys.readouterr().err
    assert "cannot run here" in err and "sees no CUDA device" in err and "EXTRAS=dev,gpu" in err
