"""`make gpu-check`: what a GPU machine proves about this project, in one report.

    .venv/bin/python bench/gpu_check.py [--out DIR] [--no-bench] [--bench-timeout S] [--test-timeout S]

1. Preflight: torch must see a CUDA device and megatron-core must import; otherwise it exits 1 naming what is
   missing (nothing is installed: install with `make install TORCH_SPEC=torch==2.14.1 EXTRAS=dev,gpu`).
2. Environment: GPU name(s), driver (nvidia-smi, else torch's CUDA runtime version), torch, megatron-core,
   transformers, Transformer Engine and SGLang versions ("absent" when not installed).
3. `pytest -m gpu tests/gpu` with a JUnit XML report; each test's outcome is read from it.
4. The GPU benchmarks (bench/gpu_rollout.py, bench/gpu_train.py) as subprocesses; each one's last
   `<name> ratio=<x>` line is its result, compared with its goal.
5. `gpu-check.json` (machine-readable) and `gpu-check.md` (tables) written atomically into the repository root
   or `--out DIR`.

Exit status: 0 when every GPU test passed (at least one ran), 1 otherwise or on a failed preflight. A benchmark
below its goal is reported ("NOT met") but does not change the exit status; a benchmark that crashed is reported
with its exit code and output tail. Test and benchmark output streams to the terminal as it happens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REPORT_JSON, REPORT_MD = "gpu-check.json", "gpu-check.md"
INSTALL_HINT = "Install on a GPU machine with `make install TORCH_SPEC=torch==2.14.1 EXTRAS=dev,gpu`"
# (name, script, goal): the name is the one the script's last line carries (`<name> ratio=<x>`); the train step's
# goal depends on whether megatron runs Transformer Engine's layers (issue 42: 1.5x with TE, 1.2x with the local
# ones) and is set from the environment in `benches`
BENCHES = [("gpu_rollout", "bench/gpu_rollout.py", 3.0), ("gpu_train", "bench/gpu_train.py", 1.2)]
TRAIN_GOAL_WITH_TE = 1.5


def benches(env: dict[str, Any]) -> list[tuple[str, str, float]]:
    te = env["transformer_engine"] != "absent"
    return [(n, s, TRAIN_GOAL_WITH_TE if n == "gpu_train" and te else g) for n, s, g in BENCHES]
RATIO_LINE = re.compile(r"^(\S+) ratio=(\S+)\s*$")
TAIL_LINES = 40


# --------------------------------------------------------------------------- preflight and environment


def preflight() -> list[str]:
    """What stops the GPU check from running here (empty: nothing)."""
    problems = []
    try:
        import torch
    except ImportError as e:
        return [f"torch is not importable ({e})"]
    if not torch.cuda.is_available():
        problems.append(f"torch {torch.__version__} sees no CUDA device (CUDA build: "
                        f"{torch.version.cuda or 'none, a CPU-only wheel'}; "
                        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    try:
        with warnings.catch_warnings():  # its "TE / apex not installed" notes are not problems here
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except Exception as e:  # ImportError, or an import-time failure of a broken install
        problems.append(f"megatron-core is not importable ({type(e).__name__}: {e})")
    return problems


def dist_version(*names: str) -> str | None:
    """The installed version of the first distribution of `names` that is installed, else None."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def driver_version() -> tuple[str, str]:
    """(driver version, where it came from): nvidia-smi's, else torch's CUDA runtime version."""
    import torch

    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30)
            first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
            if first:
                return first, "nvidia-smi"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return f"CUDA runtime {torch.version.cuda}", "torch.version.cuda (no nvidia-smi)"


def environment() -> dict[str, Any]:
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}"})
    driver, source = driver_version()
    return {
        "gpus": gpus,
        "gpu": gpus[0]["name"] if gpus else None,
        "driver": driver,
        "driver_source": source,
        "cuda_runtime": torch.version.cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": dist_version("megatron-core") or "absent",
        "transformers": dist_version("transformers") or "absent",
        "transformer_engine": dist_version("transformer-engine", "transformer-engine-torch") or "absent",
        "sglang": dist_version("sglang") or "absent",
    }


# --------------------------------------------------------------------------- tests


def parse_junit(path: str | Path) -> list[dict[str, Any]]:
    """Every testcase of a pytest JUnit XML file: id, outcome (passed / failed / error / skipped), seconds, message."""
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            child = case.find(kind)
            if child is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (child.get("message") or (child.text or "")).strip()
                break
        classname, name = case.get("classname", ""), case.get("name", "")
        cases.append({"id": f"{classname}::{name}" if classname else name, "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0.0), 2), "message": message[:500]})
    return cases


def count_outcomes(cases: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    return counts


def stream(cmd: list[str], timeout: float) -> tuple[int, list[str], float]:
    """Run `cmd` in the repository root, echoing its merged output; (exit code, output lines, seconds).

    It runs in its own process group (the GPU tests start `kimi run`, Ray and engine processes): past `timeout`,
    or when this process is interrupted, the whole group is killed; a timeout reads as exit code 124."""
    t0 = time.monotonic()
    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    killed = threading.Event()

    def kill_group() -> None:
        killed.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    watchdog = threading.Timer(timeout, kill_group)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line.rstrip("\n"))
        rc = proc.wait()
    except BaseException:
        kill_group()
        proc.wait()
        raise
    finally:
        watchdog.cancel()
    if killed.is_set():
        lines.append(f"[gpu-check: killed after {timeout:.0f} s]")
        rc = 124
    return rc, lines, round(time.monotonic() - t0, 1)


def run_tests(timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kimi-gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        args = ["-m", "gpu", "tests/gpu", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        rc, lines, seconds = stream([sys.executable, "-m", "pytest", *args], timeout)
        cases = parse_junit(xml) if xml.is_file() else []
    return tests_section(cases, rc, seconds, "pytest -m gpu tests/gpu -p no:cacheprovider --junitxml=<tmp>", lines)


def tests_section(cases: list[dict[str, Any]], returncode: int, seconds: float, command: str,
                  output: list[str]) -> dict[str, Any]:
    counts = count_outcomes(cases)
    problems = []
    if not cases:
        problems.append(f"pytest wrote no test results (exit {returncode})")
    elif counts["passed"] == 0:
        problems.append("no GPU test passed (all skipped?)")
    if counts["failed"] or counts["error"]:
        problems.append(f"{counts['failed']} failed, {counts['error']} errors")
    if returncode not in (0, 1) and cases:
        problems.append(f"pytest exited {returncode}")
    return {"command": command, "returncode": returncode, "seconds": seconds, **counts, "cases": cases,
            "ok": not problems, "problems": problems, "output_tail": output[-TAIL_LINES:] if problems else []}


# --------------------------------------------------------------------------- benchmarks


def parse_ratio(lines: list[str], name: str) -> float | None:
    """The value of the last `<name> ratio=<x>` line (None when there is none or it is not a number)."""
    for line in reversed(lines):
        m = RATIO_LINE.match(line.strip())
        if m and m.group(1) == name:
            try:
                return float(m.group(2))
            except ValueError:
                return None
    return None


def bench_section(name: str, script: str, goal: float, returncode: int, lines: list[str],
                  seconds: float) -> dict[str, Any]:
    ratio = parse_ratio(lines, name)
    detail = [ln for ln in lines if ln.strip() and not ln.startswith("  run ")]
    return {"name": name, "script": script, "goal": goal, "returncode": returncode, "seconds": seconds,
            "ratio": ratio, "met": ratio is not None and ratio >= goal,
            "detail": detail[-TAIL_LINES:]}


def run_bench(name: str, script: str, goal: float, timeout: float) -> dict[str, Any]:
    rc, lines, seconds = stream([sys.executable, script], timeout)
    return bench_section(name, script, goal, rc, lines, seconds)


# --------------------------------------------------------------------------- report


def build_report(env: dict[str, Any], tests: dict[str, Any], benches: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "ok": bool(tests["ok"]),
        "environment": env,
        "tests": tests,
        "benchmarks": benches,
    }


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any]) -> str:
    env, tests = report["environment"], report["tests"]
    out = [f"# GPU check: {'PASSED' if report['ok'] else 'FAILED'}", "",
           f"{report['generated']} on `{report['host']}`", "", "## Environment", "", "| what | version |", "|---|---|"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB, sm {g['capability']})"
                     for g in env.get("gpus", [])) or "none"
    rows = [("GPU", gpus), ("driver", f"{env['driver']} ({env['driver_source']})"),
            ("CUDA runtime (torch)", env.get("cuda_runtime")), ("python", env.get("python")), ("torch", env["torch"]),
            ("megatron-core", env["megatron_core"]), ("transformers", env.get("transformers")),
            ("Transformer Engine", env["transformer_engine"]), ("SGLang", env["sglang"])]
    out += [f"| {_cell(k)} | {_cell(v)} |" for k, v in rows]
    out += ["", f"## GPU tests: {tests['passed']} passed, {tests['failed']} failed, {tests['error']} errors, "
                f"{tests['skipped']} skipped ({tests['seconds']} s)", "", f"`{tests['command']}`", ""]
    if tests["problems"]:
        out += [f"**{_cell(p)}**" for p in tests["problems"]] + [""]
    out += ["| test | outcome | seconds | message |", "|---|---|---|---|"]
    out += [f"| `{_cell(c['id'])}` | {c['outcome']} | {c['seconds']} | {_cell(c['message'][:200])} |"
            for c in tests["cases"]]
    if tests.get("output_tail"):
        out += ["", "```", *tests["output_tail"], "```"]
    out += ["", "## Benchmarks", "", "| benchmark | ratio | goal | met | exit | seconds |", "|---|---|---|---|---|---|"]
    for b in report["benchmarks"]:
        ratio = "none" if b["ratio"] is None else f"{b['ratio']:.2f}"
        out.append(f"| `{b['script']}` | {ratio} | >= {b['goal']:g} | {'yes' if b['met'] else 'NO'} | "
                   f"{b['returncode']} | {b['seconds']} |")
    if not report["benchmarks"]:
        out.append("| (not run) | | | | | |")
    for b in report["benchmarks"]:
        out += ["", f"### {b['name']}", "", "```", *b["detail"], "```"]
    return "\n".join(out) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_report(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """gpu-check.json and gpu-check.md in `out_dir`, each written to a temp file and renamed into place."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / REPORT_JSON, out_dir / REPORT_MD
    _atomic_write(json_path, json.dumps(report, indent=2) + "\n")
    _atomic_write(md_path, render_markdown(report))
    return json_path, md_path


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT,
                    help="where gpu-check.json / gpu-check.md go (default: the repository root)")
    ap.add_argument("--no-bench", action="store_true", help="run the GPU tests only")
    ap.add_argument("--test-timeout", type=float, default=3600, help="seconds for the whole pytest run")
    ap.add_argument("--bench-timeout", type=float, default=1800, help="seconds per benchmark")
    args = ap.parse_args(argv)

    problems = preflight()
    if problems:
        print("gpu-check: cannot run here, nothing was run:\n" + "".join(f"  - {p}\n" for p in problems)
              + f"{INSTALL_HINT}, then `make gpu-check`.", file=sys.stderr)
        return 1
    env = environment()
    print(f"gpu-check: {env['gpu']}, driver {env['driver']}, torch {env['torch']}, megatron-core "
          f"{env['megatron_core']}, Transformer Engine {env['transformer_engine']}, SGLang {env['sglang']}", flush=True)
    tests = run_tests(args.test_timeout)
    benches = [] if args.no_bench else [run_bench(n, s, g, args.bench_timeout) for n, s, g in benches(env)]
    report = build_report(env, tests, benches)
    json_path, md_path = write_report(report, args.out)
    print(f"gpu-check: tests {tests['passed']} passed, {tests['failed']} failed, {tests['error']} errors, "
          f"{tests['skipped']} skipped", flush=True)
    for b in benches:
        ratio = "no ratio line" if b["ratio"] is None else f"ratio {b['ratio']:.2f}"
        print(f"gpu-check: {b['name']} {ratio} (goal >= {b['goal']:g}: {'met' if b['met'] else 'NOT met'}; "
              f"exit {b['returncode']})")
    print(f"gpu-check: wrote {json_path} and {md_path}; {'PASSED' if report['ok'] else 'FAILED'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
