"""`DIR/summary.md`: the human-readable face of summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kimi_pipeline.report.summary import RunSummary
from kimi_pipeline.util.files import atomic_write_text


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        text = json.dumps(v, default=str)
        return text if len(text) <= 120 else text[:117] + "…"
    return str(v)


def render_summary(summary: dict[str, Any]) -> str:
    lines = [f"# Run summary: {summary.get('recipe')}", "", "| stage | status | seconds |", "|---|---|---|"]
    for name, st in (summary.get("stages") or {}).items():
        secs = st.get("seconds")
        err = f" — {st['error']}" if st.get("error") else ""
        lines.append(f"| {name} | {st.get('status')}{err} | {secs if secs is not None else '—'} |")
    for section, payload in summary.items():
        if section in ("recipe", "stages") or not isinstance(payload, dict):
            continue
        lines += ["", f"## {section}", ""]
        for k, v in payload.items():
            if k == "examples":
                continue
            lines.append(f"- **{k}**: {_fmt(v)}")
    return "\n".join(lines) + "\n"


def write_summary_markdown(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    path = run_dir / "summary.md"
    atomic_write_text(path, render_summary(RunSummary(run_dir).read()))
    return path
