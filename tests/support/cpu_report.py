"""Where a test session's CPU goes, by kind of process (`pytest --cpu-report`; `make test` passes it).

On 2 cores the suite keeps both busy from start to end, so its wall time is its CPU time over two: a test is only
made cheaper by less CPU, and the 25 slowest tests do not say whose CPU it was (a test's seconds include the other
worker's load, and its Ray daemons, actors, rank processes and Prefect servers are other processes). A thread of
the controller reads every process's CPU time from /proc every `interval_s`, keeps what each spent since the
session began (a process already running then counts from there), and the end of the run prints the totals by kind
of process (`kind`): Ray's daemons, each actor class, the weight jobs' agents and ranks, `kimi` commands, Prefect's
servers, the pytest workers. A process that lives less than one interval may be missed: the line "not seen"
is the machine's busy time (/proc/stat) less what the table holds. Linux only (elsewhere the report says so).

Hand-written: psutil's per-process objects cost more per sample than reading two small files, and the sampler
runs beside the suite for its whole length.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Ray's native daemons by executable, not by text: Ray's Python processes name the raylet's socket
# (`--raylet-name=.../raylet`) on their command lines
_RAY_BINARIES = {"gcs_server": "ray gcs_server", "raylet": "ray raylet"}
_RAY_DAEMONS = (
    ("dashboard/agent.py", "ray dashboard agent"),
    ("ray::DashboardAgent", "ray dashboard agent"), ("runtime_env/agent", "ray runtime-env agent"),
    ("ray::RuntimeEnvAgent", "ray runtime-env agent"), ("log_monitor.py", "ray log monitor"),
    ("dashboard/dashboard.py", "ray dashboard"), ("ray.util.client.server", "ray client server"),
    ("kimi_pipeline.cluster.ray_start", "`ray start`"), ("ray.scripts.scripts start", "`ray start`"),
    ("ray.scripts.scripts stop", "`ray stop`"),
    ("setup_worker.py", "ray worker (starting)"), ("default_worker.py", "ray worker (starting)"),
)


def kind(cmdline: str) -> str:
    """The kind of process a command line is, at the grain the suite's cost is decided: Ray actors by class, our
    modules by module and verb, Prefect's API servers apart from its CLI."""
    argv0 = cmdline.split()[0] if cmdline.strip() else ""
    program = os.path.basename(argv0)
    if program in _RAY_BINARIES:
        return _RAY_BINARIES[program]
    for needle, name in _RAY_DAEMONS:
        if needle in cmdline:
            return name
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0][5:].split(".")[0]
        return "ray idle worker" if name == "IDLE" else f"ray actor {name}"
    if "import sys;exec(eval(sys.stdin.readline()))" in cmdline:
        return "pytest worker"
    if re.search(r"(^|/|\s)pytest(\s|$)|-m pytest", cmdline):
        return "pytest"
    m = re.search(r"(?:-m |/bin/)(kimi_pipeline\.[\w.]+|kimi)(?: ([a-z][\w-]*))?", cmdline)
    if m:
        module = "kimi" if m.group(1) in ("kimi", "kimi_pipeline.cli") else m.group(1)
        return f"{module} {m.group(2)}" if m.group(2) and not m.group(2).startswith("-") else module
    if "prefect.server.api.server:create_app" in cmdline or "prefect server start" in cmdline:
        return "prefect API server"
    m = re.search(r"-m (prefect[\w.]*)(?: ([a-z][\w-]*))?", cmdline)
    if m:
        return f"{m.group(1)} {m.group(2) or ''}".strip()
    if re.search(r"-m pip\b|pip-build-env|/pip\s|pip-[\d.]+-py3", cmdline):
        return "pip"
    if "chrom" in program:
        return "chromium"
    m = re.search(r"python[\d.]*\s+(?:-\S+\s+)*(-m \S+|\S+\.py)", cmdline)
    if m:
        return "python " + m.group(1)
    return program or "?"


def busy_seconds() -> float:
    """The machine's non-idle CPU seconds since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICKS


def _read(pid: str) -> tuple[str, float] | None:
    """(start time in ticks as a string, CPU seconds) of a process, None once it is gone."""
    try:
        stat = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    return rest[19], (int(rest[11]) + int(rest[12])) / TICKS  # starttime; utime + stime


def _cmdline(pid: str) -> str:
    try:
        raw = (PROC / pid / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


class CpuSampler:
    """Samples every process's CPU time every `interval_s` in a daemon thread; `table()` sums them by `kind`."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self.supported = (PROC / "stat").is_file()
        self._seen: dict[tuple[str, str], list] = {}  # (pid, start) -> [base CPU, last CPU, command line]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-report", daemon=True)
        self._busy0 = busy_seconds() if self.supported else 0.0
        self._t0 = time.monotonic()

    def start(self) -> CpuSampler:
        if self.supported:
            self.sample(first=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.supported:
            self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self, first: bool = False) -> None:
        for pid in os.listdir(PROC):
            if not pid.isdigit():
                continue
            got = _read(pid)
            if got is None:
                continue
            start, cpu = got
            entry = self._seen.get((pid, start))
            if entry is None:
                self._seen[(pid, start)] = [cpu if first else 0.0, cpu, _cmdline(pid)]
                continue
            entry[1] = cpu
            if entry[2].startswith("ray::") or "_worker.py" in entry[2]:  # Ray workers retitle as they take an actor
                entry[2] = _cmdline(pid) or entry[2]

    def totals(self) -> tuple[Counter, Counter]:
        """(CPU seconds, processes) by kind."""
        cpu: Counter = Counter()
        count: Counter = Counter()
        for base, last, cmdline in list(self._seen.values()):
            if last - base > 0:
                k = kind(cmdline) if cmdline else "kernel threads"
                cpu[k] += last - base
                count[k] += 1
        return cpu, count

    def table(self, top: int | None = 25) -> list[str]:
        """The CPU of the `top` most costly kinds (None: every kind), then the rest and what no sample saw."""
        if not self.supported:
            return ["CPU by kind of process: not measured (no /proc on this system)"]
        cpu, count = self.totals()
        busy = busy_seconds() - self._busy0
        wall = time.monotonic() - self._t0
        held = sum(cpu.values())
        shown = cpu.most_common(top)

        def row(seconds: float, what: str) -> str:
            return f"{seconds:9.1f} s {100 * seconds / max(busy, 1e-9):5.1f} %  {what}"

        lines = [f"CPU by kind of process ({wall:.0f} s wall, {busy:.0f} CPU-s busy on {os.cpu_count()} cores, "
                 f"sampled every {self.interval_s:g} s):"]
        lines += [row(seconds, f"{count[name]:5d} x  {name}") for name, seconds in shown]
        rest = held - sum(seconds for _, seconds in shown)
        if rest > 0:
            lines.append(row(rest, "       the other kinds"))
        lines.append(row(max(busy - held, 0.0), f"       not seen (processes shorter than {self.interval_s:g} s, "
                                                "and the kernel)"))
        return lines
