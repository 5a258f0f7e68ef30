"""What a launched weight job comes back as, whichever launcher ran it: every node agent's exit (`JobResult`), then
either every rank's report (`rank_reports`) or one error naming the failing rank, its node and that node's log tail
(`job_error`). The launchers only start agents and wait (`launch`, `ray_agents`); this module is where their
results are judged, once, the same way for all of them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_pipeline.errors import PermanentError


class WeightJobError(RuntimeError):
    """A rank of the distributed job failed (or the job timed out); retrying may help."""

    def __init__(self, message: str, failures: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.failures = failures or []


class WeightJobPermanentError(WeightJobError, PermanentError):
    """A rank failed on bad input (corrupt shard, wrong shape): retrying cannot help."""


@dataclass
class JobResult:
    """One launch of a job: per node its agent's exit code (None: still running when the launcher stopped waiting,
    or not seen: the manual launcher), its log, its command; `launcher` says which ran it (`local`, `ray`: one
    agent per Ray node, `manual`), `placement` each node's Ray node id."""

    nodes: int
    procs_per_node: int
    seconds: float
    logs: list[Path]
    commands: list[list[str]] = field(default_factory=list)
    launcher: str = "local"
    placement: list[str] = field(default_factory=list)
    codes: list[int | None] = field(default_factory=list)
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and len(self.codes) == self.nodes and all(c == 0 for c in self.codes)


def rank_reports(result: JobResult, name: str, report_dir: Path, prefix: str, world: int,
                 timeout: float | None) -> list[dict[str, Any]]:
    """Every rank's `<prefix>_<rank>.json` of a job that succeeded; else the job's error (`job_error`)."""
    if not result.ok:
        raise job_error(name, result, read_failures(report_dir), timeout)
    return read_rank_reports(report_dir, prefix, world)


def read_failures(report_dir: Path) -> list[dict[str, Any]]:
    """Per-rank error reports (`rank.rank_main`), earliest first (the first is the root cause; later ones are
    usually fallout)."""
    out = []
    for p in sorted(Path(report_dir).glob("rank_*.error.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(out, key=lambda f: f.get("time", 0))


def read_rank_reports(report_dir: Path, prefix: str, world: int) -> list[dict[str, Any]]:
    """Every rank's `<prefix>_<rank>.json` result, by rank; a job that exited cleanly with one missing is
    incomplete (a rank skipped its work): refused, never half-used."""
    reports = [json.loads(p.read_text()) for p in sorted(Path(report_dir).glob(f"{prefix}_*.json"))
               if not p.name.endswith(".error.json")]
    reports.sort(key=lambda r: r["rank"])
    if len(reports) != world:
        raise WeightJobPermanentError(
            f"{report_dir}: {len(reports)} of {world} ranks reported {prefix!r} results although the job "
            "exited cleanly; the job is incomplete")
    return reports


def job_error(name: str, result: JobResult, failures: list[dict[str, Any]], timeout: float | None) -> WeightJobError:
    """The error of a failed launch: the earliest rank error report (permanent when its rank said so) with its
    node's log tail, else the node whose agent failed without one (killed, OOM, timed out)."""
    ppn, codes, logs = result.procs_per_node, result.codes or [None] * result.nodes, result.logs
    node_codes = ", ".join(f"node {i}: exit {c}" for i, c in enumerate(codes))
    if failures:
        first = failures[0]
        node = first.get("rank", 0) // ppn
        others = sorted({f["rank"] for f in failures[1:]})
        msg = (f"{name}: rank {first['rank']} (node {node}) failed: {first['type']}: {first['message']}"
               + (f"\n(ranks {others} failed after it)" if others else "")
               + f"\n[{node_codes}]" + _log_section(logs, node))
        cls = WeightJobPermanentError if first.get("permanent") else WeightJobError
        return cls(msg, failures)
    bad = next((i for i, c in enumerate(codes) if c not in (0, None)), 0)
    what = (f"timed out after {timeout:.0f} s" if result.timed_out
            else "failed without an error report (killed, OOM, or a crash in the launcher)")
    return WeightJobError(f"{name}: {what} on node {bad} (ranks {bad * ppn}..{bad * ppn + ppn - 1})\n[{node_codes}]"
                          + _log_section(logs, bad))


def log_tail(path: Path, n: int = 25) -> str:
    """The last `n` lines of a node's log, Python's warnings left out (they drown the traceback)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep = [ln for ln in lines if "Warning" not in ln and "warnings.warn" not in ln]
    return "\n".join(keep[-n:])


def _log_section(logs: list[Path], node: int) -> str:
    if node >= len(logs):  # the manual launcher holds no logs: they are on the nodes
        return ""
    return f"\n--- node {node} log tail ({logs[node]}) ---\n{log_tail(logs[node])}"
