"""`DIR/summary.md`: the human-readable face of summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kimi_pipeline.report.plots import write_plots
from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.redact import redact


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        text = json.dumps(v, default=str)
        return text if len(text) <= 120 else text[:117] + "…"
    return str(v)


def _bullets(key: str, value: Any, depth: int = 0) -> list[str]:
    """A section's entry as a bullet; a mapping (an export's served eval, the health rules) as nested bullets
    rather than one line of JSON cut at 120 characters, two levels deep at most."""
    pad = "  " * depth
    if isinstance(value, dict) and value and depth < 2:
        return [f"{pad}- **{key}**:"] + [line for k, v in value.items() for line in _bullets(k, v, depth + 1)]
    return [f"{pad}- **{key}**: {_fmt(value)}"]


def _headline(summary: dict[str, Any]) -> list[str]:
    """The three lines a person wants first: did it learn, how does it evaluate, where is the model."""
    out = []
    train = summary.get("train") or {}
    if train.get("reward_first") is not None:
        out.append(f"- **reward**: {train['reward_first']:.3f} → {train['reward_last']:.3f} over {train['steps']} "
                   "rollouts (mean of the first / last 10 %)")
    evals = summary.get("eval") or []
    if evals:
        first, last = evals[0], evals[-1]
        out.append(f"- **eval avg@n**: {first['avg_at_n']:.3f} (step {first['step']}) → {last['avg_at_n']:.3f} "
                   f"(step {last['step']}); pass@n {last['pass_at_n']:.3f}, maj@n {last['maj_at_n'] or 0:.3f}")
    export = summary.get("export") or {}
    if export.get("path"):
        out.append(f"- **export**: `{export['path']}` ({_fmt(export.get('int4_bytes'))} B INT4 vs "
                   f"{_fmt(export.get('bf16_bytes'))} B bf16, dequant exact: {export.get('dequant_exact')})")
    served = export.get("eval") or {}
    if "avg_at_n" in served:
        out.append(f"- **export served**: avg@n {served['avg_at_n']:.3f} vs {_fmt(served.get('training_avg_at_n'))} "
                   f"in training (drop {_fmt(served.get('drop'))}); published: {export.get('published')}")
    stop = (train.get("health") or {}).get("stop")
    if stop:
        out.append(f"- **health**: rule `{stop['rule']}` stopped training at step {stop['step']}; resume from "
                   f"`{stop['resume'] or 'the initial checkpoint'}`")
    return out


def render_summary(summary: dict[str, Any], plots: dict[str, str] | None = None, run_dir: Path | None = None) -> str:
    lines = [f"# Run summary: {summary.get('recipe')}", ""]
    head = _headline(summary)
    if head:
        lines += head + [""]
    lines += ["| stage | status | seconds |", "|---|---|---|"]
    for name, st in (summary.get("stages") or {}).items():
        secs = st.get("seconds")
        err = f" — {st['error']}" if st.get("error") else ""
        lines.append(f"| {name} | {st.get('status')}{err} | {secs if secs is not None else '—'} |")
    if plots:
        lines += ["", "## Plots", ""]
        for name, path in plots.items():
            rel = Path(path).relative_to(run_dir) if run_dir and Path(path).is_relative_to(run_dir) else Path(path)
            lines.append(f"![{name}]({rel.as_posix()})")
    evals = summary.get("eval") or []
    if evals:
        lines += ["", "## eval", "", "| step | avg@n | pass@1 | pass@n | maj@n |", "|---|---|---|---|---|"]
        for e in evals:
            lines.append(f"| {e['step']} | {e['avg_at_n']:.3f} | {e['pass_at_1']:.3f} | {e['pass_at_n']:.3f} | "
                         f"{(e['maj_at_n'] or 0):.3f} |")
    for section, payload in summary.items():
        if section in ("recipe", "stages") or not isinstance(payload, dict):
            continue
        lines += ["", f"## {section}", ""]
        for k, v in payload.items():
            if k == "examples":
                continue
            lines += _bullets(k, v)
    return "\n".join(lines) + "\n"


def write_summary_markdown(run_dir: Path) -> Path:
    """summary.md (+ the PNG plots it links) from summary.json and the metric files (redacted, as summary.json)."""

    run_dir = Path(run_dir)
    path = run_dir / "summary.md"
    try:
        plots = write_plots(run_dir)
    except Exception as e:  # noqa: BLE001 - a plotting problem must not hide the summary
        plots = {}
        print(f"plots skipped: {type(e).__name__}: {e}")
    atomic_write_text(path, redact(render_summary(RunSummary(run_dir).read(), plots, run_dir)))
    return path
